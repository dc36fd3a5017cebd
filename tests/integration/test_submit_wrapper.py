"""``hpc-elastic submit`` and the wrapper on the real dev cluster: run, preempt, requeue, resume."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm, JobState
from tests.conftest import DATA, require_horovod
from tests.integration.conftest import hpc_submit, jobs_writing_under, processes_with, wait_for

pytestmark = pytest.mark.integration
STEPPER = DATA / "workers" / "stepper.py"


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_preempt_checkpoints_requeues_and_resumes(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    job_id = hpc_submit(
        workdir, STEPPER, "--gpus=2", "--gpu-type=a100", "--partition=gpu-a100", "--job-name=it-pre", args=("150",)
    )
    submitted.append(job_id)
    job_dir = workdir / f"it-pre-{job_id}"
    starts = job_dir / "starts.log"
    first: list[str] = wait_for("two workers to start", lambda: lines(starts) if len(lines(starts)) == 2 else None)
    assert sorted(line.split()[0] for line in first) == ["rank=0/2", "rank=1/2"]
    gpus = sorted(line.split("gpus=")[1].split()[0] for line in first)
    assert len(gpus) == 2 and all(gpus) and gpus[0] != gpus[1]  # one device per worker process
    job = slurm.job(job_id)
    assert job.comment.startswith("hpc-elastic:v=1,workers=2,min=2,max=2,unit=gpu")

    slurm.cancel([job_id], "USR1", batch=True)
    ack = wait_for("the checkpoint acknowledgement", (job_dir / "control" / "ack.json").exists)
    assert ack
    wait_for("the requeue", lambda: slurm.job(job_id).restart_count == 1)
    wait_for("the second start", lambda: len(lines(starts)) == 4, timeout_s=150)
    resumed = lines(starts)[2:]
    assert all("restart=1" in line for line in resumed)
    step = int(resumed[0].split("step=")[1].split()[0])
    assert step > 0  # it continued from the checkpoint, not from scratch
    wait_for("the job to finish", (job_dir / "done").exists, timeout_s=120)
    assert int((job_dir / "done").read_text()) == 150


@pytest.mark.cpu_lane
def test_time_limit_checkpoints_and_ends_timeout_without_requeues(
    slurm: CliSlurm, workdir: Path, submitted: list[int]
) -> None:
    # --time=2 with a 100 s grace: Slurm's USR1 comes at its first limit check (every 30 s) after the start.
    job_id = hpc_submit(
        workdir,
        STEPPER,
        "--gpus=0",
        "--procs=1",
        "--partition=cpu",
        "--time=2",
        "--grace=100",
        "--job-name=it-tl",
        args=("100000",),
    )
    submitted.append(job_id)
    job_dir = workdir / f"it-tl-{job_id}"
    # the signal's clock runs from the start, not the submission: a busy cluster may keep the job pending a while
    wait_for("the worker to start", lambda: lines(job_dir / "starts.log"), timeout_s=300)
    wait_for("the time-limit warning", (job_dir / "control" / "ack.json").exists, timeout_s=150)
    start = datetime.now(UTC) - timedelta(minutes=10)
    record = wait_for(
        "the job to end",
        lambda: next(
            (j for j in slurm.history(start, job_ids=[job_id]) if not j.state.is_active and j.partition), None
        ),
        timeout_s=240,  # at the limit itself, up to grace + Slurm's check period after the warning
    )
    assert record.state is JobState.TIMEOUT  # --max-requeues 0 (the default): checkpointed, then Slurm's limit
    assert '"reason": "timelimit"' in (job_dir / "control" / "stop").read_text()
    assert slurm.job(job_id).restart_count == 0
    assert "time-limit requeue(s) are spent" in (workdir / f"it-tl-{job_id}.out").read_text()


@pytest.mark.cpu_lane
def test_cancel_leaves_no_process_behind(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    job_id = hpc_submit(
        workdir,
        STEPPER,
        "--gpus=0",
        "--procs=2",
        "--nodes=2",
        "--partition=cpu",
        "--job-name=it-kill",
        args=("100000",),
    )
    submitted.append(job_id)
    job_dir = workdir / f"it-kill-{job_id}"
    wait_for("the workers", lambda: len(lines(job_dir / "starts.log")) == 2)
    marker = f"HPC_ELASTIC_JOB_DIR={job_dir}"
    assert len(processes_with(marker)) >= 2
    slurm.cancel([job_id])
    wait_for("every process of the job to end", lambda: not processes_with(marker), timeout_s=60)
    assert not (job_dir / "control" / "ack.json").exists()


@pytest.mark.cpu_lane
def test_mpi_backend_under_srun_pmix(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    job_id = hpc_submit(
        workdir,
        DATA / "workers" / "mpi_sum.py",
        "--gpus=0",
        "--procs=3",
        "--nodes=2",
        "--partition=cpu",
        "--backend=mpi",
        "--job-name=it-mpi",
    )
    submitted.append(job_id)
    result = workdir / f"it-mpi-{job_id}" / "mpi.txt"
    assert wait_for("the MPI result", lambda: result.exists() and result.read_text()) == "size=3 sum=3 env_rank=0\n"


@pytest.mark.cpu_lane
def test_horovod_backend_under_srun_pmix(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    require_horovod()
    job_id = hpc_submit(
        workdir,
        DATA / "workers" / "hvd_sum.py",
        "--gpus=0",
        "--procs=2",
        "--nodes=2",
        "--partition=cpu",
        "--backend=horovod",
        "--job-name=it-hvd",
    )
    submitted.append(job_id)
    result = workdir / f"it-hvd-{job_id}" / "hvd.txt"
    assert wait_for("the Horovod result", lambda: result.exists() and result.read_text()) == "size=2 sum=1\n"


@pytest.mark.cpu_lane
def test_bad_input_is_one_line_and_submits_nothing(slurm: CliSlurm, workdir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_elastic",
            "submit",
            str(STEPPER),
            f"--ckpt-root={workdir}",
            "--gpus=4",
            "--max-gpus=2",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["hpc-elastic: error: --gpus (4) is above --max-gpus (2)"]
    assert jobs_writing_under(workdir) == []
