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
        for shard in lease.shards:
            assert m.done(worker, shard.shard_id) is DoneOutcome.ACCEPTED
    assert lease.status is LeaseStatus.END


def one(m: ShardManager, worker: str, speed: float | None = None) -> Shard:
    """The one shard a lease gives ``worker`` (a worker without a speed, or a straggler)."""
    lease = m.lease(worker, speed)
    assert lease.status is LeaseStatus.SHARD and len(lease.shards) == 1, lease
    return lease.shards[0]


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
            (shard,) = lease.shards
            out.append((shard.epoch, shard.start))
            m.done("w", shard.shard_id)
        return out

    a = order(1)
    assert a == order(1)
    assert a != order(2)
    first, second = [s for e, s in a if e == 0], [s for e, s in a if e == 1]
    assert sorted(first) == sorted(second) == list(range(0, 200, 10))
    assert first != second


def test_a_lost_workers_shards_go_back_first_and_a_zombie_done_is_stale() -> None:
    m = ShardManager(ShardConfig(num_samples=50, shard_size=10))
    a = one(m, "a")
    one(m, "b")
    assert m.remove_worker("a") == [Shard(a.shard_id, 0, a.start, a.end, 1)]
    assert m.done("a", a.shard_id) is DoneOutcome.STALE
    again = one(m, "c")
    assert (again.start, again.end, again.attempts) == (a.start, a.end, 1)
    assert m.ledger.counts(0).sum() == 0
    m.done("c", again.shard_id)
    assert m.ledger.trained_by(0, a.start) == ["c"]


def test_a_shard_failing_too_often_is_set_aside_not_retried_forever() -> None:
    m = ShardManager(ShardConfig(num_samples=10, shard_size=10, max_retries=2))
    for attempt in range(3):
        assert one(m, f"w{attempt}").attempts == attempt
        m.remove_worker(f"w{attempt}")
    assert m.lease("w").status is LeaseStatus.END
    assert [s.attempts for s in m.failed] == [3]
    assert m.epoch_complete(0) and not m.ledger.exactly_once(0)


def test_wait_while_the_last_shards_are_held() -> None:
    m = ShardManager(ShardConfig(num_samples=10, shard_size=10))
    shard = one(m, "a")
    assert m.lease("b").status is LeaseStatus.WAIT
    m.fail("a", shard.shard_id)
    assert m.lease("b").shards == (Shard(shard.shard_id, 0, 0, 10, 1),)


def test_a_straggler_gets_smaller_shards_and_the_rest_is_served_next() -> None:
    m = ShardManager(ShardConfig(num_samples=400, shard_size=100, straggler_ratio=0.5, min_split=5, hold_seconds=0.01))
    fast = one(m, "fast", speed=1000.0)  # a bound of 10 records: one shard at a time
    one(m, "mid", speed=900.0)
    slow = one(m, "slow", speed=100.0)
    assert fast.size == 100
    assert slow.size == 12  # ceil(100 * 100 / 900)
    m.done("fast", fast.shard_id)
    rest = one(m, "fast")
    assert (rest.start, rest.end) == (slow.end, slow.start + 100)


def test_restore_serves_the_doing_shards_first_and_keeps_the_ledger() -> None:
    cfg = ShardConfig(num_samples=100, shard_size=10, epochs=2, seed=3)
    m = ShardManager(cfg)
    first = one(m, "a")
    m.done("a", first.shard_id)
    held = [one(m, "b"), one(m, "c")]
    state = m.checkpoint()
    restored = ShardManager(cfg, ShardState.from_json(json.loads(json.dumps(state.to_json()))))
    assert restored.checkpoint() != state  # DOING folded into TODO
    again = one(restored, "d")
    restored.done("d", again.shard_id)
    assert [again, one(restored, "d")] == held
    assert restored.ledger.entries[:-1] == m.ledger.entries
    assert restored.done("b", held[0].shard_id) is DoneOutcome.STALE


def test_a_lease_never_exceeds_the_bound_and_slower_workers_hold_less() -> None:
    config = ShardConfig(num_samples=10_000, shard_size=10, max_hold=8, hold_seconds=0.5, straggler_ratio=1e-9)
    m = ShardManager(config)
    assert len(m.lease("new").shards) == 1  # no speed yet: one shard at a time
    fast = m.lease("fast", speed=1e6).shards
    assert len(fast) == 8  # at most max_hold shards
    mid = m.lease("mid", speed=100.0).shards
    assert sum(s.size for s in mid) == 50 and len(mid) == 5  # 0.5 s at 100 samples/s
    assert m.lease("mid", speed=100.0).status is LeaseStatus.WAIT  # it holds its bound
    m.done("mid", mid[0].shard_id)
    assert len(m.lease("mid", speed=100.0).shards) == 1  # room for one more
    slow = m.lease("slow", speed=30.0).shards
    assert len(slow) == 1 and slow[0].size == 10  # one shard, whatever the bound: a worker holding none gets one
    for worker in ("fast", "mid", "slow", "new"):
        count, records = m.held(worker)
        assert count <= config.max_hold and (count == 1 or records <= m.bound(worker))


def finish(m: ShardManager, worker: str, shards: tuple[Shard, ...]) -> None:
    for shard in shards:
        assert m.done(worker, shard.shard_id) is DoneOutcome.ACCEPTED


def test_the_cap_doubles_while_it_cuts_the_leases_of_a_worker_that_drains_them_up_to_max_hold() -> None:
    m = ShardManager(ShardConfig(num_samples=1000, shard_size=1, start_hold=2, max_hold=8))
    sizes = []
    for _ in range(5):
        lease = m.lease("w", speed=1e6)
        sizes.append(len(lease.shards))
        finish(m, "w", lease.shards)
    assert sizes == [2, 4, 8, 8, 8]


def test_the_cap_does_not_grow_for_a_worker_that_calls_while_it_still_holds_shards() -> None:
    m = ShardManager(ShardConfig(num_samples=1000, shard_size=1, start_hold=2, max_hold=8))
    first = m.lease("w", speed=1e6).shards
    finish(m, "w", first[:1])  # a heartbeat between mini-batches: one shard done, one still held
    second = m.lease("w", speed=1e6).shards
    assert len(second) == 1 and m.held("w")[0] == 2 and m.cap("w") == 2
    finish(m, "w", first[1:] + second)
    assert m.cap("w") == 4  # drained after a lease the cap cut


def test_a_lease_cut_by_the_speed_brings_the_cap_down_to_what_the_worker_holds() -> None:
    m = ShardManager(ShardConfig(num_samples=1000, shard_size=1, start_hold=2, max_hold=16, hold_seconds=1.0))
    for _ in range(4):
        finish(m, "w", m.lease("w", speed=1e6).shards)
    assert m.cap("w") == 16
    slowed = m.lease("w", speed=5.0).shards  # 1 s of work at 5 samples/s
    assert len(slowed) == 5 and m.cap("w") == 5
    finish(m, "w", slowed)
    assert len(m.lease("w", speed=1e6).shards) == 5  # faster again: the cap cuts this lease, it grows from there
    assert m.cap("w") == 5


def test_a_straggler_holds_fewer_shards_than_a_fast_worker_whatever_their_caps() -> None:
    config = ShardConfig(
        num_samples=100_000, shard_size=4, start_hold=4, max_hold=64, straggler_ratio=1e-9, hold_seconds=1.0
    )
    m = ShardManager(config)
    held = {}
    for _ in range(6):
        for worker, speed in (("fast", 1e6), ("slow", 20.0)):
            lease = m.lease(worker, speed=speed)
            held[worker] = len(lease.shards)
            finish(m, worker, lease.shards)
    assert held == {"fast": 64, "slow": 5}  # 1 s at 20 samples/s: 20 records, five shards of 4
    assert m.cap("slow") == config.start_hold + 1


def test_a_worker_lost_or_registered_again_starts_from_the_starting_cap() -> None:
    m = ShardManager(ShardConfig(num_samples=1000, shard_size=1, start_hold=2, max_hold=8))
    for _ in range(3):
        finish(m, "w", m.lease("w", speed=1e6).shards)
    assert m.cap("w") == 8
    m.remove_worker("w")
    assert m.cap("w") == 2
    for _ in range(3):
        finish(m, "w", m.lease("w", speed=1e6).shards)
    m.add_worker("w")
    assert m.cap("w") == 2 and len(m.lease("w").shards) == 1  # no speed known after registering


def test_a_worker_killed_with_leased_unstarted_shards_gives_them_all_back_first() -> None:
    m = ShardManager(ShardConfig(num_samples=200, shard_size=10, max_hold=4))
    held = m.lease("a", speed=1e6).shards
    assert len(held) == 4
    m.done("a", held[0].shard_id)  # it trained one; the other three were leased, not started
    back = m.remove_worker("a")
    assert [(s.start, s.end) for s in back] == [(s.start, s.end) for s in held[1:]]
    again = m.lease("b", speed=1e6).shards
    assert again[:3] == tuple(back)
    assert m.held("a") == (0, 0) and m.held("b") == (4, 40)
    for shard in again:
        m.done("b", shard.shard_id)
    drain(m, "b")
    assert m.ledger.exactly_once(0) and m.ledger.workers(0)["a"] == 10


def test_shards_pack_into_one_array_and_back() -> None:
    shards = [Shard(3, 0, 10, 20, 0), Shard(9, 1, 0, 5, 2)]
    packed = Shard.pack(shards)
    assert packed.shape == (2, 5) and Shard.unpack(packed) == shards
    assert Shard.unpack(Shard.pack([])) == []
    with pytest.raises(ValueError, match="not an array of shards"):
        Shard.unpack(packed[:, :4])


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"num_samples": 0, "shard_size": 1}, "num_samples"),
        ({"num_samples": 10, "shard_size": -1}, "shard_size"),
        ({"num_samples": 10, "shard_size": 1, "epochs": 0}, "epochs"),
        ({"num_samples": 10, "shard_size": 1, "max_retries": -2}, "max_retries"),
        ({"num_samples": 10, "shard_size": 1, "straggler_ratio": 0.0}, "straggler_ratio"),
        ({"num_samples": 10, "shard_size": 1, "max_hold": 0}, "max_hold"),
        ({"num_samples": 10, "shard_size": 1, "start_hold": 0}, "start_hold"),
        ({"num_samples": 10, "shard_size": 1, "hold_seconds": -1.0}, "hold_seconds"),
    ],
)
def test_bad_configs_name_the_value(kwargs: dict[str, int | float], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        ShardConfig(**kwargs)  # type: ignore[arg-type]


def test_a_bad_speed_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        ShardManager(ShardConfig(num_samples=10, shard_size=1)).lease("w", speed=-1.0)


class Cluster(RuleBasedStateMachine):
    """Random leases of batches of shards, dones, failures, workers added and lost (scale-in, or killed holding
    leased shards it had not started) with and without speeds, and master restarts; at the end every worker drains
    the queues. Whatever the sequence, each epoch's samples are counted exactly once (no retry cap is reached:
    max_retries is large), no sample is ever counted twice on the way, and no lease exceeds a worker's bound."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ShardConfig(
            num_samples=97,
            shard_size=8,
            epochs=2,
            seed=5,
            max_retries=10_000,
            min_split=1,
            max_hold=4,
            start_hold=1,
            hold_seconds=0.05,
        )
        self.manager = ShardManager(self.config)
        self.workers = ["w0"]
        self.held: dict[str, list[int]] = {"w0": []}
        self.next_worker = 1

    @rule(k=st.integers(0, 7), speed=st.one_of(st.none(), st.floats(1.0, 1000.0)))
    def lease(self, k: int, speed: float | None) -> None:
        w = self.workers[k % len(self.workers)]
        before = self.manager.held(w)
        lease = self.manager.lease(w, speed)
        self.held[w].extend(s.shard_id for s in lease.shards)
        count, records = self.manager.held(w)
        assert (count, records) == (before[0] + len(lease.shards), before[1] + sum(s.size for s in lease.shards))
        assert count <= self.config.max_hold and (not lease.shards or count <= self.manager.cap(w))
        assert not lease.shards or count == 1 or records <= self.manager.bound(w)  # a speed lowered leases nothing

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
