"""Simulator invariants (hypothesis) and its cost / slowdown model."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.policy import (
    POLICY_NAMES,
    Decision,
    PassInput,
    PolicyOptions,
    QueueOrder,
    ServiceDistribution,
    TiresiasLas,
    make_policy,
)
from hpc_elastic.sim.cluster import NodeSpec, parse_cluster_spec
from hpc_elastic.sim.engine import FRUITLESS_LIMIT, EventKind, ReplayStalled, SimConfig, SimResult, Simulator
from hpc_elastic.sim.metrics import summarize
from hpc_elastic.sim.trace import TraceJob

THRESHOLDS = (50.0, 400.0)


@st.composite
def traces(draw: st.DrawFn, max_jobs: int = 18) -> list[TraceJob]:
    n = draw(st.integers(1, max_jobs))
    jobs = []
    for i in range(n):
        jobs.append(
            TraceJob(
                name=f"j{i}",
                submit=float(draw(st.integers(0, 300))),
                gpus=draw(st.sampled_from([1, 1, 2, 3, 4, 8])),
                duration=float(draw(st.integers(1, 200))),
                skew=draw(st.one_of(st.none(), st.sampled_from([0.1, 0.8]))),
                checkpoint_bytes=float(draw(st.sampled_from([0.0, 1.2e9]))),
                line=i,
            )
        )
    return jobs


def replay_usage(result: SimResult, nodes: tuple[NodeSpec, ...]) -> None:
    """Rebuild GPU usage from the event log: never above a node's GPUs, never a job in two places."""
    cap = {n.name: n.gpus for n in nodes}
    used = dict.fromkeys(cap, 0)
    holding: dict[int, tuple[tuple[str, int], ...]] = {}
    for event in result.log:
        if event.kind is EventKind.START:
            assert event.job_id not in holding
            holding[event.job_id] = event.allocation
            for node, count in event.allocation:
                used[node] += count
                assert used[node] <= cap[node], f"{node} over capacity at t={event.time}"
        elif event.kind in (EventKind.PREEMPT, EventKind.COMPLETE):
            for node, count in holding.pop(event.job_id):
                used[node] -= count
    assert not holding


@settings(max_examples=40, deadline=None)
@given(
    jobs=traces(),
    name=st.sampled_from(POLICY_NAMES),
    knob=st.sampled_from([math.inf, 1.0]),
    sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=2, max_size=4).filter(lambda s: sum(s) >= 8),
)
def test_capacity_completion_and_queue_events(jobs: list[TraceJob], name: str, knob: float, sizes: list[int]) -> None:
    """On nodes of mixed sizes, every job ends (none larger than the cluster), no node is over-full."""
    nodes = tuple(NodeSpec(f"n{i}", size) for i, size in enumerate(sizes))
    policy = make_policy(name, PolicyOptions(thresholds=THRESHOLDS, promote_knob=knob, min_run_time=5.0))
    result = Simulator(jobs, nodes, policy, SimConfig(record_events=True)).run()
    assert result.finished == len(jobs) and not result.dropped
    replay_usage(result, nodes)
    for jct, job in zip(result.jct.tolist(), sorted(jobs, key=lambda j: (j.submit, j.line)), strict=True):
        assert jct >= job.duration - 1e-6  # never faster than its work
    for event in result.log:
        if event.kind is EventKind.DEMOTE:  # only after crossing the queue's lower threshold
            assert event.attained + 1e-6 >= THRESHOLDS[event.queue - 1]
        if event.kind is EventKind.PROMOTE:
            assert event.queue == 0 and not math.isinf(knob)


@settings(max_examples=25, deadline=None)
@given(jobs=traces(max_jobs=12))
def test_promotion_resets_attained_service(jobs: list[TraceJob]) -> None:
    nodes = parse_cluster_spec("1x4")
    policy = make_policy("tiresias-las", PolicyOptions(thresholds=THRESHOLDS, promote_knob=0.5))
    result = Simulator(jobs, nodes, policy, SimConfig(record_events=True)).run()
    promoted_at: dict[int, float] = {}
    ran_since: dict[int, float] = {}
    started_at: dict[int, float] = {}
    gpus = dict(zip(result.job_ids, result.gpus.tolist(), strict=True))
    for event in result.log:
        if event.kind is EventKind.PROMOTE:
            promoted_at[event.job_id] = event.time
            ran_since[event.job_id] = 0.0
        elif event.kind is EventKind.START:
            started_at[event.job_id] = event.time
        elif event.kind is EventKind.PREEMPT and event.job_id in ran_since:
            ran_since[event.job_id] += event.time - started_at[event.job_id]
        elif event.kind is EventKind.DEMOTE and event.job_id in promoted_at:
            # attained service counts only what ran since the promotion (t_J and a_J were reset)
            running = (
                event.time - started_at[event.job_id] if started_at[event.job_id] >= promoted_at[event.job_id] else 0.0
            )
            assert event.attained <= gpus[event.job_id] * (ran_since[event.job_id] + running) + 1e-6


class _Recording(TiresiasLas):
    """2D-LAS that notes when each pass ran and which wake-up it asked for."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.passes: list[tuple[float, float | None]] = []

    def schedule(self, inp: PassInput) -> Decision:
        decision = super().schedule(inp)
        self.passes.append((inp.now, decision.next_wakeup))
        return decision


@settings(max_examples=40, deadline=None)
@given(jobs=traces(), knob=st.sampled_from([math.inf, 1.0]))
def test_passes_run_at_events_or_the_latest_wakeup(jobs: list[TraceJob], knob: float) -> None:
    """A pass runs at an arrival, a completion, or the wake-up the previous pass asked for: a wake-up asked by an
    earlier pass no longer counts once a later pass asked for none."""
    policy = _Recording(PolicyOptions(thresholds=THRESHOLDS, promote_knob=knob))
    result = Simulator(jobs, parse_cluster_spec("2x4"), policy, SimConfig(record_events=True)).run()
    events = {e.time for e in result.log if e.kind in (EventKind.ARRIVE, EventKind.COMPLETE)}
    asked: float | None = None
    for now, wakeup in policy.passes:
        assert now in events or (asked is not None and now == pytest.approx(asked)), (now, asked)
        asked = wakeup


def starvation_case(knob: float) -> SimResult:
    """A 4-GPU long job is demoted, then 1-GPU short jobs arrive back to back for a long time."""
    jobs = [TraceJob("long", 0.0, 4, 100.0, line=0)]
    t, i = 10.0, 1
    while t < 3000.0:
        jobs.extend(TraceJob(f"s{i}-{k}", t, 1, 12.0, line=i * 10 + k) for k in range(4))
        t += 10.0
        i += 1
    policy = make_policy("tiresias-las", PolicyOptions(thresholds=(20.0,), promote_knob=knob))
    return Simulator(jobs, parse_cluster_spec("1x4"), policy, SimConfig(record_events=True)).run()


def end_of(result: SimResult, name: str) -> float:
    return float(dict(zip(result.names, result.end.tolist(), strict=True))[name])


def test_no_starvation_with_finite_knob() -> None:
    starved = starvation_case(math.inf)
    rescued = starvation_case(2.0)
    last_arrival = float(starved.submit.max())
    assert end_of(starved, "long") >= last_arrival  # knob = ∞: it waits for the stream to end
    assert end_of(rescued, "long") < last_arrival / 2
    assert any(e.kind is EventKind.PROMOTE and rescued.names[e.job_id] == "long" for e in rescued.log)


def test_waiting_time_adds_up_over_waiting_spells() -> None:
    """δ_J sums every waiting spell since the job first ran, and only a promotion resets it (§3.2.3): a demoted
    job preempted at 20 (waits 5 s), resumed, preempted again at 30 with t_J = 25 s is promoted at 30 + 20 = 50
    with PROMOTEKNOB 1, not at 55 as if its second spell were its only one."""
    jobs = [
        TraceJob("long", 0.0, 1, 100.0, checkpoint_bytes=0.0, line=0),
        TraceJob("s1", 20.0, 1, 5.0, checkpoint_bytes=0.0, line=1),
        TraceJob("s2", 30.0, 1, 40.0, checkpoint_bytes=0.0, line=2),
    ]
    policy = make_policy("tiresias-las", PolicyOptions(thresholds=(10.0,), promote_knob=1.0))
    result = Simulator(jobs, parse_cluster_spec("1x1"), policy, SimConfig(record_events=True)).run()
    time, name = next((e.time, result.names[e.job_id]) for e in result.log if e.kind is EventKind.PROMOTE)
    assert name == "long" and time == pytest.approx(50.0)


def test_time_slicing_takes_turns() -> None:
    """Gandiva: a job that waits gets the GPU when the running job's slice ends (its waiting spell started
    before that slice ended), and they alternate from then on."""
    jobs = [TraceJob("a", 0.0, 1, 100.0, checkpoint_bytes=0.0, line=0), TraceJob("b", 10.0, 1, 100.0, line=1)]
    policy = make_policy("gandiva", PolicyOptions(time_slice=60.0))
    result = Simulator(jobs, parse_cluster_spec("1x1"), policy, SimConfig(record_events=True)).run()
    starts = [(e.time, result.names[e.job_id]) for e in result.log if e.kind is EventKind.START]
    assert starts[:3] == [(0.0, "a"), (60.0, "b"), (120.0, "a")]


def test_preemption_cost_from_checkpoint_size() -> None:
    nodes = parse_cluster_spec("1x1")
    jobs = [TraceJob("long", 0.0, 1, 100.0, checkpoint_bytes=1.2e9, line=0), TraceJob("new", 60.0, 1, 10.0, line=1)]
    policy = make_policy("tiresias-las", PolicyOptions(thresholds=(50.0,)))
    result = Simulator(jobs, nodes, policy, SimConfig(bandwidth=1.2e9, restart_overhead=3.0)).run()
    assert int(result.preemptions.sum()) == 1
    assert result.preemption_cost == pytest.approx(2 * 1.0 + 3.0)
    ends = dict(zip(result.names, result.end.tolist(), strict=True))
    assert ends["new"] == pytest.approx(70.0)
    assert ends["long"] == pytest.approx(70.0 + 40.0 + 5.0)  # 40 s of work left, plus restore


def test_spread_skewed_job_runs_slower() -> None:
    """Two 3-GPU fillers leave one GPU free on each 4-GPU node: a 2-GPU job then spans two nodes where one could
    hold it, and runs slower if skewed."""
    nodes = parse_cluster_spec("2x4")
    cfg = SimConfig(spread_slowdown=2.0, skew_sensitive=0.5)
    fillers = [TraceJob(f"f{i}", 0.0, 3, 1000.0, line=i) for i in range(2)]
    for skew, expected in ((0.9, 200.0), (0.1, 100.0), (None, 100.0)):
        job = TraceJob("j", 1.0, 2, 100.0, skew=skew, line=2)
        result = Simulator([*fillers, job], nodes, make_policy("tiresias-las"), cfg).run()
        assert result.jct.tolist()[2] == pytest.approx(expected)


def test_job_on_the_fewest_nodes_it_needs_is_consolidated() -> None:
    """A skewed job larger than a node runs at its trace speed on the fewest nodes that hold it (Tiresias:
    consolidated means the same or the minimum number of servers)."""
    cfg = SimConfig(spread_slowdown=2.0, skew_sensitive=0.5)
    for cluster, gpus in (("2x2", 3), ("2x8", 16), ("3x4", 6)):
        job = TraceJob("j", 0.0, gpus, 100.0, skew=0.9, line=0)
        result = Simulator([job], parse_cluster_spec(cluster), make_policy("tiresias-las"), cfg).run()
        assert result.jct.tolist() == [pytest.approx(100.0)], cluster


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_job_ends_on_nodes_of_mixed_sizes(name: str) -> None:
    """A job that needs every node of 1, 2, 2 and 8 GPUs, and one that needs three of them, start once the
    cluster is empty, under every policy (YARN-CS's consolidation counted them as ceil(GPUs / largest node))."""
    nodes = tuple(NodeSpec(f"n{i}", size) for i, size in enumerate((1, 2, 2, 8)))
    jobs = [TraceJob("all", 0.0, 13, 100.0, line=0), TraceJob("most", 1.0, 12, 100.0, line=1)]
    result = Simulator(jobs, nodes, make_policy(name)).run()
    assert np.isfinite(result.end).all() and not result.dropped


class _Never(TiresiasLas):
    """Starts nothing."""

    def schedule(self, inp: PassInput) -> Decision:
        return replace(super().schedule(inp), starts=(), preemptions=())


def test_a_replay_that_leaves_jobs_waiting_forever_fails_loudly() -> None:
    jobs = [TraceJob("a", 0.0, 1, 10.0, line=0)]
    with pytest.raises(ReplayStalled, match="left 1 of 1 jobs unfinished.*'a'"):
        Simulator(jobs, parse_cluster_spec("1x2"), _Never()).run()


def test_periodic_scheduling_delays_starts_to_ticks() -> None:
    jobs = [TraceJob("a", 3.0, 1, 10.0, line=0)]
    result = Simulator(jobs, parse_cluster_spec("1x1"), make_policy("fifo"), SimConfig(sched_interval=60.0)).run()
    assert result.first_start.tolist() == [60.0]


def test_jobs_larger_than_cluster_dropped() -> None:
    jobs = [TraceJob("big", 0.0, 64, 10.0, line=0), TraceJob("ok", 0.0, 1, 10.0, line=1)]
    result = Simulator(jobs, parse_cluster_spec("2x4"), make_policy("fifo"), SimConfig()).run()
    assert result.dropped == ("big",) and result.names == ("ok",)


def test_gpu_types_respected_on_typed_cluster() -> None:
    nodes = (NodeSpec("t", 4, "T4"), NodeSpec("v", 4, "V100"))
    jobs = [TraceJob(f"j{i}", 0.0, 4, 10.0, gpu_types=frozenset({"V100"}), line=i) for i in range(2)]
    result = Simulator(jobs, nodes, make_policy("fifo-skip"), SimConfig(record_events=True)).run()
    assert all(e.allocation == (("v", 4),) for e in result.log if e.kind is EventKind.START)
    assert sorted(result.end.tolist()) == [10.0, 20.0]


def test_gittins_learns_history_from_completed_jobs() -> None:
    jobs = [TraceJob(f"j{i}", float(i), 1, float(10 + 5 * (i % 4)), line=i) for i in range(30)]
    nodes = parse_cluster_spec("1x2")
    learned = Simulator(jobs, nodes, make_policy("tiresias-gittins"), SimConfig()).run()
    fixed = Simulator(
        jobs,
        nodes,
        make_policy("tiresias-gittins"),
        SimConfig(history=ServiceDistribution.from_samples([10.0, 15.0, 20.0, 25.0])),
    ).run()
    assert learned.finished == fixed.finished == 30


def test_metrics() -> None:
    jobs = [TraceJob("a", 0.0, 1, 10.0, line=0), TraceJob("b", 0.0, 1, 30.0, line=1)]
    result = Simulator(jobs, parse_cluster_spec("1x1"), make_policy("fifo"), SimConfig()).run()
    m = summarize(result)
    assert m["avg_jct"] == pytest.approx((10 + 40) / 2)
    assert m["median_jct"] == pytest.approx(25.0)
    assert m["avg_queue_delay"] == pytest.approx(5.0)
    assert m["max_queue_delay"] == pytest.approx(10.0)
    assert m["makespan"] == pytest.approx(40.0)
    assert m["utilization"] == pytest.approx(1.0)
    assert m["p99_jct"] == pytest.approx(float(np.percentile([10, 40], 99)))


@pytest.mark.parametrize(("field", "value"), [("bandwidth", 0.0), ("spread_slowdown", 0.5), ("sched_interval", -1.0)])
def test_config_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})  # type: ignore[arg-type]


def test_pack_limit_refitted_from_observed_placements() -> None:
    """Start with PACKLIMIT 0.95 (nothing consolidated): skewed models (VGG, AlexNet) run slower when spread, the
    refit learns a threshold between the insensitive (skew <= 0.21) and sensitive (>= 0.62) models (§3.3.2)."""
    models = [("vgg16", 0.74), ("alexnet", 0.62), ("resnet50", 0.09), ("bert", 0.21)]
    jobs = []
    for i in range(80):
        model, skew = models[i % 4]
        gpus = (1, 3, 4, 6)[(i // 4) % 4]
        jobs.append(TraceJob(f"j{i}", float(7 * i), gpus, 50.0 + 13 * (i % 5), model=model, skew=skew, line=i))
    nodes = parse_cluster_spec("4x4")
    cfg = SimConfig(spread_slowdown=2.0, skew_sensitive=0.5, refit_pack_limit=True)
    policy = make_policy("tiresias-las", PolicyOptions(pack_limit=0.95))
    result = Simulator(jobs, nodes, policy, cfg).run()
    assert result.finished == 80
    assert 0.21 < result.pack_limit < 0.62
    fixed = Simulator(jobs, nodes, policy, SimConfig(spread_slowdown=2.0, skew_sensitive=0.5)).run()
    assert fixed.pack_limit == 0.95


@settings(max_examples=40, deadline=None)
@given(
    jobs=traces(),
    name=st.sampled_from(POLICY_NAMES),
    knob=st.sampled_from([math.inf, 1.0]),
    min_run=st.sampled_from([0.0, 5.0]),
    order=st.sampled_from(QueueOrder),
    starve=st.sampled_from([math.inf, 60.0]),
)
def test_skipped_and_shortcut_passes_change_nothing(
    jobs: list[TraceJob], name: str, knob: float, min_run: float, order: QueueOrder, starve: float
) -> None:
    """Decision.idle_below only lets the simulator drop passes that would have decided nothing, and a pass over
    the waiting jobs alone (Policy.fit_shortcut) decides what the full pass would (also with STARVELIMIT)."""
    nodes = parse_cluster_spec("2x4")
    options = PolicyOptions(
        thresholds=THRESHOLDS, promote_knob=knob, min_run_time=min_run, queue_order=order, starve_limit=starve
    )
    policy = make_policy(name, options)
    slow = Simulator(
        jobs, nodes, policy, SimConfig(record_events=True, skip_idle_passes=False, fit_shortcut=False)
    ).run()
    for cfg in (SimConfig(record_events=True), SimConfig(record_events=True, fit_shortcut=False)):
        fast = Simulator(jobs, nodes, policy, cfg).run()
        assert fast.passes <= slow.passes
        # (a wake-up time computed in another pass may differ in the last bits of a float)
        np.testing.assert_allclose(fast.end, slow.end, rtol=0.0, atol=1e-9)
        np.testing.assert_array_equal(fast.preemptions, slow.preemptions)
        assert decisions(fast) == decisions(slow)


def decisions(result: SimResult) -> list[tuple[float, EventKind, int, tuple[tuple[str, int], ...]]]:
    """Starts, preemptions and completions (the queue a running job is logged in may be updated later)."""
    kinds = {EventKind.START, EventKind.PREEMPT, EventKind.COMPLETE}
    return [(round(e.time, 9), e.kind, e.job_id, e.allocation) for e in result.log if e.kind in kinds]


def test_two_starved_jobs_take_turns_and_each_run_does_work() -> None:
    """Two 4-GPU jobs on 4 GPUs with STARVELIMIT 8 s: each starves in turn and preempts the other, but a pin is
    lifted only for a job the pinned one overtook, never for the job it replaced, so with a minimum run time
    longer than the 5 s restore both finish. With no minimum and a limit below the restore no run does any work:
    a stalled replay, whose message names both knobs."""
    jobs = [TraceJob(name, 0.0, 4, 100.0, line=i) for i, name in enumerate("ab")]
    nodes = parse_cluster_spec("1x4")
    config = SimConfig(restart_overhead=5.0)
    for limit in (2.0, 8.0):
        policy = make_policy("tiresias-las", PolicyOptions(starve_limit=limit, min_run_time=10.0))
        result = Simulator(jobs, nodes, policy, config).run()
        assert result.finished == 2 and int(result.preemptions.sum()) > 0
    stalled = make_policy("tiresias-las", PolicyOptions(starve_limit=2.0))
    with pytest.raises(ReplayStalled, match="--starve-limit longer than the restore"):
        Simulator(jobs, nodes, stalled, config).run()


def test_two_jobs_preempting_each_other_before_any_work_is_a_stalled_replay() -> None:
    """Two 4-GPU jobs on 4 GPUs under 2D-LAS with a 2 GPU-s first queue and PROMOTEKNOB 1: each is demoted within
    its 1 s restore and the waiting one promoted at once, so neither ever works; before, the replay ran forever.
    With a minimum run time longer than the restore both finish."""
    jobs = [TraceJob(name, 0.0, 4, 100.0, line=i) for i, name in enumerate("ab")]
    options = PolicyOptions(thresholds=(2.0,), promote_knob=1.0)
    config = SimConfig(restart_overhead=1.0, default_checkpoint_bytes=0.0)
    with pytest.raises(ReplayStalled, match=f"preempted job 'a' {FRUITLESS_LIMIT} times in a row before it did any"):
        Simulator(jobs, parse_cluster_spec("1x4"), make_policy("tiresias-las", options), config).run()
    pinned = replace(options, min_run_time=5.0)
    result = Simulator(jobs, parse_cluster_spec("1x4"), make_policy("tiresias-las", pinned), config).run()
    assert result.finished == 2 and np.isfinite(result.end).all() and result.preemptions.sum() > 0
