"""Every way Slurm stops a job, on the real dev cluster, with the bundled example (N logical workers on 2 processes).

- Slurm's own preemption (a job of the ``urgent`` partition, ``PreemptMode=REQUEUE``, ``GraceTime=30``): ``TERM``
  reaches the workers only; they checkpoint, the wrapper asks Slurm (``PreemptTime``), requeues, and the job ends
  with the parameters of one uninterrupted run, bit for bit.
- The time limit: ``--time=2`` with ``--max-requeues``: checkpoint at Slurm's ``USR1``, requeue, until the training
  is done (bitwise); with the budget spent the job ends ``TIMEOUT``.
- ``scancel``: no requeue, ``CANCELLED``, no process left.
- A node set down: Slurm requeues the job, which resumes from its last periodic checkpoint (bitwise); the node is
  resumed whatever happens.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import CliSlurm, JobState
from tests.integration.conftest import hpc_submit, processes_with, wait_for
from tests.integration.plugin_helpers import ended, job_of, running
from tests.integration.test_runtime_story import EXAMPLE, SHA, reference_sha, said

pytestmark = pytest.mark.integration
WORKERS = 4
DATA_ARGS = ("--dataset-size=96", "--loader-workers=1")
CPU_JOB = ("--gpus=0", "--procs=2", "--nodes=1", f"--workers={WORKERS}", "--partition=cpu")
STOP = re.compile(r"stop \((\w+)\) at step (\d+)")
RESTORED = re.compile(r"restored from \S+ at step (\d+)")  # a first run says "restored from nothing"


@pytest.fixture
def workdir(lane_root: Path) -> Path:
    path = lane_root / f"stops-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def newest_step(job_dir: Path) -> int:
    steps = CheckpointStore(job_dir / "checkpoints").steps()
    return steps[0] if steps else -1


def submit(workdir: Path, name: str, *options: str, steps: int, delay: float = 0.25) -> tuple[int, Path, Path]:
    args = (f"--steps={steps}", *DATA_ARGS, "--ckpt-every=10", f"--step-delay={delay}")
    job_id = hpc_submit(workdir, EXAMPLE, *options, f"--job-name={name}", args=args)
    return job_id, workdir / f"{name}-{job_id}.out", workdir / f"{name}-{job_id}"


def assert_bitwise(workdir: Path, out: Path, steps: int) -> None:
    final = SHA.findall(out.read_text())
    assert len(final) == 1, out.read_text()
    assert final[0] == reference_sha(workdir, f"--steps={steps}", *DATA_ARGS, workers=WORKERS)


@pytest.mark.timeout(600)
def test_slurms_preemption_checkpoints_on_sigterm_requeues_and_ends_bitwise(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    steps = 100
    job_id, out, job_dir = submit(
        workdir, "st-pre", "--gpus=2", "--gpu-type=a100", "--partition=gpu-a100", f"--workers={WORKERS}", steps=steps
    )
    cleanup.append(job_id)
    first = wait_for("the job to run", lambda: running(slurm, job_id), timeout_s=120)
    wait_for("a periodic checkpoint", lambda: newest_step(job_dir) >= 10, timeout_s=120)
    urgent = slurm.submit(
        script_text="#!/bin/bash\nsleep 5\n",
        options=[
            "--job-name=st-urgent",
            "--partition=urgent",
            f"--nodelist={first.nodes[0]}",
            "--gres=gpu:a100:4",
            f"--output={workdir}/urgent-%j.out",
        ],
    )
    cleanup.append(urgent)
    wait_for("the urgent job to run", lambda: running(slurm, urgent) or ended(slurm, urgent), timeout_s=60)
    wait_for("the requeue", lambda: (j := job_of(slurm, job_id)) is not None and j.restart_count >= 1)
    done = wait_for("the job to complete", lambda: ended(slurm, job_id), timeout_s=300)
    assert done.state is JobState.COMPLETED and done.restart_count == 1, done  # one requeue, the wrapper's or Slurm's
    text = out.read_text()
    assert "the workers checkpointed on SIGTERM; Slurm says: preempt" in text
    assert f"job {job_id} requeued (preempt)" in text
    stops = STOP.findall(text)
    assert [reason for reason, _ in stops] == ["sigterm"]
    assert RESTORED.findall(text) == [stops[0][1]]  # the second run starts at the step of the preemption
    assert_bitwise(workdir, out, steps)


@pytest.mark.cpu_lane
@pytest.mark.timeout(900)
def test_the_time_limit_checkpoints_and_requeues_within_max_requeues_until_done(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # Slurm sends the USR1 at its first limit check (every 30 s) once at most grace + 30 s are left: with --time=2
    # and a 30 s grace, 60-90 s after each start. The steps' delays alone take 120 s (on an idle machine the
    # training itself took 69 s of a 0.25 s delay and ended before any warning): at least one requeue.
    steps = 240
    job_id, out, job_dir = submit(
        workdir, "st-tl", *CPU_JOB, "--time=2", "--grace=30", "--max-requeues=4", steps=steps, delay=0.5
    )
    cleanup.append(job_id)
    done = wait_for("the job to complete", lambda: ended(slurm, job_id), timeout_s=840)
    text = out.read_text()
    assert done.state is JobState.COMPLETED, text
    requeues = text.count(f"job {job_id} requeued (timelimit)")
    assert requeues >= 1 and done.restart_count == requeues
    assert [reason for reason, _ in STOP.findall(text)] == ["timelimit"] * requeues
    assert JobDir(job_dir).timelimit_requeues() == tuple(range(requeues))
    assert_bitwise(workdir, out, steps)


@pytest.mark.cpu_lane
@pytest.mark.timeout(600)
def test_a_spent_requeue_budget_ends_the_job_at_its_time_limit(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # --time=1 with a 45 s grace: the USR1 comes at the first limit check, the TERM 60-90 s after each start
    job_id, out, job_dir = submit(
        workdir, "st-tb", *CPU_JOB, "--time=1", "--grace=45", "--max-requeues=1", steps=100000
    )
    cleanup.append(job_id)
    done = wait_for("the job to end", lambda: ended(slurm, job_id), timeout_s=500)
    text = out.read_text()
    assert done.state is JobState.TIMEOUT and done.restart_count == 1, text
    assert text.count(f"job {job_id} requeued (timelimit)") == 1
    assert "the job's 1 time-limit requeue(s) are spent (--max-requeues); it ends at its time limit" in text
    assert [reason for reason, _ in STOP.findall(text)] == ["timelimit", "timelimit"]  # both runs checkpointed
    assert JobDir(job_dir).timelimit_requeues() == (0,)


@pytest.mark.cpu_lane
@pytest.mark.timeout(300)
def test_scancel_ends_the_job_cancelled_without_a_requeue_or_a_process_left(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    job_id, out, job_dir = submit(workdir, "st-can", *CPU_JOB, steps=100000)
    cleanup.append(job_id)
    wait_for("training", lambda: said(out, "rank 0 of 2 "), timeout_s=120)
    slurm.cancel([job_id])
    done = wait_for("the job to end", lambda: ended(slurm, job_id), timeout_s=60)
    assert done.state is JobState.CANCELLED and done.restart_count == 0
    wait_for("every process of the job to end", lambda: not processes_with(f"HPC_ELASTIC_JOB_DIR={job_dir}"), 60)
    text = out.read_text()
    assert "received signal 15: stopping the workers now (cancel)" in text and "requeued" not in text


def node_state(node: str) -> str:
    out = subprocess.run(["sinfo", "--noheader", "-n", node, "-o", "%T"], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def set_node(node: str, state: str) -> None:
    argv = ["scontrol", "update", f"nodename={node}", f"state={state}"]
    subprocess.run([*argv, "reason=hpc-elastic-test"] if state == "down" else argv, check=True, timeout=30)


@pytest.mark.cpu_lane
@pytest.mark.timeout(600)
def test_a_node_failure_is_requeued_by_slurm_and_resumes_bitwise(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    steps = 100
    job_id, out, job_dir = submit(workdir, "st-nf", *CPU_JOB, steps=steps)
    cleanup.append(job_id)
    node = wait_for("the job to run", lambda: running(slurm, job_id), timeout_s=120).nodes[0]
    wait_for("a periodic checkpoint", lambda: newest_step(job_dir) >= 10, timeout_s=120)
    try:
        set_node(node, "down")
        wait_for("Slurm's requeue", lambda: (j := job_of(slurm, job_id)) is not None and j.restart_count == 1)
    finally:
        if any(word in node_state(node) for word in ("down", "drain", "fail")):
            set_node(node, "resume")
    done = wait_for("the job to complete", lambda: ended(slurm, job_id), timeout_s=300)
    assert done.state is JobState.COMPLETED and done.restart_count == 1
    text = out.read_text()
    assert f"job {job_id} requeued" not in text  # Slurm requeued it, not the wrapper
    restored = [int(step) for step in RESTORED.findall(text)]
    assert len(restored) == 1 and restored[0] >= 10  # the second run: from a checkpoint, not from scratch
    assert_bitwise(workdir, out, steps)
