"""Session and State on threaded ranks (fast) and one real torch.distributed process: stop agreement, ack,
commit/restore across resizes with per-logical-worker state, bitwise-stable reduction."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.collective import Collective, horovod_available
from hpc_elastic.control import ACK_FILE, StopReason
from hpc_elastic.data import ElasticSampler
from hpc_elastic.env import JobEnvironment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.session import Session
from hpc_elastic.state import State
from tests.unit.checkpoint.threaded import ThreadCollective, run_ranks

N = 4
DATASET = 26  # 26 samples / (4 workers x batch 3) = 2 full steps + a short one per epoch


def session_for(coll: Collective, job_dir: Path | None, **kw: Any) -> Session:
    job = JobEnvironment(job_id=77, restart_count=1, job_dir=job_dir, workers=N)
    return Session(job, coll, **kw)


def write_stop(job_dir: Path, reason: str = "preempt") -> None:
    (job_dir / "control").mkdir(parents=True, exist_ok=True)
    (job_dir / "control" / "stop").write_text(json.dumps({"reason": reason, "requested_at": 1766400000.0}))


# -- a tiny data-parallel trainer over logical workers -------------------------------------------------------

X = torch.randn(DATASET, 3, generator=torch.Generator().manual_seed(0))
Y = X.sum(1, keepdim=True)


def make(session: Session) -> tuple[torch.nn.Module, torch.optim.Optimizer, ElasticSampler, State]:
    model = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)  # not the global RNG: the ranks are threads of one process
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(DATASET, 3, seed=5)
    return model, opt, sampler, session.state(model=model, optimizer=opt, sampler=sampler)


def train_step(
    session: Session, model: torch.nn.Module, opt: torch.optim.Optimizer, sampler: ElasticSampler, state: State
) -> None:
    rows = []
    for w in session.workers:
        idx = sampler.indices(w, N)
        model.zero_grad()
        if idx:
            ((model(X[idx]) - Y[idx]) ** 2).sum().backward()
        rows.append(
            torch.cat(
                [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]
            )
        )
        state.workers[w]["seen"] = state.workers[w].get("seen", 0) + len(idx)
    total = session.sum_over_workers(torch.stack(rows)) / sampler.step_size(N)
    offset = 0
    for p in model.parameters():
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    opt.step()
    sampler.advance(N)
    state.step += 1


def run_phase(job_dir: Path, m: int, until: int, mode: str = "sync") -> list[dict[str, Any]]:
    def body(coll: ThreadCollective) -> dict[str, Any]:
        session = session_for(coll, job_dir)
        model, opt, sampler, state = make(session)
        ckpt = state.restore()
        while state.step < until:
            train_step(session, model, opt, sampler, state)
        state.commit(mode=mode)
        state.wait()
        return {
            "restored": None if ckpt is None else ckpt.step,
            "params": [p.detach().clone() for p in model.parameters()],
            "workers": {w: dict(v) for w, v in state.workers.items()},
            "sampler": sampler.state_dict(),
        }

    return run_ranks(m, body)


def test_resize_4_to_2_to_1_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    ref = run_phase(tmp_path / "ref", 1, 9)[0]
    first = run_phase(tmp_path / "job", 4, 3)
    assert [r["restored"] for r in first] == [None] * 4
    second = run_phase(tmp_path / "job", 2, 6, mode="async")
    assert [r["restored"] for r in second] == [3, 3]
    third = run_phase(tmp_path / "job", 1, 9)
    assert third[0]["restored"] == 6
    final = third[0]
    # bitwise: the logical workers, their samples and the reduction order never depended on M
    assert all(torch.equal(a, b) for a, b in zip(final["params"], ref["params"], strict=True))
    assert final["sampler"] == ref["sampler"]
    # per-logical-worker state followed each worker from rank to rank
    assert final["workers"] == ref["workers"]
    assert (final["sampler"]["epoch"], final["sampler"]["position"]) == (3, 0)  # 3 steps per epoch
    assert sum(v["seen"] for v in final["workers"].values()) == 3 * DATASET
    assert second[0]["workers"].keys() == {0, 1} and second[1]["workers"].keys() == {2, 3}


def test_sum_over_workers_is_bitwise_the_same_for_every_world_size() -> None:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(N, 1000, generator=g) * torch.logspace(-8, 8, N).unsqueeze(1)

    def reduce(m: int) -> torch.Tensor:
        def body(coll: ThreadCollective) -> torch.Tensor:
            session = session_for(coll, None)
            return session.sum_over_workers(rows[list(session.workers)])

        results = run_ranks(m, body)
        assert all(torch.equal(r, results[0]) for r in results)
        return results[0]

    sequential = rows[0].clone()
    for i in range(1, N):
        sequential += rows[i]
    for m in (1, 2, 4):
        assert torch.equal(reduce(m), sequential)


def test_sum_over_workers_checks_the_row_count() -> None:
    session = Session.local(num_workers=2)
    with pytest.raises(ValueError, match=r"one row per logical worker of this process \(2\)"):
        session.sum_over_workers(torch.zeros(3, 4))


def test_should_stop_is_agreed_even_by_ranks_that_do_not_see_the_file(tmp_path: Path) -> None:
    seen, blind = tmp_path / "seen", tmp_path / "blind"
    write_stop(seen)

    def body(coll: ThreadCollective) -> tuple[bool, StopReason | None]:
        session = session_for(coll, seen if coll.rank == 1 else blind)
        stop = session.should_stop()
        return stop, session.stop_request.reason if session.stop_request else None

    assert run_ranks(2, body) == [(True, StopReason.UNKNOWN), (True, StopReason.PREEMPT)]


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


def test_checkpoint_and_acknowledge_writes_the_ack_on_rank_0_only(tmp_path: Path) -> None:
    write_stop(tmp_path)

    def body(coll: ThreadCollective) -> Any:
        session = session_for(coll, tmp_path)
        model, opt, sampler, state = make(session)
        train_step(session, model, opt, sampler, state)
        assert session.should_stop()
        path = session.checkpoint_and_acknowledge(state)
        return path, session.acknowledge(state.step, path)

    (p0, ack0), (p1, ack1) = run_ranks(2, body)
    assert p0 == p1 == (tmp_path / "checkpoints" / "ckpt-000000000001").resolve()
    assert ack1 is None and ack0 is not None
    doc = json.loads((tmp_path / "control" / ACK_FILE).read_text())
    assert set(doc) == {"job_id", "restart_count", "step", "checkpoint", "written_at"}
    assert (doc["job_id"], doc["restart_count"], doc["step"], doc["checkpoint"]) == (77, 1, 1, str(p0))
    assert isinstance(doc["written_at"], float)
    assert sorted(p.name for p in (tmp_path / "control").iterdir()) == [ACK_FILE, "stop"]  # no temp file left


def test_stop_right_after_restore_acknowledges_the_restored_checkpoint(tmp_path: Path) -> None:
    s1 = Session.local(tmp_path, num_workers=N)
    model, opt, sampler, state = make(s1)
    train_step(s1, model, opt, sampler, state)
    first = state.commit()
    s2 = Session.local(tmp_path, num_workers=N)
    state2 = make(s2)[3]
    assert state2.restore() is not None and state2.step == 1
    write_stop(tmp_path)
    assert s2.should_stop()
    assert s2.checkpoint_and_acknowledge(state2) == first
    assert CheckpointStore(tmp_path / "checkpoints").steps() == [1]  # no second checkpoint of the same step
    assert json.loads((tmp_path / "control" / ACK_FILE).read_text())["step"] == 1


def test_restore_with_a_different_number_of_logical_workers_fails_clearly(tmp_path: Path) -> None:
    s1 = Session.local(tmp_path, num_workers=4)
    make(s1)[3].commit()
    s2 = Session.local(tmp_path, num_workers=2)
    with pytest.raises(HpcElasticError, match="written for 4 logical workers, this job has 2"):
        make(s2)[3].restore()


def test_state_checks(tmp_path: Path) -> None:
    session = Session.local(tmp_path, num_workers=2)
    _, _, _, state = make(session)
    with pytest.raises(ValueError, match="epoch follows the sampler"):
        state.epoch = 3
    state.extras["bad"] = {1, object()}
    with pytest.raises(ValueError, match=r"state.extras\['bad'\]\[\d\] is a object"):
        state.commit()
    state.extras = {"lr": 0.1, "note": "x", "hist": torch.arange(3)}
    state.step = 2
    state.commit()
    _, _, _, again = make(Session.local(tmp_path, num_workers=2))
    again.restore()
    assert again.step == 2 and again.extras["lr"] == 0.1 and torch.equal(again.extras["hist"], torch.arange(3))


def test_no_job_dir_means_no_stop_and_no_checkpoints() -> None:
    session = Session.local()
    assert session.should_stop() is False
    with pytest.raises(HpcElasticError, match="HPC_ELASTIC_JOB_DIR is not set"):
        session.state()


def test_from_environment_torch_single_process(tmp_path: Path) -> None:
    env = {"HPC_ELASTIC_JOB_DIR": str(tmp_path), "HPC_ELASTIC_WORKERS": "2", "HPC_ELASTIC_BACKEND": "torch"}
    with Session.from_environment(env) as session:
        assert (session.rank, session.world_size, session.num_workers, list(session.workers)) == (0, 1, 2, [0, 1])
        assert session.device.type == "cpu" and session.job_dir == tmp_path.resolve()
        assert session.collective.allreduce_max_int(5) == 5
        assert session.collective.broadcast_object({"k": 1}) == {"k": 1}
    import torch.distributed as dist

    assert not dist.is_initialized()  # close() released the group it opened


def test_from_environment_rejects_bad_worker_counts(tmp_path: Path) -> None:
    env = {"HPC_ELASTIC_JOB_DIR": str(tmp_path), "HPC_ELASTIC_WORKERS": "3", "HPC_ELASTIC_WORLD_SIZE": "1"}
    with Session.from_environment(env) as session:
        assert session.num_workers == 3
    with pytest.raises(ValueError, match="HPC_ELASTIC_BACKEND must be one of torch, mpi, horovod, got 'nccl'"):
        Session.from_environment({"HPC_ELASTIC_BACKEND": "nccl"})


def test_horovod_backend_without_horovod_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # what an environment without Horovod looks like
    assert not horovod_available()
    with pytest.raises(HpcElasticError, match="the horovod backend needs Horovod built with PyTorch support"):
        Session.from_environment({"HPC_ELASTIC_BACKEND": "horovod"})
