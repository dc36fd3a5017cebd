"""LB-BSP Alg. 2 on synthetic workers whose batch time is Γ_i(x) = Γ(0) + x / v_i."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from hpc_elastic.balance.gpu import (
    Alg2Config,
    Alg2Decision,
    Alg2State,
    Outcome,
    Phase,
    WorkerReading,
    alg2_step,
    memory_cap,
)
from hpc_elastic.profile.schema import MemoryLimitInfo, MemoryMethod, Profile
from tests.unit.profile.helpers import make_profile


def run(
    state: Alg2State,
    speeds: Sequence[float],
    iterations: int,
    overhead: float = 0.0,
    free: Sequence[float] | None = None,
    config: Alg2Config | None = None,
) -> tuple[Alg2State, list[Alg2Decision]]:
    decisions = []
    for _ in range(iterations):
        fractions = free if free is not None else [1.0] * len(speeds)
        readings = [WorkerReading(overhead + x / v, f) for x, v, f in zip(state.sizes, speeds, fractions, strict=True)]
        state, decision = alg2_step(state, readings, config)
        assert sum(state.sizes) == state.total == sum(decision.sizes)
        assert decision.sizes == state.sizes
        decisions.append(decision)
    return state, decisions


def slowest(sizes: Sequence[int], speeds: Sequence[float], overhead: float = 0.0) -> float:
    return max(overhead + x / v for x, v in zip(sizes, speeds, strict=True))


@pytest.mark.parametrize("overhead", [0.0, 3.0])
def test_converges_to_balance_through_both_phases(overhead: float) -> None:
    speeds = [1.0, 2.0, 3.0, 4.0]
    total = 256
    state, decisions = run(Alg2State.initial(total, [None] * 4), speeds, 200, overhead)
    ideal = overhead + total / sum(speeds)  # x_i = X·v_i/Σv: every worker takes X/Σv + Γ(0)
    bsp = slowest([64] * 4, speeds, overhead)
    final = slowest(state.sizes, speeds, overhead)
    print(f"Γ(0) = {overhead}: BSP {bsp:.2f}, LB-BSP {final:.2f}, ideal {ideal:.2f}, sizes {state.sizes}")
    assert final <= 1.05 * ideal
    assert state.phase is Phase.FINE_TUNE
    switch = next(i for i, d in enumerate(decisions) if d.outcome is Outcome.SWITCHED)
    fast_moves = [d.move for d in decisions[:switch] if d.move is not None]
    fine_moves = [d.move for d in decisions[switch:] if d.move is not None]
    assert len(fast_moves) >= 5 and all(m.samples == 5 for m in fast_moves)
    assert fine_moves and all(m.samples == 1 for m in fine_moves)
    # the first move waits for D = 5 observations in which the leader led
    assert decisions[3].outcome is Outcome.WAITING and decisions[4].outcome is Outcome.MOVED
    # the switch happens exactly when the leader was once the slower of the two (an oscillation)
    before, _ = run(Alg2State.initial(total, [None] * 4), speeds, switch, overhead)
    d = decisions[switch]
    assert d.leader is not None and before.slower(d.leader, d.straggler)
    # a fine-tune move needs D = 20 iterations in which the leader led, so after a pause moves come 20 apart
    fine = [i for i, x in enumerate(decisions) if x.move is not None and i > switch]
    assert max(b - a for a, b in itertools.pairwise(fine)) >= 19


def test_fast_phase_has_no_switch_without_oscillation() -> None:
    # two workers 1:3 with X = 40: from (20, 20) the balance (10, 30) is reached in two steps of 5 without overshoot
    state, decisions = run(Alg2State.initial(40, [None, None]), [1.0, 3.0], 30)
    assert state.sizes == (10, 30)
    assert state.phase is Phase.FAST_APPROACH
    assert [d.outcome for d in decisions].count(Outcome.MOVED) == 2
    assert all(d.outcome is not Outcome.SWITCHED for d in decisions)


def test_overshoot_switches_to_fine_tune_and_settles() -> None:
    # 1:2.2 with X = 30: the balance is (9.4, 20.6); steps of 5 from (15, 15) pass (10, 20) and overshoot to (5, 25),
    # where the former leader is the straggler: an oscillation
    speeds = [1.0, 2.2]
    state, decisions = run(Alg2State.initial(30, [None, None]), speeds, 80)
    outcomes = [d.outcome for d in decisions]
    assert Outcome.SWITCHED in outcomes
    switch = outcomes.index(Outcome.SWITCHED)
    assert all(d.move is None or d.move.samples == 5 for d in decisions[:switch])
    assert all(d.move is None or d.move.samples == 1 for d in decisions[switch:])
    assert state.sizes in {(9, 21), (10, 20)}  # 30·1/3.2 = 9.4


def test_memory_cap_is_never_exceeded() -> None:
    speeds = [1.0, 2.0, 3.0, 4.0]
    caps = [None, None, None, 70]
    state, decisions = run(Alg2State.initial(256, caps), speeds, 300)
    for d in decisions:
        assert d.sizes[3] <= 70
    assert state.sizes[3] in range(66, 71)  # it fills up to its cap (Δ = 5 in the fast phase may stop it short)
    # the others share the rest in balance: 186 samples over speeds 1:2:3 take about 31 each
    rest = 256 - state.sizes[3]
    assert slowest(state.sizes[:3], speeds[:3]) <= 1.05 * rest / 6
    with pytest.raises(ValueError, match="hold only"):
        Alg2State.initial(256, [60, 60, 60, 60])


def test_a_worker_short_of_memory_is_never_the_leader() -> None:
    speeds = [1.0, 2.0, 3.0, 4.0]
    free = [0.5, 0.5, 0.5, 0.04]  # the fastest has less than 5 % free
    state, decisions = run(Alg2State.initial(256, [None] * 4), speeds, 200, free=free)
    assert all(d.leader != 3 for d in decisions)
    assert state.sizes[3] == 64
    assert all(d.move is None or d.move.taker != 3 for d in decisions)


def test_no_eligible_leader_moves_nothing() -> None:
    state = Alg2State.initial(40, [None, None])
    readings = [WorkerReading(1.0, 0.01), WorkerReading(2.0, 0.02)]
    for _ in range(10):
        state, decision = alg2_step(state, readings)
        assert decision.outcome is Outcome.NO_LEADER and decision.sizes == (20, 20)


def test_a_too_slow_worker_is_dropped_with_a_warning() -> None:
    speeds = [1.0, 50.0, 50.0, 50.0]
    state, decisions = run(Alg2State.initial(32, [None] * 4), speeds, 12)
    drops = [d for d in decisions if d.outcome is Outcome.DROP]
    assert drops, [d.outcome for d in decisions]
    first = drops[0]
    assert first.drop == 0 and first.warning is not None and "worker 0" in first.warning
    assert first.sizes[0] <= 5  # line 8: x_straggler ≤ Δ, sizes unchanged
    assert all(d.sizes[0] >= 1 for d in decisions)
    smaller = state.without(0)
    assert smaller.workers == 3 and smaller.total == 32
    assert len(smaller.ever_slower) == 3 and all(len(r) == 3 for r in smaller.recent)
    after, _ = run(smaller, speeds[1:], 30)
    assert after.total == 32


def test_est_mode_uses_a_step_of_one() -> None:
    config = Alg2Config(fast_step=1, fine_step=1)
    state, decisions = run(Alg2State.initial(16, [None] * 4), [1.0, 1.0, 1.0, 3.0], 60, config=config)
    assert all(d.move is None or d.move.samples == 1 for d in decisions)
    assert state.sizes[3] > 4 and sum(state.sizes) == 16


def test_bad_input_is_rejected() -> None:
    state = Alg2State.initial(8, [None, None])
    with pytest.raises(ValueError, match="expected 2 worker readings"):
        alg2_step(state, [WorkerReading(1.0)])
    with pytest.raises(ValueError, match="free memory"):
        WorkerReading(1.0, 1.5)
    with pytest.raises(ValueError, match="fast_step"):
        Alg2Config(fast_step=0)
    with pytest.raises(ValueError, match="above its memory cap"):
        Alg2State(sizes=(5, 3), caps=(4, None))


def _with_limit(limit: int | None, capped: bool = False) -> Profile:
    info = MemoryLimitInfo(
        batch_size=limit,
        capped=capped,
        max_batch=limit if capped and limit else 512,
        first_failing_batch=None if capped else (limit or 0) + 1,
        cap_bytes=1 << 30,
        method=MemoryMethod.CUDA_PEAK,
        probes=[],
    )
    return make_profile().model_copy(update={"memory_limit": info})


def test_memory_cap_comes_from_the_profile() -> None:
    assert memory_cap(None) is None
    assert memory_cap(make_profile()) == 40
    assert memory_cap(make_profile().model_copy(update={"memory_limit": None})) is None
    assert memory_cap(_with_limit(96)) == 96
    assert memory_cap(_with_limit(256, capped=True)) == 256
    with pytest.raises(ValueError, match="not even one sample"):
        memory_cap(_with_limit(None))


def test_predictive_whole_unit_moves_settle_without_ping_pong() -> None:
    # 5 units on speeds 1:1.4: the plain rule with Δ = 1 swaps leader and straggler between (2, 3) and (3, 2) for
    # ever; the predictive rule reaches the better split and then moves nothing
    speeds = [1.0, 1.4]
    plain = Alg2Config(fast_step=1, fast_window=2, fine_step=1, fine_window=4)
    guarded = Alg2Config(fast_step=1, fast_window=2, fine_step=1, fine_window=4, predictive=True)
    _, plain_decisions = run(Alg2State(sizes=(3, 2), caps=(None, None)), speeds, 200, config=plain)
    state, decisions = run(Alg2State(sizes=(3, 2), caps=(None, None)), speeds, 200, config=guarded)
    late_plain = [d for d in plain_decisions[100:] if d.move is not None]
    late = [d for d in decisions[100:] if d.move is not None]
    print(f"plain: {len(late_plain)} moves in the last 100 iterations; predictive: {len(late)}, sizes {state.sizes}")
    assert late_plain and not late
    assert state.sizes == (2, 3)
    # on 1:2:3:4 with 8 units it ends at the best split one unit per move can reach, every worker keeping one
    state, decisions = run(Alg2State.initial(8, [None] * 4), [1.0, 2.0, 3.0, 4.0], 200, config=guarded)
    best = min(slowest(s, [1.0, 2.0, 3.0, 4.0]) for s in itertools.product(range(1, 6), repeat=4) if sum(s) == 8)
    assert slowest(state.sizes, [1.0, 2.0, 3.0, 4.0]) == best and min(state.sizes) >= 1
    assert not [d for d in decisions[100:] if d.move is not None]


def test_predictive_rule_refuses_a_move_that_makes_the_leader_the_straggler() -> None:
    config = Alg2Config(fast_step=1, fast_window=1, fine_step=1, fine_window=1, predictive=True)
    # leader 1.0 s for 2 units; with 3 it would take 1.5 s, above the straggler's 1.2 s now
    state = Alg2State(sizes=(2, 2), caps=(None, None))
    _, decision = alg2_step(state, [WorkerReading(1.0), WorkerReading(1.2)], config)
    assert decision.move is None and decision.sizes == (2, 2)
    # a straggler at 2.0 s: the leader's 1.5 s and the straggler's 1.0 s both beat it
    _, decision = alg2_step(state, [WorkerReading(1.0), WorkerReading(2.0)], config)
    assert decision.move is not None and decision.sizes == (3, 1)
