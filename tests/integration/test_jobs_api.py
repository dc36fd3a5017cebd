"""The Python API (``hpc_elastic.submit`` and its Job handle) and ``hpc-elastic jobs`` / ``hpc-elastic job`` on the
real dev cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hpc_elastic
from hpc_elastic.slurm import CliSlurm, JobState
from tests.integration.api_functions import fail, train_linear
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


def cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args], check=True, capture_output=True, text=True, timeout=60
    )
    return out.stdout


def job_json(job_id: int, workdir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cli("job", str(job_id), f"--ckpt-root={workdir}", "--json"))
    return doc


def test_submit_a_training_function_watch_it_and_get_its_result(
    slurm: CliSlurm, workdir: Path, submitted: list[int]
) -> None:
    job = hpc_elastic.submit(
        train_linear,
        args=(150,),
        kwargs={"ckpt_every": 20, "step_delay": 0.05},
        gpus=2,
        workers=4,
        max_gpus=4,
        gpu_type="a100",
        partition="gpu-a100",
        ckpt_root=workdir,
        job_name="it-api",
    )
    submitted.append(job.job_id)
    initial = job.state
    assert initial in {JobState.PENDING, JobState.RUNNING, JobState.CONFIGURING}

    def training() -> dict[str, Any] | None:
        doc = job_json(job.job_id, workdir)
        return doc if doc["state"] == "RUNNING" and (doc["step"] or 0) > 0 and doc["checkpoints"] else None

    doc = wait_for("a step and a checkpoint in hpc-elastic job --json", training, timeout_s=120, every_s=1.0)
    assert (doc["workers"], doc["processes"], doc["gpu_types"], doc["elastic_range"]) == (4, 2, ["a100"], [2, 4])
    assert doc["checkpoints"][0]["size_bytes"] > 0 and doc["checkpoints"][0]["world_size"] == 2
    assert doc["job_dir"] == str(workdir / f"it-api-{job.job_id}")
    listed = json.loads(cli("jobs", f"--ckpt-root={workdir}", "--json"))
    assert job.job_id in [row["job_id"] for row in listed]

    result = job.result(timeout_s=180)
    assert (result["step"], result["world_size"], result["workers"]) == (150, 2, 4)
    assert job.state is JobState.COMPLETED
    assert [c.step for c in job.checkpoints()] == [140, 120, 100]
    assert "workers finished with exit code 0" in job.stdout()
    final = job_json(job.job_id, workdir)
    assert (final["state"], final["step"], final["finished"]) == ("COMPLETED", 150, True)


@pytest.mark.cpu_lane
def test_cancel_a_running_function(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    job = hpc_elastic.submit(
        train_linear,
        args=(100000,),
        kwargs={"step_delay": 0.05},
        gpus=0,
        procs=1,
        partition="cpu",
        ckpt_root=workdir,
        job_name="it-api-cancel",
    )
    submitted.append(job.job_id)
    wait_for("the function to train", lambda: (job.status().step or 0) > 0, timeout_s=120, every_s=1.0)
    job.cancel()
    assert job.wait(timeout_s=60, poll_s=0.5) is JobState.CANCELLED
    with pytest.raises(hpc_elastic.JobFailed, match="ended CANCELLED without a result"):
        job.result()


@pytest.mark.cpu_lane
def test_an_exception_of_the_function_comes_back_from_result(
    slurm: CliSlurm, workdir: Path, submitted: list[int]
) -> None:
    job = hpc_elastic.submit(
        fail,
        args=("no data here",),
        gpus=0,
        procs=1,
        partition="cpu",
        max_restarts=0,
        ckpt_root=workdir,
        job_name="it-api-fail",
    )
    submitted.append(job.job_id)
    with pytest.raises(hpc_elastic.RemoteError, match="raised ValueError: no data here") as info:
        job.result(timeout_s=120, poll_s=0.5)
    assert "in fail" in info.value.remote_traceback
    assert job.state is JobState.FAILED
