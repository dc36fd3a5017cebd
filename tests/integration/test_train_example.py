"""The example trainer (``wrappers/examples/train_mlp.py``) as users run it: ``hpc-elastic submit`` on the dev
cluster, preempted by signal or hit by ``kill -9``; its final parameters must equal an uninterrupted run's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.slurm import CliSlurm, SlurmError
from tests.conftest import REPO
from tests.integration.conftest import hpc_submit, processes_with, root_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cpu_lane]
TRAIN = REPO / "wrappers" / "examples" / "train_mlp.py"
STEPS = 40
# Two worker processes (M=2) for four logical workers (N=4) on the CPU partition; every run has the same M.
COMMON = ("--gpus=0", "--procs=2", "--workers=4", "--partition=cpu")


def final_result(path: Path) -> dict[str, Any] | None:
    """The RESULT of a finished run (a stopped run writes one too, marked ``stopped``)."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return None if result.get("stopped") else result


def steps_done(trace: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in trace.glob("*.jsonl")) if trace.exists() else 0


@pytest.fixture(scope="module")
def reference(slurm: CliSlurm, request: pytest.FixtureRequest) -> Iterator[Path]:
    """The uninterrupted run, submitted once for the module; the path of its result file."""
    workdir = root_of(request.node) / uuid.uuid4().hex[:12]
    workdir.mkdir(parents=True, exist_ok=True)
    result = workdir / "result.json"
    job_id = hpc_submit(
        workdir, TRAIN, *COMMON, "--job-name=it-mlp-ref", args=(f"--steps={STEPS}", f"--result={result}")
    )
    yield result
    with contextlib.suppress(SlurmError):
        slurm.cancel([job_id])


def test_preempted_training_resumes_from_its_checkpoint_with_identical_parameters(
    slurm: CliSlurm, workdir: Path, submitted: list[int], reference: Path
) -> None:
    result, trace = workdir / "result.json", workdir / "trace"
    job_id = hpc_submit(
        workdir,
        TRAIN,
        *COMMON,
        "--job-name=it-mlp-pre",
        args=(f"--steps={STEPS}", "--step-delay=0.5", f"--trace={trace}", f"--result={result}"),
    )
    submitted.append(job_id)
    job_dir = workdir / f"it-mlp-pre-{job_id}"
    wait_for("a few training steps", lambda: steps_done(trace) >= 5 * 4, timeout_s=120)  # 4 logical workers a step

    slurm.cancel([job_id], "USR1", batch=True)  # what the plugin sends to preempt
    ack = json.loads(wait_for("the checkpoint acknowledgement", lambda: _read(job_dir / "control" / "ack.json")))
    assert 0 < ack["step"] < STEPS and Path(ack["checkpoint"]).is_dir()
    wait_for("the requeue", lambda: slurm.job(job_id).restart_count == 1)

    resumed = wait_for("the resumed run to finish", lambda: final_result(result), timeout_s=240)
    assert resumed["start_step"] == ack["step"]  # it went on from the acknowledged checkpoint, not from scratch
    assert resumed["restored_from"] == ack["checkpoint"]
    assert resumed["step"] == STEPS
    expected = wait_for("the uninterrupted run to finish", lambda: final_result(reference), timeout_s=240)
    assert resumed["sha256"] == expected["sha256"]


def test_a_killed_worker_restarts_the_step_from_the_last_checkpoint(
    slurm: CliSlurm, workdir: Path, submitted: list[int], reference: Path
) -> None:
    result = workdir / "result.json"
    job_id = hpc_submit(
        workdir,
        TRAIN,
        *COMMON,
        "--job-name=it-mlp-kill",
        args=(f"--steps={STEPS}", "--step-delay=0.5", "--ckpt-every=5", f"--result={result}"),
    )
    submitted.append(job_id)
    job_dir = workdir / f"it-mlp-kill-{job_id}"
    wait_for("a periodic checkpoint", lambda: list((job_dir / "checkpoints").glob("ckpt-*")), timeout_s=120)
    marker = f"HPC_ELASTIC_JOB_DIR={job_dir}"
    victims = wait_for(
        "worker rank 1",
        lambda: [p for p in processes_with(marker, "SLURM_PROCID=1") if _comm(p).startswith("python")],
    )
    os.kill(victims[0], signal.SIGKILL)

    finished = wait_for("the restarted run to finish", lambda: final_result(result), timeout_s=240)
    assert finished["start_step"] > 0 and finished["start_step"] % 5 == 0  # from a periodic checkpoint
    assert finished["step"] == STEPS
    assert slurm.job(job_id).restart_count == 0  # restarted inside the allocation, not requeued
    expected = wait_for("the uninterrupted run to finish", lambda: final_result(reference), timeout_s=240)
    assert finished["sha256"] == expected["sha256"]


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or None
    except OSError:
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
