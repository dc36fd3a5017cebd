"""Lower bounds on a trace's average JCT that no policy reaches below in the simulator's speed model.

A benchmark's goal ("policy A >= k x better than policy B in average JCT") can only be met where B's average JCT is
at least k times what the best possible schedule reaches. Two relaxations of the simulator's model bound that
(:func:`jct_bound` takes the larger):

- **alone at its fastest** (:func:`isolated_jct`): a job cannot finish before its work at the fastest speed it has
  on any GPUs of the cluster, from its submission, with no wait, checkpoint, restore or slow placement (each only
  slows it in :mod:`hpc_elastic.sim.engine`). For a job with a profile per GPU type
  (:class:`~hpc_elastic.policy.hetero.EstProfile`) that speed is Role 1's top-1 plan on every GPU of the cluster
  (EasyScale §3.4, Eq. 1d), relative to its request on its base type, as the simulator counts it; for any other
  job, its scaling curve's best count in [1, its maximum], relative to its request.
- **one machine of the cluster's capacity** (:func:`srpt_mean_flow`): give each GPU type a weight (capacity per
  GPU-second); the least capacity a job needs (:func:`least_capacity_seconds`: on the GPUs that do most of its
  work per unit) is work on one machine that serves the whole cluster's capacity together, and shortest remaining
  processing time first is optimal for the mean flow time on one machine with release dates and preemption
  (Schrage 1968; 1|r_j, pmtn|ΣC_j). Every schedule of the cluster serves at most that much capacity per second,
  so its average JCT is no smaller, for every weighting; the bound takes the largest of a few.

Pure: trace jobs and nodes in, numbers out; no clock, command or file.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.policy.types import LINEAR
from hpc_elastic.sim.cluster import NodeSpec
from hpc_elastic.sim.engine import count_nodes
from hpc_elastic.sim.trace import TraceJob


def gpus_by_type(nodes: Sequence[NodeSpec]) -> dict[str, int]:
    """The cluster's GPUs per type (the empty type for untyped nodes)."""
    return {node.gpu_type: node.gpus for node in count_nodes(nodes)}


def _check(job: TraceJob, cluster: Mapping[str, int]) -> None:
    if not (math.isfinite(job.duration) and job.duration >= 0):
        raise ValueError(f"job {job.name!r}: duration must be a finite number >= 0, got {job.duration!r}")
    if job.gpus < 1:
        raise ValueError(f"job {job.name!r}: GPUs must be >= 1, got {job.gpus!r}")
    if sum(cluster.values()) < 1:
        raise ValueError(f"the cluster has no GPUs: {dict(cluster)!r}")


def _counts(job: TraceJob, total: int) -> range:
    """The GPU counts a job may run on, relaxed to every count from 1 up to its maximum (or its request)."""
    if not job.elastic or job.max_gpus is None:
        return range(job.gpus, job.gpus + 1)
    return range(1, min(max(job.gpus, job.max_gpus), total) + 1)


def isolated_jct(job: TraceJob, cluster: Mapping[str, int], *, one_type: bool = False) -> float:
    """Seconds from its submission that ``job`` needs at least: its work at its fastest on ``cluster``'s GPUs
    (type -> count), alone; with ``one_type``, at its fastest on the GPUs of one type (what plans on one type can
    reach: the difference is what mixing types buys a job at best)."""
    _check(job, cluster)
    curve = job.scaling
    if isinstance(curve, EstProfile):
        one = (curve.throughput({t: n}) for t, n in cluster.items())
        fastest = max(one) if one_type else curve.throughput(cluster)
        if fastest <= 0:
            return math.inf  # no GPU of the cluster runs it
        return job.duration * curve.throughput({curve.base_type: job.gpus}) / fastest
    curve = curve or LINEAR
    best = max(curve.at(m) for m in _counts(job, sum(cluster.values())))
    return job.duration * curve.at(job.gpus) / best


def least_capacity_seconds(job: TraceJob, cluster: Mapping[str, int], weight: Mapping[str, float]) -> float:
    """The least capacity-seconds ``job`` can finish in, where a second of one GPU of type ``t`` is ``weight[t]``
    of capacity. With a profile per type: a plan's Eq. 1d throughput is at most Σ n_i C_i (1c's waste is >= 0),
    so a unit of capacity does at most ``max_i C_i / weight[i]`` of its mini-batches; otherwise (no speed per type:
    weight 1 per GPU is the meaningful one) its scaling curve's most efficient count, each GPU-second worth the
    smallest weight."""
    _check(job, cluster)
    curve = job.scaling
    types = [t for t, n in cluster.items() if n > 0]
    for t in types:
        if not (math.isfinite(weight.get(t, math.nan)) and weight[t] > 0):
            raise ValueError(f"the weight of GPU type {t!r} must be a positive number, got {weight.get(t)!r}")
    if isinstance(curve, EstProfile):
        caps = dict(curve.capability)
        best = max((caps[t] / weight[t] for t in types if t in caps), default=0.0)
        if best <= 0:
            return math.inf
        return job.duration * curve.throughput({curve.base_type: job.gpus}) / best
    curve = curve or LINEAR
    gpu_seconds = min(m * job.duration * curve.at(job.gpus) / curve.at(m) for m in _counts(job, sum(cluster.values())))
    return gpu_seconds * min(weight[t] for t in types)


def srpt_mean_flow(jobs: Sequence[tuple[float, float]]) -> float:
    """Mean flow time (completion - release) of preemptive shortest-remaining-processing-time on one machine for
    ``(release, processing)`` pairs: the optimum of 1|r_j, pmtn|ΣC_j."""
    if not jobs:
        raise ValueError("no jobs to schedule")
    for release, work in jobs:
        if not (math.isfinite(release) and math.isfinite(work) and work >= 0):
            raise ValueError(f"a job needs a finite release and processing time >= 0, got {(release, work)!r}")
    arrivals = sorted(jobs)
    now, total, i, n = 0.0, 0.0, 0, len(arrivals)
    ready: list[list[float]] = []  # [remaining, release]
    while i < n or ready:
        if not ready:
            now = max(now, arrivals[i][0])
        while i < n and arrivals[i][0] <= now:
            heapq.heappush(ready, [arrivals[i][1], arrivals[i][0]])
            i += 1
        remaining, release = ready[0]
        next_release = arrivals[i][0] if i < n else math.inf
        if now + remaining <= next_release:
            now += remaining
            heapq.heappop(ready)
            total += now - release
        else:
            ready[0][0] = remaining - (next_release - now)
            now = next_release
    return total / n


@dataclass(frozen=True)
class JctBound:
    """The two lower bounds on a trace's average JCT (seconds) and the one that holds for both; and the first for
    policies that run a job's plan on one GPU type at a time (``isolated_one_type``)."""

    isolated: float
    fluid: float
    isolated_one_type: float

    @property
    def value(self) -> float:
        return max(self.isolated, self.fluid)

    @property
    def one_type_value(self) -> float:
        """The bound of policies whose plans use one GPU type at a time."""
        return max(self.isolated_one_type, self.fluid)


def _weightings(jobs: Sequence[TraceJob], cluster: Mapping[str, int]) -> list[dict[str, float]]:
    """Capacity per GPU type to bound with: one per GPU, and each distinct capability vector of the jobs' profiles
    over the cluster's types (a job of that vector then gets exactly one unit per unit of capacity)."""
    types = sorted(t for t, n in cluster.items() if n > 0)
    out: list[dict[str, float]] = [dict.fromkeys(types, 1.0)]
    seen: set[tuple[float, ...]] = set()
    for job in jobs:
        if isinstance(job.scaling, EstProfile):
            caps = dict(job.scaling.capability)
            vector = tuple(caps.get(t, 0.0) for t in types)
            if all(c > 0 for c in vector) and vector not in seen:
                seen.add(vector)
                out.append(dict(zip(types, vector, strict=True)))
    return out


def jct_bound(jobs: Sequence[TraceJob], nodes: Sequence[NodeSpec]) -> JctBound:
    """No policy's average JCT of ``jobs`` on ``nodes`` in :mod:`hpc_elastic.sim.engine` is below ``.value``.
    The fluid bound is the largest over :func:`_weightings` (each is a valid relaxation)."""
    if not jobs:
        raise ValueError("no jobs to bound")
    cluster = gpus_by_type(nodes)
    isolated = statistics.fmean(isolated_jct(job, cluster) for job in jobs)
    one_type = statistics.fmean(isolated_jct(job, cluster, one_type=True) for job in jobs)
    fluid = 0.0
    for weight in _weightings(jobs, cluster):
        capacity = sum(cluster[t] * w for t, w in weight.items())
        work = [(job.submit, least_capacity_seconds(job, cluster, weight) / capacity) for job in jobs]
        fluid = max(fluid, srpt_mean_flow(work))
    return JctBound(isolated, fluid, one_type)
