"""PS mode on the real dev cluster: a batch job on the ``cpu`` partition runs the job master, 2 parameter servers and
3 workers, each as its own ``srun`` step, and trains Wide & Deep asynchronously to the end with every sample counted
exactly once per epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm
from tests.conftest import REPO
from tests.integration.conftest import wait_for
from tests.integration.plugin_helpers import ended

pytestmark = pytest.mark.integration

SAMPLES = 2000


def test_master_ps_and_workers_run_as_srun_steps_on_the_cpu_partition(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    run_dir = workdir / "run"
    status_file = workdir / "status.json"
    script = workdir / "ps.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --partition=cpu\n"
        "#SBATCH --job-name=ps-mode-test\n"
        "#SBATCH --ntasks=6\n"
        "#SBATCH --cpus-per-task=1\n"
        "#SBATCH --mem-per-cpu=1024\n"
        "#SBATCH --time=10\n"
        f"#SBATCH --output={workdir}/job.out\n"
        "set -euo pipefail\n"
        f"cd {REPO}\n"
        f"{sys.executable} -m hpc_elastic.ps local --launcher srun --ps 2 --workers 3 --samples {SAMPLES}"
        f" --shard-size 100 --batch-size 50 --epochs 2 --run-dir {run_dir} > {status_file}\n"
    )
    out = subprocess.run(
        ["sbatch", "--parsable", str(script)], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    job_id = int(out.strip().split(";")[0])
    cleanup.append(job_id)
    job = wait_for("the PS job to end", lambda: ended(slurm, job_id), timeout_s=400, every_s=2.0)
    log = (workdir / "job.out").read_text() if (workdir / "job.out").exists() else ""
    assert job.state.value == "COMPLETED", log
    status = json.loads(status_file.read_text())
    assert status["finished"] and not status["failed_shards"] and status["lost"] == []
    for epoch in status["epochs"]:
        assert epoch["exactly_once"] and (epoch["min_count"], epoch["max_count"]) == (1, 1)
        assert sum(epoch["samples_by_worker"].values()) == SAMPLES
    assert status["loss_last"] < status["loss_first"]
    steps = subprocess.run(
        ["sacct", "-j", str(job_id), "--noheader", "--parsable2", "--format=JobName,Partition"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    names = {line.split("|")[0] for line in steps}
    assert {"master", "ps0", "ps1", "w0", "w1", "w2"} <= names, steps
    for name in ("master", "ps0", "ps1", "w0"):
        assert (run_dir / f"{name}.log").exists()
