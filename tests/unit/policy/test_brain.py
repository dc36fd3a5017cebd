"""DLRover Brain's resource configuration (§4): the sample, optimize and adjust stages."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.policy.brain import (
    Estimates,
    Group,
    JobLimits,
    Partition,
    PlanRecord,
    Range,
    ResourcePlan,
    Role,
    Stage,
    StepRequest,
    Usage,
    adjust,
    estimate,
    fall_back,
    optimize,
    out_of_memory,
    sample_plan,
)

NODE = Partition(cores_per_node=32, mem_per_node_mb=128_000, free_cores=1_000)
LIMITS = JobLimits(c_total=200, workers=Range(1, 64), ps=Range(1, 16))


@pytest.mark.parametrize(
    ("w_hat", "s_total_hat", "workers", "cores", "ps"),
    [(2.5, 5.7, 24, 3, 8), (19.4, 3.1, 8, 20, 2)],  # Table 1: W&D, xDeepFM (C_total 200, sample w = 32)
)
def test_optimize_reproduces_the_papers_table_1(
    w_hat: float, s_total_hat: float, workers: int, cores: int, ps: int
) -> None:
    sample = sample_plan(LIMITS, NODE, mem_mb=4_000)
    assert sample.workers == Group(1, 32, 4_000) and sample.stage is Stage.SAMPLE
    usage = Usage(sample, (w_hat,), (1_000.0,), tuple(s_total_hat / sample.num_ps for _ in sample.ps_cores))
    est = estimate(usage)
    assert est.w_hat == pytest.approx(w_hat) and est.s_hat == pytest.approx(s_total_hat)
    plan = optimize(est, LIMITS, NODE, ps_mem_mb=8_000)
    assert (plan.workers.count, plan.workers.cores, plan.num_ps) == (workers, cores, ps)
    assert plan.total_cores <= LIMITS.c_total  # Eq. 3
    assert plan.workers.mem_mb == 1_250  # the largest resident set and a 25 % margin


@settings(max_examples=300, deadline=None)
@given(
    w_hat=st.floats(0.1, 31.0),
    s_hat=st.floats(0.05, 20.0),
    c_total=st.integers(4, 600),
    cores=st.sampled_from([4, 8, 16, 32, 64]),
    free=st.integers(0, 800),
    held=st.integers(0, 100),
)
def test_optimize_stays_inside_the_budget_the_partition_and_eq_4(
    w_hat: float, s_hat: float, c_total: int, cores: int, free: int, held: int
) -> None:
    partition = Partition(cores, 256_000, free)
    limits = JobLimits(c_total, Range(1, 1_000), Range(1, 1_000))
    budget = min(c_total, held + free)
    if budget < 2:
        with pytest.raises(ValueError, match="cannot hold 1 workers and 1 PS"):
            optimize(Estimates(w_hat, s_hat, 100), limits, partition, ps_mem_mb=100, held_cores=held)
        return
    plan = optimize(Estimates(w_hat, s_hat, 100), limits, partition, ps_mem_mb=100, held_cores=held)
    assert plan.total_cores <= budget
    assert max(plan.ps_cores) <= cores and plan.workers.cores <= cores
    w = plan.workers.cores
    assert w == min(math.ceil(w_hat), cores, budget - 1)
    if plan.workers.count > 1 and w == math.ceil(w_hat):
        # Eq. 4 up to the rounding of ŵ to w: the PS keep up with the workers but for what the rounding took
        assert plan.workers.count * s_hat <= plan.ps_total_cores + plan.workers.count * (w - w_hat) + plan.num_ps + 1e-6


def test_the_plan_never_exceeds_the_partitions_free_cores() -> None:
    small = Partition(32, 128_000, free_cores=40)
    plan = optimize(Estimates(2.5, 5.7, 1_000), LIMITS, small, ps_mem_mb=8_000)
    assert plan.total_cores <= 40
    with pytest.raises(ValueError, match="free"):
        ResourcePlan(Group(30, 2, 100), (16,), 100, Stage.OPTIMIZE).check(small)


def test_requests_are_per_role_and_size() -> None:
    plan = ResourcePlan(Group(4, 3, 3_000), (16, 24, 16), 10_000, Stage.ADJUST)
    assert plan.requests() == (
        StepRequest(Role.WORKER, 4, 3, 1_000),
        StepRequest(Role.PS, 1, 24, 417),
        StepRequest(Role.PS, 2, 16, 625),
    )


def _running(plan: ResourcePlan, worker_cpu: float, ps_cpu: tuple[float, ...], **kw: bool) -> Usage:
    n = plan.workers.count
    return Usage(plan, (worker_cpu,) * n, (500.0,) * n, ps_cpu, **kw)


def test_adjust_adds_workers_when_ps_cores_idle() -> None:
    plan = ResourcePlan(Group(8, 20, 4_000), (20, 20), 8_000, Stage.OPTIMIZE)
    usage = _running(plan, 18.0, (4.0, 4.0))  # ŝ' = 1 core per worker, s_total = 40
    new = adjust(usage, Estimates(19.4, 3.1, 4_000), LIMITS, NODE)
    assert new is not None and new.stage is Stage.ADJUST
    assert new.workers.count == 40 and new.ps_cores == plan.ps_cores  # ΔN_w = min(40 / 1, ∞) - 8
    # √K bounds the asynchronous workers: K = 400 steps -> at most 20 workers
    bounded = adjust(usage, Estimates(19.4, 3.1, 4_000), JobLimits(200, Range(1, 64), Range(1, 16), 400), NODE)
    assert bounded is not None and bounded.workers.count == 20
    # and the partition's free cores bound the growth (the job holds its plan's 200 cores)
    tight = adjust(usage, Estimates(19.4, 3.1, 4_000), LIMITS, Partition(32, 128_000, 50))
    assert tight is not None and tight.workers.count == 10 and tight.total_cores <= 200 + 50


def test_adjust_replaces_a_hot_ps_with_a_larger_one() -> None:
    plan = ResourcePlan(Group(24, 3, 1_000), (16,) * 8, 8_000, Stage.OPTIMIZE)
    ps_cpu = (15.5, 15.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0)  # two hot PS (W&D's uneven partition, Figure 6)
    new = adjust(_running(plan, 2.4, ps_cpu), Estimates(2.5, 5.7, 1_000), LIMITS, NODE)
    assert new is not None
    total = sum(ps_cpu)
    expect = [min(math.ceil(u / total * 5.7 * 24), 32) for u in ps_cpu[:2]]
    assert list(new.ps_cores[:2]) == expect and all(c > 16 for c in expect)
    assert new.ps_cores[2:] == (16,) * 6 and new.workers == plan.workers
    assert "hot PS 0" in new.reasons[0]


def test_adjust_doubles_memory_after_out_of_memory() -> None:
    plan = ResourcePlan(Group(2, 4, 6_000), (8, 8), 50_000, Stage.OPTIMIZE)
    w = adjust(_running(plan, 3.0, (1.0, 1.0), worker_oom=True), Estimates(3, 1, 6_000), LIMITS, NODE)
    assert w is not None and w.workers.mem_mb == 12_000
    ps = adjust(_running(plan, 3.0, (1.0, 1.0), ps_oom=True), Estimates(3, 1, 6_000), LIMITS, NODE)
    assert ps is not None and ps.ps_mem_mb == 100_000
    # a PS at a node's memory already: the paper doubles the PS instead
    full = ResourcePlan(Group(2, 4, 6_000), (8, 8), 100_000, Stage.OPTIMIZE)
    more = adjust(_running(full, 3.0, (1.0, 1.0), ps_oom=True), Estimates(3, 1, 6_000), LIMITS, NODE)
    assert more is not None and more.num_ps == 4 and more.ps_mem_mb == 100_000


def test_out_of_memory_doubles_the_memory_the_process_died_with() -> None:
    plan = ResourcePlan(Group(2, 4, 6_000), (8, 8), 50_000, Stage.ADJUST)
    w = out_of_memory(plan, Role.WORKER, 6_000, LIMITS, NODE)
    assert (
        w is not None and w.workers == Group(2, 4, 12_000) and w.reasons == ("worker out of memory: 6000 -> 12000 MiB",)
    )
    # a worker started before the group's memory doubled dies with less: never below what the plan gives already
    later = out_of_memory(w, Role.WORKER, 3_000, LIMITS, NODE)
    assert later is not None and later.workers.mem_mb == 12_000
    with pytest.raises(ValueError, match="a worker needs more than 70000 MiB and a node has 128000"):
        out_of_memory(plan, Role.WORKER, 70_000, LIMITS, NODE)
    ps = out_of_memory(plan, Role.PS, 50_000, LIMITS, NODE)
    assert ps is not None and ps.ps_mem_mb == 100_000 and ps.ps_cores == (8, 8)
    # twice a node's memory: twice the PS, if the partition has their cores
    more = out_of_memory(plan, Role.PS, 100_000, LIMITS, NODE)
    assert more is not None and more.num_ps == 4
    assert out_of_memory(plan, Role.PS, 100_000, LIMITS, Partition(32, 128_000, 0)) is None
    with pytest.raises(ValueError, match="mem_mb must be an integer >= 1"):
        out_of_memory(plan, Role.WORKER, 0, LIMITS, NODE)


def test_a_job_whose_ps_keep_up_exactly_needs_no_adjustment() -> None:
    plan = ResourcePlan(Group(8, 20, 4_000), (20, 20), 8_000, Stage.OPTIMIZE)
    busy = _running(plan, 19.0, (19.0, 19.0))  # ŝ' = 4.75: 40 / 4.75 = 8.4 workers, the 8 it has
    assert adjust(busy, Estimates(19.4, 3.1, 4_000), LIMITS, NODE, hot_threshold=0.96) is None


def test_growth_that_does_not_fit_the_partition_is_no_plan() -> None:
    plan = ResourcePlan(Group(8, 20, 4_000), (20, 20), 8_000, Stage.OPTIMIZE)
    usage = _running(plan, 19.0, (12.0, 12.0))  # ŝ' = 3: 13 workers would keep the PS busy
    grown = adjust(usage, Estimates(19.4, 3.1, 4_000), LIMITS, NODE)
    assert grown is not None and grown.workers.count == 13
    assert adjust(usage, Estimates(19.4, 3.1, 4_000), LIMITS, Partition(32, 128_000, 19)) is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Range(3, 2), "range 3:2 is empty"),
        (lambda: Range.parse("a:b"), "bad range 'a:b'"),
        (lambda: Range.parse("0:4"), "bad range '0:4'"),
        (lambda: Group(-1, 2, 10), "process count must be an integer >= 1, got -1"),
        (lambda: Partition(0, 10, 10), "cores_per_node"),
        (lambda: JobLimits(3, Range(2, 4), Range(2, 2)), "cannot hold the minimum 2 workers and 2 PS"),
        (lambda: ResourcePlan(Group(1, 1, 1), (), 10, Stage.SAMPLE), "at least one PS"),
        (lambda: ResourcePlan(Group(1, 64, 1), (1,), 10, Stage.SAMPLE).check(NODE), "exceeds a node"),
        (lambda: Estimates(0.0, 1.0, 10), "w_hat must be > 0"),
    ],
)
def test_bad_values_are_named(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_usage_readings_must_match_the_plan() -> None:
    plan = ResourcePlan(Group(2, 4, 100), (8,), 100, Stage.SAMPLE)
    with pytest.raises(ValueError, match="ps_cpu has 2 readings for 1 processes"):
        Usage(plan, (1.0, 1.0), (1.0, 1.0), (1.0, 2.0))


def test_a_hot_ps_below_its_estimated_need_still_gets_one_core_more_up_to_a_node() -> None:
    # ŝ · N_w = 0.3 · 2 = 0.6 cores: the formula alone keeps 1 core; a PS at its threshold is saturated: 2 cores
    plan = ResourcePlan(Group(2, 1, 1_000), (1,), 1_000, Stage.OPTIMIZE)
    usage = _running(plan, 0.5, (0.95,))
    new = adjust(usage, Estimates(0.5, 0.3, 1_000), JobLimits(3, Range(1, 2), Range(1, 1)), Partition(4, 8_000, 4))
    assert new is not None and new.ps_cores == (2,) and new.workers == plan.workers
    assert "hot PS 0 (0.95 of 1 cores -> 2)" in new.reasons[0]
    # at a node's cores (C_max) already, or without a free core for it: no plan
    at_max = ResourcePlan(Group(2, 1, 1_000), (4,), 1_000, Stage.ADJUST)
    assert adjust(_running(at_max, 0.5, (3.9,)), Estimates(0.5, 0.3, 1_000), LIMITS, Partition(4, 8_000, 4)) is None
    assert adjust(usage, Estimates(0.5, 0.3, 1_000), LIMITS, Partition(4, 8_000, 0)) is None
    # a forced low threshold makes a lightly used PS hot
    light = _running(plan, 0.5, (0.2,))
    assert adjust(light, Estimates(0.5, 0.3, 1_000), LIMITS, Partition(4, 8_000, 4), hot_threshold=0.1) is not None


def test_a_budget_of_a_few_cores_samples_with_fewer_ps() -> None:
    plan = sample_plan(JobLimits(2, Range(1, 4), Range(1, 4)), Partition(2, 4_000, 2), mem_mb=1_000)
    assert (plan.workers.count, plan.workers.cores, plan.ps_cores) == (1, 1, (1,))


# -- fallback to the best observed plan (ours) ----------------------------------------------------------------------

SMALL = Partition(cores_per_node=8, mem_per_node_mb=16_000, free_cores=2)  # 8 cores beside OPTIMIZED's 6
SMALL_LIMITS = JobLimits(c_total=8, workers=Range(1, 4), ps=Range(1, 2))
SAMPLED = ResourcePlan(Group(1, 4, 1024), (2, 2), 1024, Stage.SAMPLE)
OPTIMIZED = ResourcePlan(Group(4, 1, 1024), (2,), 1024, Stage.OPTIMIZE)


def test_a_plan_measured_slower_than_the_best_falls_back_to_it_and_is_rejected() -> None:
    record = PlanRecord().observe(SAMPLED, 7_092.0).observe(OPTIMIZED, 1_555.0)  # the dev cluster's first run
    back = fall_back(record, OPTIMIZED, SMALL_LIMITS, SMALL)
    assert back is not None
    assert back.plan.shape == SAMPLED.shape and back.plan.stage is Stage.FALLBACK
    assert "1,555" in back.plan.reasons[0] and "7,092" in back.plan.reasons[0]
    assert (back.worse.samples_s, back.best.samples_s) == (1_555.0, 7_092.0)
    assert back.record.rejects(OPTIMIZED) and not back.record.rejects(SAMPLED)
    assert not record.rejects(OPTIMIZED)  # the record given is unchanged (frozen)


@pytest.mark.parametrize(
    ("rate", "tolerance", "kept"),
    [(7_500.0, 0.1, True), (7_092.0, 0.0, True), (6_400.0, 0.1, True), (6_400.0, 0.0, False), (6_300.0, 0.1, False)],
)  # better, equal, within 10 % below, below with no tolerance, more than 10 % below
def test_a_plan_better_or_within_the_tolerance_is_kept(rate: float, tolerance: float, kept: bool) -> None:
    record = PlanRecord().observe(SAMPLED, 7_092.0).observe(OPTIMIZED, rate)
    assert (fall_back(record, OPTIMIZED, SMALL_LIMITS, SMALL, tolerance=tolerance) is None) is kept


def test_the_best_of_several_observed_plans_is_the_one_gone_back_to() -> None:
    middle = ResourcePlan(Group(2, 2, 1024), (2,), 1024, Stage.ADJUST)
    record = PlanRecord().observe(SAMPLED, 3_000.0).observe(middle, 5_000.0).observe(OPTIMIZED, 1_000.0)
    back = fall_back(record, OPTIMIZED, SMALL_LIMITS, SMALL)
    assert back is not None and back.plan.shape == middle.shape
    # a later measurement of a shape replaces the earlier one (the machine now), whatever its stage
    again = record.observe(ResourcePlan(Group(2, 2, 1024), (2,), 1024, Stage.FALLBACK), 2_000.0)
    back = fall_back(again, OPTIMIZED, SMALL_LIMITS, SMALL)
    assert back is not None and back.plan.shape == SAMPLED.shape and len(again.observed) == 3


def test_a_bad_plan_is_never_retried_in_a_loop() -> None:
    # an adjust that, from the best plan's readings, always proposes the same bad plan: it runs once
    record = PlanRecord().observe(SAMPLED, 7_000.0)
    current, applied = SAMPLED, 0
    for _ in range(10):
        proposed = OPTIMIZED
        if record.rejects(proposed):
            break
        current, applied = proposed, applied + 1
        record = record.observe(current, 1_500.0)
        back = fall_back(record, current, SMALL_LIMITS, SMALL)
        if back is not None:
            record, current = back.record, back.plan
            record = record.observe(current, 6_900.0)
            assert fall_back(record, current, SMALL_LIMITS, SMALL) is None  # the rejected plan is no candidate
    assert applied == 1 and current.shape == SAMPLED.shape


def test_a_fallback_stays_within_the_ranges_and_the_partition() -> None:
    big = ResourcePlan(Group(4, 2, 1024), (4,), 1024, Stage.ADJUST)  # 12 cores
    record = PlanRecord().observe(big, 9_000.0).observe(SAMPLED, 3_000.0).observe(OPTIMIZED, 1_000.0)
    # the job holds OPTIMIZED's 6 cores and the partition has 2 free: the 12-core plan does not fit, the 8-core one
    back = fall_back(record, OPTIMIZED, SMALL_LIMITS, SMALL)
    assert back is not None and back.plan.shape == SAMPLED.shape
    back.plan.check(SMALL, OPTIMIZED.total_cores)
    # a narrower PS range (one PS) excludes the sample's two PS: nothing left to go back to
    assert fall_back(record, OPTIMIZED, replace(SMALL_LIMITS, ps=Range(1, 1)), SMALL) is None
    # no free core and a job holding OPTIMIZED's 6: neither fits
    assert fall_back(record, OPTIMIZED, SMALL_LIMITS, replace(SMALL, free_cores=0)) is None
    back = fall_back(record, OPTIMIZED, SMALL_LIMITS, replace(SMALL, free_cores=6))
    assert back is not None and back.plan.shape == big.shape


def test_fallback_refuses_bad_values() -> None:
    record = PlanRecord().observe(SAMPLED, 1.0)
    for bad in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match="tolerance"):
            fall_back(record, SAMPLED, SMALL_LIMITS, SMALL, tolerance=bad)
    with pytest.raises(ValueError, match="no measurement"):
        fall_back(record, OPTIMIZED, SMALL_LIMITS, SMALL)
    with pytest.raises(ValueError, match="samples_s"):
        record.observe(OPTIMIZED, -1.0)
