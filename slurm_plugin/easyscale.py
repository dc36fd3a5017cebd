"""What ``tiresias-las+easyscale`` needs of the jobs in the daemon (pure): each elastic job's speed model.

The policy (:class:`~hpc_elastic.policy.hetero.TiresiasLasEasyScale`) reads an elastic job's
:class:`~hpc_elastic.policy.hetero.EstProfile`: its ESTs (the marker's workers, maxP), its capability C_i per GPU
type and the observation of its last scale-out (Role 3). Here:

- C_i: without a profile every type is estimated at 1 (relative), and the companion's correction (§3.4,
  :func:`~hpc_elastic.policy.easyscale.correct_capability`) replaces the types the job observed (its telemetry,
  ``apply.capabilities``). A type it has not run on keeps its estimate scaled by the mean ratio observed /
  estimated of the types it has run on, so that observed and estimated values share one unit;
- Role 3: when the daemon grows a job it records the job's throughput then (Eq. 1d of Role 1's top-1 plan with the
  observed C_i on its GPUs) and the GPUs it had (:class:`ScaleOutWatch`); once the grown job reports from its new
  incarnation, its throughput there is the "after" of the :class:`~hpc_elastic.policy.hetero.ScaleOut` the policy
  falls back on when it is worse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from hpc_elastic.launch.spec import JobMarker
from hpc_elastic.policy.easyscale import correct_capability
from hpc_elastic.policy.hetero import EstProfile, ScaleOut, est_profile
from hpc_elastic.slurm import Job

Capability = tuple[tuple[str, float], ...]
Gpus = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class ScaleOutWatch:
    """A grow the daemon carried out: the job's throughput before it, on ``previous`` GPUs per type, and its
    restart count then (the grown job reports from a later incarnation)."""

    before: float
    previous: Gpus
    restart_count: int


def estimated_capability(types: tuple[str, ...], observed: Mapping[str, float]) -> dict[str, float]:
    """C_i per type of the cluster: 1 each, corrected by the observed values (§3.4); a type not observed takes
    the mean ratio observed / estimated (geometric) of those observed, 1 when none was."""
    if not types:
        raise ValueError("no GPU type to estimate a capability for")
    estimate = dict.fromkeys(types, 1.0)
    seen = {t: c for t, c in observed.items() if t in estimate}
    if not seen:
        return estimate
    corrected = correct_capability(estimate, seen)
    scale = math.exp(sum(math.log(c / estimate[t]) for t, c in seen.items()) / len(seen))
    return {t: corrected[t] if t in seen else estimate[t] * scale for t in types}


def job_gpus(job: Job) -> Gpus:
    """The GPUs per type a job holds or asks for (sorted; an untyped request is left out)."""
    counts: dict[str, int] = {}
    for gpu_type, count in job.gpus.by_type:
        if gpu_type and count > 0:
            counts[gpu_type] = counts.get(gpu_type, 0) + count
    return tuple(sorted(counts.items()))


def job_profile(
    marker: JobMarker,
    job: Job,
    types: tuple[str, ...],
    observed: Capability,
    scale_out: ScaleOut | None = None,
) -> EstProfile:
    """The speed model of an elastic job: maxP = its workers, C_i from :func:`estimated_capability`, requested on
    the type it holds (else the marker's, else the cluster's first)."""
    capability = estimated_capability(types, dict(observed))
    held = [t for t, _ in job_gpus(job) if t in capability]
    base = held[0] if held else (marker.gpu_type if marker.gpu_type in capability else types[0])
    return replace(est_profile(capability, marker.workers, base), scale_out=scale_out)


def watch_grow(profile: EstProfile, job: Job) -> ScaleOutWatch:
    """What to remember when the daemon grows ``job``: its throughput on its GPUs now (Role 3's "before")."""
    gpus = job_gpus(job)
    return ScaleOutWatch(profile.throughput(dict(gpus)), gpus, job.restart_count)


def observed_scale_out(watch: ScaleOutWatch, profile: EstProfile, job: Job, reported: bool) -> ScaleOut | None:
    """Role 3's observation of a grow, once the job runs again and ``reported`` its capability from this
    incarnation: its throughput on its GPUs now against that before the grow (None until then)."""
    if not reported or job.restart_count <= watch.restart_count:
        return None
    return ScaleOut(watch.before, profile.throughput(dict(job_gpus(job))), watch.previous)
