"""EasyScale's planner (§3.4): Eq. 1a-1d by hand, the plan database against brute force, proposals, fallback,
the companion's correction and the inter-job greedy."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hpc_elastic.policy.easyscale import (
    Proposal,
    accept_proposals,
    best_plan,
    correct_capability,
    evaluate,
    keep_scale_out,
    plan_frontier,
    propose,
    top_plans,
)

CAP = {"a100": 2.0, "v100": 1.0}


def test_eq1_by_hand() -> None:
    # 2 a100 (C=2) with at most 3 ESTs, 3 v100 (C=1) with 1: nEST = 2*3 + 3*1 = 9 >= 8 (1a);
    # f = max(3/2, 1/1) = 1.5 (1b); waste = 2*(2 - 3/1.5) + 3*(1 - 1/1.5) + (9 - 8)/1.5 = 0 + 1 + 2/3 (1c);
    # throughput = (2*2 + 3*1) - 5/3 = 16/3 (1d) = maxP / f.
    plan = evaluate({"a100": 2, "v100": 3}, {"a100": 3, "v100": 1}, CAP, 8)
    assert plan.n_est == 9
    assert plan.overload == pytest.approx(1.5)
    assert plan.waste == pytest.approx(5 / 3)
    assert plan.throughput == pytest.approx(16 / 3)
    assert plan.throughput == pytest.approx(plan.max_p / plan.overload)


def test_eq1_one_gpu_per_type_matches_the_printed_sum() -> None:
    # with n_i = 1 the per-type and per-GPU readings of Eq. 1c are the same number
    cap = {"a": 3.0, "b": 1.0}
    plan = evaluate({"a": 1, "b": 1}, {"a": 4, "b": 1}, cap, 5)
    f = max(4 / 3.0, 1 / 1.0)
    printed = (3.0 - 4 / f) + (1.0 - 1 / f) + (5 - 5) / f
    assert plan.waste == pytest.approx(printed)
    assert plan.throughput == pytest.approx(4.0 - printed)


@pytest.mark.parametrize(
    ("gpus", "ests", "max_p", "message"),
    [
        ({"a100": 1}, {"a100": 3}, 8, "fewer than maxP"),
        ({"a100": 1, "v100": 1}, {"a100": 8}, 8, "at least one EST"),
        ({}, {}, 8, "at least one GPU"),
        ({"a100": -1}, {"a100": 1}, 1, "count >= 0"),
        ({"a100": 1}, {"a100": 1}, 0, "maxP"),
    ],
)
def test_eq1_refuses_bad_plans(gpus: dict[str, int], ests: dict[str, int], max_p: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate(gpus, ests, CAP, max_p)


def test_capability_must_be_positive() -> None:
    with pytest.raises(ValueError, match="'v100'"):
        plan_frontier({"v100": 1}, {"v100": 0.0}, 4)


def _brute_front(free: dict[str, int], cap: dict[str, float], max_p: int) -> list[tuple[int, float]]:
    """Every (n_i, A_i) with A_i up to ceil(maxP / n_i) (a larger A_i only raises the load), its throughput; the
    Pareto front of (GPUs, throughput) as (GPUs, throughput), fastest first."""
    types = sorted(free)
    best: dict[int, float] = {}
    for counts in itertools.product(*(range(free[t] + 1) for t in types)):
        used = [(t, n) for t, n in zip(types, counts, strict=True) if n > 0]
        if not used:
            continue
        for ests in itertools.product(*(range(1, -(-max_p // n) + 1) for _, n in used)):
            if sum(n * a for (_, n), a in zip(used, ests, strict=True)) < max_p:
                continue
            plan = evaluate(dict(used), {t: a for (t, _), a in zip(used, ests, strict=True)}, cap, max_p)
            total = plan.total_gpus
            best[total] = max(best.get(total, 0.0), plan.throughput)
    front: list[tuple[int, float]] = []
    for total in sorted(best):
        if not front or best[total] > front[-1][1] * (1 + 1e-9):
            front.append((total, best[total]))
    return front[::-1]


def _cases() -> list[tuple[dict[str, int], dict[str, float], int]]:
    rng = random.Random(20231112)
    cases = [({"a100": 2, "v100": 3}, CAP, 8)]
    while len(cases) < 60:
        n_types = rng.randint(1, 3)
        types = ["a100", "v100", "t4"][:n_types]
        free = {t: rng.randint(0, 4) for t in types}
        if not 0 < sum(free.values()) <= 8:
            continue
        cap = {t: round(rng.uniform(0.3, 4.0), rng.choice((0, 1, 2))) or 1.0 for t in types}
        cases.append((free, cap, rng.randint(1, 16)))
    return cases


@pytest.mark.parametrize(("free", "cap", "max_p"), _cases())
def test_planner_equals_brute_force(free: dict[str, int], cap: dict[str, float], max_p: int) -> None:
    front = plan_frontier(free, cap, max_p)
    expected = _brute_front(free, cap, max_p)
    assert [p.total_gpus for p in front] == [g for g, _ in expected]
    assert [p.throughput for p in front] == pytest.approx([t for _, t in expected], rel=1e-9)
    best = best_plan(free, cap, max_p)
    assert best is not None and best == front[0]
    for plan in front:  # every plan is a valid one, within the free GPUs
        assert plan.n_est >= max_p and all(n <= free[t] for t, n in plan.gpus)
        per_gpu = [a for _, row in plan.assignment() for a in row]
        assert sum(per_gpu) == max_p and min(per_gpu) >= 1 and len(per_gpu) == plan.total_gpus


def test_top_k_is_the_fastest_k() -> None:
    free, cap = {"a100": 4, "v100": 4}, {"a100": 2.5, "v100": 1.0}
    front = plan_frontier(free, cap, 16)
    assert top_plans(free, cap, 16, 3) == front[:3]
    assert [p.throughput for p in front] == sorted((p.throughput for p in front), reverse=True)
    with pytest.raises(ValueError, match="k >= 1"):
        top_plans(free, cap, 16, 0)


def test_proposals_sorted_by_speedup_per_gpu_then_more_gpus() -> None:
    proposals = propose(7, {"a100": 2}, {"a100": 2, "v100": 3}, CAP, 8)
    # a100 x2 doubles the speed (+50 %/GPU), a100 x1 gives 4/3 (+33 %), two v100 give 4/3 (+17 %/GPU);
    # one v100 helps nothing (2*3 + 1 < 8 ESTs at the a100s' load 1.5) and is not proposed
    assert [(p.gpu_type, p.count) for p in proposals] == [("a100", 2), ("a100", 1), ("v100", 2)]
    assert [p.speedup for p in proposals] == pytest.approx([2.0, 4 / 3, 4 / 3])
    keys = [(-p.speedup_per_gpu, -p.count) for p in proposals]
    assert keys == sorted(keys)
    assert all(p.plan.total_gpus == 2 + p.count for p in proposals)


def test_proposals_respect_max_gpus_and_a_job_past_its_scaling() -> None:
    assert [(p.gpu_type, p.count) for p in propose(1, {"a100": 2}, {"a100": 2, "v100": 3}, CAP, 8, max_gpus=3)] == [
        ("a100", 1)
    ]
    # 4 ESTs already on 4 GPUs: no GPU more can help
    assert propose(1, {"a100": 4}, {"a100": 4, "v100": 4}, CAP, 4) == []


def test_tie_in_speedup_per_gpu_goes_to_more_gpus() -> None:
    plan = evaluate({"a100": 1}, {"a100": 1}, CAP, 1)
    small = Proposal(1, "a100", 1, plan, 1.5)
    big = Proposal(2, "a100", 2, plan, 2.0)
    assert small.speedup_per_gpu == big.speedup_per_gpu
    assert [g.job_id for g in accept_proposals([small, big], {"a100": 2})] == [2]
    assert [g.job_id for g in accept_proposals([small, big], {"a100": 3})] == [2, 1]


def test_greedy_takes_one_proposal_per_job_and_only_free_gpus() -> None:
    plan = evaluate({"a100": 1}, {"a100": 1}, CAP, 1)
    proposals = [
        Proposal(1, "v100", 2, plan, 1.8),  # +40 %/GPU
        Proposal(1, "v100", 1, plan, 1.3),  # +30 %/GPU: job 1 already got its grant
        Proposal(2, "v100", 2, plan, 1.5),  # +25 %/GPU: only one v100 left
        Proposal(3, "v100", 1, plan, 1.2),  # +20 %/GPU
        Proposal(4, "a100", 1, plan, 1.0),  # no speedup: never taken
    ]
    grants = accept_proposals(proposals, {"v100": 3, "a100": 1})
    assert [(g.job_id, g.gpu_type, g.count) for g in grants] == [(1, "v100", 2), (3, "v100", 1)]


def test_fallback_triggers_when_the_scale_out_is_slower() -> None:
    assert keep_scale_out(100.0, 130.0)
    assert keep_scale_out(100.0, 99.0)  # within the 2 % tolerance: noise
    assert not keep_scale_out(100.0, 90.0)
    assert not keep_scale_out(100.0, 99.0, tolerance=0.0)
    with pytest.raises(ValueError, match="tolerance"):
        keep_scale_out(1.0, 1.0, tolerance=1.0)
    with pytest.raises(ValueError, match="after"):
        keep_scale_out(1.0, math.nan)


def test_companion_corrects_only_a_significant_bias() -> None:
    corrected = correct_capability({"a100": 2.0, "v100": 1.0}, {"a100": 2.1, "v100": 0.6}, threshold=0.1)
    assert corrected == {"a100": 2.0, "v100": 0.6}
    # a corrected C changes the plan: slower v100 take fewer ESTs
    before = best_plan({"a100": 2, "v100": 3}, {"a100": 2.0, "v100": 1.0}, 8)
    after = best_plan({"a100": 2, "v100": 3}, corrected, 8)
    assert before is not None and after is not None and after.throughput < before.throughput
