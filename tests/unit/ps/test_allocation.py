"""The ps-mode wrapper (:class:`hpc_elastic.ps.allocation.PsWrapper`) with its processes on this machine: a ``USR1``
mid-epoch checkpoints the PS parameters, the queues and the ledger, acknowledges, stops the processes and requeues
the job; the next incarnation restores and finishes with every sample exactly once per epoch."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.env import JobEnvironment
from hpc_elastic.jobdir import StopNotice, StopReason
from hpc_elastic.ps.allocation import Outcome, PsWrapper, parse_args
from hpc_elastic.ps.job import PsLauncher
from hpc_elastic.ps.rpc import Client, PeerUnavailable
from hpc_elastic.slurm.types import JobRef, JobState

SAMPLES = 2000
SETTINGS = {"num_samples": SAMPLES, "shard_size": 50, "batch_size": 25, "epochs": 2}


class RequeueSlurm:
    """Records requeues; the job's ``AdminComment`` and time limit as given."""

    def __init__(self, admin_comment: str = "", limit_s: int | None = None, started: float = 0.0) -> None:
        self.requeued: list[int | JobRef] = []
        self.admin_comment, self.limit_s, self.started = admin_comment, limit_s, started

    def requeue(self, job_ids: list[int | JobRef]) -> None:
        self.requeued += job_ids

    def job(self, job_id: int) -> object:
        start = datetime.fromtimestamp(self.started, tz=UTC)
        fields = {"admin_comment": self.admin_comment, "start_time": start, "time_limit_s": self.limit_s}
        running = {"state": JobState.RUNNING, "restart_count": 0, "preempt_time": None}
        return type("Job", (), {**fields, **running})()


def master_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        client = Client((run_dir / "master.addr").read_text(), timeout=5)
    except FileNotFoundError:
        return None
    try:
        return client.call("status")[0]
    except PeerUnavailable:
        return None
    finally:
        client.close()


def usr1_when(run_dir: Path, shards_done: int) -> threading.Thread:
    """A thread that sends this process USR1 once the job's master has accepted ``shards_done`` shards."""

    def body() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = master_status(run_dir)
            if status is not None and status["shards_done"] >= shards_done:
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def wrapper(tmp_path: Path, slurm: RequeueSlurm, restarts: int, *extra: str) -> PsWrapper:
    argv = ["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=2:2", "--ps-range=2:2"]
    config = parse_args([*argv, f"--ps-config={json.dumps(SETTINGS)}", *extra])
    job = JobEnvironment(job_id=7, job_name="ps", restart_count=restarts)
    return PsWrapper(config, job, slurm, launcher=PsLauncher.LOCAL)  # type: ignore[arg-type]


def test_usr1_checkpoints_requeues_and_the_next_run_restores_exactly_once(tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    first = wrapper(tmp_path, slurm, 0)
    usr1_when(first.job_dir.ps, shards_done=12)
    assert first.run() == 0
    assert slurm.requeued == [JobRef(7)]
    ack = first.job_dir.read_ack()
    assert ack is not None and ack.reason is StopReason.PREEMPT and ack.restart_count == 0
    assert (ack.checkpoint / "queues.json").exists()
    assert not (first.job_dir.ps / "status.json").exists()  # not finished

    second = wrapper(tmp_path, slurm, 1)
    assert second.run() == 0
    assert slurm.requeued == [JobRef(7)]  # no second requeue
    assert second.job_dir.read_ack() is None  # the previous incarnation's, set aside
    status = json.loads((second.job_dir.ps / "status.json").read_text())
    assert status["restored_from"] == ack.step and status["finished"]
    assert sorted(status["registered"]) == ["r1w0", "r1w1"]
    for epoch in status["epochs"]:
        assert epoch["exactly_once"] and (epoch["min_count"], epoch["max_count"]) == (1, 1)
        assert sum(epoch["samples_by_worker"].values()) == SAMPLES
    first_epoch = status["epochs"][0]["samples_by_worker"]
    assert first_epoch.get("w0", 0) + first_epoch.get("w1", 0) >= 12 * 50  # what the first run did, still credited


@pytest.mark.parametrize(
    ("comment", "limit_s", "reason", "timelimit_record"),
    [
        # the daemon's notice for this incarnation: a resize
        (StopNotice(StopReason.RESIZE, 1.0, 0).encode(), None, StopReason.RESIZE, ()),
        # a notice of an earlier incarnation is not this signal's; near the limit, USR1 is the time-limit warning
        (StopNotice(StopReason.RESIZE, 1.0, 3).encode(), 60, StopReason.TIMELIMIT, (0,)),
    ],
)
def test_the_reason_of_usr1_is_recorded_and_the_job_requeued(
    tmp_path: Path, comment: str, limit_s: int | None, reason: StopReason, timelimit_record: tuple[int, ...]
) -> None:
    slurm = RequeueSlurm(comment, limit_s, started=time.time())
    ps_wrapper = wrapper(tmp_path, slurm, 0, "--max-requeues=1")
    ps_wrapper.prepare()
    ps_wrapper.usr1 = True
    ps_wrapper.stop = ps_wrapper.take_stop()
    assert ps_wrapper.stop is not None and ps_wrapper.stop[0] is reason
    stop = ps_wrapper.job_dir.read_stop()
    assert stop is not None and stop.reason is reason  # written for the record
    assert ps_wrapper.after(Outcome.STOPPED, {}) == 0
    assert slurm.requeued == [JobRef(7)]
    assert ps_wrapper.job_dir.timelimit_requeues() == timelimit_record


def kill_master_when(run_dir: Path, shards_done: int) -> threading.Thread:
    """A thread that SIGKILLs the job master (as Slurm's signal to the steps would end it) once it has accepted
    ``shards_done`` shards."""

    def body() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = master_status(run_dir)
            if status is not None and status["shards_done"] >= shards_done:
                for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                    try:
                        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
                    except OSError:
                        continue
                    if b"master" in argv and str(run_dir).encode() in argv:
                        os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_a_master_ended_under_the_wrapper_is_requeued_and_restores_the_periodic_checkpoint(tmp_path: Path) -> None:
    slurm = RequeueSlurm()  # Slurm says: running, no preemption: a TERM of unknown cause, requeued
    first = wrapper(tmp_path, slurm, 0)
    kill_master_when(first.job_dir.ps, shards_done=20)
    assert first.run() == 0
    assert slurm.requeued == [JobRef(7)] and first.job_dir.read_ack() is None  # no checkpoint of a stop
    second = wrapper(tmp_path, slurm, 1)
    assert second.run() == 0
    status = json.loads((second.job_dir.ps / "status.json").read_text())
    assert status["restored_from"] is not None and status["restored_from"] >= 2  # a periodic one (every 8 shards)
    for epoch in status["epochs"]:
        assert epoch["exactly_once"] and sum(epoch["samples_by_worker"].values()) == SAMPLES
