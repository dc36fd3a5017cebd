"""Session and State: stop agreement on threaded ranks, the ack, stops at a chosen step, commit/restore of extras
and per-EST values, device-type guards, and opening a real one-process group from the environment."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.collective import horovod_available
from hpc_elastic.env import JobEnvironment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.comm import local_communicator
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.jobdir import ACK as ACK_FILE
from hpc_elastic.jobdir import PROGRESS as PROGRESS_FILE
from hpc_elastic.jobdir import JobDir, Progress, StopReason, StopRequest
from hpc_elastic.session import Session
from hpc_elastic.state import State
from tests.unit.checkpoint.threaded import ThreadCollective, run_ranks, threaded_communicator

N = 4
DATASET = 24
X = torch.randn(DATASET, 3, generator=torch.Generator().manual_seed(0))
Y = X.sum(1, keepdim=True)


def session_for(coll: ThreadCollective, job_dir: Path | None, **kw: Any) -> Session:
    job = JobEnvironment(job_id=77, restart_count=1, job_dir=job_dir, workers=N)
    return Session(job, threaded_communicator(coll), **kw)


def write_stop(job_dir: Path, reason: str = "preempt", at_step: int | None = None) -> None:
    (job_dir / "control").mkdir(parents=True, exist_ok=True)
    request = StopRequest(StopReason(reason), 1766400000.0, at_step)
    (job_dir / "control" / "stop").write_text(request.to_json())


def make(session: Session) -> tuple[torch.nn.Module, State]:
    """A linear model (no randomness in the step: threaded ranks share the process's generators) over in-memory
    data the runtime hands out by index."""
    model = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    state = session.state(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state.plan_data(DATASET, 3)
    return model, state


def train_step(model: torch.nn.Module, state: State) -> None:
    for idx in state.batches():
        rows = list(idx)
        ((model(X[rows]) - Y[rows]) ** 2).mean().backward()
        assert state.active is not None
        state.active.extra["seen"] = state.active.extra.get("seen", 0) + len(rows)
    state.finish_step()


def test_should_stop_is_agreed_even_by_ranks_that_do_not_see_the_file(tmp_path: Path) -> None:
    seen, blind = tmp_path / "seen", tmp_path / "blind"
    write_stop(seen)

    def body(coll: ThreadCollective) -> tuple[bool, StopReason | None]:
        session = session_for(coll, seen if coll.rank == 1 else blind)
        stop = session.should_stop()
        return stop, session.stop_request.reason if session.stop_request else None

    assert run_ranks(2, body) == [(True, StopReason.UNKNOWN), (True, StopReason.PREEMPT)]


def test_a_rank_that_looked_before_the_file_was_written_reads_its_reason_once_the_group_stops(tmp_path: Path) -> None:
    """Rank 0 looks before the stop file exists, rank 1 after: both stop, and rank 0 (which acknowledges) takes the
    reason from the file that is there by then, not ``unknown``."""
    shared = tmp_path / "job"
    write_stop(shared, "resize")

    def body(coll: ThreadCollective) -> StopReason | None:
        session = session_for(coll, shared)
        if coll.rank == 0:
            real, looked = session._read_stop, []

            def first_look_too_early() -> StopRequest | None:
                looked.append(True)
                return None if len(looked) == 1 else real()

            session._read_stop = first_look_too_early  # type: ignore[method-assign]
        assert session.should_stop()
        return session.stop_request.reason if session.stop_request else None

    assert run_ranks(2, body) == [StopReason.RESIZE, StopReason.RESIZE]


def test_should_stop_checks_every_kth_call(tmp_path: Path) -> None:
    session = Session.local(tmp_path, stop_check_every=3)
    assert session.should_stop() is False  # call 1 looks: no file yet
    write_stop(tmp_path, "timelimit")
    assert [session.should_stop() for _ in range(2)] == [False, False]  # calls 2, 3 do not look
    assert session.should_stop() is True  # call 4 looks
    assert session.stop_request is not None and session.stop_request.reason is StopReason.TIMELIMIT
    assert session.should_stop() is True  # once stopping, always stopping
    with pytest.raises(ValueError, match="stop_check_every must be a positive integer, got 0"):
        Session.local(tmp_path, stop_check_every=0)


def test_a_stop_at_a_step_waits_for_that_step(tmp_path: Path) -> None:
    session = Session.local(tmp_path, num_workers=N)
    model, state = make(session)
    write_stop(tmp_path, "resize", at_step=2)
    stops = []
    for _ in range(3):
        stops.append(session.should_stop())
        if not stops[-1]:
            train_step(model, state)
    assert stops == [False, False, True] and state.step == 2
    assert session.stop_request == StopRequest(StopReason.RESIZE, 1766400000.0, 2)


def test_checkpoint_and_acknowledge_writes_the_ack_on_rank_0_only(tmp_path: Path) -> None:
    write_stop(tmp_path)

    def body(coll: ThreadCollective) -> Any:
        session = session_for(coll, tmp_path)
        model, state = make(session)
        train_step(model, state)
        assert session.should_stop()
        path = session.checkpoint_and_acknowledge(state)
        return path, session.acknowledge(state.step, path)

    (p0, ack0), (p1, ack1) = run_ranks(2, body)
    assert p0 == p1 == (tmp_path / "checkpoints" / "ckpt-000000000001").resolve()
    assert ack1 is None and ack0 is not None
    doc = json.loads((tmp_path / "control" / ACK_FILE).read_text())
    assert set(doc) == {"job_id", "restart_count", "step", "checkpoint", "written_at", "reason"}
    assert (doc["job_id"], doc["restart_count"], doc["step"], doc["checkpoint"]) == (77, 1, 1, str(p0))
    assert doc["reason"] == "preempt"  # the stop acted on
    assert isinstance(doc["written_at"], float)
    # no temp file left; rank 0's progress record beside the control files
    assert sorted(p.name for p in (tmp_path / "control").iterdir()) == [ACK_FILE, PROGRESS_FILE, "stop"]


def test_rank_0_records_progress_every_few_seconds_and_at_the_end(tmp_path: Path) -> None:
    def body(coll: ThreadCollective) -> Any:
        session = session_for(coll, tmp_path)
        model, state = make(session)
        for _ in range(3):
            train_step(model, state)
        first = JobDir(tmp_path).read_progress()  # written after the first step, not again within the interval
        session.close()
        return first, JobDir(tmp_path).read_progress()

    (first, last), _ = run_ranks(2, body)
    assert first is not None and first.step >= 1
    assert (first.world_size, first.restart_count, first.device_types) == (2, 1, ("cpu",))
    assert last is not None and last.step == 3 and last.written_at >= first.written_at


def test_progress_reports_the_observed_capability_once_a_window_of_steps_is_timed(tmp_path: Path) -> None:
    def body(coll: ThreadCollective) -> Any:
        session = session_for(coll, tmp_path)
        model, state = make(session)
        seen = []
        for _ in range(state.timer.every):
            seen.append(state.capability)
            train_step(model, state)
        session.close()
        return seen, state.capability, JobDir(tmp_path).read_progress()

    (seen, capability, last), (_, other, _) = run_ranks(2, body)
    assert set(seen) == {()}  # nothing before the first window is complete
    assert capability == other and [kind for kind, _ in capability] == ["cpu"]  # the same on every process
    assert capability[0][1] > 0 and last is not None and last.capability == capability


def test_stop_right_after_restore_acknowledges_the_restored_checkpoint(tmp_path: Path) -> None:
    s1 = Session.local(tmp_path, num_workers=N)
    model, state = make(s1)
    train_step(model, state)
    first = state.commit()
    s2 = Session.local(tmp_path, num_workers=N)
    state2 = make(s2)[1]
    assert state2.restore() is not None and state2.step == 1
    write_stop(tmp_path)
    assert s2.should_stop()
    assert s2.checkpoint_and_acknowledge(state2) == first
    assert CheckpointStore(tmp_path / "checkpoints").steps() == [1]  # no second checkpoint of the same step
    assert json.loads((tmp_path / "control" / ACK_FILE).read_text())["step"] == 1


def test_restore_with_a_different_number_of_logical_workers_fails_clearly(tmp_path: Path) -> None:
    s1 = Session.local(tmp_path, num_workers=4)
    make(s1)[1].commit()
    s2 = Session.local(tmp_path, num_workers=2)
    with pytest.raises(ValueError, match="written for 4 logical workers \\(ESTs\\), this job has 2"):
        make(s2)[1].restore()


def test_extras_and_per_est_values_are_committed_and_restored(tmp_path: Path) -> None:
    session = Session.local(tmp_path, num_workers=2)
    model, state = make(session)
    state.extras["bad"] = {1, object()}
    with pytest.raises(ValueError, match=r"state.extras\['bad'\]\[\d\] is a object"):
        state.commit()
    state.extras = {"lr": 0.1, "note": "x", "hist": torch.arange(3)}
    for _ in range(4):  # one epoch: 24 samples / (2 ESTs x 3)
        train_step(model, state)
    state.commit()
    again = make(Session.local(tmp_path, num_workers=2))[1]
    again.restore()
    assert again.step == 4 and again.extras["lr"] == 0.1 and torch.equal(again.extras["hist"], torch.arange(3))
    assert {v: c.extra["seen"] for v, c in again.contexts.items()} == {0: 12, 1: 12}
    assert again.epoch == 1 and again.params_sha256() == state.params_sha256()


def test_no_job_dir_means_no_stop_and_no_checkpoints() -> None:
    session = Session.local()
    assert session.should_stop() is False
    _, state = make(session)
    with pytest.raises(HpcElasticError, match="HPC_ELASTIC_JOB_DIR is not set"):
        state.commit()


def test_mixed_device_types_need_d2_and_a_checkpoint_keeps_its_type(tmp_path: Path) -> None:
    def body(coll: ThreadCollective) -> str:
        types = (("node1", "a100"), ("node2", "v100"))
        job = JobEnvironment(job_dir=tmp_path, workers=2, node_name=f"node{coll.rank + 1}", node_gpu_types=types)
        session = Session(job, threaded_communicator(coll))
        assert session.device_types == ("a100", "v100")
        with pytest.raises(HpcElasticError, match="train on a100\\+v100: at level d1 the bits depend on the device"):
            make(session)
        return "refused"

    assert run_ranks(2, body) == ["refused", "refused"]
    a100 = Session(
        JobEnvironment(job_dir=tmp_path, workers=2, node_name="node1", node_gpu_types=(("node1", "a100"),)),
        local_communicator(),
    )
    model, state = make(a100)
    train_step(model, state)
    state.commit()
    v100 = Session(
        JobEnvironment(job_dir=tmp_path, workers=2, node_name="node3", node_gpu_types=(("node3", "v100"),)),
        local_communicator(),
    )
    with pytest.raises(HpcElasticError, match="trained on a100, this run has v100"):
        make(v100)[1].restore()


def test_a_run_on_two_device_types_places_ests_by_the_capability_its_last_run_observed(tmp_path: Path) -> None:
    """3 processes (a100, a100, v100), 8 ESTs: even blocks (3, 3, 2) without a record; with the last run's C_a100 = 3
    and C_v100 = 1 in the progress record, Eq. 1d's shares 3.43, 3.43, 1.14 -> (4, 3, 1) by largest remainder."""
    types = (("node1", "a100"), ("node2", "a100"), ("node3", "v100"))

    def counts(coll: ThreadCollective) -> tuple[int, ...]:
        job = JobEnvironment(job_dir=tmp_path, workers=8, node_name=f"node{coll.rank + 1}", node_gpu_types=types)
        return Session(job, threaded_communicator(coll)).placement.counts()

    JobDir(tmp_path).prepare()
    assert run_ranks(3, counts) == [(3, 3, 2)] * 3
    JobDir(tmp_path).record_progress(Progress(9, 1766400000.0, 1.0, 2, 0, 0, ("a100",), 8, (("a100", 3.0),)))
    assert run_ranks(3, counts) == [(3, 3, 2)] * 3  # the v100 not observed: at the mean of the types observed
    observed = (("a100", 3.0), ("v100", 1.0))
    JobDir(tmp_path).record_progress(Progress(9, 1766400001.0, 1.0, 3, 1, 0, ("a100", "v100"), 8, observed))
    assert run_ranks(3, counts) == [(4, 3, 1)] * 3


def test_from_environment_torch_single_process(tmp_path: Path) -> None:
    env = {"HPC_ELASTIC_JOB_DIR": str(tmp_path), "HPC_ELASTIC_WORKERS": "2", "HPC_ELASTIC_BACKEND": "torch"}
    with Session.from_environment(env) as session:
        assert (session.rank, session.world_size, session.num_workers, list(session.workers)) == (0, 1, 2, [0, 1])
        assert session.device.type == "cpu" and session.job_dir == JobDir(tmp_path.resolve())
        assert session.comm.collective.allreduce_max_int(5) == 5
        assert session.level is DeterminismLevel.D1 and session.device_types == ("cpu",)
    env = {**env, "HPC_ELASTIC_WORKERS": "3", "HPC_ELASTIC_LEVEL": "d2"}
    with Session.from_environment(env) as session:
        assert session.num_workers == 3 and session.level is DeterminismLevel.D2
    with pytest.raises(ValueError, match="HPC_ELASTIC_BACKEND: backend must be one of torch, mpi, horovod, got 'nccl'"):
        Session.from_environment({"HPC_ELASTIC_BACKEND": "nccl"})
    with pytest.raises(ValueError, match="HPC_ELASTIC_LEVEL: determinism level must be one of d0, d1, d2, got 'd3'"):
        Session.from_environment({"HPC_ELASTIC_LEVEL": "d3"})


def test_sigterm_in_a_slurm_job_is_a_stop_acknowledged_as_such(tmp_path: Path) -> None:
    """Slurm's preemption sends SIGTERM to the job's steps (the workers), not to the wrapper: the runtime takes it
    as a stop at the next boundary; rank 0's acknowledgement names it."""
    env = {"HPC_ELASTIC_JOB_DIR": str(tmp_path), "HPC_ELASTIC_WORKERS": str(N), "SLURM_JOB_ID": "77"}
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with Session.from_environment(env) as session:
            model, state = make(session)
            train_step(model, state)
            assert session.should_stop() is False
            os.kill(os.getpid(), signal.SIGTERM)  # the process lives on
            assert session.should_stop() is True
            assert session.stop_request is not None and session.stop_request.reason is StopReason.SIGTERM
            session.checkpoint_and_acknowledge(state)
        ack = JobDir(tmp_path).read_ack()
        assert ack is not None and (ack.job_id, ack.step, ack.reason) == (77, 1, StopReason.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == previous  # closed: TERM ends the process again
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_outside_a_slurm_job_keeps_its_default(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with Session.from_environment({"HPC_ELASTIC_JOB_DIR": str(tmp_path)}):
        assert signal.getsignal(signal.SIGTERM) == previous  # verify-determinism's local runs, tests


def test_horovod_backend_without_horovod_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # what an environment without Horovod looks like
    assert not horovod_available()
    with pytest.raises(HpcElasticError, match="the horovod backend needs Horovod built with PyTorch support"):
        Session.from_environment({"HPC_ELASTIC_BACKEND": "horovod"})


def test_a_session_closes_its_state_and_waits_for_an_async_commit(tmp_path: Path) -> None:
    session = Session.local(tmp_path, num_workers=2, save_mode="async")
    model, state = make(session)
    train_step(model, state)
    pending = state.commit()
    session.close()  # waits for the commit in flight
    assert (pending / "MANIFEST.json").exists()
