"""The Slurm adapter against the real dev cluster: Slurm 22.05, six slurmd, fake GPUs, slurmdbd."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm, Job, JobNotFound, JobState, RetryPolicy, Runner, SlurmUnavailable
from tests.integration.conftest import DEV_CLUSTER, stop_controller, wait_for

pytestmark = pytest.mark.integration


def script(body: str) -> str:
    return "#!/bin/bash\n" + body.strip() + "\n"


def state_of(slurm: CliSlurm, job_id: int) -> Job:
    return slurm.job(job_id)


def running(slurm: CliSlurm, job_id: int) -> Job | None:
    job = slurm.job(job_id)
    return job if job.state is JobState.RUNNING else None


def on_nodes(slurm: CliSlurm, job_id: int, count: int) -> Job | None:
    job = slurm.job(job_id)
    return job if job.node_count == count else None


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_gpu_job_runs_with_its_gpus(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    out = workdir / "env.txt"
    job_id = slurm.submit(
        script_text=script(f"""
echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" > {out}.tmp
echo "SLURM_JOB_GPUS=$SLURM_JOB_GPUS" >> {out}.tmp
echo "SLURMD_NODENAME=$SLURMD_NODENAME" >> {out}.tmp
mv {out}.tmp {out}
sleep 120
"""),
        options=["--job-name=it-gpu", "--partition=gpu-a100", "--gres=gpu:a100:2", f"--output={workdir}/%j.out"],
    )
    submitted.append(job_id)
    job = wait_for("the GPU job to run", lambda: running(slurm, job_id))
    assert job.gpus.as_dict() == {"a100": 2}
    assert len(job.nodes) == 1 and job.nodes[0] in {"node1", "node2"}
    env = dict(line.split("=", 1) for line in wait_for("the job's environment", lambda: lines_of(out)))
    assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2
    assert len(env["SLURM_JOB_GPUS"].split(",")) == 2
    assert env["SLURMD_NODENAME"] == job.nodes[0]
    node = next(n for n in slurm.nodes() if n.name == job.nodes[0])
    assert node.gpus_allocated.get("a100") >= 2


def _pending_cpu_job(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> int:
    """A job that waits for resources: the cpu partition is filled first."""
    blocker = slurm.submit(
        script_text=script("sleep 300"),
        options=["--job-name=it-blocker", "--partition=cpu", "--nodes=2", "--exclusive", f"--output={workdir}/b.out"],
    )
    submitted.append(blocker)
    wait_for("the blocker to run", lambda: running(slurm, blocker))
    waiter = slurm.submit(
        script_text=script("true"),
        options=["--job-name=it-waiter", "--partition=cpu", f"--output={workdir}/w.out"],
    )
    submitted.append(waiter)
    wait_for("the waiter to pend", lambda: slurm.job(waiter).state is JobState.PENDING)
    return waiter


@pytest.mark.cpu_lane
def test_site_factor_priority_hold_release(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    job_id = _pending_cpu_job(slurm, workdir, submitted)
    slurm.set_site_factor(job_id, 321)
    job = wait_for(
        "the site factor", lambda: next(j for j in slurm.jobs([job_id], site_factors=True) if j.site_factor == 321)
    )
    assert job.site_factor == 321

    slurm.hold([job_id])
    held = slurm.job(job_id)
    assert held.state is JobState.PENDING and "Held" in held.pending_reason and held.priority == 0
    slurm.release([job_id])
    released = slurm.job(job_id)
    assert released.state is JobState.PENDING and "Held" not in released.pending_reason

    slurm.set_priority(job_id, 4242)
    assert slurm.job(job_id).priority == 4242


@pytest.mark.cpu_lane
def test_signal_reaches_the_batch_script(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    flag = workdir / "usr1"
    ready = workdir / "ready"
    job_id = slurm.submit(
        script_text=script(f"""
trap 'echo got-usr1 > {flag}' USR1
touch {ready}
for i in $(seq 1 300); do sleep 1; done
"""),
        options=["--job-name=it-signal", "--partition=cpu", f"--output={workdir}/%j.out"],
    )
    submitted.append(job_id)
    wait_for("the trap to be installed", ready.exists)
    slurm.cancel([job_id], "USR1", batch=True)
    assert wait_for("the USR1 trap", lambda: flag.exists() and flag.read_text().strip()) == "got-usr1"
    assert slurm.job(job_id).state is JobState.RUNNING  # a signal is not a cancel


@pytest.mark.cpu_lane
def test_requeue_runs_the_job_again(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    log = workdir / "starts"
    job_id = slurm.submit(
        script_text=script(f"""
echo "start restart_count=${{SLURM_RESTART_COUNT:-0}}" >> {log}
sleep 300
"""),
        options=["--job-name=it-requeue", "--partition=cpu", "--requeue", f"--output={workdir}/%j.out"],
    )
    submitted.append(job_id)
    wait_for("the first start", lambda: len(lines_of(log)) == 1)
    slurm.requeue([job_id])
    requeued = slurm.job(job_id)
    assert requeued.restart_count == 1 and requeued.state is not JobState.RUNNING
    # With AuthInfo=cred_expire=10 the requeued job may start again after ~26 s (120 s by default).
    wait_for("the second start", lambda: len(lines_of(log)) == 2, timeout_s=150)
    assert log.read_text().splitlines() == ["start restart_count=0", "start restart_count=1"]
    assert wait_for("the job to run again", lambda: running(slurm, job_id)).restart_count == 1


def test_shrink_running_two_node_gpu_job(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    job_id = slurm.submit(
        script_text=script("sleep 300"),
        options=[
            "--job-name=it-shrink",
            "--partition=gpu-v100",
            "--nodes=2",
            "--gres=gpu:v100:1",
            f"--output={workdir}/%j.out",
        ],
    )
    submitted.append(job_id)
    before = wait_for("the 2-node job to run", lambda: running(slurm, job_id))
    assert before.node_count == 2 and before.gpus.as_dict() == {"v100": 2}
    slurm.set_num_nodes(job_id, 1)
    after = wait_for("the shrink", lambda: on_nodes(slurm, job_id, 1))
    assert after.state is JobState.RUNNING and len(after.nodes) == 1 and after.nodes[0] in before.nodes
    assert after.gpus.as_dict() == {"v100": 1}


@pytest.mark.cpu_lane
def test_finished_jobs_in_sacct(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    start = datetime.now(UTC) - timedelta(minutes=5)
    job_id = slurm.submit(
        script_text=script("exit 3"),
        options=["--job-name=it-sacct", "--partition=cpu", f"--output={workdir}/%j.out"],
    )
    submitted.append(job_id)

    def finished() -> Job | None:
        # accounting is written asynchronously: wait for the complete record of this job
        records = slurm.history(start, job_ids=[job_id])
        return next((j for j in records if not j.state.is_active and j.name == "it-sacct" and j.partition), None)

    job = wait_for("sacct to record the finished job", finished)
    assert job.state is JobState.FAILED and job.exit_code == 3 and job.name == "it-sacct"
    assert job.partition == "cpu" and job.end_time is not None and job.start_time is not None


@pytest.mark.cpu_lane
def test_unknown_job_is_job_not_found(slurm: CliSlurm) -> None:
    unknown = 987654
    with pytest.raises(JobNotFound):
        slurm.job(unknown)
    with pytest.raises(JobNotFound):
        slurm.set_priority(unknown, 10)
    with pytest.raises(JobNotFound):
        slurm.requeue([unknown])
    with pytest.raises(JobNotFound):
        slurm.cancel([unknown])


@pytest.mark.disruptive
def test_controller_down_is_unavailable_then_recovers(slurm: CliSlurm) -> None:
    stop_controller(slurm)
    try:
        quick = CliSlurm(Runner(timeout_s=5.0, retry=RetryPolicy(2, 0.1, 0.2)))
        with pytest.raises(SlurmUnavailable, match="not reachable|did not answer"):
            quick.jobs()
        cli = subprocess.run(
            [sys.executable, "-m", "hpc_elastic", "cluster", "status"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HPC_ELASTIC_SLURM_TIMEOUT": "5", "HPC_ELASTIC_SLURM_BACKEND": "cli"},
        )
        assert cli.returncode == 2
        lines = [line for line in cli.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("hpc-elastic: error:"), cli.stderr

        # A client that keeps retrying rides through the controller's restart.
        restart = threading.Timer(
            2.0, lambda: subprocess.run([str(DEV_CLUSTER), "up"], check=True, capture_output=True, timeout=180)
        )
        restart.start()
        patient = CliSlurm(Runner(timeout_s=10.0, retry=RetryPolicy(12, 0.5, 4.0)))
        try:
            patient.ping()
        finally:
            restart.join()
    finally:
        subprocess.run([str(DEV_CLUSTER), "up"], check=True, capture_output=True, timeout=180)
    assert {n.name for n in slurm.nodes()} == {f"node{i}" for i in range(1, 7)}
    assert isinstance(slurm.jobs(), list)
