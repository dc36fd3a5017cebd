"""Invariants of one scheduling pass, for every policy, on random consistent inputs (hypothesis).

MLFQ (Tiresias §3.2.3): capacity is never exceeded, demotion only on threshold crossings, promotion only when
δ_J >= PROMOTEKNOB x t_J and with a reset, the in-queue orders (running jobs first, then FIFO by first start; or
the public simulator's queue lists), all-or-nothing skipping.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.policy import (
    POLICY_NAMES,
    Decision,
    JobStatus,
    JobView,
    NodeView,
    PassInput,
    PolicyOptions,
    QueueChangeKind,
    QueueOrder,
    make_policy,
)
from hpc_elastic.policy.core import NEVER, _select_single_pool
from tests.unit.policy.strategies import level, pass_inputs

THRESHOLDS = (1000.0, 5000.0)
MLFQ = ("tiresias-las", "tiresias-gittins")
PREEMPTIVE = ("srtf", "srsf", "gandiva", *MLFQ)
ELASTIC = ("tiresias-las+elastic", "easyscale-homo", "easyscale-heter", "tiresias-las+easyscale")


def apply(decision: Decision, jobs: list[JobView], nodes: list[NodeView]) -> dict[str, int]:
    """Free GPUs per node after the decision (preempted and resized jobs let go of their GPUs first); fails if a
    node would go negative."""
    free = {node.name: node.free_gpus for node in nodes}
    for row in [p.row for p in decision.preemptions] + [r.row for r in decision.resizes]:
        for name, count in jobs[row].allocation:
            free[name] += count
    placed = [(s.job_id, s.allocation) for s in decision.starts] + [(r.job_id, r.allocation) for r in decision.resizes]
    for job_id, allocation in placed:
        for name, count in allocation:
            free[name] -= count
            assert free[name] >= 0, f"{job_id} overfills {name}"
    return free


def options(knob: float, min_run: float, starve: float = math.inf) -> PolicyOptions:
    return PolicyOptions(
        thresholds=THRESHOLDS, promote_knob=knob, min_run_time=min_run, min_history=0, starve_limit=starve
    )


def starving(inp: PassInput, starve: float) -> bool:
    """Whether a job waits that has waited the STARVELIMIT (only then may a pin be lifted)."""
    return bool((~inp.jobs.running & (inp.jobs.current_wait >= starve - 1e-6)).any())


@settings(max_examples=60, deadline=None)
@given(
    case=pass_inputs(types=("", "v100")),
    name=st.sampled_from(POLICY_NAMES),
    knob=st.sampled_from([math.inf, 0.5, 2.0]),
    min_run=st.sampled_from([0.0, 300.0]),
    starve=st.sampled_from([math.inf, 2000.0]),
)
def test_capacity_and_roles(
    case: tuple[PassInput, list[JobView], list[NodeView]], name: str, knob: float, min_run: float, starve: float
) -> None:
    inp, jobs, nodes = case
    policy = make_policy(name, options(knob, min_run, starve))
    if policy.uses_history:
        policy = policy.with_history([100.0, 900.0, 4000.0, 20000.0])
    decision = policy.schedule(inp)
    free = apply(decision, jobs, nodes)
    assert all(count >= 0 for count in free.values())
    started = {s.row for s in decision.starts}
    preempted = {p.row for p in decision.preemptions}
    assert all(not inp.jobs.running[r] for r in started)
    assert all(inp.jobs.running[r] for r in preempted)
    assert sorted(decision.priority_order.tolist()) == list(range(len(jobs)))
    for start in decision.starts:
        job = jobs[start.row]
        assert sum(c for _, c in start.allocation) == job.gpus
        node_types = {n.name: n.gpu_type for n in nodes}
        kinds = {node_types[name] for name, _ in start.allocation}
        assert len(kinds) == 1
        if job.gpu_types is not None:
            assert kinds <= job.gpu_types
    if not policy.preemptive:
        assert not preempted
    for row in preempted:
        assert jobs[row].run_time + 1e-6 >= min_run or starving(inp, starve), "pinned job preempted"


@settings(max_examples=80, deadline=None)
@given(
    case=pass_inputs(types=("v100", "a100"), elastic=True),
    name=st.sampled_from(ELASTIC),
    min_run=st.sampled_from([0.0, 300.0]),
    starve=st.sampled_from([math.inf, 2000.0]),
)
def test_elastic_passes_fit_and_keep_pinned_and_rigid_jobs(
    case: tuple[PassInput, list[JobView], list[NodeView]], name: str, min_run: float, starve: float
) -> None:
    """The elastic policies on two GPU types: after the preemptions, resizes (each job lets go of its GPUs first)
    and starts no node is over-full; a job within its minimum run time is neither preempted nor resized (unless a
    starved job waits: STARVELIMIT lifts pins); a rigid
    job is never resized; every size is within the job's [min, max]."""
    inp, jobs, nodes = case
    decision = make_policy(name, options(math.inf, min_run, starve)).schedule(inp)
    apply(decision, jobs, nodes)
    for resize in decision.resizes:
        job = jobs[resize.row]
        assert job.status is JobStatus.RUNNING and job.min_gpus is not None and job.max_gpus is not None
        assert min(job.min_gpus, job.gpus) <= resize.gpus <= max(job.max_gpus, job.gpus)
        assert sum(c for _, c in resize.allocation) == resize.gpus
    for row in {p.row for p in decision.preemptions} | {r.row for r in decision.resizes}:
        pinned = jobs[row].run_time + 1e-6 < min_run
        assert not pinned or starving(inp, starve), f"job {jobs[row].job_id} within its minimum run time"


@settings(max_examples=60, deadline=None)
@given(
    case=pass_inputs(),
    name=st.sampled_from(PREEMPTIVE),
)
def test_no_fitting_job_left_waiting(case: tuple[PassInput, list[JobView], list[NodeView]], name: str) -> None:
    """All-or-nothing with skipping (single pool): every waiting job needs more GPUs than remain free."""
    inp, jobs, nodes = case
    policy = make_policy(name, options(math.inf, 0.0))
    decision = policy.schedule(inp)
    free = sum(apply(decision, jobs, nodes).values())
    holding = {s.row for s in decision.starts} | {
        r for r in range(len(jobs)) if inp.jobs.running[r] and r not in {p.row for p in decision.preemptions}
    }
    capacity = sum(n.total_gpus for n in nodes)
    for row, job in enumerate(jobs):
        if row not in holding and job.gpus <= capacity:
            assert job.gpus > free, f"{job.job_id} fits {free} free GPUs but waits"


@settings(max_examples=80, deadline=None)
@given(case=pass_inputs(max_queue=2), knob=st.sampled_from([math.inf, 0.5, 1.0, 3.0]), name=st.sampled_from(MLFQ))
def test_queue_changes(case: tuple[PassInput, list[JobView], list[NodeView]], knob: float, name: str) -> None:
    inp, jobs, _ = case
    decision = make_policy(name, options(knob, 0.0)).schedule(inp)
    changes = {c.row: c for c in decision.queue_changes}
    for row, job in enumerate(jobs):
        change = changes.get(row)
        lvl = level(THRESHOLDS, job.attained_service)
        promotable = (
            job.status.value == "pending"
            and max(job.queue, lvl) > 0
            and job.waiting_time + 1e-6 >= knob * job.executed_time
        )
        if change is None:
            assert lvl <= job.queue, f"{job.job_id} crossed a threshold but was not demoted"
            assert not promotable
            continue
        assert change.old_queue == job.queue
        if change.kind is QueueChangeKind.PROMOTE:
            assert promotable and change.queue == 0 and change.reset
        else:
            assert not change.reset
            assert change.queue == lvl > job.queue, "demotion without a threshold crossing"


@settings(max_examples=60, deadline=None)
@given(case=pass_inputs(max_queue=2))
def test_las_order_is_queue_then_running_then_first_start(
    case: tuple[PassInput, list[JobView], list[NodeView]],
) -> None:
    inp, jobs, _ = case
    decision = make_policy("tiresias-las", options(math.inf, 0.0)).schedule(inp)
    new_queue = {c.row: c.queue for c in decision.queue_changes}
    keys = []
    for row in decision.priority_order.tolist():
        job = jobs[row]
        fs = math.inf if job.first_start_time is None else job.first_start_time
        keys.append((new_queue.get(row, job.queue), job.status is not JobStatus.RUNNING, fs, job.submit_time))
    assert keys == sorted(keys)
    assert decision.positions is None


@settings(max_examples=60, deadline=None)
@given(case=pass_inputs(max_queue=2), knob=st.sampled_from([math.inf, 0.5]))
def test_las_list_order_and_positions(case: tuple[PassInput, list[JobView], list[NodeView]], knob: float) -> None:
    """QueueOrder.LIST: by queue, then place in the queue list (jobs new to their queue at the tail, by
    submission); after the pass, per queue, the jobs holding GPUs ahead of those waiting, each in walk order."""
    inp, jobs, _ = case
    policy = make_policy(
        "tiresias-las", PolicyOptions(thresholds=THRESHOLDS, promote_knob=knob, queue_order=QueueOrder.LIST)
    )
    decision = policy.schedule(inp)
    new_queue = {c.row: c.queue for c in decision.queue_changes}
    order = decision.priority_order.tolist()
    keys = []
    for row in order:
        job = jobs[row]
        queue = new_queue.get(row, job.queue)
        moved = queue != job.queue
        place = math.inf if job.queue_position is None or moved else job.queue_position
        keys.append((queue, place, job.submit_time))
    assert keys == sorted(keys)
    positions = decision.positions
    assert positions is not None
    preempted = {p.row for p in decision.preemptions}
    holding = {s.row for s in decision.starts} | {
        r for r, j in enumerate(jobs) if j.status is JobStatus.RUNNING and r not in preempted
    }
    walk_rank = {row: i for i, row in enumerate(order)}
    after = sorted(range(len(jobs)), key=lambda r: positions[r])
    assert after == sorted(
        range(len(jobs)), key=lambda r: (new_queue.get(r, jobs[r].queue), r not in holding, walk_rank[r])
    )
    known = [j.queue_position for j in jobs if j.queue_position is not None]
    assert all(p > max(known, default=-1.0) for p in positions.tolist())  # positions only grow


@settings(max_examples=60, deadline=None)
@given(case=pass_inputs(max_queue=2))
def test_mlfq_selection_is_greedy_in_priority_order(case: tuple[PassInput, list[JobView], list[NodeView]]) -> None:
    """Reference: walk the priority order, keep a job iff its GPUs fit what is left (single pool)."""
    inp, jobs, nodes = case
    decision = make_policy("tiresias-las", options(math.inf, 0.0)).schedule(inp)
    left = sum(n.total_gpus for n in nodes)
    expected = set()
    for row in decision.priority_order.tolist():
        if jobs[row].gpus <= left:
            left -= jobs[row].gpus
            expected.add(row)
    preempted = {p.row for p in decision.preemptions}
    holding = {s.row for s in decision.starts} | {
        r for r, j in enumerate(jobs) if j.status.value == "running" and r not in preempted
    }
    assert holding == expected


def test_single_pool_fast_path_equals_loop() -> None:
    """The vectorised greedy fit and its deficit (fewest GPUs to free before a left-out job fits at its place)
    against a plain loop."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        gpus = rng.integers(1, 9, size=int(rng.integers(0, 40)))
        cap = int(rng.integers(0, 60))
        left, want, lack = cap, [], NEVER
        for g in gpus.tolist():
            fit = g <= left
            want.append(fit)
            if not fit:
                lack = min(lack, max(g - left, 1))
            left -= g if fit else 0
        take, deficit = _select_single_pool(gpus.astype(np.int64), cap, deficit=True)
        assert take.tolist() == want and deficit == lack
