"""``hpc-elastic verify-determinism``'s input checks, the launcher's availability checks (no process starts) and how
``--submit`` gives up on a case job."""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import pytest
from click.testing import CliRunner

import hpc_elastic.launch.workers as workers_mod
from hpc_elastic.cli.main import cli
from hpc_elastic.collective import Backend
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.launch.spec import SubmitSpec
from hpc_elastic.launch.workers import unavailable_reason
from hpc_elastic.slurm import Job, JobState, SlurmClient
from hpc_elastic.verify import SlurmRunner


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--procs", "1,8"], "--procs value 8 is outside [1, 4]"),
        (["--procs", "x"], "--procs must be a comma-separated list of integers, got 'x'"),
        (["--steps", "4", "--resize-at", "4"], "--resize-at must be in [1, 3] for --steps 4, got 4"),
        (["--workers", "0"], "--workers must be between 1 and 16384, got 0"),
        (["--workers", "99999999999999999999"], "--workers must be between 1 and 16384, got 99999999999999999999"),
        (["--steps", "1", "--resize-at", "0"], "--resize-at needs --steps 2 or more (a step before the last), got 1"),
        (["/nonexistent/train.py"], "training script /nonexistent/train.py does not exist"),
        (["--timeout", "-1"], "--timeout must be a finite number of seconds > 0, got -1.0"),
        (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
    ],
)
def test_verify_cli_rejects_bad_input_with_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["verify-determinism", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_horovod_backend_reports_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "horovod_available", lambda: False)
    assert "Horovod is not installed" in str(unavailable_reason(Backend.HOROVOD))
    assert unavailable_reason(Backend.TORCH) is None
    result = CliRunner().invoke(cli, ["verify-determinism", "--backend", "horovod", "--procs", "1"])
    assert result.exit_code == 2
    assert "backend horovod cannot run here: Horovod is not installed" in result.output


class WaitingSlurm:
    """squeue's view of one job that waits for resources all along; records the cancels."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def jobs(self, job_ids: list[int]) -> list[Job]:
        return [Job(job_id=job_ids[0], name="case", user="u", state=JobState.PENDING, pending_reason="Resources")]

    def submit(self, *, options: tuple[str, ...], script_text: str) -> int:
        return 7

    def cancel(self, job_ids: list[int]) -> None:
        self.cancelled.extend(job_ids)


def test_a_case_job_that_never_completes_is_cancelled_and_the_error_says_how_it_was_left(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    slurm = WaitingSlurm()
    spec = SubmitSpec(script=tmp_path / "train.py", ckpt_root=tmp_path)
    runner = SlurmRunner(cast(SlurmClient, slurm), spec, ["hpc-elastic-run"], timeout_s=0.05)
    with pytest.raises(HpcElasticError) as failed:
        runner.fixed("case", 2)
    assert slurm.cancelled == [7]
    assert str(failed.value) == "job 7: no completion within 0 s (cancelled; it was PENDING (Resources))"
