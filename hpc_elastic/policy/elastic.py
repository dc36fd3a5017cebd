"""Elastic jobs under a priority order: the order decides who runs, spare GPUs make elastic jobs grow.

An elastic job may run on any GPU count in [min, max] (EasyScale keeps its training the same bits whatever the
count) at the speed its :class:`ScalingCurve` gives. The mechanism, for any policy that orders jobs and then
lends what its walk leaves idle:

1. the priority walk (Pseudocode 1 lines 13-19) counts every elastic job at its efficient size
   (:func:`efficient_size`): the fewest GPUs in [min, max] at which each of its GPUs does the most work
   (speedup(n) / n at its highest; the minimum for a concave curve, more where the curve rises steeply again, as
   N ESTs do where M divides N): a job runs if that size fits what the jobs before it left. The jobs it leaves
   out (waiting, or running and to be preempted) then run at their minimum where the GPUs the holders leave fit
   them, in the same order (:func:`fill_at_minimum`: no holder is preempted for them). GPUs a running job holds
   beyond its walk size are lent, so they come back to the walk whenever a job it ranks higher needs them;
2. after the walk the holders get their walk size, and the GPUs no waiting job can use (the walk would have
   taken any waiting job that fits them) are lent out a step at a time (:func:`target_sizes`), each step to the
   holder whose throughput grows the most, relatively, per GPU of the step ((speedup(n + k) / speedup(n) - 1) / k,
   the best k for that job, :func:`_step`): a job on few GPUs gains the most, a job past its scaling gains nothing
   and gets none, a job whose speed only rises again a few GPUs further (N ESTs on M GPUs run at ceil(N / M)
   ESTs per GPU) gets those GPUs together; among equal gains the job with the least attained service first
   (2D-LAS's own priority, undiscretised: lending preempts nobody);
3. :func:`place_targets` places the jobs whose size changes: every resized job releases its GPUs first, then the
   shrunk jobs, the starts and the grown jobs are placed in that order.

A job shrinks only when GPUs it borrowed go to a job the walk runs, or to a borrower they help more. Shrinking a
job below its efficient size to start another would lose throughput on every GPU it keeps (a job of 16 ESTs on
Gavel's median curve runs at 0.57 of linear on 4 GPUs and 0.81 on 8); a waiting job starts below its own
efficient size only on GPUs no holder gives up. Pollux (OSDI'21) reports average JCT 32-37 % below Tiresias's
with adaptive allocations and batch sizes; here only the GPU count adapts.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import replace

import numpy as np

from hpc_elastic.policy.core import (
    Selection,
    WalkResult,
    _named,
    place_starts,
    preemptions_of,
    preemptive_walk,
    released,
    select,
)
from hpc_elastic.policy.placement import FreeIndex
from hpc_elastic.policy.types import (
    LINEAR,
    BoolArray,
    IntArray,
    PassInput,
    PlacementMode,
    ScalingCurve,
    SizeChange,
    Start,
)


@functools.lru_cache(maxsize=4096)
def efficient_size(curve: ScalingCurve, lo: int, hi: int) -> int:
    """The fewest GPUs in [``lo``, ``hi``] at which the job's GPUs do the most work each: the highest
    speedup(n) / n (``lo`` for a concave curve; ties to fewer GPUs)."""
    if lo < 1 or hi < lo:
        raise ValueError(f"an elastic job's GPU range must be 1 <= min <= max, got [{lo}, {hi}]")
    best, most = lo, curve.at(lo) / lo
    for n in range(lo + 1, hi + 1):
        per_gpu = curve.at(n) / n
        if per_gpu > most * (1.0 + 1e-9):
            best, most = n, per_gpu
    return best


def minimum_sizes(inp: PassInput) -> IntArray:
    """Every job's minimum (a rigid job's minimum is its GPU count)."""
    jobs = inp.jobs
    return np.minimum(jobs.min_gpus, jobs.gpus)


def walk_sizes(inp: PassInput) -> IntArray:
    """GPUs each job needs in the priority walk: an elastic job's :func:`efficient_size` in [min, max], a rigid
    job's GPU count."""
    jobs = inp.jobs
    size = minimum_sizes(inp)
    # (on one GPU a job does the most work per GPU any curve allows: a speedup never exceeds the GPU count)
    elastic = ((size > 1) & (size < jobs.max_gpus)).nonzero()[0].tolist()
    if elastic:
        scaling, top = jobs.scaling, jobs.max_gpus
        size[elastic] = [efficient_size(scaling[row] or LINEAR, int(size[row]), int(top[row])) for row in elastic]
    return size


def fill_at_minimum(
    inp: PassInput, order: IntArray, pinned: BoolArray | None, sel: Selection, size: IntArray
) -> tuple[Selection, IntArray]:
    """The walk once more with the jobs it left out at their minimum, after its holders (in ``order`` both): a
    waiting job starts, and a running job keeps running instead of being preempted, where the GPUs the holders
    leave fit its minimum; no holder is preempted or shrunk for them. Returns the selection and the sizes it
    counted (``size`` when no such job fits); its deficit is the smaller of the two walks' (either walk may
    change once that many GPUs are freed)."""
    jobs = inp.jobs
    smallest = minimum_sizes(inp)
    shrinks = ~sel.holding & (smallest < size)
    if not shrinks.any():
        return sel, size
    # GPUs the holders leave, over all pools (an upper bound of what any one pool has left)
    left = int(inp.cluster.free.sum()) + int(jobs.gpus.dot(jobs.running))
    kept = sel.holding if pinned is None else sel.holding & ~pinned
    left -= int(size.dot(kept)) + (0 if pinned is None else int(jobs.gpus.dot(pinned)))
    lack = int(smallest[shrinks].min()) - left
    if lack > 0:  # none fits: a later pass could start one once ``lack`` GPUs are freed
        return replace(sel, deficit=min(sel.deficit, lack)), size
    size = np.where(~sel.holding, smallest, size)
    held = sel.holding[order]
    filled = select(inp, np.concatenate((order[held], order[~held])), pinned, size=size)
    return replace(filled, deficit=min(sel.deficit, filled.deficit)), size


def _step(curve: ScalingCurve, gpus: int, most: int) -> tuple[int, float]:
    """The next growth step of a job on ``gpus`` GPUs by at most ``most`` more: the k GPUs that add the most
    throughput per GPU, relatively ((speedup(gpus + k) / speedup(gpus) - 1) / k), and that gain; (0, 0.0) when no
    step adds any. Looking past one GPU matters where a curve is flat for a while and then rises again (a job
    of N ESTs on M GPUs runs ceil(N / M) ESTs per GPU: 8 ESTs run no faster on 5 GPUs than on 4, but on 8)."""
    base = curve.at(gpus)
    best_k, best = 0, 0.0
    for k in range(1, most + 1):
        gain = (curve.at(gpus + k) / base - 1.0) / k
        if gain > best * (1.0 + 1e-9):
            best_k, best = k, gain
    return best_k, best


def target_sizes(inp: PassInput, order: IntArray, sel: Selection, size: IntArray, pinned: BoolArray | None) -> IntArray:
    """GPUs each job runs on after the pass (0: it waits), from the walk's holders (see the module doc, step 2).

    ``sel.start_pool`` gives the pool of every start; a running job stays in its pool; a pinned job keeps its GPUs.
    """
    jobs, cluster = inp.jobs, inp.cluster
    running = jobs.running
    target = np.where(sel.holding, size, 0)
    movable = sel.holding
    if pinned is not None:
        target = np.where(pinned, jobs.gpus, target)
        movable = movable & ~pinned
    pool = jobs.pool.copy()
    if sel.start_rows:
        pool[np.asarray(sel.start_rows, dtype=np.int64)] = np.asarray(sel.start_pool, dtype=np.int64)
    n_pools = cluster.n_pools
    # capacity of the walk (free GPUs and those of the running jobs) minus what the holders get
    spare = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools)
    if running.any():
        spare += np.bincount(jobs.pool[running], weights=jobs.gpus[running], minlength=n_pools)
    held = sel.holding
    spare -= np.bincount(pool[held], weights=target[held], minlength=n_pools)
    left = spare.astype(np.int64).tolist()
    if not any(left):
        return target
    scaling, attained, top = jobs.scaling, jobs.attained, jobs.max_gpus.tolist()
    heap: list[tuple[float, float, int, int]] = []  # (-gain per GPU, attained, row, GPUs of the step)

    def push(row: int, most: int) -> None:
        gpus = int(target[row])
        k, gain = _step(scaling[row] or LINEAR, gpus, min(top[row] - gpus, most))
        if k:
            heapq.heappush(heap, (-gain, float(attained[row]), row, k))

    for row in (movable & (jobs.max_gpus > target)).nonzero()[0].tolist():
        push(row, left[int(pool[row])])
    while heap:
        _, _, row, k = heapq.heappop(heap)
        p = int(pool[row])
        if left[p] <= 0:
            continue
        if k > left[p]:  # too big a step now: the best that still fits
            push(row, left[p])
            continue
        target[row] += k
        left[p] -= k
        push(row, left[p])
    return target


def place_targets(
    inp: PassInput,
    sel: Selection,
    target: IntArray,
    pinned: BoolArray | None,
    *,
    mode: PlacementMode,
    pack_limit: float,
) -> tuple[tuple[Start, ...], tuple[SizeChange, ...]]:
    """Place the starts at their target sizes and the running jobs whose size changes (module doc, step 3)."""
    jobs, cluster = inp.jobs, inp.cluster
    running = jobs.running
    resized = sel.holding & running & (target != jobs.gpus)
    if pinned is not None:
        resized &= ~pinned
    moving = resized.nonzero()[0].tolist()
    if not moving and not sel.start_rows:
        return (), ()
    index = FreeIndex(cluster, released(inp, sel.preempt_rows + moving))
    shrink = [row for row in moving if target[row] < jobs.gpus[row]]
    grow = [row for row in moving if target[row] > jobs.gpus[row]]
    changes: list[SizeChange] = []
    for row in shrink:
        changes.append(_resize(inp, index, row, int(target[row]), mode=mode, pack_limit=pack_limit))
    starts = place_starts(inp, sel, index, mode, pack_limit, size=target)
    for row in grow:
        changes.append(_resize(inp, index, row, int(target[row]), mode=mode, pack_limit=pack_limit))
    return starts, tuple(changes)


def elastic_walk(
    inp: PassInput, order: IntArray, pinned: BoolArray | None, mode: PlacementMode, pack_limit: float
) -> WalkResult:
    """The preemptive walk (Pseudocode 1 lines 13-22) with elastic jobs: steps 1-3 of the module doc.

    Its deficit (``Decision.idle_below``) is 0 while an elastic holder could still grow: any GPU freed would
    change the next pass."""
    jobs = inp.jobs
    if np.array_equal(jobs.min_gpus, jobs.gpus) and np.array_equal(jobs.max_gpus, jobs.gpus):
        return preemptive_walk(inp, order, pinned, mode, pack_limit)  # no elastic job in this pass
    size = walk_sizes(inp)
    sel, size = fill_at_minimum(inp, order, pinned, select(inp, order, pinned, size=size), size)
    target = target_sizes(inp, order, sel, size, pinned)
    starts, resizes = place_targets(inp, sel, target, pinned, mode=mode, pack_limit=pack_limit)
    preemptions = preemptions_of(jobs.job_ids, sel.preempt_rows)
    infeasible = tuple((~sel.feasible).nonzero()[0].tolist()) if not sel.feasible.all() else ()
    growable = bool((sel.holding & (target < jobs.max_gpus)).any())
    deficit = 0 if growable else sel.deficit
    return WalkResult(starts, preemptions, sel.holding, sel.feasible, infeasible, deficit, resizes, target)


def _resize(
    inp: PassInput, index: FreeIndex, row: int, gpus: int, *, mode: PlacementMode, pack_limit: float
) -> SizeChange:
    jobs, cluster = inp.jobs, inp.cluster
    placed = index.place(int(jobs.pool[row]), gpus, mode, float(jobs.skew[row]), pack_limit)
    if placed is None:  # (counted fits always place outside STRICT mode; the walk never uses STRICT)
        raise RuntimeError(f"job {int(jobs.job_ids[row])}: cannot place its {gpus} GPUs")
    rows_alloc = tuple(placed)
    return SizeChange(row, int(jobs.job_ids[row]), gpus, rows_alloc, _named(cluster, rows_alloc))
