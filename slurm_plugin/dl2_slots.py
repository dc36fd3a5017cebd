"""The daemon's DL² slot decision for running ps-mode jobs of a CPU partition (pure: frozen views in, targets out).

Once per slot the daemon describes a CPU partition's running ps-mode jobs as DL²'s slot problem (§3.1: every job
gets its numbers of workers and PS anew each slot; §4.1: the state the policy network reads), lets the trained
policy network decide it greedily (§4.1's inference loop, :func:`hpc_elastic.policy.dl2.decide`), and turns the
decision into scale targets of the jobs whose sizes change (sent to their wrappers as scale notices by
:mod:`slurm_plugin.dl2_daemon`). Where the network must not decide (§4.1's state has no column for it, or the
job shows values the training never came near: :func:`hpc_elastic.policy.dl2.in_training_range`), the plan says
why and the daemon keeps its default (2D-LAS) plan alone.

What stays the default policy's: the order and preemption of pending ps jobs
(:func:`slurm_plugin.cpu_policy.plan_ps_jobs`); DL² here only resizes running jobs within their ranges, since a
running ps job cannot be stopped and restarted at another size by a scale notice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from hpc_elastic.policy.dl2 import Network, StateSpec, decide, in_training_range
from hpc_elastic.policy.slots import JobType, Servers, SlotInput, SlotJob


@dataclass(frozen=True, slots=True)
class PsSlotView:
    """A running ps-mode job of a CPU partition as one slot sees it.

    ``model``: the job type's name (the model it trains); ``submitted``: its submission time (the state's arrival
    order); ``executed_s``: the seconds it ran over all its runs; ``epochs_done`` / ``epochs_total``: its progress
    record's (None when it has written none yet); ``workers`` / ``ps``: what runs now; the ranges: its
    ``--workers-range`` and ``--ps-range``; ``cores_per_task``: each process's cores; ``scale_pending``: a scale
    request of it is not answered yet (nothing more is asked of it until it is).
    """

    job_id: int
    partition: str
    model: str
    submitted: float
    executed_s: float
    epochs_done: float | None
    epochs_total: float | None
    workers: int
    ps: int
    workers_range: tuple[int, int]
    ps_range: tuple[int, int]
    cores_per_task: int
    scale_pending: bool = False

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("workers_range", self.workers_range), ("ps_range", self.ps_range)):
            if not 1 <= lo <= hi:
                raise ValueError(f"job {self.job_id}: {name} must be 1 <= low <= high, got {lo}:{hi}")
        if self.workers < 0 or self.ps < 0:
            raise ValueError(f"job {self.job_id}: workers and ps must be >= 0, got {self.workers}, {self.ps}")
        if self.cores_per_task < 1:
            raise ValueError(f"job {self.job_id}: cores_per_task must be >= 1, got {self.cores_per_task}")
        if not math.isfinite(self.executed_s) or self.executed_s < 0:
            raise ValueError(f"job {self.job_id}: executed_s must be finite and >= 0, got {self.executed_s!r}")


@dataclass(frozen=True, slots=True)
class ScaleTarget:
    """A job's new workers and PS (both within its ranges), what it runs now, and why."""

    job_id: int
    workers: int
    ps: int
    old_workers: int
    old_ps: int
    reason: str


@dataclass(frozen=True, slots=True)
class Dl2Plan:
    """One partition's slot: the targets of the jobs whose sizes change, or why DL² did not decide
    (``fallback``, empty when it did)."""

    partition: str
    targets: tuple[ScaleTarget, ...] = ()
    fallback: str = ""


def slot_input(
    spec: StateSpec,
    catalogue: Mapping[str, JobType],
    node_cores: Sequence[int],
    jobs: Iterable[PsSlotView],
    *,
    slot: int,
    slot_seconds: float,
) -> SlotInput | str:
    """DL² §3.1 / §4.1's slot problem of one partition, or why there is none.

    Servers: the partition's nodes, no GPU and their cores. Job types: the model's (``spec.type_names``, in its
    one-hot order) up to the last one a job trains, each the catalogue's with its workers' and PS's cores set to
    the most cores per process of its jobs here. Jobs in submission order (§4.1's arrival order): slots run (its
    executed seconds in whole slots), epochs done and total, its workers and PS now (as the previous slot's), its
    ranges' highs as its maxima and the size it started with (the most workers, the fewest PS) as its request.
    """
    views = sorted(jobs, key=lambda v: (v.submitted, v.job_id))
    if not node_cores:
        return "the partition has no nodes"
    index = {name: k for k, name in enumerate(spec.type_names)}
    used = -1
    progress: list[tuple[PsSlotView, float, float]] = []
    for view in views:
        if view.model not in index:
            return f"job {view.job_id} trains {view.model!r}, not one of the model's job types"
        if view.epochs_done is None or view.epochs_total is None:
            return f"job {view.job_id} has recorded no epochs yet"
        used = max(used, index[view.model])
        progress.append((view, view.epochs_done, view.epochs_total))
    types: list[JobType] = []
    for name in spec.type_names[: used + 1] or spec.type_names[:1]:
        kind = catalogue.get(name)
        if kind is None:
            return f"the model's job type {name!r} is unknown here"
        cores = [v.cores_per_task for v in views if v.model == name]
        if cores:
            kind = replace(kind, worker_cpus=max(cores), ps_cpus=max(cores))
        types.append(kind)
    slot_jobs = []
    for arrival, (view, done, total) in enumerate(progress):
        if done >= total:
            continue  # training ended: nothing to decide
        slot_jobs.append(
            SlotJob(
                job_id=view.job_id,
                job_type=index[view.model],
                arrival=arrival,
                epochs_total=total,
                epochs_done=done,
                slots_run=int(view.executed_s // slot_seconds),
                workers=min(view.workers, view.workers_range[1]),
                ps=min(view.ps, view.ps_range[1]),
                request_workers=view.workers_range[1],
                request_ps=view.ps_range[0],
                max_workers=view.workers_range[1],
                max_ps=view.ps_range[1],
            )
        )
    servers = Servers((0,) * len(node_cores), tuple(node_cores))
    return SlotInput(slot, slot_seconds, tuple(types), servers, tuple(slot_jobs))


def plan_slot(
    spec: StateSpec,
    network: Network,
    partition: str,
    inp: SlotInput | str,
    *,
    jobs: Iterable[PsSlotView],
    free_cores: int,
) -> Dl2Plan:
    """DL²'s greedy decision of a slot (§4.1's inference loop on the trained network) as scale targets.

    The fallback rule first (:func:`in_training_range`: a reason, and no target). Then each job in arrival order:
    DL²'s workers and PS, brought into the job's ranges (a running job is not stopped: none is its low); a job whose
    size does not change, or with a scale request unanswered, gets no target; a job that grows gets its target only
    when the cores it adds fit the partition's free cores left (``free_cores``, what the pass's Slurm read showed),
    so the targets never hand out more cores than the partition has free (shrinking frees none: the allocation
    keeps its cores).
    """
    if isinstance(inp, str):
        return Dl2Plan(partition, fallback=inp)
    why = in_training_range(spec, inp)
    if why is not None:
        return Dl2Plan(partition, fallback=why)
    decision = decide(spec, inp, network)
    decided = {job.job_id for job in inp.jobs}
    left = max(0, free_cores)
    targets: list[ScaleTarget] = []
    for view in sorted(jobs, key=lambda v: (v.submitted, v.job_id)):
        if view.job_id not in decided or view.scale_pending:
            continue
        w, p = decision.of(view.job_id)
        w = min(max(w, view.workers_range[0]), view.workers_range[1])
        p = min(max(p, view.ps_range[0]), view.ps_range[1])
        if (w, p) == (view.workers, view.ps):
            continue
        added = (max(0, w - view.workers) + max(0, p - view.ps)) * view.cores_per_task
        if added > left:
            continue
        left -= added
        dl2 = decision.of(view.job_id)
        reason = (
            f"DL² slot {inp.slot}: {dl2[0]} workers and {dl2[1]} PS (in its ranges: {w} and {p}; "
            f"it runs {view.workers} and {view.ps})"
        )
        targets.append(ScaleTarget(view.job_id, w, p, view.workers, view.ps, reason))
    return Dl2Plan(partition, tuple(targets))
