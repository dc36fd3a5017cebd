"""The two scheduling walks every policy is built on (Tiresias Pseudocode 1 lines 13-22).

Preemptive walk (2D-LAS, 2D-Gittins, SRTF, SRSF, time slicing): visit all jobs, running and waiting, in priority
order; a job joins the set P of jobs that hold GPUs after the pass if its GPUs still fit in what is left of its
pool (all-or-nothing: a job that does not fit is skipped, and lower jobs may go ahead); running jobs outside P
are preempted; waiting jobs in P are started and placed (lines 17-22). Running jobs that have run for less than
the minimum run time are kept whatever their priority ("pinned"), so a job is never preempted twice within that
time.

Non-preemptive walk (YARN-CS FIFO, best effort, Slurm backfill): running jobs keep their GPUs; waiting jobs are
placed in priority order on the GPUs free now, stopping at the first that does not fit (head-of-line blocking)
or skipping it.

The capacity check of the preemptive walk counts GPUs per pool (GPU type); placement then picks nodes among the
GPUs free after the preemptions, so a counted fit always places (except in STRICT mode). With a single pool the
walk is vectorised: the prefix of jobs that fit is a cumulative sum, and only the few jobs that squeeze into the
leftover GPUs are found one numpy scan at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpc_elastic.policy.placement import FreeIndex
from hpc_elastic.policy.types import (
    BoolArray,
    ClusterState,
    FloatArray,
    IntArray,
    PassInput,
    PlacementMode,
    Preemption,
    RowAllocation,
    SizeChange,
    Start,
)

#: Time tolerance for comparisons of clocks (seconds).
TIME_EPS = 1e-6

#: ``idle_below`` when no job is left out: no amount of freed GPUs changes the next pass.
NEVER = 2**62

#: Passes over at most this many jobs (on one pool) walk in plain Python: cheaper than numpy's calls there.
SMALL_PASS = 16


@dataclass(frozen=True, slots=True)
class WalkResult:
    starts: tuple[Start, ...]
    preemptions: tuple[Preemption, ...]
    holding: BoolArray  # rows that hold GPUs after the pass (kept or started)
    feasible: BoolArray  # rows that fit the cluster at all (running rows included)
    infeasible: tuple[int, ...]
    #: GPUs that must be freed before a later pass could hold a job this one leaves out (see Decision.idle_below).
    deficit: int = 0
    #: elastic jobs that run on other GPUs after the pass, and every job's GPUs then (None: as now)
    resizes: tuple[SizeChange, ...] = ()
    sizes: IntArray | None = None


def pool_capacity(cluster: ClusterState) -> IntArray:
    """Total GPUs per pool."""
    return cluster.capacity


def feasible_rows(inp: PassInput, size: IntArray | None = None) -> BoolArray:
    """Jobs whose GPU count (or ``size``) fits at least one allowed pool of the cluster (when empty)."""
    jobs = inp.jobs
    gpus = jobs.gpus if size is None else size
    caps = inp.cluster.capacity
    if len(jobs) == 0:
        return np.zeros(0, dtype=np.bool_)
    if caps.size == 1:
        single: BoolArray = (gpus <= int(caps[0])) & (jobs.pool_mask != 0)
        return single
    cap_list = caps.tolist()
    masks, inverse = np.unique(jobs.pool_mask, return_inverse=True)
    best = np.array(
        [max((cap_list[p] for p in range(len(cap_list)) if int(m) >> p & 1), default=0) for m in masks.tolist()],
        dtype=np.int64,
    )
    return gpus <= best[inverse.reshape(-1)]


def _pools_of(mask: int, n_pools: int) -> tuple[int, ...]:
    return tuple(p for p in range(n_pools) if mask >> p & 1)


def _named(cluster: ClusterState, rows: RowAllocation) -> tuple[tuple[str, int], ...]:
    names = cluster.names
    return tuple([(names[node], count) for node, count in rows])


def _select_single_pool(gpus: IntArray, capacity: int, *, deficit: bool = False) -> tuple[BoolArray, int]:
    """Greedy all-or-nothing fit in order, vectorised: ``take[i]`` if job i fits what is left after 0..i-1.

    With ``deficit``, also the fewest GPUs that must be freed so that a job left out would fit at its place in
    the order (:data:`NEVER` when none is left out): job i saw ``capacity - Σ taken GPUs before i`` GPUs and
    lacked ``gpus[i]`` minus that. With the same order and nothing but completions (which only return GPUs), it
    fits only once the GPUs freed reach its deficit, so the walk selects the same jobs until the smallest one is
    reached (``Decision.idle_below``).
    """
    n = gpus.size
    take = np.zeros(n, dtype=np.bool_)
    if n == 0:
        return take, NEVER
    if capacity <= 0:
        return take, max(int(gpus.min()) - capacity, 1) if deficit else 0
    cs = gpus.cumsum()
    k = int(cs.searchsorted(capacity, side="right"))
    take[:k] = True
    left = prefix_left = capacity - (int(cs[k - 1]) if k else 0)
    squeezed = False
    if k < n and left > 0:
        # After the prefix, only jobs no larger than what is left can still fit; what is left only shrinks,
        # so one filter finds every candidate and a plain loop takes them greedily.
        hits = (gpus[k:] <= left).nonzero()[0]
        if hits.size:
            chosen: list[int] = []
            for j, g in zip(hits.tolist(), gpus[k + hits].tolist(), strict=True):
                if g <= left:
                    chosen.append(j)
                    left -= g
                    if left == 0:
                        break
            if chosen:
                take[np.asarray(chosen, dtype=np.int64) + k] = True
                squeezed = True
    if not deficit:
        return take, 0
    if k == n:
        return take, NEVER
    if not squeezed:  # every job after the prefix saw what the prefix left
        return take, max(int(gpus[k:].min()) - prefix_left, 1)
    out = ~take
    if not out.any():
        return take, NEVER
    taken = np.where(take, gpus, 0)
    left_before = capacity - (np.cumsum(taken) - taken)
    return take, max(int(np.min(gpus[out] - left_before[out])), 1)


@dataclass(frozen=True, slots=True)
class Selection:
    """Who holds GPUs after a preemptive pass, before placement (Pseudocode 1 lines 13-19)."""

    holding: BoolArray  # rows that keep or get GPUs
    feasible: BoolArray
    start_rows: list[int]  # waiting rows that get GPUs, in priority order
    start_pool: list[int]  # the pool each of them gets its GPUs in
    preempt_rows: list[int]
    deficit: int


def select(
    inp: PassInput,
    order: IntArray,
    pinned: BoolArray | None,
    *,
    size: IntArray | None = None,
    deficit: bool = True,
) -> Selection:
    """Visit all jobs in ``order`` (highest priority first); a job joins the holders if ``size`` GPUs (default:
    its GPUs) still fit in what is left of its pool. Pinned running jobs hold theirs whatever their rank. With
    ``deficit``, also the fewest GPUs that must be freed before a job left out could hold (``Decision.idle_below``).
    """
    jobs, cluster = inp.jobs, inp.cluster
    n_pools = cluster.n_pools
    running = jobs.running
    held = jobs.gpus
    need = held if size is None else size
    n = len(jobs)
    if n_pools == 1 and n <= SMALL_PASS:
        return _select_small(inp, order, pinned, need, deficit=deficit)
    if n_pools == 1 and n and need.max() <= cluster.capacity[0] and jobs.pool_mask.min() > 0:
        feasible = np.ones(n, dtype=np.bool_)  # every job fits the one pool
        candidates = order
    else:
        feasible = feasible_rows(inp, need) | running
        candidates = order if bool(feasible.all()) else order[feasible[order]]
    holding = np.zeros(n, dtype=np.bool_) if pinned is None else pinned.copy()
    if pinned is not None and pinned.any():
        candidates = candidates[~pinned[candidates]]
    start_rows: list[int] = []
    start_pool: list[int] = []
    lack = 0
    if n_pools == 1:
        # What the policy may hand out: free GPUs plus the GPUs of the jobs it manages (not the pinned ones).
        capacity = int(cluster.free.sum()) + int(held.dot(running))
        if pinned is not None:
            capacity -= int(held.dot(pinned))
        take, lack = _select_single_pool(need[candidates], capacity, deficit=deficit)
        chosen = candidates[take]
        holding[chosen] = True
        start_rows = chosen[~running[chosen]].tolist()
        start_pool = [0] * len(start_rows)
    elif n_pools > 1:
        left = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools).astype(np.int64)
        if running.any():
            left += np.bincount(jobs.pool[running], weights=held[running], minlength=n_pools).astype(np.int64)
        if pinned is not None and pinned.any():
            left -= np.bincount(jobs.pool[pinned], weights=held[pinned], minlength=n_pools).astype(np.int64)
        start_rows, start_pool = _select_pools(inp, candidates, need, left.tolist(), holding)
    preempt_rows = (running & ~holding).nonzero()[0].tolist()
    return Selection(holding, feasible, start_rows, start_pool, preempt_rows, lack)


def _select_small(
    inp: PassInput, order: IntArray, pinned: BoolArray | None, need: IntArray, *, deficit: bool
) -> Selection:
    """:func:`select` on one pool for a few jobs, in plain Python (the same selection and deficit as the
    vectorised walk: half of a simulated trace's passes hold one job, where numpy's per-call cost dominates)."""
    jobs, cluster = inp.jobs, inp.cluster
    n = len(jobs)
    cap = int(cluster.capacity[0])
    need_l: list[int] = need.tolist()
    run_l: list[bool] = jobs.running.tolist()
    held_l: list[int] = jobs.gpus.tolist()
    mask_l: list[int] = jobs.pool_mask.tolist()
    pin_l: list[bool] = [False] * n if pinned is None else pinned.tolist()
    feasible_l = [run or (g <= cap and m != 0) for g, m, run in zip(need_l, mask_l, run_l, strict=True)]
    left = int(cluster.free.sum())
    for row in range(n):
        if run_l[row] and not pin_l[row]:
            left += held_l[row]
    holding_l = list(pin_l)
    lack = NEVER
    seen = False
    start_rows: list[int] = []
    for row in order.tolist():
        if not feasible_l[row] or pin_l[row]:
            continue
        seen = True
        g = need_l[row]
        if g <= left:
            left -= g
            holding_l[row] = True
            if not run_l[row]:
                start_rows.append(row)
        elif deficit:
            lack = min(lack, g - left)
    if not seen:
        lack = NEVER
    elif not deficit:
        lack = 0
    elif lack != NEVER:
        lack = max(lack, 1)
    preempt_rows = [row for row in range(n) if run_l[row] and not holding_l[row]]
    holding = np.array(holding_l, dtype=np.bool_) if n else np.zeros(0, dtype=np.bool_)
    feasible = np.array(feasible_l, dtype=np.bool_) if n else np.zeros(0, dtype=np.bool_)
    return Selection(holding, feasible, start_rows, [0] * len(start_rows), preempt_rows, lack)


def _select_pools(
    inp: PassInput, candidates: IntArray, need: IntArray, left: list[int], holding: BoolArray
) -> tuple[list[int], list[int]]:
    """The walk over several pools (GPU types): a running job holds in its pool, a waiting job goes to the
    allowed pool with room, preferring one with enough idle GPUs (no preemption), then the best fit."""
    jobs, cluster = inp.jobs, inp.cluster
    n_pools = cluster.n_pools
    total_left = sum(left)
    # GPUs free now and not yet promised: a waiting job goes where it needs no preemption if it can.
    idle = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools).astype(np.int64).tolist()
    pools_cache: dict[int, tuple[int, ...]] = {}
    g_list = need.tolist()
    run_list = jobs.running.tolist()
    pool_list = jobs.pool.tolist()
    mask_list = jobs.pool_mask.tolist()
    start_rows: list[int] = []
    start_pool: list[int] = []
    for row in candidates.tolist():
        if total_left <= 0:
            break
        g = g_list[row]
        if run_list[row]:
            p = pool_list[row]
            if left[p] >= g:
                left[p] -= g
                total_left -= g
                holding[row] = True
            continue
        mask = mask_list[row]
        pools = pools_cache.get(mask)
        if pools is None:
            pools = pools_cache[mask] = _pools_of(mask, n_pools)
        fits = [p for p in pools if left[p] >= g]
        if fits:
            quiet = [p for p in fits if idle[p] >= g]
            # best fit (keep large pools for large jobs), preferring pools with enough idle GPUs
            p = min(quiet, key=lambda q: (idle[q], q)) if quiet else min(fits, key=lambda q: (left[q], q))
            idle[p] -= min(idle[p], g)
            left[p] -= g
            total_left -= g
            holding[row] = True
            start_rows.append(row)
            start_pool.append(p)
    return start_rows, start_pool


def held_per_pool(inp: PassInput) -> IntArray:
    """GPUs each job holds in each pool, from its allocation (a row per job, a column per pool; 0 while waiting):
    a plan on several GPU types counts in each of them."""
    jobs, cluster = inp.jobs, inp.cluster
    node_pool: list[int] = cluster.pool.tolist()
    held = np.zeros((len(jobs), cluster.n_pools), dtype=np.int64)
    for row in np.flatnonzero(jobs.running).tolist():
        for node, count in jobs.alloc[row]:
            held[row, node_pool[node]] += count
    return held


def released(inp: PassInput, rows: list[int]) -> dict[int, int]:
    """GPUs per node that these running jobs hold (what stopping them frees)."""
    extra: dict[int, int] = {}
    alloc = inp.jobs.alloc
    for row in rows:
        for node, count in alloc[row]:
            extra[node] = extra.get(node, 0) + count
    return extra


def place_starts(
    inp: PassInput,
    sel: Selection,
    index: FreeIndex,
    mode: PlacementMode,
    pack_limit: float,
    *,
    size: IntArray | None = None,
) -> tuple[Start, ...]:
    """Place the selected waiting jobs (Pseudocode 1 lines 20-22) on the GPUs ``index`` holds free; a job that
    cannot be placed (STRICT mode) waits after all."""
    jobs, cluster = inp.jobs, inp.cluster
    rows = sel.start_rows
    sizes, skews, job_ids = jobs.gpus if size is None else size, jobs.skew, jobs.job_ids
    need = [sizes.item(row) for row in rows]
    skew = [skews.item(row) for row in rows]
    ids = [job_ids.item(row) for row in rows]
    starts: list[Start] = []
    for i, (row, p) in enumerate(zip(rows, sel.start_pool, strict=True)):
        placed = index.place(p, need[i], mode, skew[i], pack_limit)
        if placed is None:
            sel.holding[row] = False
            continue
        rows_alloc = tuple(placed)
        starts.append(Start(row, ids[i], rows_alloc, _named(cluster, rows_alloc)))
    return tuple(starts)


def preemptive_walk(
    inp: PassInput,
    order: IntArray,
    pinned: BoolArray | None,
    mode: PlacementMode,
    pack_limit: float,
    *,
    deficit: bool = True,
) -> WalkResult:
    """Pseudocode 1 lines 13-22 over all jobs in ``order`` (highest priority first)."""
    jobs = inp.jobs
    sel = select(inp, order, pinned, deficit=deficit)
    starts: tuple[Start, ...] = ()
    if sel.start_rows:
        index = FreeIndex(inp.cluster, released(inp, sel.preempt_rows))
        starts = place_starts(inp, sel, index, mode, pack_limit)
    preemptions = preemptions_of(jobs.job_ids, sel.preempt_rows)
    infeasible = tuple((~sel.feasible).nonzero()[0].tolist()) if not sel.feasible.all() else ()
    return WalkResult(starts, preemptions, sel.holding, sel.feasible, infeasible, sel.deficit)


def preemptions_of(job_ids: IntArray, rows: list[int]) -> tuple[Preemption, ...]:
    """Preempt these rows (whose job ids are ``job_ids[rows]``)."""
    if not rows:
        return ()
    return tuple(Preemption(row, job_id) for row, job_id in zip(rows, job_ids[rows].tolist(), strict=True))


def nonpreemptive_walk(
    inp: PassInput,
    order: IntArray,
    *,
    skip: bool,
    mode: PlacementMode,
    pack_limit: float,
) -> tuple[list[Start], FreeIndex, IntArray, tuple[int, ...]]:
    """Place waiting jobs in ``order`` on the free GPUs; stop at the first misfit unless ``skip``.

    Returns the starts, the free-GPU index after them, the feasible waiting rows not started (in ``order``) and
    the infeasible rows. Jobs that can never fit are passed over even without ``skip`` (a real YARN rejects them).
    """
    jobs, cluster = inp.jobs, inp.cluster
    feasible = feasible_rows(inp)
    pending = order[~jobs.running[order]]
    index = FreeIndex(cluster)
    pool_free = [index.pool_free(p) for p in range(cluster.n_pools)]
    total = sum(pool_free)
    starts: list[Start] = []
    started_pos: list[int] = []
    if total > 0 and pending.size:
        ok = feasible[pending]
        if skip:
            ok &= jobs.gpus[pending] <= total  # free GPUs only decrease during the walk
        positions = ok.nonzero()[0]
        candidates = pending[positions]
        g_list = jobs.gpus[candidates].tolist()
        mask_list = jobs.pool_mask[candidates].tolist()
        skew = jobs.skew[candidates].tolist()
        pools_cache: dict[int, tuple[int, ...]] = {}
        # (pool, gpus) that failed to place: free GPUs only decrease, so they fail again in this pass.
        failed: set[tuple[int, int]] = set()
        for i, g in enumerate(g_list):
            placed: list[tuple[int, int]] | None = None
            if total >= g:
                mask = mask_list[i]
                pools = pools_cache.get(mask)
                if pools is None:
                    pools = pools_cache[mask] = _pools_of(mask, cluster.n_pools)
                fits = [q for q in pools if pool_free[q] >= g and (q, g) not in failed]
                for p in sorted(fits, key=lambda q: (pool_free[q], q)):
                    placed = index.place(p, g, mode, skew[i], pack_limit)
                    if placed is not None:
                        pool_free[p] -= g
                        total -= g
                        break
                    failed.add((p, g))
            if placed is None:
                if not skip or total <= 0:
                    break
                continue
            started_pos.append(int(positions[i]))
            row = int(candidates[i])
            rows_alloc = tuple(placed)
            starts.append(Start(row, int(jobs.job_ids[row]), rows_alloc, _named(cluster, rows_alloc)))
            if total <= 0:
                break
    keep = feasible[pending]
    keep[started_pos] = False
    infeasible = tuple((~feasible & ~jobs.running).nonzero()[0].tolist()) if not feasible.all() else ()
    return starts, index, pending[keep], infeasible


def nonpreemptive_idle(
    inp: PassInput, waiting: IntArray, index: FreeIndex, *, head: PlacementMode | None = None
) -> int:
    """``Decision.idle_below`` of a non-preemptive pass: a job can only start on free GPUs, so until the GPUs
    freed reach (smallest waiting job - GPUs free after the pass) the next pass starts nothing.

    ``head``: only the first waiting job can start (no skipping), placed in this mode. In STRICT mode it needs
    whole nodes: on one node, the GPUs freed must reach its size minus the most free on a node; on k nodes,
    its size minus the free GPUs of the k freest nodes (freed GPUs raise those sums by at most their number).
    """
    if waiting.size == 0:
        return NEVER
    free_after = sum(index.pool_free(p) for p in range(inp.cluster.n_pools))
    if head is None:
        return max(int(inp.jobs.gpus[waiting].min()) - free_after, 1)
    row = int(waiting[0])
    gpus = int(inp.jobs.gpus[row])
    lack = gpus - free_after
    if head is PlacementMode.STRICT:
        cluster = inp.cluster
        free = np.asarray(index.free, dtype=np.int64)
        mask = int(inp.jobs.pool_mask[row])
        lack = NEVER
        for p in _pools_of(mask, cluster.n_pools):
            if gpus > int(cluster.capacity[p]):
                continue
            in_pool = np.sort(free[cluster.pool == p])[::-1]
            lack = min(lack, gpus - int(in_pool[: cluster.fewest_nodes(gpus, p)].sum()))
    return max(lack, 1)


def starved_rows(inp: PassInput, limit: float, size: IntArray) -> BoolArray | None:
    """Waiting jobs that fit the cluster at ``size`` GPUs (what the walk counts for them) and have waited ``limit``
    seconds or more since they last began to (arrival, preemption, promotion); None when there is none or no
    limit (∞)."""
    if math.isinf(limit) or len(inp.jobs) == 0:
        return None
    jobs = inp.jobs
    starved = ~jobs.running & (_starve_time(inp.now, jobs.current_wait, limit) <= inp.now)
    if not starved.any():
        return None
    starved &= feasible_rows(inp, size)
    return starved if starved.any() else None


def starved_first(
    inp: PassInput, order: IntArray, pinned: BoolArray | None, starved: BoolArray, size: IntArray
) -> tuple[IntArray, BoolArray | None]:
    """Starvation avoidance (Tiresias §3.2.3, Pseudocode 1 line 6: a job WAITING longer than STARVELIMIT is
    promoted to the first queue, which the caller does) for the pass in which the job starves. Promotion alone
    is not enough: in the first queue a job that has never run ranks after every job that has (FIFO by first
    start), and the walk skips it while a stream of smaller jobs keeps some of its GPUs busy, so it may wait for
    ever. A starved job therefore also goes ahead of all others in this pass (starved jobs keep ``order`` among
    themselves).

    Where the GPUs of its pool that are free or held by unpinned jobs fall short of its ``size`` (what the walk
    counts for it), pins (the minimum run time) are lifted, but only of jobs that started while it waited: they
    overtook it. (Two jobs that preempt each other are never such: each began to wait when the other started, so
    each run lasts the minimum run time.) The lowest-ranked of them lose their pin first, until the pool has room;
    then any of those whose GPUs turn out not to be needed keeps it; of the pools that can make room, the one
    that lifts the fewest. The walk then holds the starved job, preempting those.

    Pools are counted as the walks count them: a running job's GPUs in the pools of its nodes, a starved job that
    fits without lifting a pin in the pool :func:`_select_pools` would choose. Returns the new order and pins."""
    front = starved[order]
    order = np.concatenate((order[front], order[~front]))
    if pinned is None or not pinned.any():
        return order, pinned
    jobs, cluster = inp.jobs, inp.cluster
    n_pools = cluster.n_pools
    idle: list[int] = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools).astype(np.int64).tolist()
    per_pool = held_per_pool(inp)
    # what the walk may hand out in each pool: the free GPUs and those of the unpinned running jobs
    room: list[int] = (np.asarray(idle, dtype=np.int64) + per_pool[jobs.running & ~pinned].sum(axis=0)).tolist()
    held = {row: per_pool[row].tolist() for row in np.flatnonzero(pinned).tolist()}  # a pinned job's, per pool
    backwards = order[::-1]
    ranked = backwards[pinned[backwards]].tolist()  # the lowest-ranked first
    run_time, wait = jobs.run_time, jobs.current_wait
    capacity = cluster.capacity.tolist()
    pinned = pinned.copy()
    for row in order[: int(front.sum())].tolist():
        need = int(size[row])
        pools = [p for p in _pools_of(int(jobs.pool_mask[row]), n_pools) if capacity[p] >= need]
        ready = [p for p in pools if room[p] >= need]
        if ready:
            quiet = [p for p in ready if idle[p] >= need]
            p = min(quiet, key=lambda q: (idle[q], q)) if quiet else min(ready, key=lambda q: (room[q], q))
            room[p] -= need
            idle[p] -= min(idle[p], need)
            continue
        overtook = [r for r in ranked if pinned[r] and run_time[r] + TIME_EPS < wait[row]]
        best: tuple[int, list[int]] | None = None
        for p in pools:
            have, lifts = room[p], []
            for r in overtook:
                if have >= need:
                    break
                if held[r][p]:
                    lifts.append(r)
                    have += held[r][p]
            if have < need:
                continue
            for r in lifts[::-1]:  # keep again the pins not needed
                if have - held[r][p] >= need:
                    lifts.remove(r)
                    have -= held[r][p]
            if best is None or len(lifts) < len(best[1]):
                best = (p, lifts)
        if best is None:
            continue
        p, lifts = best
        for r in lifts:
            pinned[r] = False
            room = [a + b for a, b in zip(room, held[r], strict=True)]
        room[p] -= need
        idle[p] -= min(idle[p], need)
    return order, (pinned if pinned.any() else None)


def _starve_time(now: float, wait: FloatArray, limit: float) -> FloatArray:
    """When jobs that have waited ``wait`` seconds at ``now`` count as starved (the limit less TIME_EPS): a job is
    starved at ``now`` when this is not after ``now``. A wake-up at this time finds it starved, or (rounding of
    the clock) finds it a few ulps short and wakes again that much later: the same in every pass that computes it,
    so the time a starved job is served does not depend on which passes ran before."""
    return now + ((limit - TIME_EPS) - wait)


def starve_wakeup(inp: PassInput, waiting: BoolArray, limit: float, promoted: BoolArray | None) -> float:
    """When the first job that waits after the pass, and is not starved yet, will be (∞ if none; a job the pass
    preempts or ``promoted`` begins to wait now). Always after ``inp.now``: the caller keeps it as it is."""
    if math.isinf(limit):
        return math.inf
    jobs = inp.jobs
    fresh = jobs.running if promoted is None else jobs.running | promoted
    due = _starve_time(inp.now, np.where(fresh, 0.0, jobs.current_wait), limit)
    later = waiting & (due > inp.now)
    return float(due[later].min()) if later.any() else math.inf


def pinned_rows(inp: PassInput, min_run_time: float) -> BoolArray | None:
    """Running jobs that ran less than ``min_run_time`` since they last (re)started (None: no minimum)."""
    if min_run_time <= 0:
        return None
    return inp.jobs.running & (inp.jobs.run_time + TIME_EPS < min_run_time)


def pin_wakeup(inp: PassInput, pinned: BoolArray | None, min_run_time: float, started: bool) -> float:
    """When the earliest pinned job may be preempted again (∞ if none)."""
    best = math.inf
    if pinned is not None and pinned.any():
        best = inp.now + float(np.min(min_run_time - inp.jobs.run_time[pinned]))
    if started and min_run_time > 0:
        best = min(best, inp.now + min_run_time)
    return best
