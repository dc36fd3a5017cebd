"""``hpc-elastic profile run --submit`` on the dev cluster: the job runs the profile and writes its file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import cli
from hpc_elastic.profile import list_profiles
from hpc_elastic.slurm import CliSlurm, JobState
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cpu_lane]
TINY = "tests.unit.profile.tiny_models:tiny"


def test_submitted_profile_job_writes_the_profile(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "profile", "run", TINY, "--submit", "--partition", "cpu", "--device-type", "it-cpu",
            "--batch-sizes", "1,4", "--iters", "1", "--repeats", "2", "--warmup", "0", "--max-batch", "4",
            "--profiles-dir", str(workdir),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    match = re.match(r"submitted profile job (\d+):", result.output)
    assert match, result.output
    job_id = int(match.group(1))
    submitted.append(job_id)
    path = workdir / "tiny@it-cpu.json"
    wait_for("the profile file", path.exists, timeout_s=240)
    (profile,) = list_profiles(workdir)
    assert profile.name == "tiny@it-cpu"
    assert [point.batch_size for point in profile.points] == [1, 4]
    assert profile.memory_limit is not None and profile.memory_limit.batch_size == 4
    wait_for("the job to end", lambda: not slurm.job(job_id).state.is_active, timeout_s=120)
    assert slurm.job(job_id).state is JobState.COMPLETED
    log = (workdir / "logs" / f"profile-{job_id}.out").read_text()
    assert f"wrote {path}" in log
