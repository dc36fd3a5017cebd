"""EasyScale's intra-job planner, its companion's plan database, and the inter-job greedy (EasyScale, SC'23, §3.4).

A job has ``maxP`` EasyScale threads (ESTs, its logical workers) and may run them on GPUs of several types. On a
GPU of type ``i`` one EST's mini-batch takes ``1 / C_i`` seconds (``C_i``: the type's computing capability for this
job, mini-batches per second, from its profile or observed). A plan gives ``n_i`` GPUs of each type ``A_i`` ESTs
at most each; the ESTs of a global step then take ``f = max A_i / C_i`` seconds (Sync-SGD waits for the most
loaded GPU), and the plan trains ``maxP / f`` mini-batches per second.

- :func:`evaluate` is Eq. 1a-1d for one plan;
- :func:`plan_frontier` is the companion's database (Role 1's top-K): for every throughput the job can reach on
  the free GPUs, the plan that reaches it with the fewest GPUs;
- :func:`propose` forms Role 2's scale-out proposals (incremental homogeneous GPUs with their estimated speedup);
- :func:`keep_scale_out` is Role 3's fallback;
- :func:`correct_capability` is the companion's correction of ``C_i`` from observed throughput;
- :func:`accept_proposals` is the inter-job scheduler's greedy by speedup per GPU.

Pure: plain values in, frozen dataclasses out; no clock, command or file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: relative tolerance when comparing EST loads A_i / C_i (capabilities are measured floats)
_REL = 1e-9


def _check_capability(capability: Mapping[str, float]) -> None:
    for gpu_type, c in capability.items():
        if not (isinstance(c, int | float) and math.isfinite(c) and c > 0):
            raise ValueError(f"capability of GPU type {gpu_type!r} must be a positive number, got {c!r}")


def _check_counts(name: str, counts: Mapping[str, int]) -> None:
    for gpu_type, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} of GPU type {gpu_type!r} must be a count >= 0, got {n!r}")


def _check_max_p(max_p: int) -> None:
    if isinstance(max_p, bool) or not isinstance(max_p, int) or max_p < 1:
        raise ValueError(f"maxP (the job's ESTs) must be an integer >= 1, got {max_p!r}")


@dataclass(frozen=True)
class Plan:
    """GPUs per type, the most ESTs a GPU of each type runs, and Eq. 1a-1d's values for them."""

    gpus: tuple[tuple[str, int], ...]  # (type, n_i), n_i > 0, sorted by type
    ests: tuple[tuple[str, int], ...]  # (type, A_i), same types
    max_p: int
    n_est: int  # Eq. 1a
    overload: float  # f_overload, Eq. 1b: seconds per global step
    waste: float  # Eq. 1c
    throughput: float  # Eq. 1d: mini-batches per second

    @property
    def total_gpus(self) -> int:
        return sum(n for _, n in self.gpus)

    def count(self, gpu_type: str) -> int:
        return dict(self.gpus).get(gpu_type, 0)

    def assignment(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """ESTs on each GPU, per type: exactly ``maxP`` in all, at most ``A_i`` and at least one on a GPU of type
        ``i``. Eq. 1a's over-provision (``nEST - maxP``) is taken one EST at a time from a GPU with the most."""
        per_gpu = {t: [a] * n for (t, n), (_, a) in zip(self.gpus, self.ests, strict=True)}
        surplus = self.n_est - self.max_p
        while surplus > 0:
            gpu_type = max(per_gpu, key=lambda t: (max(per_gpu[t]), t))
            row = per_gpu[gpu_type]
            i = row.index(max(row))
            if row[i] <= 1:
                break
            row[i] -= 1
            surplus -= 1
        return tuple((t, tuple(sorted(row, reverse=True))) for t, row in sorted(per_gpu.items()))


def evaluate(gpus: Mapping[str, int], ests: Mapping[str, int], capability: Mapping[str, float], max_p: int) -> Plan:
    """Eq. 1a-1d for ``n_i = gpus[i]`` GPUs running at most ``A_i = ests[i]`` ESTs each (§3.4).

    - 1a: ``nEST = Σ n_i·A_i``, which must be ``>= maxP``;
    - 1b: ``f_overload = max_{n_i>0} A_i / C_i``;
    - 1c: ``waste = Σ_{n_i>0} n_i·(C_i - A_i / f_overload) + (nEST - maxP) / f_overload``;
    - 1d: ``throughput = Σ n_i·C_i - waste``.

    The paper prints 1c's first sum per type; it runs over GPUs here (each of the ``n_i`` GPUs of type ``i``
    wastes ``C_i - A_i / f``), which makes 1d equal ``maxP / f_overload``, the rate at which the ESTs' global steps
    complete. With one GPU per type the two readings agree."""
    _check_counts("GPU count", gpus)
    _check_counts("ESTs per GPU", ests)
    _check_capability(capability)
    _check_max_p(max_p)
    used = sorted(t for t, n in gpus.items() if n > 0)
    if not used:
        raise ValueError("a plan needs at least one GPU")
    for t in used:
        if t not in capability:
            raise ValueError(f"no capability for GPU type {t!r}")
        if ests.get(t, 0) < 1:
            raise ValueError(f"each GPU of a plan runs at least one EST; type {t!r} has {ests.get(t, 0)}")
    n_est = sum(gpus[t] * ests[t] for t in used)
    if n_est < max_p:
        raise ValueError(f"the plan runs {n_est} ESTs, fewer than maxP = {max_p} (Eq. 1a)")
    return _plan(gpus, ests, capability, max_p)


def _plan(gpus: Mapping[str, int], ests: Mapping[str, int], capability: Mapping[str, float], max_p: int) -> Plan:
    """Eq. 1a-1d for a plan known to be valid (see :func:`evaluate`)."""
    used = sorted(t for t, n in gpus.items() if n > 0)
    n_est = sum(gpus[t] * ests[t] for t in used)  # 1a
    overload = max(ests[t] / capability[t] for t in used)  # 1b
    waste = sum(gpus[t] * (capability[t] - ests[t] / overload) for t in used) + (n_est - max_p) / overload  # 1c
    throughput = sum(gpus[t] * capability[t] for t in used) - waste  # 1d
    return Plan(
        gpus=tuple((t, gpus[t]) for t in used),
        ests=tuple((t, ests[t]) for t in used),
        max_p=max_p,
        n_est=n_est,
        overload=overload,
        waste=waste,
        throughput=throughput,
    )


def _fewest_gpus(
    free: Sequence[tuple[str, int]], capability: Mapping[str, float], max_p: int, f: float
) -> tuple[dict[str, int], dict[str, int]] | None:
    """The fewest GPUs whose ESTs at load ``<= f`` (``A_i = floor(f·C_i)``) reach ``maxP``: the types with the
    most ESTs per GPU first (covering a sum with the fewest items takes the largest first); ties by name."""
    per_gpu = {t: min(math.floor(f * capability[t] * (1 + _REL)), max_p) for t, n in free if n > 0}
    counts: dict[str, int] = {}
    need = max_p
    for t, n in sorted(free, key=lambda item: (-per_gpu.get(item[0], 0), item[0])):
        a = per_gpu.get(t, 0)
        if need <= 0 or a < 1 or n <= 0:
            continue
        take = min(n, -(-need // a))
        counts[t] = take
        need -= take * a
    if need > 0:
        return None
    return counts, {t: per_gpu[t] for t in counts}


def plan_frontier(free: Mapping[str, int], capability: Mapping[str, float], max_p: int) -> list[Plan]:
    """The companion's plan database on these GPUs (Role 1): every plan no other beats with as few GPUs, highest
    throughput first (the first is Role 1's top-1: the fastest plan, on the fewest GPUs that reach it).

    Every throughput a plan can have is ``maxP / f`` for a load ``f = a / C_i`` (``a`` ESTs on a GPU of type
    ``i``); for each such ``f`` the fewest GPUs that reach it (:func:`_fewest_gpus`) make a plan, and the plans
    that are not dominated (another reaches at least the same throughput on at most as many GPUs) are kept.
    That equals the Pareto front of the brute-force enumeration of every ``(n_i, A_i)`` (tested)."""
    _check_counts("free GPUs", free)
    _check_capability(capability)
    _check_max_p(max_p)
    items = tuple(sorted((t, n) for t, n in free.items() if n > 0 and t in capability))
    if not items:
        return []
    loads = _loads(items, capability, max_p)
    plans: dict[int, Plan] = {}  # fewest GPUs -> fastest plan with them
    for f in loads[_first_feasible(items, capability, max_p, loads) :]:
        found = _fewest_gpus(items, capability, max_p, f)
        if found is None:
            continue
        plan = _plan(*found, capability, max_p)
        best = plans.get(plan.total_gpus)
        if best is None or plan.throughput > best.throughput * (1 + _REL):
            plans[plan.total_gpus] = plan
        if plan.total_gpus == 1:  # the fewest GPUs only fall as the load grows: none fewer than one
            break
    front: list[Plan] = []
    for total in sorted(plans):  # fewer GPUs first: keep a plan only if it is faster than every smaller one
        plan = plans[total]
        if not front or plan.throughput > front[-1].throughput * (1 + _REL):
            front.append(plan)
    return front[::-1]


def _first_feasible(
    items: Sequence[tuple[str, int]], capability: Mapping[str, float], max_p: int, loads: Sequence[float]
) -> int:
    """Index of the smallest load at which these GPUs reach ``maxP`` ESTs, by bisection: reaching it only gets
    easier as the load grows, and the largest load (``maxP`` ESTs on one GPU of the slowest type) always does."""
    lo, hi = 0, len(loads) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fewest_gpus(items, capability, max_p, loads[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _loads(items: Sequence[tuple[str, int]], capability: Mapping[str, float], max_p: int) -> list[float]:
    """Every load ``a / C_i`` (``a`` ESTs, ``1 <= a <= maxP``, on a GPU of a type in ``items``), ascending."""
    return sorted({a / capability[t] for t, _ in items for a in range(1, max_p + 1)})


def top_plans(free: Mapping[str, int], capability: Mapping[str, float], max_p: int, k: int) -> list[Plan]:
    """Role 1's top-K: the ``k`` fastest plans of :func:`plan_frontier`."""
    if k < 1:
        raise ValueError(f"top-K needs k >= 1, got {k}")
    return plan_frontier(free, capability, max_p)[:k]


def best_plan(gpus: Mapping[str, int], capability: Mapping[str, float], max_p: int) -> Plan | None:
    """Role 1: the fastest plan on (a subset of) these GPUs, on the fewest of them; None without GPUs.

    The first plan of :func:`plan_frontier` without building the rest: the plan at the smallest feasible load is
    the fastest (its own load cannot be smaller)."""
    _check_counts("GPUs", gpus)
    _check_capability(capability)
    _check_max_p(max_p)
    items = tuple(sorted((t, n) for t, n in gpus.items() if n > 0 and t in capability))
    if not items:
        return None
    loads = _loads(items, capability, max_p)
    found = _fewest_gpus(items, capability, max_p, loads[_first_feasible(items, capability, max_p, loads)])
    return _plan(*found, capability, max_p) if found is not None else None


@dataclass(frozen=True)
class Proposal:
    """Role 2: ``count`` more GPUs of ``gpu_type`` would run the job at ``plan``, ``speedup`` times as fast."""

    job_id: int
    gpu_type: str
    count: int
    plan: Plan
    speedup: float

    @property
    def speedup_per_gpu(self) -> float:
        """The relative throughput gained per GPU added: ``(speedup - 1) / count``."""
        return (self.speedup - 1.0) / self.count


def propose(
    job_id: int,
    current: Mapping[str, int],
    free: Mapping[str, int],
    capability: Mapping[str, float],
    max_p: int,
    *,
    max_gpus: int | None = None,
    limit: int | None = None,
) -> list[Proposal]:
    """Role 2: scale-out proposals of incremental homogeneous GPUs (``k`` more of one type, ``k`` up to what is
    free), each with its estimated speedup over the best plan on the job's current GPUs. An increment is proposed
    only when its best plan uses all the job's GPUs and is faster than every smaller increment of the type (two
    v100 may help where one does not), and none beyond ``max_gpus`` in all. Sorted as the inter-job scheduler
    takes them: speedup per GPU first, then more GPUs."""
    _check_counts("current GPUs", current)
    now = best_plan(current, capability, max_p) if any(current.values()) else None
    base = now.throughput if now is not None else 0.0
    held = sum(current.values())
    proposals: list[Proposal] = []
    for gpu_type in sorted(t for t, n in free.items() if n > 0 and t in capability):
        previous = base
        for k in range(1, free[gpu_type] + 1):
            if max_gpus is not None and held + k > max_gpus:
                break
            grown = dict(current)
            grown[gpu_type] = grown.get(gpu_type, 0) + k
            plan = best_plan(grown, capability, max_p)
            if plan is None or plan.throughput <= previous * (1 + _REL) or plan.total_gpus < held + k:
                continue  # not faster than a smaller increment, or some GPUs would idle: that one does as well
            previous = plan.throughput
            speedup = plan.throughput / base if base > 0 else math.inf
            proposals.append(Proposal(job_id, gpu_type, k, plan, speedup))
    proposals.sort(key=lambda p: (-p.speedup_per_gpu, -p.count, p.gpu_type))
    return proposals[:limit] if limit is not None else proposals


#: Role 3's back-off (seconds): after a fallback the job proposes no scale-out beyond its GPUs before for this long,
#: doubled for each fallback in a row. Half an hour: six times the daemon's 300 s minimum run time, so a retry that
#: fails again (a grow and a fallback, two checkpoint-restarts) costs a few percent of the time it waited, a share
#: that halves with every further failure; and short against the hours for which a trace's jobs run, so that GPUs
#: that became free or uncontended are not left unused for long.
DEFAULT_FALLBACK_HOLD = 1800.0


def keep_scale_out(throughput_before: float, throughput_after: float, tolerance: float = 0.02) -> bool:
    """Role 3's check after a scale-out: keep the new GPUs unless the observed throughput is worse than before
    (by more than ``tolerance``, relative); otherwise fall back to the previous allocation and release them."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"fallback tolerance must be in [0, 1), got {tolerance}")
    for name, value in (("before", throughput_before), ("after", throughput_after)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"observed throughput {name} must be a finite number >= 0, got {value!r}")
    return throughput_after >= throughput_before * (1 - tolerance)


def correct_capability(
    capability: Mapping[str, float], observed: Mapping[str, float], threshold: float = 0.1
) -> dict[str, float]:
    """The companion's correction (§3.4): a type whose observed capability (mini-batches per second per GPU, from
    the job's reports) differs from the estimate by more than ``threshold`` (relative) takes the observed value."""
    _check_capability(capability)
    _check_capability(observed)
    if not threshold >= 0:
        raise ValueError(f"correction threshold must be >= 0, got {threshold}")
    corrected = dict(capability)
    for gpu_type, seen in observed.items():
        estimate = capability.get(gpu_type)
        if estimate is None or abs(seen / estimate - 1.0) > threshold:
            corrected[gpu_type] = float(seen)
    return corrected


@dataclass(frozen=True)
class Grant:
    """An accepted proposal: ``count`` more GPUs of ``gpu_type`` for ``job_id``."""

    job_id: int
    gpu_type: str
    count: int
    speedup: float


def proposal_rank(p: Proposal) -> tuple[float, int, int, str]:
    """The inter-job scheduler's order of proposals (a sort key, smallest first): the highest speedup per GPU,
    a tie to more GPUs, then by job and type."""
    return (-p.speedup_per_gpu, -p.count, p.job_id, p.gpu_type)


def accept_proposals(proposals: Iterable[Proposal], free: Mapping[str, int]) -> list[Grant]:
    """The inter-job scheduler (§3.4): accept proposals greedily by speedup per GPU, a tie to the one with more
    GPUs, while the GPUs of its type are free; at most one proposal per job per pass (the job's plan changes with
    it, so its other proposals are stale)."""
    _check_counts("free GPUs", free)
    left = dict(free)
    granted: set[int] = set()
    grants: list[Grant] = []
    ranked = sorted(proposals, key=proposal_rank)
    for p in ranked:
        if p.job_id in granted or p.speedup <= 1.0 or left.get(p.gpu_type, 0) < p.count:
            continue
        left[p.gpu_type] -= p.count
        granted.add(p.job_id)
        grants.append(Grant(p.job_id, p.gpu_type, p.count, p.speedup))
    return grants
