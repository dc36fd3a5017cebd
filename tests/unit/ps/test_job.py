"""A PS job of real processes on localhost (master, 2 PS, workers over gRPC): the loss falls, a worker killed with
SIGKILL mid-epoch (holding leased shards it had not started) loses no sample and counts none twice, nor does a hung
worker the master declares lost by its silence, nor a job master killed mid-epoch; a worker added mid-epoch gets
shards.

No timing decides an outcome: a worker is frozen with SIGSTOP while the test looks at what it holds, so the kill
lands on a worker known to hold a shard, and the added worker trains while the others are frozen."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpc_elastic.policy.brain import Role
from hpc_elastic.ps import checkpoint, rpc
from hpc_elastic.ps.__main__ import main
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.job import OutOfMemory, PsJob, end_process
from hpc_elastic.slurm.types import JobState, Step

SMALL = {"num_ps": 2, "num_samples": 2000, "shard_size": 100, "batch_size": 50}


def until(job: PsJob, cond: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job.status()
        if cond(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"condition not reached: {job.status()}")


def assert_exactly_once(status: dict[str, Any]) -> None:
    assert status["finished"]
    assert not status["failed_shards"]
    for epoch in status["epochs"]:
        assert epoch["complete"] and epoch["exactly_once"], epoch
        assert (epoch["min_count"], epoch["max_count"]) == (1, 1)
        assert sum(epoch["samples_by_worker"].values()) == SMALL["num_samples"]


def assert_learned(status: dict[str, Any]) -> None:
    """The trained model's loss on records no worker trained on is below the untrained model's (the per-shard
    training losses of asynchronous SGD, on shards of any size, are not a sound measure)."""
    held = status["held_out"]
    assert held["samples"] == 5000 and held["final"] < held["initial"] - 0.02, held


def test_two_ps_three_workers_lower_the_loss(tmp_path: Path) -> None:
    config = PsJobConfig(num_workers=3, epochs=2, **SMALL)
    with PsJob(config, tmp_path) as job:
        status = job.wait()
    assert_exactly_once(status)
    assert status["lost"] == [] and status["requeued"] == 0
    assert status["shards_done"] >= 2 * 20
    assert_learned(status)


def test_a_worker_killed_mid_epoch_loses_no_sample(tmp_path: Path) -> None:
    # a hold of 1 s of work: w0, slowed to at most 500 samples/s, would hold the default quarter second in one shard
    config = PsJobConfig(num_workers=1, epochs=1, hold_seconds=1.0, **SMALL)
    with PsJob(config, tmp_path, worker_delays={"w0": 0.1}) as job:
        until(job, lambda s: s["shards_done"] >= 1)  # w0 alone: it is mid-epoch
        job.add_worker()
        job.add_worker()
        held = 0
        for _ in range(200):  # freeze w0 at a moment it holds a batch: a shard in training, others not started
            job.signal_worker("w0", signal.SIGSTOP)
            held = job.status()["doing_by_worker"].get("w0", 0)
            if held >= 2:
                break
            job.signal_worker("w0", signal.SIGCONT)
            time.sleep(0.02)
        assert held >= 2
        assert job.kill_worker("w0") == {"requeued": held}
        status = job.wait()
    assert_exactly_once(status)
    assert status["lost"] == ["w0"] and status["requeued"] == held and status["stale_dones"] == 0
    by_worker = status["epochs"][0]["samples_by_worker"]
    assert by_worker["w0"] > 0 and set(by_worker) - {"w0"} <= {"w1", "w2"} and set(by_worker) != {"w0"}


def test_a_ps_killed_mid_epoch_is_replaced_without_restarting_the_workers(tmp_path: Path) -> None:
    # a hold of 2 shards: with the default cap (16 at first, up to 256; about a second of work) two workers lease the
    # whole epoch at once and report it in one go, so no checkpoint would fall mid-epoch
    config = PsJobConfig(num_workers=2, epochs=2, max_hold=2, **SMALL)
    ckpt = tmp_path / "ckpt"
    delays = {"w0": 0.02, "w1": 0.02}
    with PsJob(config, tmp_path, worker_delays=delays, checkpoint_dir=ckpt, checkpoint_every=4) as job:
        before = until(job, lambda s: s["checkpoint_seq"] >= 2)
        assert not before["epochs"][0]["complete"]  # mid-epoch 0
        for w in ("w0", "w1"):  # frozen mid-shard: nothing is counted between the rollback and the look at it
            job.signal_worker(w, signal.SIGSTOP)
        job.kill_ps(1)
        job.poll()  # the launcher notices the dead PS: a new PS 1, and the job rolled back to the checkpoint
        assert len(job.replaced) == 1 and job.replaced[0]["checkpoint"] >= 2
        after = job.status()
        assert after["rollbacks"] == 1 and after["shards_done"] >= before["shards_done"]
        where = checkpoint.latest(ckpt)
        assert where is not None
        _, state = checkpoint.read_queues(where)
        # the ledger is the checkpoint's, epoch by epoch (training may have gone on into epoch 1 before the kill)
        restored = [sum(e.end - e.start for e in state.ledger if e.epoch == k) for k in range(config.epochs)]
        assert [sum(e["samples_by_worker"].values()) for e in after["epochs"]] == restored and sum(restored) > 0
        assert after["queues"]["doing"] == 0 and after["doing_by_worker"] == {}  # its DOING went back to TODO first
        for w in ("w0", "w1"):
            job.signal_worker(w, signal.SIGCONT)
        status = job.wait()
    assert_exactly_once(status)
    assert status["lost"] == [] and sorted(status["registered"]) == ["w0", "w1"]  # the same workers went on
    assert [r["index"] for r in status["ps_replaced"]] == [1]
    assert_learned(status)


def test_a_frozen_worker_is_declared_lost_by_its_silence_and_its_late_report_refused(tmp_path: Path) -> None:
    config = PsJobConfig(num_workers=2, epochs=1, **SMALL)
    delays = {"w0": 0.05, "w1": 0.05}
    with PsJob(config, tmp_path, worker_delays=delays, liveness_s=3.0) as job:
        until(job, lambda s: s["shards_done"] >= 2)
        held = 0
        for _ in range(200):  # freeze w0 (a hung process: the launcher sees it alive) while it holds shards
            job.signal_worker("w0", signal.SIGSTOP)
            held = job.status()["doing_by_worker"].get("w0", 0)
            if held:
                break
            job.signal_worker("w0", signal.SIGCONT)
            time.sleep(0.02)
        assert held
        lost = until(job, lambda s: s["expired"] == ["w0"])  # the master noticed the silence on its own
        assert lost["lost"] == ["w0"] and lost["requeued"] >= held and "w0" not in lost["doing_by_worker"]
        job.signal_worker("w0", signal.SIGCONT)  # it wakes up and reports what it trained: refused
        status = job.wait()
    assert_exactly_once(status)
    assert status["refused"] >= 1 and status["expired"] == ["w0"] and job.exited["w0"] != 0
    assert status["stale_dones"] == 0  # the late reports were refused as a whole, not applied


def test_a_job_master_killed_mid_epoch_is_restarted_from_its_checkpoint(tmp_path: Path) -> None:
    config = PsJobConfig(num_workers=2, epochs=2, **SMALL)
    ckpt = tmp_path / "ckpt"
    delays = {"w0": 0.1, "w1": 0.1}  # an epoch of about 2 s: the kill comes in epoch 0 (about 0.4 s in)
    with PsJob(config, tmp_path, worker_delays=delays, checkpoint_dir=ckpt, checkpoint_every=4) as job:
        before = until(job, lambda s: s["checkpoint_seq"] >= 2)
        assert not before["epochs"][0]["complete"]  # mid-epoch 0
        old_address = (tmp_path / "master.addr").read_text()
        for w in ("w0", "w1"):  # frozen: nothing is counted between the restart and the look at it
            job.signal_worker(w, signal.SIGSTOP)
        job.kill_master()
        job.poll()  # the launcher notices the dead master and starts one from the latest checkpoint
        assert job.master_restarts == 1 and (tmp_path / "master.addr").read_text() != old_address
        after = job.status()
        where = checkpoint.latest(ckpt)
        assert where is not None
        seq, state = checkpoint.read_queues(where)
        assert after["restored_from"] == seq >= 2
        # the ledger is the checkpoint's, epoch by epoch (training may have gone on into epoch 1 before the kill)
        restored = [sum(e.end - e.start for e in state.ledger if e.epoch == k) for k in range(config.epochs)]
        assert [sum(e["samples_by_worker"].values()) for e in after["epochs"]] == restored and sum(restored) > 0
        assert after["queues"]["doing"] == 0 and after["registered"] == []  # DOING back in TODO, first
        for w in ("w0", "w1"):
            job.signal_worker(w, signal.SIGCONT)
        status = job.wait()
    assert_exactly_once(status)
    assert status["lost"] == [] and sorted(status["registered"]) == ["w0", "w1"]  # the same workers went on
    assert_learned(status)


def test_a_worker_added_mid_epoch_gets_shards(tmp_path: Path) -> None:
    config = PsJobConfig(num_workers=2, epochs=1, **SMALL)
    with PsJob(config, tmp_path, worker_delays={"w0": 0.05, "w1": 0.05}) as job:
        until(job, lambda s: s["shards_done"] >= 1)
        for w in ("w0", "w1"):
            job.signal_worker(w, signal.SIGSTOP)
        added = job.add_worker()
        assert added == "w2"
        until(job, lambda s: s["epochs"][0]["samples_by_worker"].get("w2", 0) > 0)
        for w in ("w0", "w1"):
            job.signal_worker(w, signal.SIGCONT)
        status = job.wait()
    assert_exactly_once(status)
    assert set(status["registered"]) == {"w0", "w1", "w2"}
    assert status["epochs"][0]["samples_by_worker"]["w2"] > 0


def test_workers_2_4_1_and_ps_1_2_1_within_one_epoch_keep_the_ledger(tmp_path: Path) -> None:
    config = PsJobConfig(num_ps=1, num_workers=2, num_samples=4000, shard_size=100, batch_size=50, epochs=1)
    delays = {f"w{k}": 0.1 for k in range(4)}
    with PsJob(config, tmp_path, worker_delays=delays) as job:
        until(job, lambda s: s["shards_done"] >= 2)
        assert job.add_ps()["num_ps"] == 2  # the workers are pulling and pushing meanwhile
        job.add_worker()
        job.add_worker()
        status = until(job, lambda s: s["shards_done"] >= 8)
        assert not status["finished"]
        assert job.remove_ps()["num_ps"] == 1
        for w in ("w1", "w2", "w3"):  # scale in to one worker
            job.kill_worker(w, signal.SIGTERM)
        status = job.wait()
    assert status["finished"] and not status["failed_shards"]
    epoch = status["epochs"][0]
    assert epoch["exactly_once"] and (epoch["min_count"], epoch["max_count"]) == (1, 1)
    assert sum(epoch["samples_by_worker"].values()) == 4000
    assert status["num_ps"] == 1 and len(status["repartition_seconds"]) == 2
    assert sorted(status["lost"]) == ["w1", "w2", "w3"]


def test_the_job_goes_on_from_its_checkpoint_after_everything_died(tmp_path: Path) -> None:
    config = PsJobConfig(num_workers=1, epochs=1, **SMALL)
    ckpt = tmp_path / "ckpt"
    with PsJob(config, tmp_path / "a", worker_delays={"w0": 0.05}, checkpoint_dir=ckpt) as job:
        until(job, lambda s: s["shards_done"] >= 3)
        seq = job.checkpoint()
        after = job.status()["shards_done"]
        until(job, lambda s: s["shards_done"] >= after + 2)  # progress that dies with the master
        job.kill_all()
    where = checkpoint.latest(ckpt)
    assert where is not None
    _, state = checkpoint.read_queues(where)
    counted = sum(e.end - e.start for e in state.ledger)
    assert 0 < counted < SMALL["num_samples"]
    restart = replace(config, num_workers=2)
    with PsJob(
        restart, tmp_path / "b", checkpoint_dir=ckpt, checkpoint_every=5, restore=True, worker_prefix="r"
    ) as job:
        status = job.wait()
    assert status["restored_from"] == seq
    assert seq < status["checkpoint_seq"] <= seq + status["shards_done"] // 5  # periodic checkpoints go on numbering
    assert_exactly_once(status)
    by_worker = status["epochs"][0]["samples_by_worker"]
    assert by_worker["w0"] == counted  # what the checkpoint counted stays counted; the rest was redone
    assert set(by_worker) - {"w0"} <= {"r0", "r1"}


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--ps", "0"], "num_ps"),
        (["--samples", "-5"], "num_samples"),
        (["--shard-size", "0"], "shard_size"),
        (["--workers", "0"], "--workers"),
        (["--lr", "-1"], "lr"),
        (["--workers", "99999999999999999999"], "num_workers must be at most 4,096"),
        (["--ps", "5000"], "num_ps must be at most 4,096"),
    ],
)
def test_bad_configs_are_one_line_and_exit_2(args: list[str], word: str) -> None:
    result = CliRunner().invoke(main, ["local", *args])
    assert result.exit_code == 2
    assert word in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["ps", "--index", "0", "--num-ps", "99999999999999999999"], "PS index 0 outside [0, 99999999999999999999)"),
        (["ps", "--index", "0", "--bind", "not an address"], "cannot listen on not an address:0"),
        (["ps", "--index", "0", "--bind", "192.0.2.1"], "cannot listen on 192.0.2.1:0: Cannot assign requested"),
        (["master", "--ps", "127.0.0.1:1", "--liveness", "inf"], "liveness_s must be a positive, finite number"),
        (["worker", "--id", "w0", "--master", ""], "--master must be HOST:PORT, got ''"),
    ],
)
def test_bad_role_arguments_are_one_line_and_exit_2(tmp_path: Path, args: list[str], line: str) -> None:
    config = ["--config", '{"num_ps": 1}', "--run-dir", str(tmp_path)] if args[0] != "worker" else []
    result = CliRunner().invoke(main, [*args, *config])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"hpc-elastic: error: {line}") and len(result.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_an_address_a_role_cannot_listen_on_is_one_line_of_ours(tmp_path: Path) -> None:
    """gRPC's C core writes its own log line to the process's stderr before it refuses an address: the role refuses
    it first (a real process: that line bypasses Python's streams)."""
    for bind in ("not an address", "192.0.2.1"):  # (TEST-NET-1: never an address of this machine)
        argv = ["ps", "--config", '{"num_ps": 1}', "--index", "0", "--run-dir", str(tmp_path), "--bind", bind]
        out = subprocess.run(
            [sys.executable, "-m", "hpc_elastic.ps", *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert out.returncode == 2 and out.stderr.startswith(f"hpc-elastic: error: cannot listen on {bind}:0: ")
        assert len(out.stderr.splitlines()) == 1, out.stderr
    assert rpc.address("::1", 5) == "[::1]:5" == rpc.address("[::1]", 5) and rpc.address("node1", 5) == "node1:5"
    missing = CliRunner().invoke(main, ["ps", "--config", "{}", "--index", "0", "--run-dir", str(tmp_path / "no")])
    assert missing.exit_code == 2 and "Directory" in missing.stderr and "does not exist" in missing.stderr


def test_a_local_job_sent_term_stops_its_processes_before_it_exits(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hpc_elastic.ps", "local", "--samples", "2000000", "--run-dir", str(run_dir)]
    job = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (run_dir / "master.addr").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (run_dir / "master.addr").exists(), job.stderr.read() if job.stderr else ""
    job.send_signal(signal.SIGTERM)  # to the parent alone, as a service manager or a kill of its pid does
    assert job.wait(60) == 128 + signal.SIGTERM
    left = subprocess.run(["pgrep", "-f", f"--run-dir {run_dir}"], capture_output=True, text=True, check=False)
    assert left.stdout.split() == []


def test_bad_config_values_are_named() -> None:
    with pytest.raises(ValueError, match="num_ps must be an integer >= 1, not 0"):
        PsJobConfig(num_ps=0)
    with pytest.raises(ValueError, match="vocab must be at most 4,611,686,018,427,387,904, not 4611686018427387905"):
        PsJobConfig(vocab=(1 << 62) + 1)
    with pytest.raises(ValueError, match="unknown PS job settings"):
        PsJobConfig.from_json({"num_ps": 1, "mode": "x"})
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="hold_seconds must be a positive number"):
            PsJobConfig.from_json({"hold_seconds": bad})
    assert PsJobConfig.from_json({"hold_seconds": 2}).shards().hold_seconds == 2


def test_a_worker_whose_step_ended_out_of_memory_comes_back_with_the_memory_decided(tmp_path: Path) -> None:
    # Slurm's accounting, as a step killed over its memory reads (see tests/unit/slurm): w0's only; w1's a crash
    ends = {
        "w0": Step(7, "3", "w0", JobState.CANCELLED, 0, 9, mem_mb=1024, max_rss_mb=1500.0),
        "w1": Step(7, "4", "w1", JobState.FAILED, 1, None, mem_mb=1024, max_rss_mb=300.0),
    }
    asked: list[OutOfMemory] = []

    def double(end: OutOfMemory) -> int:
        asked.append(end)
        return end.mem_mb * 2

    config = PsJobConfig(num_workers=2, epochs=1, **SMALL)
    job = PsJob(config, tmp_path, worker_delays={"w0": 0.05, "w1": 0.05}, step_end=ends.get, memory_after_oom=double)
    with job:
        until(job, lambda s: s["shards_done"] >= 2)
        for worker in ("w0", "w1"):
            job.signal_worker(worker, signal.SIGKILL)
            job.workers[worker].popen.wait()
        job.poll()
        assert asked == [OutOfMemory("w0", Role.WORKER, 1024, 1500.0)]
        assert job.worker_mem_mb == {"w2": 2048}  # w0 came back as w2 with twice the memory; w1 is only lost
        assert job.mem_floor == {Role.WORKER: 2048}
        status = job.wait()
    assert_exactly_once(status)
    assert status["lost"] == ["w0", "w1"] and "w2" in status["registered"]
    (record,) = job.oom
    assert record.to_json() == {
        "process": "w0",
        "role": "worker",
        "mem_mb": 1024,
        "max_rss_mb": 1500.0,
        "new_mem_mb": 2048,
        "replaced_by": "w2",
        "refused": None,
    }


def test_an_out_of_memory_end_without_a_memory_decision_is_a_lost_worker(tmp_path: Path) -> None:
    ends = {"w0": Step(7, "3", "w0", JobState.OUT_OF_MEMORY, 0, None, mem_mb=1024)}
    with PsJob(PsJobConfig(num_workers=2, epochs=1, **SMALL), tmp_path, step_end=ends.get) as job:
        until(job, lambda s: s["shards_done"] >= 1)
        job.signal_worker("w0", signal.SIGKILL)
        job.workers["w0"].popen.wait()
        job.poll()
        assert list(job.workers) == ["w1"]
        status = job.wait()
    assert_exactly_once(status)
    (record,) = job.oom
    assert record.new_mem_mb is None and record.replaced_by is None and record.refused == "no memory decision given"


def test_a_process_that_does_not_leave_when_asked_is_killed_after_the_grace() -> None:
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    assert end_process(stubborn, signal.SIGTERM, grace_s=0.5) == -signal.SIGKILL
    polite = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(60)"])
    assert end_process(polite, signal.SIGTERM, grace_s=30) == -signal.SIGTERM
