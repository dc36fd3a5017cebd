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
    IntArray,
    PassInput,
    PlacementMode,
    Preemption,
    RowAllocation,
    Start,
)

#: Time tolerance for comparisons of clocks (seconds).
TIME_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class WalkResult:
    starts: tuple[Start, ...]
    preemptions: tuple[Preemption, ...]
    holding: BoolArray  # rows that hold GPUs after the pass (kept or started)
    feasible: BoolArray  # rows that fit the cluster at all (running rows included)
    infeasible: tuple[int, ...]
    #: GPUs that must be freed before a later pass could hold a job this one leaves out (see Decision.idle_below).
    deficit: int = 0


def pool_capacity(cluster: ClusterState) -> IntArray:
    """Total GPUs per pool."""
    return np.bincount(cluster.pool, weights=cluster.total, minlength=cluster.n_pools).astype(np.int64)


def feasible_rows(inp: PassInput) -> BoolArray:
    """Jobs whose GPU count fits at least one allowed pool of the cluster (when empty)."""
    jobs = inp.jobs
    caps = pool_capacity(inp.cluster).tolist()
    if len(jobs) == 0:
        return np.zeros(0, dtype=np.bool_)
    if len(caps) == 1:
        single: BoolArray = (jobs.gpus <= caps[0]) & (jobs.pool_mask & 1).astype(np.bool_)
        return single
    masks, inverse = np.unique(jobs.pool_mask, return_inverse=True)
    best = np.array(
        [max((caps[p] for p in range(len(caps)) if int(m) >> p & 1), default=0) for m in masks.tolist()],
        dtype=np.int64,
    )
    return jobs.gpus <= best[inverse.reshape(-1)]


def _pools_of(mask: int, n_pools: int) -> tuple[int, ...]:
    return tuple(p for p in range(n_pools) if mask >> p & 1)


def _named(cluster: ClusterState, rows: RowAllocation) -> tuple[tuple[str, int], ...]:
    return tuple((cluster.names[node], count) for node, count in rows)


def _select_single_pool(gpus: IntArray, capacity: int) -> BoolArray:
    """Greedy all-or-nothing fit in order, vectorised: ``take[i]`` if job i fits what is left after 0..i-1."""
    take = np.zeros(gpus.size, dtype=np.bool_)
    if gpus.size == 0 or capacity <= 0:
        return take
    cs = np.cumsum(gpus)
    k = int(np.searchsorted(cs, capacity, side="right"))
    take[:k] = True
    left = capacity - (int(cs[k - 1]) if k else 0)
    i = k
    while i < gpus.size and left > 0:
        tail = gpus[i:]
        hits = (tail <= left).nonzero()[0]
        if hits.size == 0:
            break
        # Every hit fits alone; greedily the leading hits fit together while their running sum does.
        run = np.cumsum(tail[hits])
        n_fit = int(np.searchsorted(run, left, side="right"))
        chosen = hits[:n_fit] + i
        take[chosen] = True
        left -= int(run[n_fit - 1]) if n_fit else 0
        if n_fit == hits.size:
            break
        i = int(hits[n_fit]) + i + 1  # the first hit that no longer fits is skipped; rescan after it
    return take


def preemptive_walk(
    inp: PassInput,
    order: IntArray,
    pinned: BoolArray,
    mode: PlacementMode,
    pack_limit: float,
) -> WalkResult:
    """Pseudocode 1 lines 13-22 over all jobs in ``order`` (highest priority first)."""
    jobs, cluster = inp.jobs, inp.cluster
    n_pools = cluster.n_pools
    feasible = feasible_rows(inp) | jobs.running
    running = jobs.running
    gpus = jobs.gpus
    # What the policy may hand out: free GPUs plus the GPUs of the jobs it manages.
    capacity = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools).astype(np.int64)
    if running.any():
        capacity += np.bincount(jobs.pool[running], weights=gpus[running], minlength=n_pools).astype(np.int64)
    if pinned.any():
        capacity -= np.bincount(jobs.pool[pinned], weights=gpus[pinned], minlength=n_pools).astype(np.int64)
    candidates = order[feasible[order] & ~pinned[order]]
    holding = pinned.copy()
    start_pool: dict[int, int] = {}
    start_rows: list[int] = []
    deficit = 0
    if n_pools == 1:
        cand_gpus = gpus[candidates]
        take = _select_single_pool(cand_gpus, int(capacity[0]))
        deficit = _min_deficit(cand_gpus, take, int(capacity[0]))
        holding[candidates[take]] = True
        start_rows = candidates[take & ~running[candidates]].tolist()
        start_pool = dict.fromkeys(start_rows, 0)
    elif n_pools > 1:
        left = capacity.tolist()
        total_left = sum(left)
        # GPUs free now and not yet promised: a waiting job goes where it needs no preemption if it can.
        idle = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools).astype(np.int64).tolist()
        pools_cache: dict[int, tuple[int, ...]] = {}
        g_list = gpus.tolist()
        run_list = running.tolist()
        pool_list = jobs.pool.tolist()
        mask_list = jobs.pool_mask.tolist()
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
                start_pool[row] = p
                start_rows.append(row)
    preempt_rows = (running & ~holding).nonzero()[0]
    extra: dict[int, int] = {}
    for row in preempt_rows.tolist():
        for node, count in jobs.alloc[row]:
            extra[node] = extra.get(node, 0) + count
    starts: list[Start] = []
    if start_pool:
        index = FreeIndex(cluster, extra)
        skew = jobs.skew.tolist()
        for row in start_rows:
            p = start_pool[row]
            placed = index.place(p, int(gpus[row]), mode, skew[row], pack_limit)
            if placed is None:
                holding[row] = False
                continue
            rows_alloc = tuple(placed)
            starts.append(Start(row, int(jobs.job_ids[row]), rows_alloc, _named(cluster, rows_alloc)))
    preemptions = tuple(Preemption(row, int(jobs.job_ids[row])) for row in preempt_rows.tolist())
    infeasible = tuple((~feasible).nonzero()[0].tolist())
    return WalkResult(tuple(starts), preemptions, holding, feasible, infeasible, deficit)


#: ``idle_below`` when no job is left out: no amount of freed GPUs changes the next pass.
NEVER = 2**62


def _min_deficit(gpus: IntArray, take: BoolArray, capacity: int) -> int:
    """Fewest GPUs that must be freed so that a job the greedy walk left out would fit at its place in the order.

    Job i (not taken) saw ``capacity - Σ taken GPUs before i`` GPUs left; it lacked ``gpus[i]`` minus that. With
    the same order and nothing but completions (which only return GPUs), it fits only once the GPUs freed reach
    its deficit, so the walk selects the same jobs until the smallest deficit is reached.
    """
    out = ~take
    if not out.any():
        return NEVER
    taken = np.where(take, gpus, 0)
    left_before = capacity - (np.cumsum(taken) - taken)
    return max(int(np.min(gpus[out] - left_before[out])), 1)


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
        g_list = jobs.gpus.tolist()
        mask_list = jobs.pool_mask.tolist()
        skew = jobs.skew.tolist()
        pools_cache: dict[int, tuple[int, ...]] = {}
        # (pool, gpus) that failed to place: free GPUs only decrease, so they fail again in this pass.
        failed: set[tuple[int, int]] = set()
        positions = ok.nonzero()[0]
        # Without skipping the walk usually stops at the first job: do not convert the whole queue.
        for pos in positions.tolist() if skip else map(int, positions):
            row = int(pending[pos])
            g = g_list[row]
            placed: list[tuple[int, int]] | None = None
            if total >= g:
                mask = mask_list[row]
                pools = pools_cache.get(mask)
                if pools is None:
                    pools = pools_cache[mask] = _pools_of(mask, cluster.n_pools)
                fits = [q for q in pools if pool_free[q] >= g and (q, g) not in failed]
                for p in sorted(fits, key=lambda q: (pool_free[q], q)):
                    placed = index.place(p, g, mode, skew[row], pack_limit)
                    if placed is not None:
                        pool_free[p] -= g
                        total -= g
                        break
                    failed.add((p, g))
            if placed is None:
                if not skip:
                    break
                if total <= 0:
                    break
                continue
            started_pos.append(pos)
            rows_alloc = tuple(placed)
            starts.append(Start(row, int(jobs.job_ids[row]), rows_alloc, _named(cluster, rows_alloc)))
            if total <= 0:
                break
    keep = feasible[pending]
    keep[started_pos] = False
    infeasible = tuple((~feasible & ~jobs.running).nonzero()[0].tolist())
    return starts, index, pending[keep], infeasible


def nonpreemptive_idle(inp: PassInput, waiting: IntArray, index: FreeIndex) -> int:
    """``Decision.idle_below`` of a non-preemptive pass: a job can only start on free GPUs, so until the GPUs
    freed reach (smallest waiting job - GPUs free after the pass) the next pass starts nothing."""
    if waiting.size == 0:
        return NEVER
    free_after = sum(index.pool_free(p) for p in range(inp.cluster.n_pools))
    return max(int(inp.jobs.gpus[waiting].min()) - free_after, 1)


def pinned_rows(inp: PassInput, min_run_time: float) -> BoolArray:
    """Running jobs that ran less than ``min_run_time`` since they last (re)started."""
    if min_run_time <= 0:
        return np.zeros(len(inp.jobs), dtype=np.bool_)
    return inp.jobs.running & (inp.jobs.run_time + TIME_EPS < min_run_time)


def pin_wakeup(inp: PassInput, pinned: BoolArray, min_run_time: float, started: bool) -> float:
    """When the earliest pinned job may be preempted again (∞ if none)."""
    best = math.inf
    if pinned.any():
        best = inp.now + float(np.min(min_run_time - inp.jobs.run_time[pinned]))
    if started and min_run_time > 0:
        best = min(best, inp.now + min_run_time)
    return best
