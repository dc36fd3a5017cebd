"""The ps-mode wrapper (:class:`hpc_elastic.ps.allocation.PsWrapper`) with its processes on this machine: a ``USR1``
mid-epoch checkpoints the PS parameters, the queues and the ledger, acknowledges, stops the processes and requeues
the job; the next incarnation restores and finishes with every sample exactly once per epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.env import JobEnvironment
from hpc_elastic.jobdir import StopNotice, StopReason
from hpc_elastic.launch import run
from hpc_elastic.policy.brain import Role
from hpc_elastic.ps import allocation
from hpc_elastic.ps.allocation import Outcome, PsWrapper, parse_args
from hpc_elastic.ps.job import OutOfMemory, PsJob, PsLauncher
from hpc_elastic.ps.rpc import Client, PeerUnavailable
from hpc_elastic.slurm.types import JobRef, JobState, Step

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


def usr1_when(run_dir: Path, shards_done: int, seen: list[dict[str, Any]] | None = None) -> threading.Thread:
    """A thread that sends this process USR1 once the job's master has accepted ``shards_done`` shards; the master's
    status that triggered it goes to ``seen``."""

    def body() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = master_status(run_dir)
            if status is not None and status["shards_done"] >= shards_done:
                if seen is not None:
                    seen.append(status)
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
    signalled: list[dict[str, Any]] = []
    usr1_when(first.job_dir.ps, shards_done=12, seen=signalled)
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
    # what the first run had done when it was signalled is still credited to its workers (counted in samples: a
    # worker that looks slow is leased smaller shards, so 12 shards need not be 12 x 50 samples)
    before = sum(signalled[0]["epochs"][0]["samples_by_worker"].values())
    first_epoch = status["epochs"][0]["samples_by_worker"]
    assert before > 0 and first_epoch.get("w0", 0) + first_epoch.get("w1", 0) >= before


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
    ps_wrapper.job_dir.prepare()
    killed = ps_wrapper.job_dir.control / ".stop.tmp-42-00000000000000ff"  # a write a kill interrupted, long ago
    killed.write_bytes(b"{")
    os.utime(killed, (time.time() - 3600,) * 2)
    ps_wrapper.prepare()
    assert not killed.exists()
    ps_wrapper.usr1 = True
    ps_wrapper.stop = ps_wrapper.take_stop()
    assert ps_wrapper.stop is not None and ps_wrapper.stop[0] is reason
    stop = ps_wrapper.job_dir.read_stop()
    assert stop is not None and stop.reason is reason  # written for the record
    assert ps_wrapper.after(Outcome.STOPPED, {}) == 0
    assert slurm.requeued == [JobRef(7)]
    assert ps_wrapper.job_dir.timelimit_requeues() == timelimit_record


def test_a_lost_time_limit_warning_checkpoints_and_requeues_all_the_same(tmp_path: Path) -> None:
    """Slurm's USR1 came before the wrapper could hold it (lost): at the run's end less the grace the wrapper stops
    as if it had come, checkpoints and requeues for the time limit; the next run restores and finishes exactly once."""
    probe = wrapper(tmp_path / "probe", RequeueSlurm(), 0)
    limit_s, grace_s = 3600, probe.config.grace_s
    slurm = RequeueSlurm(limit_s=limit_s, started=time.time() - limit_s + grace_s + 2.0)  # the deadline in 2 s
    first = wrapper(tmp_path, slurm, 0, "--max-requeues=1")
    assert first.run() == 0  # no USR1 was sent
    assert first.stop is not None and first.stop[0] is StopReason.TIMELIMIT
    assert slurm.requeued == [JobRef(7)]
    assert first.job_dir.timelimit_requeues() == (0,)
    ack = first.job_dir.read_ack()
    assert ack is not None and ack.reason is StopReason.TIMELIMIT
    second = wrapper(tmp_path, RequeueSlurm(), 1)
    assert second.run() == 0
    status = json.loads((second.job_dir.ps / "status.json").read_text())
    assert status["finished"] and all(e["exactly_once"] for e in status["epochs"])


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


class ResetMaster:
    """A :class:`PsJob` whose master's connection resets (SIGKILL closes its sockets) while its process, or the srun
    running it, has not exited yet: it exits ``exits_after_s`` later."""

    def __init__(self, exits_after_s: float) -> None:
        popen = subprocess.Popen(["sleep", str(exits_after_s)])
        self.master_proc = type("Proc", (), {"popen": popen})()
        self.workers = {"w0": object()}

    def poll(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        raise PeerUnavailable("127.0.0.1:1 did not answer status: StatusCode.UNAVAILABLE")


def test_a_master_whose_connection_resets_before_it_exits_is_lost_not_a_failure(tmp_path: Path) -> None:
    ps_job = ResetMaster(exits_after_s=0.5)
    outcome, status = wrapper(tmp_path, RequeueSlurm(), 0).watch(ps_job)  # type: ignore[arg-type]
    assert (outcome, status) == (Outcome.LOST, {})


def test_a_master_alive_that_does_not_answer_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocation, "MASTER_EXIT_WAIT_S", 0.2)
    ps_job = ResetMaster(exits_after_s=30)
    try:
        with pytest.raises(PeerUnavailable):
            wrapper(tmp_path, RequeueSlurm(), 0).watch(ps_job)  # type: ignore[arg-type]
    finally:
        ps_job.master_proc.popen.kill()
        ps_job.master_proc.popen.wait()


def test_a_worker_out_of_memory_comes_back_with_brains_doubled_memory(tmp_path: Path) -> None:
    """The wrapper reads how a lost worker's step ended from Slurm's accounting (here w0's: killed over its memory,
    as jobacct_gather's OverMemoryKill leaves it) and Brain doubles its memory within the allocation's on a node."""
    killed = Step(7, "4", "w0", JobState.CANCELLED, 0, 9, mem_mb=1024, max_rss_mb=1400.0)
    asked: list[int] = []

    def steps(job_id: int) -> list[Step]:
        asked.append(job_id)
        return [Step(7, "0", "master", JobState.RUNNING), killed]

    argv = ["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=2:2", "--ps-range=1:1"]
    config = parse_args([*argv, f"--ps-config={json.dumps(SETTINGS)}"])
    job = JobEnvironment(job_id=7, job_name="ps", mem_on_node_mb=4096)
    ps_wrapper = PsWrapper(config, job, RequeueSlurm(), launcher=PsLauncher.LOCAL, steps=steps)  # type: ignore[arg-type]

    def kill_w0() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = master_status(ps_wrapper.job_dir.ps)
            ps_job = ps_wrapper.ps_job
            if status is not None and status["shards_done"] >= 3 and ps_job is not None and "w0" in ps_job.workers:
                ps_job.workers["w0"].popen.kill()
                return
            time.sleep(0.05)

    threading.Thread(target=kill_w0, daemon=True).start()
    assert ps_wrapper.run() == 0
    status = json.loads((ps_wrapper.job_dir.ps / "status.json").read_text())
    assert status["oom"] == [
        {
            "process": "w0",
            "role": "worker",
            "mem_mb": 1024,
            "max_rss_mb": 1400.0,
            "new_mem_mb": 2048,
            "replaced_by": "w2",
            "refused": None,
        }
    ]
    assert status["lost"] == ["w0"] and "w2" in status["registered"] and asked == [7]
    assert all(epoch["exactly_once"] for epoch in status["epochs"])


def test_brain_refuses_more_memory_than_a_node_of_the_allocation_has(tmp_path: Path) -> None:
    argv = ["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=2:2", "--ps-range=1:1"]
    config = parse_args([*argv, f"--ps-config={json.dumps(SETTINGS)}"])
    job = JobEnvironment(job_id=7, job_name="ps", mem_on_node_mb=1500)
    ps_wrapper = PsWrapper(config, job, RequeueSlurm(), launcher=PsLauncher.LOCAL)  # type: ignore[arg-type]
    with PsJob(replace(config.job_config(), num_workers=1), ps_wrapper.job_dir.ps) as ps_job:
        ps_wrapper.ps_job = ps_job
        with pytest.raises(ValueError, match="a worker needs more than 1024 MiB and a node has 1500"):
            ps_wrapper.memory_after_oom(OutOfMemory("w0", Role.WORKER, 1024, 1100.0))
        assert ps_wrapper.memory_after_oom(OutOfMemory("ps0", Role.PS, 512, 600.0)) == 1024


def test_step_end_waits_for_accounting_and_takes_the_latest_step_of_a_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(allocation, "STEP_END_WAIT_S", 0.6)
    answers = [
        [Step(7, "1", "ps0", JobState.CANCELLED, 0, 9), Step(7, "5", "ps0", JobState.RUNNING)],
        [Step(7, "1", "ps0", JobState.CANCELLED, 0, 9), Step(7, "5", "ps0", JobState.OUT_OF_MEMORY)],
    ]
    argv = ["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=2:2", "--ps-range=1:1"]
    job = JobEnvironment(job_id=7, job_name="ps")
    ps_wrapper = PsWrapper(
        parse_args(argv),
        job,
        RequeueSlurm(),  # type: ignore[arg-type]
        launcher=PsLauncher.LOCAL,
        steps=lambda _: answers.pop(0) if answers else [],
    )
    end = ps_wrapper.step_end("ps0")
    assert end is not None and end.step_id == "5" and end.out_of_memory
    assert ps_wrapper.step_end("ps0") is None  # accounting never says


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--workers-range=2:1", "--ps-range=1:1"], "bad --workers-range 2:1: two whole numbers A:B, 1 <= A <= B"),
        (["--workers-range=1:2", "--ps-range=1:99999999999999999999"], "a PS-mode job runs at most 4096 of them"),
        (["--workers-range=1:2", "--ps-range=1:1", "--cpus-per-worker=0"], "--cpus-per-worker must be between 1"),
        (["--workers-range=1:2", "--ps-range=1:1", "--grace=inf"], "--grace must be between 1 and 3600 seconds"),
        (["--workers-range=1:2", "--ps-range=1:1", "--max-requeues=x"], "bad --max-requeues 'x': not a whole number"),
        (["--workers-range=1:2", "--ps-range=1:1", "--ckpt-root=jobs"], "--ckpt-root must be an absolute path"),
    ],
)
def test_the_ps_wrapper_refuses_bad_options_before_it_asks_slurm(
    options: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_slurm(*_: object) -> None:
        raise AssertionError("Slurm asked before the options were checked")

    monkeypatch.setattr(allocation, "connect", no_slurm)
    monkeypatch.setattr(allocation, "read_job_environment", no_slurm)
    assert run.main(["--mode=ps", "--ckpt-root=/gpfs/jobs", *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpc-elastic-run: error: ") and message in err, err
