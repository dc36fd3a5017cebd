"""EasyScale's inter-job scheduler on heterogeneous GPUs: ``easyscale-homo`` and ``easyscale-heter`` (§3.4, §5.2).

Tiresias' discretised 2D-LAS decides who runs (so the pair composes as ``tiresias-las+easyscale``: Tiresias
decides who waits, EasyScale how many GPUs of which types the elastic jobs get); EasyScale decides the rest:

1. the 2D-LAS order walks the jobs at their *minimum* (gang) allocation, counted per GPU type: a rigid job's GPUs
   in one type, an elastic job's minimum in one type (the fastest type with room for a waiting job; the types it
   holds for a running one). Jobs whose minimum does not fit what the jobs before them left wait (a running job is
   preempted: the order's decision, as in ``tiresias-las``);
2. a running elastic job keeps the GPUs it holds beyond its minimum where the minimums leave them (a resize costs
   a checkpoint and a restore), in the same order; GPUs it borrowed come back whenever a job ranked higher needs
   them for its minimum. A running rigid job keeps exactly its GPUs: never shrunk, grown or moved. A job running a
   mixed plan keeps here only its GPUs of the type of most capability; the others go back to step 3;
3. the GPUs left free go to elastic jobs by Role 2's proposals (:func:`_best_scale_out`: k more GPUs of one type
   with the estimated Eq. 1d speedup, as :func:`~hpc_elastic.policy.easyscale.propose` forms them), greedily by
   speedup per GPU, a tie to the proposal with more GPUs (the ranking of
   :func:`~hpc_elastic.policy.easyscale.accept_proposals`); a granted job runs Role 1's top-1 plan on the fewest of
   its GPUs, releases the others, and proposes again from its new plan. ``easyscale-homo`` only lets a job's plan
   use one type (a proposal of k GPUs of another type than it holds moves it there when its plan on them alone is
   faster), ``easyscale-heter`` several. Plans on one type are granted first, to every job but those running a
   mixed plan: on one type a GPU runs at its full capability, where a mixed plan's step waits for its slowest GPU
   (Eq. 1b), so a GPU goes to a mixed plan only when no plan on one type wants it. Mixed plans are then granted on
   what is left. A job whose new plan is no faster than the mixed plan it ran keeps that one where its GPUs are
   still left;
4. Role 3's fallback: a job whose last scale-out was observed to run slower than before
   (:func:`~hpc_elastic.policy.easyscale.keep_scale_out`) goes back to the GPUs it had before it. The cap that
   follows is bounded, in what and for how long (:meth:`ScaleOut.capped`, :meth:`ScaleOut.refuses`): it refuses
   the configuration that did not pay (more GPUs than before of a type the scale-out added), not every scale-out,
   so a proposal of another type may still be granted; and it lapses
   ``PolicyOptions.fallback_hold`` seconds after the fallback, doubled for each fallback in a row, after which the
   job is planned and observed again (the pass wakes up then). Why: a job is only observed on GPUs it is given, so
   a cap kept until "a later scale-out is observed to pay" is kept forever; the observation has already corrected
   what it can in the estimate (the companion's per-type ``C_i``, §3.4, in the daemon), and what a per-type
   correction cannot tell apart (a slow placement across nodes, contention that passes) is retried at
   exponentially longer intervals, so that repeated failures cost a share of the job's time that halves each time.

A job's speed model travels in its ``JobTable.scaling`` column as an :class:`EstProfile` (a :class:`ScalingCurve`
whose homogeneous curve is Eq. 1d on its requested type, so the other policies read it as before) with its
capability ``C_i`` per GPU type, its ESTs (maxP) and the observation of its last scale-out. An elastic job without
one is planned as maxP = its maximum ESTs of capability 1 on every type (its curve is not read).

Pure: plain values in, a :class:`~hpc_elastic.policy.types.Decision` out; no clock, command or file.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from hpc_elastic.policy.core import WalkResult, _named, held_per_pool, preemptions_of, released
from hpc_elastic.policy.easyscale import DEFAULT_FALLBACK_HOLD, Proposal, best_plan, keep_scale_out, proposal_rank
from hpc_elastic.policy.elastic import minimum_sizes
from hpc_elastic.policy.placement import FreeIndex
from hpc_elastic.policy.policies import TiresiasLas
from hpc_elastic.policy.types import (
    BoolArray,
    Decision,
    IntArray,
    PassInput,
    PlacementMode,
    ScalingCurve,
    SizeChange,
    Start,
)

#: relative tolerance when comparing throughputs
_REL = 1e-9
#: Role 3: a scale-out is kept unless the observed throughput after it is this much (relative) below before.
FALLBACK_TOLERANCE = 0.02
#: Role 3's back-off doubles the hold at most this many times (2^40 holds: longer than any job)
_MAX_DOUBLINGS = 40


@dataclass(frozen=True, slots=True)
class ScaleOut:
    """What a job observed about its last scale-out: its throughput on its GPUs before and after (the same unit,
    e.g. relative to its requested GPUs), and the GPUs per type it had before. ``at``: when it was observed slower
    (the pass that falls back; None: not stamped, the pass that reads it counts as that time); ``earlier``: how many
    scale-outs in a row before this one were observed slower (Role 3's back-off, :meth:`capped`); ``grown``: its
    GPUs per type after the scale-out (what the cap refuses, :meth:`refuses`; empty: not known)."""

    before: float
    after: float
    previous: tuple[tuple[str, int], ...]
    at: float | None = None
    earlier: int = 0
    grown: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.at is not None and not math.isfinite(self.at):
            raise ValueError(f"a scale-out's fallback time must be finite, got {self.at!r}")
        if isinstance(self.earlier, bool) or not isinstance(self.earlier, int) or self.earlier < 0:
            raise ValueError(f"a scale-out's earlier failures must be an integer >= 0, got {self.earlier!r}")

    @property
    def worse(self) -> bool:
        """Role 3's check: the new GPUs made the job slower (:func:`keep_scale_out`)."""
        return not keep_scale_out(self.before, self.after, FALLBACK_TOLERANCE)

    @property
    def failures(self) -> int:
        """Scale-outs in a row observed slower, this one included (0 when this one paid)."""
        return self.earlier + 1 if self.worse else 0

    @property
    def previous_gpus(self) -> int:
        return sum(n for _, n in self.previous)

    def hold(self, base: float) -> float:
        """Seconds the cap after this fallback lasts: ``base`` doubled for each earlier failure in a row."""
        return base * 2.0 ** min(self.failures - 1, _MAX_DOUBLINGS) if self.failures else 0.0

    def capped(self, now: float, base: float) -> bool:
        """Role 3's cap (§3.4, bounded by a back-off): from the fallback until :meth:`hold` has passed, the job
        proposes no plan that :meth:`refuses`."""
        if not self.worse:
            return False
        return self.at is None or now < self.at + self.hold(base)

    @property
    def limits(self) -> tuple[tuple[str, int], ...]:
        """The most GPUs per type a plan may hold under the cap: for each type the scale-out added GPUs of, what
        the job had of it before (empty when ``grown`` is not known: then no plan beyond the GPUs before)."""
        before = dict(self.previous)
        return tuple((t, before.get(t, 0)) for t, n in self.grown if n > before.get(t, 0))

    def refuses(self, gpus: Mapping[str, int]) -> bool:
        """Whether the cap refuses a plan on these GPUs per type: one that adds GPUs of a type the scale-out that
        did not pay added (the observation is per type: the companion corrects ``C_i`` per type, §3.4), while
        GPUs of another type may be tried; with ``grown`` unknown, any plan on more GPUs than before."""
        if not self.limits:
            return sum(gpus.values()) > self.previous_gpus
        return any(gpus.get(t, 0) > n for t, n in self.limits)


@dataclass(frozen=True, slots=True)
class EstProfile(ScalingCurve):
    """A job of ``ests`` ESTs (maxP) with capability ``C_i`` per GPU type (mini-batches of one EST per second on
    one GPU of the type), asking for its GPUs in ``base_type``. Its :class:`ScalingCurve` part is Eq. 1d on
    1..maxP GPUs of ``base_type`` relative to one (:func:`est_profile` builds it so)."""

    capability: tuple[tuple[str, float], ...] = ()
    ests: int = 1
    base_type: str = ""
    scale_out: ScaleOut | None = None
    #: whether its plan may span GPU types where the policy plans on one type only (the runtime's D2 guard:
    #: EasyScale §3.3, the bits of a model D2 covers do not depend on the device type)
    mixed: bool = False

    def throughput(self, gpus: Mapping[str, int]) -> float:
        """Eq. 1d of Role 1's top-1 plan on these GPUs per type (0.0 when none has a capability here)."""
        return _best(tuple(sorted((t, n) for t, n in gpus.items() if n > 0)), self.capability, self.ests)


def est_profile(capability: Mapping[str, float], ests: int, base_type: str) -> EstProfile:
    """The profile of a job of ``ests`` ESTs with these capabilities, requested on ``base_type``."""
    if base_type not in capability:
        raise ValueError(f"no capability for the requested GPU type {base_type!r}")
    cap = tuple(sorted((t, float(c)) for t, c in capability.items()))
    one = _best(((base_type, 1),), cap, ests)
    counts = tuple(range(1, ests + 1))
    speedup = tuple(_best(((base_type, m),), cap, ests) / one for m in counts)
    return EstProfile(counts, speedup, capability=cap, ests=ests, base_type=base_type)


@functools.lru_cache(maxsize=65536)
def _best(gpus: tuple[tuple[str, int], ...], capability: tuple[tuple[str, float], ...], ests: int) -> float:
    """Eq. 1d of the top-1 plan (Role 1) on these GPUs: cached, the simulator asks it at every start."""
    plan = best_plan(dict(gpus), dict(capability), ests)
    return plan.throughput if plan is not None else 0.0


@functools.lru_cache(maxsize=65536)
def _best_scale_out(  # noqa: PLR0917 - the cache keys on every argument
    current: tuple[tuple[str, int], ...],
    free: tuple[tuple[str, int], ...],
    capability: tuple[tuple[str, float], ...],
    ests: int,
    bounds: tuple[int, int],
    mixed: bool,
    limits: tuple[tuple[str, int], ...] = (),
) -> Proposal | None:
    """Role 2 for a job on ``current`` GPUs: its best scale-out proposal in the inter-job ranking (job id 0: cached
    for every job alike), or None. A proposal is k more GPUs of one type ``t``; the job's plan is then Role 1's
    top-1 plan on its GPUs and those (``mixed``), or on its GPUs of ``t`` alone (plans on one type), on the fewest
    GPUs that reach its throughput: the GPUs the plan leaves out are released (with plans on one type, a job moves to
    a faster type so). An increment is proposed only when its plan uses all of the k GPUs, is faster than the job
    now and than every smaller increment of ``t``, and runs on ``bounds`` = [min, max] GPUs; and, under Role 3's
    cap, on at most ``limits`` GPUs of each type there (:meth:`ScaleOut.refuses`)."""
    base = _best(current, capability, ests)
    have = dict(current)
    low, top = bounds
    cap = dict(capability)
    best: Proposal | None = None
    for gpu_type, n in free:
        previous = base
        for k in range(1, n + 1):
            grown = dict(have) if mixed else {}
            grown[gpu_type] = have.get(gpu_type, 0) + k
            if grown[gpu_type] > top:  # (the plan uses them all)
                break
            plan = best_plan(grown, cap, ests)
            if plan is None or plan.count(gpu_type) < grown[gpu_type] or not low <= plan.total_gpus <= top:
                continue
            if any(plan.count(t) > c for t, c in limits):
                continue
            if plan.throughput <= previous * (1 + _REL):
                continue
            previous = plan.throughput
            found = Proposal(0, gpu_type, k, plan, plan.throughput / base if base > 0 else math.inf)
            if best is None or proposal_rank(found) < proposal_rank(best):
                best = found
    return best


@functools.lru_cache(maxsize=4096)
def _plain(types: tuple[str, ...], ests: int) -> EstProfile:
    """The profile an elastic job without one is planned with: capability 1 on every type."""
    return est_profile(dict.fromkeys(types, 1.0), ests, types[0])


def _profile(curve: ScalingCurve | None, types: tuple[str, ...], ests: int, elastic: bool) -> EstProfile | None:
    if isinstance(curve, EstProfile):
        return curve
    return _plain(types, ests) if elastic else None


def _spans(prof: EstProfile | None, mixed: bool) -> bool:
    """Whether a job's plan may use several GPU types: the policy's plans, or the job's D2 guard."""
    return mixed or (prof is not None and prof.mixed)


def easyscale_walk(
    inp: PassInput,
    order: IntArray,
    pinned: BoolArray | None,
    *,
    mixed: bool,
    pack_limit: float,
    own_types: bool = False,
    fallback_hold: float = DEFAULT_FALLBACK_HOLD,
) -> WalkResult:
    """Steps 1-4 of the module doc: who holds GPUs, how many of each type, and where. ``own_types``: proposals
    only of the GPU types each job may run on (its ``JobTable.pool_mask``); else of any type (the simulator's
    EasyScale, whose jobs name a type for their speeds only). ``fallback_hold``: Role 3's cap after a first
    fallback, in seconds (:meth:`ScaleOut.capped`)."""
    jobs, cluster = inp.jobs, inp.cluster
    n, n_pools = len(jobs), cluster.n_pools
    types = cluster.pool_names
    running = jobs.running.tolist()
    gpus = jobs.gpus.tolist()
    low = np.minimum(jobs.min_gpus, jobs.gpus).tolist()
    top = np.maximum(jobs.max_gpus, jobs.gpus).tolist()
    masks = jobs.pool_mask.tolist()
    scaling = jobs.scaling
    held = held_per_pool(inp)
    capacity = np.bincount(cluster.pool, weights=cluster.free, minlength=n_pools).astype(np.int64) + held.sum(axis=0)
    left = capacity.tolist()
    take = np.zeros((n, n_pools), dtype=np.int64)
    holding = np.zeros(n, dtype=np.bool_)
    profiles = [_profile(scaling[row], types, top[row], low[row] < top[row]) for row in range(n)]

    def speed_of(row: int, pool: int) -> float:
        prof = profiles[row]
        return dict(prof.capability).get(types[pool], 0.0) if prof is not None else 1.0

    if pinned is not None:  # jobs within their minimum run time keep their GPUs
        for row in np.flatnonzero(pinned).tolist():
            take[row] = held[row]
            holding[row] = True
            left = [a - b for a, b in zip(left, held[row].tolist(), strict=True)]
    # 1. the order at every job's minimum
    for row in order.tolist():
        if holding[row]:
            continue
        elastic = low[row] < top[row]
        if running[row]:
            have = held[row].tolist()
            if not elastic:  # a rigid job keeps exactly its GPUs or waits
                if all(h <= a for h, a in zip(have, left, strict=True)):
                    take[row] = held[row]
                    left = [a - h for a, h in zip(left, have, strict=True)]
                    holding[row] = True
                continue
            need = low[row]  # its minimum out of the types it holds, the fastest first
            part = [0] * n_pools
            for p in sorted(range(n_pools), key=lambda p: (-speed_of(row, p), p)):
                k = min(have[p], left[p], need)
                part[p] = k
                need -= k
            if need == 0:
                take[row] = part
                left = [a - k for a, k in zip(left, part, strict=True)]
                holding[row] = True
            continue
        size = low[row] if elastic else gpus[row]
        fits = [p for p in range(n_pools) if masks[row] >> p & 1 and left[p] >= size]
        if fits:
            p = max(fits, key=lambda p: (speed_of(row, p), left[p], -p))
            take[row, p] = size
            left[p] -= size
            holding[row] = True
    # 2. running elastic holders keep what they hold beyond their minimum where it is left (Role 3: not beyond the
    #    GPUs they had before a scale-out that did not pay; while the back-off holds, no plan the cap refuses)
    cap = list(top)
    limits: list[tuple[tuple[str, int], ...]] = [()] * n
    mixed_held: dict[int, list[int]] = {}  # row -> the GPUs per type it would keep of its mixed plan
    for row in order.tolist():
        if not (holding[row] and running[row] and low[row] < top[row]) or (pinned is not None and pinned[row]):
            continue
        keep = held[row].tolist()
        prof = profiles[row]
        if prof is not None and prof.scale_out is not None and prof.scale_out.worse:
            before = dict(prof.scale_out.previous)
            keep = [min(k, before.get(t, 0)) for k, t in zip(keep, types, strict=True)]
            if prof.scale_out.capped(inp.now, fallback_hold):
                limits[row] = prof.scale_out.limits
                if not limits[row]:  # the configuration is not known: no plan beyond the GPUs before
                    cap[row] = prof.scale_out.previous_gpus
        if _spans(prof, mixed) and sum(1 for k in keep if k) > 1:
            # a mixed plan keeps its type of the most capability; its other types' GPUs go back to step 3, where
            # plans on one type come first and the job's own mixed plan is formed again from what they leave
            mixed_held[row] = [max(k, int(take[row, p])) for p, k in enumerate(keep)]
            primary = max(range(n_pools), key=lambda p: (keep[p] * speed_of(row, p), -p))
            keep = [k if p == primary else 0 for p, k in enumerate(keep)]
        for p in range(n_pools):
            extra = min(max(keep[p] - int(take[row, p]), 0), left[p])
            take[row, p] += extra
            left[p] -= extra
    # 3. the free GPUs by Role 2's proposals, greedily by speedup per GPU (not to a job within its minimum run
    #    time: it keeps its GPUs as they are, so what its plan would take or release is not handed out)
    _grant(
        inp,
        take=take,
        left=left,
        holding=holding if pinned is None else holding & ~pinned,
        profiles=profiles,
        cap=cap,
        limits=limits,
        low=low,
        mixed=mixed,
        own_types=own_types,
        mixed_held=set(mixed_held),
    )
    for row, kept in mixed_held.items():
        # a job whose new plan is no faster than the mixed plan it runs keeps that plan where its GPUs are still
        # left (a resize costs a checkpoint and a restore, and buys nothing then)
        prof, now = profiles[row], take[row].tolist()
        if prof is None or any(k > t + a for k, t, a in zip(kept, now, left, strict=True)):
            continue
        if prof.throughput(dict(zip(types, kept, strict=True))) >= prof.throughput(dict(zip(types, now, strict=True))):
            left = [a + t - k for a, t, k in zip(left, now, kept, strict=True)]
            take[row] = kept
    target = take.sum(axis=1)
    return _place(inp, held=held, take=take, holding=holding, target=target, pinned=pinned, pack_limit=pack_limit)


def _grant(
    inp: PassInput,
    *,
    take: IntArray,
    left: list[int],
    holding: BoolArray,
    profiles: list[EstProfile | None],
    cap: list[int],
    limits: list[tuple[tuple[str, int], ...]],
    low: list[int],
    mixed: bool,
    own_types: bool,
    mixed_held: set[int],
) -> None:
    """Step 3: one grant at a time to the best proposal of all jobs (a granted job proposes again from its new
    plan; a proposal that no longer fits is formed again on what is left). Two rounds: plans on one type first
    (a GPU then runs at its full capability, where a mixed plan's step waits for its slowest GPU), for every job but
    those ``mixed_held`` (running a mixed plan, whose other types step 2 handed back: their next plan is mixed
    again, formed with the jobs that may span types in the second round, on what the first left)."""
    types = inp.cluster.pool_names
    jobs = inp.jobs
    elastic = (np.minimum(jobs.min_gpus, jobs.gpus) < np.maximum(jobs.max_gpus, jobs.gpus)) & holding
    heap: list[tuple[tuple[float, int, int, str], int, Proposal]] = []
    masks = jobs.pool_mask.tolist()

    def push(row: int, spans: bool) -> None:
        prof = profiles[row]
        if prof is None:
            return
        counts = take[row].tolist()
        current = tuple((types[p], counts[p]) for p in range(len(types)) if counts[p] > 0)
        mask = int(masks[row]) if own_types else -1  # the types the job may run on, or any
        free = tuple((types[p], min(left[p], cap[row])) for p in range(len(types)) if left[p] > 0 and mask >> p & 1)
        if not free:
            return
        best = _best_scale_out(current, free, prof.capability, prof.ests, (low[row], cap[row]), spans, limits[row])
        if best is not None and best.speedup > 1.0:
            best = replace(best, job_id=int(jobs.job_ids[row]))
            heapq.heappush(heap, (proposal_rank(best), row, best))

    def greedy(rows: list[int], spans: bool) -> None:
        for row in rows:
            push(row, spans)
        while heap:
            _, row, best = heapq.heappop(heap)
            p = types.index(best.gpu_type)
            if best.count > left[p]:
                push(row, spans)  # stale: what is left of its type shrank since it was formed
                continue
            plan = dict(best.plan.gpus)  # the job runs its plan: the GPUs it leaves out go back
            for q, gpu_type in enumerate(types):
                left[q] += int(take[row, q]) - plan.get(gpu_type, 0)
                take[row, q] = plan.get(gpu_type, 0)
            if any(left):
                push(row, spans)

    if not any(left):
        return
    rows = np.flatnonzero(elastic).tolist()
    greedy([row for row in rows if row not in mixed_held], False)
    if any(left):
        greedy([row for row in rows if _spans(profiles[row], mixed)], True)  # then mixed plans, on what is left


def _place(
    inp: PassInput,
    *,
    held: IntArray,
    take: IntArray,
    holding: BoolArray,
    target: IntArray,
    pinned: BoolArray | None,
    pack_limit: float,
) -> WalkResult:
    """Step 4: preempt the running jobs left out, place the shrunk jobs, the starts, then the grown jobs (every
    resized job lets go of its GPUs first), each type of a job's plan on its own nodes."""
    jobs, cluster = inp.jobs, inp.cluster
    running = jobs.running
    preempt = (running & ~holding).nonzero()[0].tolist()
    changed = running & holding & (take != held).any(axis=1)
    if pinned is not None:
        changed &= ~pinned
    moving = changed.nonzero()[0].tolist()
    starts: list[Start] = []
    resizes: list[SizeChange] = []
    index = FreeIndex(cluster, released(inp, preempt + moving))
    skew = jobs.skew

    def place(row: int) -> tuple[tuple[int, int], ...]:
        rows: list[tuple[int, int]] = []
        for p, count in enumerate(take[row].tolist()):
            if count:
                placed = index.place(p, count, PlacementMode.SKEW_AWARE, float(skew[row]), pack_limit)
                if placed is None:  # (counted fits always place outside STRICT mode)
                    raise RuntimeError(f"job {int(jobs.job_ids[row])}: cannot place {count} GPUs")
                rows.extend(placed)
        return tuple(rows)

    grow: list[int] = []
    for row in moving:
        if target[row] < jobs.gpus[row]:
            alloc = place(row)
            resizes.append(SizeChange(row, int(jobs.job_ids[row]), int(target[row]), alloc, _named(cluster, alloc)))
        else:
            grow.append(row)
    for row in (~running & holding).nonzero()[0].tolist():
        alloc = place(row)
        starts.append(Start(row, int(jobs.job_ids[row]), alloc, _named(cluster, alloc)))
    for row in grow:
        alloc = place(row)
        resizes.append(SizeChange(row, int(jobs.job_ids[row]), int(target[row]), alloc, _named(cluster, alloc)))
    capacity = np.bincount(cluster.pool, weights=cluster.total, minlength=cluster.n_pools)
    size = np.where(jobs.min_gpus < jobs.max_gpus, np.minimum(jobs.min_gpus, jobs.gpus), jobs.gpus)
    feasible = np.zeros(len(jobs), dtype=np.bool_)
    for p in range(cluster.n_pools):
        feasible |= ((jobs.pool_mask >> p) & 1).astype(np.bool_) & (size <= capacity[p])
    infeasible = tuple((~feasible).nonzero()[0].tolist()) if not feasible.all() else ()
    return WalkResult(
        tuple(starts),
        preemptions_of(jobs.job_ids, preempt),
        holding,
        feasible,
        infeasible,
        0,
        tuple(resizes),
        np.where(holding, target, 0),
    )


class EasyScaleHomo(TiresiasLas):
    """Discretised 2D-LAS decides who runs at its minimum; EasyScale's proposals share out the free GPUs, each
    job's plan on one GPU type (EasyScale_homo, §5.2)."""

    name = "easyscale-homo"
    elastic = True
    plans_per_type = True
    #: whether a job's plan may use several GPU types
    mixed = False
    #: whether proposals are only of the types a job may run on (its pool mask)
    own_types = False

    def _walk(self, inp: PassInput, order: IntArray, pinned: BoolArray | None) -> WalkResult:
        jobs = inp.jobs
        if np.array_equal(jobs.min_gpus, jobs.gpus) and np.array_equal(jobs.max_gpus, jobs.gpus):
            return super()._walk(inp, order, pinned)  # no elastic job in this pass: 2D-LAS's own walk
        return easyscale_walk(
            inp,
            order,
            pinned,
            mixed=self.mixed,
            pack_limit=self.options.pack_limit,
            own_types=self.own_types,
            fallback_hold=self.options.fallback_hold,
        )

    def _walk_sizes(self, inp: PassInput) -> IntArray:
        return minimum_sizes(inp)  # (rigid jobs: their GPUs)

    def schedule(self, inp: PassInput) -> Decision:
        """2D-LAS's pass with EasyScale's walk; it wakes up again when Role 3's cap on a job lapses (that job may
        then take free GPUs by a proposal with nothing else happening)."""
        decision = super().schedule(inp)
        lapse = cap_lapse(inp, self.options.fallback_hold)
        if lapse is None or (decision.next_wakeup is not None and decision.next_wakeup <= lapse):
            return decision
        return replace(decision, next_wakeup=lapse)


def cap_lapse(inp: PassInput, fallback_hold: float) -> float | None:
    """The earliest time after ``inp.now`` at which Role 3's cap on a job lapses (:meth:`ScaleOut.capped`), or
    None when no job is capped (or no cap was stamped with a time)."""
    jobs = inp.jobs
    elastic = (jobs.min_gpus < jobs.max_gpus).tolist()
    scaling = jobs.scaling
    best = math.inf
    for row, flexible in enumerate(elastic):
        prof = scaling[row]
        if not (flexible and isinstance(prof, EstProfile)) or prof.scale_out is None:
            continue
        seen = prof.scale_out
        if seen.at is not None and seen.capped(inp.now, fallback_hold):
            best = min(best, seen.at + seen.hold(fallback_hold))
    return best if math.isfinite(best) else None


class EasyScaleHeter(EasyScaleHomo):
    """As :class:`EasyScaleHomo`, a job's plan on several GPU types at once (EasyScale_heter, §5.2)."""

    name = "easyscale-heter"
    mixed = True


class TiresiasLasEasyScale(EasyScaleHomo):
    """``tiresias-las+easyscale``, the Slurm daemon's EasyScale: as :class:`EasyScaleHomo` (2D-LAS decides who
    runs at its minimum, Role 2's proposals share out the free GPUs by speedup per GPU, Role 3 falls back), each
    job's plan on one GPU type, except for a job whose profile is ``mixed`` (its run is at D2 and the model scanner
    covers its model: EasyScale §3.3's guard), whose plans span types as ``easyscale-heter``'s do. The daemon
    carries a plan out as a resize (checkpoint, requeue, new task count; a plan on several types as the nodes whose
    free GPUs give its counts per type: the README's "One job on two GPU types")."""

    name = "tiresias-las+easyscale"
    plans_per_type = False
    own_types = True
