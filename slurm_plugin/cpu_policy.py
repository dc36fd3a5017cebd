"""The daemon's plan for ps-mode jobs on CPU partitions (pure: frozen views in, a decision out).

The same 2D-LAS as for GPU jobs (Tiresias §3.2.2), on CPU-core-time: a job's attained service is the cores of its
allocation times the seconds it ran, over all its runs; the least attained goes first, ties by submission. A pending
job that does not fit its partition's free cores may take the cores of running ps jobs of that partition that
attained more than it, the most attained first, and only when the cores so freed make it fit; the preempted jobs
checkpoint and are requeued by their wrappers (:mod:`hpc_elastic.ps.allocation`). The cores the plan hands out
never exceed the partition's free cores plus the cores it frees: a plan never oversubscribes a partition.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PsJobView:
    """A managed ps-mode job on a CPU partition, as one pass sees it. ``cores``: the cores of its allocation
    (Slurm's ``NumCPUs``); ``core_seconds``: its attained service; ``may_preempt``: a running job that ran long
    enough since its last start or preemption to be preempted now (the daemon's ``min_run_time_s``)."""

    job_id: int
    partition: str
    running: bool
    cores: int
    core_seconds: float
    submitted: float
    may_preempt: bool = True

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ValueError(f"job {self.job_id}: a ps job holds at least one core, got {self.cores}")
        if not math.isfinite(self.core_seconds) or self.core_seconds < 0:
            raise ValueError(f"job {self.job_id}: core_seconds must be finite and >= 0, got {self.core_seconds}")

    @property
    def priority(self) -> tuple[float, float, int]:
        """2D-LAS: the least attained CPU-core-time first, then the earliest submitted."""
        return (self.core_seconds, self.submitted, self.job_id)


@dataclass(frozen=True, slots=True)
class CpuDecision:
    """The jobs to preempt, each with its reason, and the pending jobs the plan makes room for."""

    preempt: tuple[int, ...] = ()
    reasons: Mapping[int, str] = field(default_factory=dict)
    fits: tuple[int, ...] = ()


def plan_ps_jobs(jobs: Iterable[PsJobView], free_cores: Mapping[str, int], *, max_preempt: int) -> CpuDecision:
    """Walk the pending ps jobs in 2D-LAS order, each partition's free cores (``free_cores``) handed out in turn:
    a job that fits takes its cores; one that does not takes the cores of running jobs of its partition that
    attained more (the most attained first, at most ``max_preempt`` preemptions in all) when they make it fit,
    else nothing (its cores stay free: a smaller job behind it may fit, as Slurm's backfill would start it)."""
    views = sorted(jobs, key=lambda v: v.priority)
    free = {p: max(0, c) for p, c in free_cores.items()}
    taken: set[int] = set()
    preempt: list[int] = []
    reasons: dict[int, str] = {}
    fits: list[int] = []
    for job in (v for v in views if not v.running):
        have = free.get(job.partition, 0)
        if job.cores <= have:
            free[job.partition] = have - job.cores
            fits.append(job.job_id)
            continue
        victims: list[PsJobView] = []
        freed = 0
        for other in sorted(views, key=lambda v: v.priority, reverse=True):
            if have + freed >= job.cores or len(preempt) + len(victims) >= max_preempt:
                break
            if (
                other.running
                and other.partition == job.partition
                and other.may_preempt
                and other.job_id not in taken
                and other.priority > job.priority
            ):
                victims.append(other)
                freed += other.cores
        if have + freed < job.cores:
            continue
        for victim in victims:
            taken.add(victim.job_id)
            preempt.append(victim.job_id)
            reasons[victim.job_id] = (
                f"{victim.core_seconds:.0f} core-s attained on partition {victim.partition}; its {victim.cores} "
                f"cores go to ps job {job.job_id} ({job.core_seconds:.0f} core-s, {job.cores} cores)"
            )
        free[job.partition] = have + freed - job.cores
        fits.append(job.job_id)
    return CpuDecision(tuple(preempt), reasons, tuple(fits))
