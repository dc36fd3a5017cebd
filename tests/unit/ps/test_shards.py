"""The Data Shard Manager keeps every sample trained exactly once per epoch through leases, dones, failures, workers
added and lost, and checkpoint/restore of the master."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hpc_elastic.ps.shards import (
    DoneOutcome,
    LeaseStatus,
    Shard,
    ShardConfig,
    ShardManager,
    ShardState,
)


def drain(m: ShardManager, worker: str = "w") -> None:
    while (lease := m.lease(worker)).status is LeaseStatus.SHARD:
        assert lease.shard is not None
        assert m.done(worker, lease.shard.shard_id) is DoneOutcome.ACCEPTED
    assert lease.status is LeaseStatus.END


def test_one_worker_trains_every_sample_once_per_epoch() -> None:
    m = ShardManager(ShardConfig(num_samples=103, shard_size=10, epochs=3, seed=7))
    drain(m)
    assert m.finished
    for epoch in range(3):
        assert m.ledger.exactly_once(epoch)
        assert m.epoch_complete(epoch)
    assert m.ledger.workers(0) == {"w": 103}


def test_the_shuffle_is_seeded_per_epoch() -> None:
    def order(seed: int) -> list[tuple[int, int]]:
        m = ShardManager(ShardConfig(num_samples=200, shard_size=10, epochs=2, seed=seed))
        out = []
        while (lease := m.lease("w")).status is LeaseStatus.SHARD:
            assert lease.shard is not None
            out.append((lease.shard.epoch, lease.shard.start))
            m.done("w", lease.shard.shard_id)
        return out

    a = order(1)
    assert a == order(1)
    assert a != order(2)
    first, second = [s for e, s in a if e == 0], [s for e, s in a if e == 1]
    assert sorted(first) == sorted(second) == list(range(0, 200, 10))
    assert first != second


def test_a_lost_workers_shards_go_back_first_and_a_zombie_done_is_stale() -> None:
    m = ShardManager(ShardConfig(num_samples=50, shard_size=10))
    a = m.lease("a").shard
    b = m.lease("b").shard
    assert a is not None and b is not None
    assert m.remove_worker("a") == [Shard(a.shard_id, 0, a.start, a.end, 1)]
    assert m.done("a", a.shard_id) is DoneOutcome.STALE
    again = m.lease("c").shard
    assert again is not None and (again.start, again.end, again.attempts) == (a.start, a.end, 1)
    assert m.ledger.counts(0).sum() == 0
    m.done("c", again.shard_id)
    assert m.ledger.trained_by(0, a.start) == ["c"]


def test_a_shard_failing_too_often_is_set_aside_not_retried_forever() -> None:
    m = ShardManager(ShardConfig(num_samples=10, shard_size=10, max_retries=2))
    for attempt in range(3):
        lease = m.lease(f"w{attempt}")
        assert lease.shard is not None and lease.shard.attempts == attempt
        m.remove_worker(f"w{attempt}")
    assert m.lease("w").status is LeaseStatus.END
    assert [s.attempts for s in m.failed] == [3]
    assert m.epoch_complete(0) and not m.ledger.exactly_once(0)


def test_wait_while_the_last_shards_are_held() -> None:
    m = ShardManager(ShardConfig(num_samples=10, shard_size=10))
    shard = m.lease("a").shard
    assert shard is not None
    assert m.lease("b").status is LeaseStatus.WAIT
    m.fail("a", shard.shard_id)
    assert m.lease("b").shard == Shard(shard.shard_id, 0, 0, 10, 1)


def test_a_straggler_gets_smaller_shards_and_the_rest_is_served_next() -> None:
    m = ShardManager(ShardConfig(num_samples=400, shard_size=100, straggler_ratio=0.5, min_split=5))
    fast = m.lease("fast", speed=1000.0).shard
    m.lease("mid", speed=900.0)
    slow = m.lease("slow", speed=100.0).shard
    assert fast is not None and fast.size == 100
    assert slow is not None and slow.size == 12  # ceil(100 * 100 / 900)
    rest = m.lease("fast").shard
    assert rest is not None and (rest.start, rest.end) == (slow.end, slow.start + 100)
    assert m.lease("mid").shard is not None


def test_restore_serves_the_doing_shards_first_and_keeps_the_ledger() -> None:
    cfg = ShardConfig(num_samples=100, shard_size=10, epochs=2, seed=3)
    m = ShardManager(cfg)
    first = m.lease("a").shard
    assert first is not None
    m.done("a", first.shard_id)
    held = [m.lease("b").shard, m.lease("c").shard]
    state = m.checkpoint()
    restored = ShardManager(cfg, ShardState.from_json(json.loads(json.dumps(state.to_json()))))
    assert restored.checkpoint() != state  # DOING folded into TODO
    assert [restored.lease("d").shard, restored.lease("d").shard] == held
    assert restored.ledger.entries == m.ledger.entries
    assert restored.done("b", held[0].shard_id if held[0] else -1) is DoneOutcome.STALE


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"num_samples": 0, "shard_size": 1}, "num_samples"),
        ({"num_samples": 10, "shard_size": -1}, "shard_size"),
        ({"num_samples": 10, "shard_size": 1, "epochs": 0}, "epochs"),
        ({"num_samples": 10, "shard_size": 1, "max_retries": -2}, "max_retries"),
        ({"num_samples": 10, "shard_size": 1, "straggler_ratio": 0.0}, "straggler_ratio"),
    ],
)
def test_bad_configs_name_the_value(kwargs: dict[str, int | float], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        ShardConfig(**kwargs)  # type: ignore[arg-type]


def test_a_bad_speed_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        ShardManager(ShardConfig(num_samples=10, shard_size=1)).lease("w", speed=-1.0)


class Cluster(RuleBasedStateMachine):
    """Random leases, dones, failures, workers added and lost (with and without speeds) and master restarts; at
    the end every worker drains the queues. Whatever the sequence, each epoch's samples are counted exactly once
    (no retry cap is reached: max_retries is large), and no sample is ever counted twice on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ShardConfig(num_samples=97, shard_size=8, epochs=2, seed=5, max_retries=10_000, min_split=1)
        self.manager = ShardManager(self.config)
        self.workers = ["w0"]
        self.held: dict[str, list[int]] = {"w0": []}
        self.next_worker = 1

    @rule(k=st.integers(0, 7), speed=st.one_of(st.none(), st.floats(1.0, 1000.0)))
    def lease(self, k: int, speed: float | None) -> None:
        w = self.workers[k % len(self.workers)]
        lease = self.manager.lease(w, speed)
        if lease.shard is not None:
            self.held[w].append(lease.shard.shard_id)

    @rule(k=st.integers(0, 7), j=st.integers(0, 7))
    def done(self, k: int, j: int) -> None:
        w = self.workers[k % len(self.workers)]
        if self.held[w]:
            sid = self.held[w].pop(j % len(self.held[w]))
            assert self.manager.done(w, sid) is DoneOutcome.ACCEPTED

    @rule(k=st.integers(0, 7))
    def fail(self, k: int) -> None:
        w = self.workers[k % len(self.workers)]
        if self.held[w]:
            assert self.manager.fail(w, self.held[w].pop()) is DoneOutcome.ACCEPTED

    @rule()
    def add_worker(self) -> None:
        w = f"w{self.next_worker}"
        self.next_worker += 1
        self.manager.add_worker(w)
        self.workers.append(w)
        self.held[w] = []

    @precondition(lambda self: len(self.workers) > 1)
    @rule(k=st.integers(0, 7))
    def remove_worker(self, k: int) -> None:
        w = self.workers.pop(k % len(self.workers))
        stale = self.held.pop(w)
        self.manager.remove_worker(w)
        for sid in stale:  # a zombie's late reports count for nothing
            assert self.manager.done(w, sid) is DoneOutcome.STALE

    @rule()
    def restart_master(self) -> None:
        state = ShardState.from_json(json.loads(json.dumps(self.manager.checkpoint().to_json())))
        self.manager = ShardManager(self.config, state)
        self.held = {w: [] for w in self.workers}  # the workers' leases died with the old master

    @invariant()
    def never_twice(self) -> None:
        for epoch in range(self.config.epochs):
            assert self.manager.ledger.counts(epoch).max(initial=0) <= 1

    def teardown(self) -> None:
        for w, sids in self.held.items():
            for sid in sids:
                self.manager.done(w, sid)
        drain(self.manager, self.workers[0])
        assert self.manager.finished and not self.manager.failed
        for epoch in range(self.config.epochs):
            assert self.manager.ledger.exactly_once(epoch)


TestCluster = Cluster.TestCase
TestCluster.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.integers(1, 500), st.integers(1, 64), st.integers(0, 2**31))
def test_shards_cover_the_dataset(n: int, size: int, seed: int) -> None:
    m = ShardManager(ShardConfig(num_samples=n, shard_size=size, seed=seed))
    drain(m)
    assert m.ledger.exactly_once(0)
