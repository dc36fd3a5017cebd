"""Behaviour of each policy on small hand-made passes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest

from hpc_elastic.policy import (
    POLICY_NAMES,
    ClusterState,
    Decision,
    Fifo,
    JobStatus,
    JobTable,
    JobView,
    NodeView,
    PassInput,
    PolicyOptions,
    QueueOrder,
    ServiceDistribution,
    make_policy,
    policy_names,
)
from hpc_elastic.policy.hetero import est_profile

R = JobStatus.RUNNING
_IDS: dict[str, int] = {}


def job(name: str, *args: object, **kwargs: object) -> JobView:
    """A job named for the test's readability; job ids are ints (one stable id per name)."""
    return JobView(_IDS.setdefault(name, len(_IDS)), *args, **kwargs)  # type: ignore[arg-type]


def name_of(job_id: int) -> str:
    return next(name for name, i in _IDS.items() if i == job_id)


def run(name: str, jobs: list[JobView], nodes: list[NodeView], now: float = 100.0, **opts: object) -> Decision:
    """One pass of policy ``name`` (a history given here is used whatever its size, unless ``min_history``)."""
    cluster = ClusterState.from_nodes(nodes)
    opts.setdefault("min_history", 0)
    policy = make_policy(name, PolicyOptions(**opts))  # type: ignore[arg-type]
    history = opts.get("history")
    if history is not None:
        policy = policy.with_history(history.samples.tolist())  # type: ignore[attr-defined]
    return policy.schedule(PassInput(now, JobTable.from_views(jobs, cluster), cluster))


def started(d: Decision) -> list[str]:
    return [name_of(s.job_id) for s in d.starts]


def preempted(d: Decision) -> list[str]:
    return [name_of(p.job_id) for p in d.preemptions]


def test_registry_has_every_policy() -> None:
    assert POLICY_NAMES == (
        "fifo",
        "fifo-skip",
        "srtf",
        "srsf",
        "slurm-backfill",
        "gandiva",
        "tiresias-las",
        "tiresias-gittins",
        "tiresias-las+elastic",
        "easyscale-homo",
        "easyscale-heter",
    )
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="'nope'"):
        make_policy("nope")
    assert make_policy("mine", extra={"mine": Fifo}).name == "fifo"
    assert policy_names({"mine": Fifo})[-1] == "mine"


def test_fifo_blocks_head_of_line_and_fifo_skip_does_not() -> None:
    nodes = [NodeView("n0", 4, 2)]
    jobs = [
        job("run", 2, 0.0, R, allocation=(("n0", 2),), first_start_time=0.0),
        job("big", 4, 1.0),
        job("small", 1, 2.0),
    ]
    assert started(run("fifo", jobs, nodes)) == []
    assert started(run("fifo-skip", jobs, nodes)) == ["small"]


def test_fifo_passes_over_jobs_that_can_never_fit() -> None:
    nodes = [NodeView("n0", 4, 4)]
    jobs = [job("huge", 16, 0.0), job("ok", 2, 1.0)]
    decision = run("fifo", jobs, nodes)
    assert started(decision) == ["ok"]
    assert decision.infeasible == (0,)


def test_yarn_cs_needs_consolidated_nodes() -> None:
    nodes = [NodeView("n0", 4, 2), NodeView("n1", 4, 2), NodeView("n2", 4, 4)]
    busy = [
        job("a", 2, 0.0, R, allocation=(("n0", 2),), first_start_time=0.0),
        job("b", 2, 0.0, R, allocation=(("n1", 2),), first_start_time=0.0),
    ]
    # A 6-GPU job needs 2 nodes (of 4 GPUs): n2 (4 free) + 2 more on one node exist -> placed.
    assert started(run("fifo", [*busy, job("six", 6, 1.0)], nodes)) == ["six"]
    # 8 GPUs need two free nodes: only one exists.
    assert started(run("fifo", [*busy, job("eight", 8, 1.0)], nodes)) == []
    # Tiresias places an unskewed 8-GPU job across fragments.
    assert started(run("tiresias-las", [*busy, job("eight", 8, 1.0)], nodes)) == ["eight"]


def test_srtf_preempts_the_longest_remaining() -> None:
    nodes = [NodeView("n0", 2, 0)]
    jobs = [
        job("long", 2, 0.0, R, allocation=(("n0", 2),), first_start_time=0.0, remaining_time=500.0),
        job("short", 2, 50.0, remaining_time=20.0),
    ]
    decision = run("srtf", jobs, nodes)
    assert started(decision) == ["short"] and preempted(decision) == ["long"]


def test_srsf_weighs_gpus() -> None:
    nodes = [NodeView("n0", 4, 4)]
    # remaining time 10 s on 4 GPUs (40 GPU-s) vs 30 s on 1 GPU (30 GPU-s)
    jobs = [job("wide", 4, 0.0, remaining_time=10.0), job("narrow", 1, 1.0, remaining_time=30.0)]
    assert run("srtf", jobs, nodes).priority_order.tolist() == [0, 1]
    assert run("srsf", jobs, nodes).priority_order.tolist() == [1, 0]


def test_easy_backfill_respects_the_reservation() -> None:
    nodes = [NodeView("n0", 4, 2)]
    running = job(
        "run", 2, 0.0, R, allocation=(("n0", 2),), first_start_time=0.0, time_limit=200.0, executed_time=100.0
    )
    head = job("head", 4, 1.0, time_limit=100.0)
    long_ = job("long", 2, 2.0, time_limit=500.0)
    short = job("short", 2, 3.0, time_limit=50.0)
    # shadow time = 100 + (200 - 100) = 200; long would end at 600 and delay head; short ends at 150.
    assert started(run("slurm-backfill", [running, head, long_, short], nodes)) == ["short"]
    # Without a reservation conflict (head fits later anyway), FIFO order applies.
    assert started(run("slurm-backfill", [running, long_, short], nodes)) == ["long"]


def test_backfill_age_priority_saturates() -> None:
    nodes = [NodeView("n0", 1, 1)]
    jobs = [job("young", 1, 90.0), job("old", 1, 0.0)]
    assert run("slurm-backfill", jobs, nodes).priority_order.tolist() == [1, 0]


def test_gandiva_rotates_after_the_time_slice() -> None:
    nodes = [NodeView("n0", 1, 0)]
    fresh = job("fresh", 1, 0.0, R, allocation=(("n0", 1),), first_start_time=0.0, run_time=30.0)
    waiting = job("waiting", 1, 1.0, current_wait=99.0)
    decision = run("gandiva", [fresh, waiting], nodes, time_slice=60.0)
    assert preempted(decision) == [] and decision.next_wakeup == pytest.approx(180.0)  # slice ends at 130; next round
    stale = job("stale", 1, 0.0, R, allocation=(("n0", 1),), first_start_time=0.0, run_time=90.0)
    decision = run("gandiva", [stale, waiting], nodes, time_slice=60.0)
    assert preempted(decision) == ["stale"] and started(decision) == ["waiting"]


def test_las_new_job_preempts_demoted_job() -> None:
    nodes = [NodeView("n0", 4, 0)]
    old = job(
        "old",
        4,
        0.0,
        R,
        attained_service=4000.0,
        executed_time=1000.0,
        allocation=(("n0", 4),),
        first_start_time=0.0,
        queue=1,
    )
    new = job("new", 2, 90.0)
    decision = run("tiresias-las", [old, new], nodes)
    assert preempted(decision) == ["old"] and started(decision) == ["new"]


def test_las_keeps_started_job_ahead_of_never_started_in_same_queue() -> None:
    nodes = [NodeView("n0", 4, 0)]
    first = job(
        "first", 4, 50.0, R, attained_service=100.0, executed_time=25.0, allocation=(("n0", 4),), first_start_time=60.0
    )
    early = job("early", 4, 0.0)  # submitted earlier, never started
    decision = run("tiresias-las", [first, early], nodes)
    assert preempted(decision) == [] and started(decision) == []
    assert decision.priority_order.tolist() == [0, 1]


def test_las_waiting_job_never_displaces_a_running_job_of_its_own_queue() -> None:
    """A queue-1 job preempted earlier by a queue-0 job (it started first) waits for the running queue-1 job that
    started after it: only a higher queue preempts (§3.2.3; the public simulator keeps running jobs first)."""
    nodes = [NodeView("n0", 4, 0)]
    resumed = job("resumed", 4, 0.0, attained_service=5000.0, executed_time=2000.0, first_start_time=1.0, queue=1)
    later = job(
        "later",
        4,
        2.0,
        R,
        attained_service=4000.0,
        executed_time=1000.0,
        allocation=(("n0", 4),),
        first_start_time=10.0,
        queue=1,
    )
    decision = run("tiresias-las", [resumed, later], nodes)
    assert preempted(decision) == [] and started(decision) == []
    assert decision.priority_order.tolist() == [1, 0]


def test_list_order_is_the_public_simulators_queue_lists() -> None:
    """QueueOrder.LIST: the queue list decides (not the first start); a job demoted by this pass joins the tail
    of its new queue; afterwards, per queue, the jobs holding GPUs come first."""
    nodes = [NodeView("n0", 4, 0)]
    ahead = job(
        "ahead",
        2,
        5.0,
        attained_service=4000.0,
        executed_time=2000.0,
        first_start_time=9.0,
        queue=1,
        queue_position=0.0,
    )
    behind = job(
        "behind",
        2,
        0.0,
        attained_service=9000.0,
        executed_time=4000.0,
        first_start_time=1.0,
        queue=1,
        queue_position=3.0,
    )
    demoted = job(
        "demoted",
        4,
        1.0,
        R,
        attained_service=3300.0,
        executed_time=825.0,
        allocation=(("n0", 4),),
        first_start_time=2.0,
        queue=0,
        queue_position=1.0,
    )
    decision = run("tiresias-las", [ahead, behind, demoted], nodes, queue_order=QueueOrder.LIST)
    assert [name_of(jid) for jid in [[ahead, behind, demoted][r].job_id for r in decision.priority_order]] == [
        "ahead",
        "behind",
        "demoted",
    ]
    assert started(decision) == ["ahead", "behind"] and preempted(decision) == ["demoted"]
    positions = decision.positions
    assert positions is not None
    assert sorted(range(3), key=lambda r: positions[r]) == [0, 1, 2]  # holders first, then the demoted job
    assert min(positions) > 3.0
    # START order for the same jobs: the demoted job runs, so it keeps its GPUs ahead of its new queue's waiters
    start_order = run("tiresias-las", [ahead, behind, demoted], nodes)
    assert started(start_order) == [] and preempted(start_order) == []


def test_gittins_ranks_the_last_queue_by_index() -> None:
    """DeltaMode.QUEUE keeps the last finite quantum in the last queue: a job likely to end within it goes
    first there (the paper's Δ = ∞ would make the last queue FIFO, i.e. 2D-LAS)."""
    hist = ServiceDistribution.from_samples([4000.0] * 5 + [100_000.0] * 5)
    nodes = [NodeView("n0", 1, 1)]
    old = job("old", 1, 0.0, attained_service=50_000.0, executed_time=50_000.0, first_start_time=1.0, queue=1)
    near = job("near", 1, 1.0, attained_service=3500.0, executed_time=3500.0, first_start_time=2.0, queue=1)
    assert started(run("tiresias-las", [old, near], nodes, thresholds=(3200.0,))) == ["old"]
    assert started(run("tiresias-gittins", [old, near], nodes, thresholds=(3200.0,), history=hist)) == ["near"]
    # with fewer job sizes than min_history it is 2D-LAS (Pseudocode 1 lines 2-3)
    few = run("tiresias-gittins", [old, near], nodes, thresholds=(3200.0,), history=hist, min_history=11)
    assert started(few) == ["old"]


def test_min_run_time_pins_a_job() -> None:
    nodes = [NodeView("n0", 4, 0)]
    old = job(
        "old",
        4,
        0.0,
        R,
        attained_service=4000.0,
        executed_time=1000.0,
        allocation=(("n0", 4),),
        first_start_time=0.0,
        queue=1,
        run_time=10.0,
    )
    new = job("new", 2, 90.0)
    decision = run("tiresias-las", [old, new], nodes, min_run_time=60.0)
    assert preempted(decision) == [] and started(decision) == []
    assert decision.next_wakeup == pytest.approx(150.0)


def test_las_wakes_up_at_the_demotion_threshold() -> None:
    nodes = [NodeView("n0", 2, 0)]
    holder = job(
        "a", 2, 0.0, R, attained_service=3000.0, executed_time=1500.0, allocation=(("n0", 2),), first_start_time=0.0
    )
    waiting = job("b", 2, 1.0)
    decision = run("tiresias-las", [holder, waiting], nodes)
    assert decision.next_wakeup == pytest.approx(100.0 + (3200.0 - 3000.0) / 2)
    # Nobody waits: no wake-up needed.
    assert run("tiresias-las", [holder], nodes).next_wakeup is None


def test_promotion_resets_and_puts_job_first() -> None:
    """The promoted job joins queue 0 ahead of its never-started jobs and preempts lower queues."""
    nodes = [NodeView("n0", 2, 0)]
    holder = job(
        "holder",
        2,
        5.0,
        R,
        attained_service=5000.0,
        executed_time=2500.0,
        allocation=(("n0", 2),),
        first_start_time=5.0,
        queue=1,
    )
    fresh = job("fresh", 2, 0.5)
    starved = job(
        "starved",
        2,
        0.0,
        attained_service=4000.0,
        executed_time=2000.0,
        waiting_time=4000.0,
        first_start_time=1.0,
        queue=1,
    )
    decision = run("tiresias-las", [holder, fresh, starved], nodes, promote_knob=2.0)
    (change,) = decision.queue_changes
    assert name_of(change.job_id) == "starved" and change.queue == 0 and change.reset
    assert started(decision) == ["starved"] and preempted(decision) == ["holder"]
    not_yet = job(
        "starved",
        2,
        0.0,
        attained_service=4000.0,
        executed_time=2000.0,
        waiting_time=3000.0,
        first_start_time=1.0,
        queue=1,
    )
    decision = run("tiresias-las", [holder, fresh, not_yet], nodes, promote_knob=2.0)
    assert decision.queue_changes == () and started(decision) == ["fresh"]
    assert decision.next_wakeup == pytest.approx(1100.0)


def starving_cluster() -> tuple[list[JobView], list[NodeView]]:
    """Three 1-GPU jobs of the first queue keep 3 of 4 GPUs busy (the last one started 10 s ago); a 4-GPU job
    that never ran has waited 700 s."""
    nodes = [NodeView("n0", 4, 1)]
    small = [
        job(
            f"s{i}",
            1,
            float(i),
            R,
            attained_service=run_time,
            executed_time=run_time,
            run_time=run_time,
            allocation=(("n0", 1),),
            first_start_time=100.0 - run_time,
        )
        for i, run_time in enumerate((70.0, 40.0, 10.0))
    ]
    big = job("big", 4, 0.0, current_wait=700.0)
    return [*small, big], nodes


@pytest.mark.parametrize("name", ["tiresias-las", "tiresias-gittins", "tiresias-las+elastic", "easyscale-homo"])
def test_starved_job_goes_first_and_lifts_the_fewest_pins(name: str) -> None:
    """STARVELIMIT: a job that never ran ranks after every started job of its queue, so the walk skips it while
    any of them runs; once it has waited the limit it goes first. Pins (minimum run time) it needs are lifted,
    the lowest-ranked job's first: here all three (it needs every GPU)."""
    jobs, nodes = starving_cluster()
    before = run(name, jobs, nodes, min_run_time=300.0)
    assert started(before) == [] and preempted(before) == []
    decision = run(name, jobs, nodes, min_run_time=300.0, starve_limit=600.0)
    assert name_of(jobs[int(decision.priority_order[0])].job_id) == "big"
    assert started(decision) == ["big"] and sorted(preempted(decision)) == ["s0", "s1", "s2"]
    assert decision.queue_changes == ()  # it is in the first queue already: nothing to promote


def test_starved_job_lifts_only_the_pins_it_needs() -> None:
    """A 2-GPU starved job with 1 GPU free needs one more: the pin of the job ranked lowest (started last) goes."""
    jobs, nodes = starving_cluster()
    jobs[-1] = job("big", 2, 0.0, current_wait=700.0)
    decision = run("tiresias-las", jobs, nodes, min_run_time=300.0, starve_limit=600.0)
    assert started(decision) == ["big"] and preempted(decision) == ["s2"]
    unpinned = run("tiresias-las", jobs, nodes, starve_limit=600.0)
    assert started(unpinned) == ["big"] and preempted(unpinned) == ["s2"]


def test_starved_job_lifts_only_the_pins_of_jobs_that_overtook_it_and_only_those_needed() -> None:
    """A pinned 4-GPU job and a pinned 1-GPU job of a lower queue (ranked last) both started after the 4-GPU job
    began to wait; lowest-ranked first would lift both, but the 4-GPU job's pin alone makes room: the 1-GPU job
    keeps its pin (a 1-GPU waiting job does not take its GPU). A pinned job that was running before the starved job
    began to wait did not overtake it: its pin holds, and the starved job waits for it."""
    nodes = [NodeView("n0", 5, 0)]
    big4 = job(
        "big4",
        4,
        0.0,
        R,
        attained_service=40.0,
        executed_time=10.0,
        run_time=10.0,
        first_start_time=90.0,
        allocation=(("n0", 4),),
    )
    small = job(
        "small",
        1,
        0.0,
        R,
        attained_service=5000.0,
        executed_time=5000.0,
        run_time=10.0,
        first_start_time=0.0,
        allocation=(("n0", 1),),
        queue=1,
    )
    other = job("other", 1, 50.0, current_wait=10.0)
    starved = job("starved", 4, 1.0, current_wait=700.0)
    for name in ("tiresias-las", "tiresias-gittins", "tiresias-las+elastic", "easyscale-homo"):
        decision = run(name, [big4, small, other, starved], nodes, min_run_time=300.0, starve_limit=600.0)
        assert started(decision) == ["starved"] and preempted(decision) == ["big4"], name
    older = replace(big4, run_time=800.0, executed_time=800.0, attained_service=3200.0 - 1.0)
    decision = run("tiresias-las", [older, small, other, starved], nodes, min_run_time=1000.0, starve_limit=600.0)
    assert started(decision) == [] and preempted(decision) == []


def test_starved_job_lifts_the_pin_of_a_job_on_two_gpu_types() -> None:
    """A pinned elastic job runs a plan on a100 and v100; a starved v100-only job needs its v100 GPUs, whatever the
    order of the job's nodes."""
    nodes = [NodeView("a0", 4, 3, gpu_type="a100"), NodeView("v0", 4, 0, gpu_type="v100")]
    profile = est_profile({"a100": 1.0, "v100": 1.0}, 8, "v100")
    for allocation in ((("a0", 1), ("v0", 4)), (("v0", 4), ("a0", 1))):
        mixed = job(
            "mixed",
            5,
            0.0,
            R,
            attained_service=50.0,
            executed_time=10.0,
            run_time=10.0,
            first_start_time=90.0,
            allocation=allocation,
            min_gpus=1,
            max_gpus=8,
            scaling=profile,
        )
        starved = job("v100-only", 4, 1.0, current_wait=700.0, gpu_types=frozenset({"v100"}))
        decision = run("easyscale-heter", [mixed, starved], nodes, min_run_time=300.0, starve_limit=600.0)
        assert started(decision) == ["v100-only"], allocation


def test_an_elastic_job_that_asks_more_than_the_cluster_starves_at_its_minimum() -> None:
    """The elastic walks run a job that asks for 8 GPUs (minimum 2) on 4: it starves as any other."""
    nodes = [NodeView("n0", 4, 0)]
    runners = [
        job(
            f"r{i}",
            1,
            0.0,
            R,
            attained_service=10.0,
            executed_time=10.0,
            run_time=10.0,
            first_start_time=90.0,
            allocation=(("n0", 1),),
        )
        for i in range(4)
    ]
    wide = job("wide", 8, 0.0, current_wait=700.0, min_gpus=2, max_gpus=8)
    jobs = [*runners, wide]
    for name in ("tiresias-las+elastic", "easyscale-homo"):
        decision = run(name, jobs, nodes, starve_limit=600.0)
        assert name_of(jobs[int(decision.priority_order[0])].job_id) == "wide" and "wide" in started(decision)


def test_starve_limit_wakes_the_pass_and_promotes_a_lower_queue_job() -> None:
    """Before the limit the pass wakes up when the job will have waited it; a starved job of a lower queue is
    promoted to the first (a reset, as PROMOTEKNOB's promotion) and goes ahead of the running first-queue jobs."""
    jobs, nodes = starving_cluster()
    jobs[-1] = job("big", 4, 0.0, current_wait=500.0)
    decision = run("tiresias-las", jobs, nodes, starve_limit=600.0)
    assert started(decision) == [] and decision.next_wakeup == pytest.approx(200.0)
    low = job(
        "big",
        4,
        0.0,
        queue=1,
        attained_service=9000.0,
        executed_time=2250.0,
        first_start_time=0.0,
        waiting_time=700.0,
        current_wait=700.0,
    )
    decision = run("tiresias-las", [*jobs[:-1], low], nodes, starve_limit=600.0)
    (change,) = decision.queue_changes
    assert name_of(change.job_id) == "big" and change.queue == 0 and change.reset
    assert started(decision) == ["big"] and len(preempted(decision)) == 3
    # Two starve at once on 4 free GPUs and only one fits: the other is promoted too, begins to wait again, and the
    # pass wakes up when it will have waited the limit once more (before the started job's demotion at 100 + 800).
    other = replace(low, job_id=_IDS.setdefault("other", len(_IDS)), submit_time=1.0)
    decision = run("tiresias-las", [low, other], [NodeView("n0", 4, 4)], starve_limit=600.0)
    assert sorted(name_of(c.job_id) for c in decision.queue_changes) == ["big", "other"]
    assert started(decision) == ["big"] and decision.next_wakeup == pytest.approx(700.0)


def test_gittins_orders_by_index_inside_a_queue() -> None:
    # Sizes 100 and 10,000: a job that has attained 90 is likely to end within Δ; a fresh one less so.
    hist = ServiceDistribution.from_samples([100.0] * 5 + [10_000.0] * 5)
    nodes = [NodeView("n0", 1, 1)]
    fresh = job("fresh", 1, 0.0, first_start_time=None)
    near = job("near", 1, 1.0, attained_service=90.0, executed_time=90.0, first_start_time=2.0)
    las = run("tiresias-las", [fresh, near], nodes)
    gittins = run("tiresias-gittins", [fresh, near], nodes, history=hist)
    assert started(las) == ["near"]  # started jobs first (FIFO by first start)
    assert started(gittins) == ["near"]
    late = job("late", 1, 1.0, attained_service=150.0, executed_time=150.0, first_start_time=0.5)
    # 'late' outlived the small sizes: its index drops below a fresh job's; LAS still prefers it (started first).
    assert started(run("tiresias-las", [fresh, late], nodes)) == ["late"]
    assert started(run("tiresias-gittins", [fresh, late], nodes, history=hist)) == ["fresh"]


def test_gittins_without_history_is_las() -> None:
    nodes = [NodeView("n0", 2, 2)]
    jobs = [JobView(i, 1, float(i), attained_service=float(10 * i), first_start_time=float(i)) for i in range(4)]
    assert (
        run("tiresias-gittins", jobs, nodes).priority_order.tolist()
        == run("tiresias-las", jobs, nodes).priority_order.tolist()
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"thresholds": (3200.0, 100.0)}, "increasing"),
        ({"thresholds": (-1.0,)}, "thresholds"),
        ({"promote_knob": -1.0}, "PROMOTEKNOB"),
        ({"min_run_time": math.nan}, "min_run_time"),
        ({"time_slice": 0.0}, "time_slice"),
        ({"pack_limit": math.inf}, "PACKLIMIT"),
        ({"min_history": -1}, "min_history"),
        ({"starve_limit": 0.0}, "starve_limit"),
        ({"starve_limit": math.nan}, "starve_limit"),
    ],
)
def test_options_validated(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpus": 0}, "gpus"),
        ({"attained_service": -1.0}, "attained_service"),
        ({"status": R}, "allocation"),
        ({"allocation": (("n0", 1),)}, "pending job"),
        ({"status": R, "allocation": (("n0", 1),), "gpus": 2}, "holds 1"),
        ({"queue": -1}, "queue"),
        ({"submit_time": math.nan}, "submit_time"),
    ],
)
def test_job_view_validated(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"job_id": 1, "gpus": 1, "submit_time": 0.0}
    with pytest.raises(ValueError, match=match):
        JobView(**{**base, **kwargs})  # type: ignore[arg-type]


def test_table_checks_allocations_against_nodes() -> None:
    cluster = ClusterState.from_nodes([NodeView("n0", 4, 4)])
    held = job("j", 2, 0.0, R, allocation=(("n0", 2),))
    with pytest.raises(ValueError, match="only 0 are in use"):
        JobTable.from_views([held], cluster)
    with pytest.raises(ValueError, match="unknown node 'n9'"):
        JobTable.from_views([job("j", 1, 0.0, R, allocation=(("n9", 1),))], cluster)
    with pytest.raises(ValueError, match="appears twice"):
        JobTable.from_views([job("j", 1, 0.0), job("j", 1, 0.0)], cluster)
    with pytest.raises(ValueError, match="free_gpus"):
        NodeView("n", 2, 3)
    with pytest.raises(ValueError, match="appears twice"):
        ClusterState.from_nodes([NodeView("n", 2, 2), NodeView("n", 2, 2)])


def test_gpu_type_constraint() -> None:
    nodes = [NodeView("a", 4, 4, "t4"), NodeView("b", 4, 4, "v100")]
    jobs = [job("v", 4, 0.0, gpu_types=frozenset({"v100"})), job("any", 4, 1.0)]
    decision = run("tiresias-las", jobs, nodes)
    alloc = {name_of(s.job_id): s.allocation for s in decision.starts}
    assert alloc["v"] == (("b", 4),) and alloc["any"] == (("a", 4),)
    missing = run("fifo", [job("x", 1, 0.0, gpu_types=frozenset({"a100"}))], nodes)
    assert missing.starts == () and missing.infeasible == (0,)


def test_backfill_extra_counts_every_job_ending_at_the_shadow_time() -> None:
    nodes = [NodeView("n0", 8, 2)]
    a = job("a", 2, 0.0, R, allocation=(("n0", 2),), first_start_time=0.0, time_limit=200.0, executed_time=100.0)
    b = job("b", 4, 0.0, R, allocation=(("n0", 4),), first_start_time=0.0, time_limit=200.0, executed_time=100.0)
    head = job("head", 4, 1.0, time_limit=50.0)
    long_ = job("long", 2, 2.0, time_limit=10_000.0)
    # 'a' alone would free enough for the head at t=200, but 'b' ends then too: 2 + 2 + 4 = 8 GPUs are free at
    # the shadow time, the head needs 4, so 'long' may keep 2 of them.
    assert started(run("slurm-backfill", [a, b, head, long_], nodes)) == ["long"]


def test_waiting_job_prefers_idle_pool_over_preemption() -> None:
    nodes = [NodeView("a", 4, 0, "t4"), NodeView("b", 4, 4, "v100")]
    demoted = job(
        "demoted",
        4,
        0.0,
        R,
        attained_service=9000.0,
        executed_time=2250.0,
        allocation=(("a", 4),),
        first_start_time=0.0,
        queue=1,
    )
    new = job("new", 4, 50.0)
    decision = run("tiresias-las", [demoted, new], nodes)
    assert preempted(decision) == [] and [s.allocation for s in decision.starts] == [(("b", 4),)]


def test_las_wakes_up_for_a_job_it_preempted() -> None:
    """The preempted job waits after the pass. In the public simulator's queue lists the job it started falls
    behind it when demoted, so the pass must wake up then; with the holders first in a queue (START), that
    demotion changes nothing and no wake-up is needed."""
    nodes = [NodeView("n0", 2, 0)]
    old = job(
        "old",
        2,
        0.0,
        R,
        attained_service=4000.0,
        executed_time=2000.0,
        allocation=(("n0", 2),),
        first_start_time=0.0,
        queue=1,
    )
    listed = run("tiresias-las", [old, job("new", 2, 90.0)], nodes, queue_order=QueueOrder.LIST)
    assert preempted(listed) == ["old"] and started(listed) == ["new"]
    assert listed.next_wakeup == pytest.approx(100.0 + 3200.0 / 2)
    holders_first = run("tiresias-las", [old, job("new", 2, 90.0)], nodes)
    assert preempted(holders_first) == ["old"] and started(holders_first) == ["new"]
    assert holders_first.next_wakeup is None
    # a job waiting in the queue the holder leaves: its demotion lets that job go first
    other = job("other", 2, 95.0)
    assert run("tiresias-las", [old, job("new", 2, 90.0), other], nodes).next_wakeup == pytest.approx(1700.0)


def test_derived_table_computes_later_columns_once_with_the_same_values() -> None:
    cluster = ClusterState.from_nodes([NodeView("n0", 4, 2)])
    eager = JobTable.from_views([job("a", 2, 0.0, R, 10.0, 5.0, allocation=(("n0", 2),)), job("b", 1, 1.0)], cluster)
    names = ("executed", "waiting", "current_wait", "remaining")
    calls: list[str] = []

    def later(name: str) -> Callable[[], object]:
        def compute() -> object:
            calls.append(name)
            return getattr(eager, name)

        return compute

    columns = {k: getattr(eager, k) for k in JobTable.__dataclass_fields__ if k not in names}
    table = JobTable.derived(columns, {name: later(name) for name in names})
    assert calls == []
    for name in (*names, *names):
        assert getattr(table, name) is getattr(eager, name)
    assert calls == list(names)  # each computed once, when first read
    assert table.attained is eager.attained and len(table) == 2
    with pytest.raises(AttributeError):
        _ = table.nothing  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="every column once"):
        JobTable.derived(columns, {})
