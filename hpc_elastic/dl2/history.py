"""Slurm's own decisions as DL²'s supervised samples (DL² §4.2: offline learning from an existing scheduler).

DL² bootstraps its policy network from the decisions of the scheduler a cluster already runs. In the simulator that
teacher is DRF (:mod:`hpc_elastic.policy.drf`); at a Slurm site it is Slurm itself, and its decisions are in the
accounting: when each PS-mode job (``hpc-elastic submit --mode ps``) was submitted, started and ended, and when each
of its worker steps (``w0``, ``w1``, ..., ``r1w0`` after a requeue) and parameter-server steps (``ps0``, ...) ran,
with its cores (:mod:`hpc_elastic.ps` starts every process as a job step of its own). A job is PS-mode by its
marker, or, where the accounting keeps no job comment (Slurm stores it only with
``AccountingStoreFlags=job_comment``; the dev cluster does not), by its steps (:func:`collect`). This module turns
those records into the slot model of :mod:`hpc_elastic.policy.slots` and each slot's allocation into DL²'s action
sequence (:func:`teacher_steps`).

**Slots.** Time from the window's start is cut into slots of the spec's ``slot_seconds``; only whole slots that
end by the window's end are used. A job is *present* in a slot when it was submitted before the slot ends and had
not ended when it started (pending jobs are present with nothing allocated: Slurm chose not to run them).

**Workers and PS of a slot**: the most steps of each role that ran *at the same time* within the slot (not those
running at its start). DL² decides once at a slot's start what a job runs for the whole slot; Slurm decides at any
moment, so a job that started within the slot was granted its tasks in that slot, and a worker that replaced a
lost one is not a second worker. For the same reason a job submitted within a slot is present in it. This holds
for jobs that run for many slots, as DL²'s do (hours); jobs much shorter than a slot that ran one after the other
in it add up to more than the servers hold, and the slot is not expressible (the dev cluster's test jobs of
seconds, in 20-minute slots).

**The state of a job** (:class:`SlotJob`): its previous slot's workers and PS (the counts above, for the slot
before), its slots run (slots before this one in which it held a task, counted from its first step even before
the window), its request and maximum (the upper ends of the marker's ``--workers-range`` / ``--ps-range``, which
the allocation holds, or without a marker the most it ran at once; the maximum is raised to the most the job was
ever seen to run at once). Epochs: sacct
does not carry them, so a record's ``epochs_total`` is used when the caller has it, else
:data:`ASSUMED_EPOCHS`; the epochs done at a slot's start are the total times the fraction of the job's run
(from its start to its end, or to the window's end for a job still running: a lower bound) elapsed by then. A
job's speed is not in DL²'s state, and the teacher's decisions do not depend on epochs; this estimate is only
there so that the state's remaining-epochs column decreases as the job runs, as it does in the simulator.

**Servers and job types.** The servers are the partition's nodes (their cores, no GPUs). A job's type is its model's
name matched exactly to the spec's type names (the caller names the model; an unknown name is skipped and counted,
never guessed). The types' demands are the jobs': a PS-mode worker and a PS hold their cores (the marker's cores per
process, or the cores most of the job's worker and PS steps had) and no GPU, so a slot's :class:`JobType` of each
name is the catalogue's with those demands (the speed coefficients are not used by a teacher's decision). Two jobs
of one type with different cores in one slot cannot be expressed with one type per name: the slot is skipped and
counted. The job master (one process of the same cores) and other jobs are not in DL²'s model: their cores count as
free.

**The decision** (a :class:`SlotDecision`, then :func:`teacher_steps`): in arrival order each job first keeps
what it held in the previous slot, up to this slot's counts (pairs, then the rest, as DRF keeps a running job's
tasks), then in arrival order the tasks it gained (pairs first); the sequence ends with void when a task would
still fit. A decision the slot model cannot express (a task that does not fit the partition's cores by DL²'s
load-balancing placement, more than ``J`` jobs in the slot) gives no samples and is counted.

Pure: frozen dataclasses in (the Slurm records of :mod:`hpc_elastic.slurm.types` or this module's own), frozen
dataclasses out; no command, file or clock.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from hpc_elastic.launch.spec import MarkerError, PsShape, decode_marker
from hpc_elastic.policy.dl2 import StateSpec, Step, teacher_steps
from hpc_elastic.policy.slots import JobType, Packing, Servers, SlotAction, SlotDecision, SlotInput, SlotJob
from hpc_elastic.slurm.types import Job, Node
from hpc_elastic.slurm.types import Step as SlurmStep

#: the epochs of a job when its record does not say (sacct does not): within the simulator's 10-2000 epochs
ASSUMED_EPOCHS = 100.0


class Role(StrEnum):
    """What a PS-mode job step is."""

    WORKER = "worker"
    PS = "ps"


#: the job master's step, as :mod:`hpc_elastic.ps` names it
MASTER_STEP = "master"
_ROLE_NAMES = ((re.compile(r"(?:r\d+)?w\d+"), Role.WORKER), (re.compile(r"ps\d+"), Role.PS))


def step_role(name: str) -> Role | None:
    """The role of a PS-mode job's step by its name (``w3``, or ``r1w3`` after the job's first requeue: a worker;
    ``ps0``: a PS); None for the job master, the batch and extern steps and anything else."""
    for pattern, role in _ROLE_NAMES:
        if pattern.fullmatch(name):
            return role
    return None


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One worker or PS step: its start and end in seconds since the epoch (``end`` None: still running)."""

    role: Role
    start: float
    end: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ValueError(f"task role must be a Role, got {self.role!r}")
        if not math.isfinite(self.start) or (self.end is not None and not self.end >= self.start):
            raise ValueError(f"task {self.role}: bad times start={self.start!r} end={self.end!r}")


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One PS-mode job from accounting: times in seconds since the epoch (``start`` None: never started, ``end``
    None: still active), its request, its cores per worker and per PS (``ps_cores`` None: the same), its tasks."""

    job_id: int
    model: str
    submit: float
    start: float | None
    end: float | None
    request_workers: int
    request_ps: int
    cores: int
    tasks: tuple[TaskRecord, ...] = ()
    epochs_total: float | None = None
    ps_cores: int | None = None

    def __post_init__(self) -> None:
        where = f"job {self.job_id}"
        for name in ("request_workers", "request_ps", "cores"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
        if self.ps_cores is not None and (
            isinstance(self.ps_cores, bool) or not isinstance(self.ps_cores, int) or self.ps_cores < 1
        ):
            raise ValueError(f"{where}: ps_cores must be an int >= 1, got {self.ps_cores!r}")
        if self.epochs_total is not None and not (math.isfinite(self.epochs_total) and self.epochs_total > 0):
            raise ValueError(f"{where}: epochs_total must be > 0, got {self.epochs_total!r}")


@dataclass(frozen=True, slots=True)
class Collected:
    """The PS-mode jobs of a partition found in accounting, and what was left out (jobs, by reason)."""

    records: tuple[JobRecord, ...]
    not_ps: int = 0
    bad_marker: int = 0
    other_partition: int = 0
    never_submitted: int = 0
    #: jobs known as PS-mode by their steps, the accounting holding no marker
    by_steps: int = 0


@dataclass(frozen=True, slots=True)
class TeacherSlot:
    """One slot of history: its input, Slurm's decision in DL²'s actions, and the samples (None: not expressible)."""

    slot: int
    inp: SlotInput
    decision: SlotDecision
    steps: tuple[Step, ...] | None


@dataclass(frozen=True, slots=True)
class HistorySamples:
    """The slots of a window with at least one job present, and what could not be used."""

    slots: tuple[TeacherSlot, ...]
    jobs: int
    unknown_types: tuple[tuple[str, int], ...] = ()
    mixed_cores: int = 0

    @property
    def inexpressible(self) -> int:
        """Slots whose decision DL²'s actions cannot express (:func:`teacher_steps` gave None)."""
        return sum(1 for slot in self.slots if slot.steps is None)

    @property
    def samples(self) -> int:
        return sum(len(slot.steps) for slot in self.slots if slot.steps is not None)

    def summary(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "slots": len(self.slots),
            "samples": self.samples,
            "inexpressible_slots": self.inexpressible,
            "mixed_core_slots": self.mixed_cores,
            "unknown_types": dict(self.unknown_types),
        }


# -- Slurm's records -> job records -----------------------------------------------------------------------------


def partition_servers(nodes: Iterable[Node], partition: str) -> Servers:
    """A CPU partition's nodes as DL²'s servers: their cores, no GPUs (``ValueError`` for a partition without
    nodes)."""
    cores = tuple(node.cpus for node in sorted(nodes, key=lambda n: n.name) if partition in node.partitions)
    if not cores:
        raise ValueError(f"partition {partition!r} has no nodes")
    return Servers((0,) * len(cores), cores)


def _seconds(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


_Cores = dict[tuple[int, Role], Counter[int]]


def _tasks_of(steps: Iterable[SlurmStep]) -> tuple[dict[int, list[TaskRecord]], _Cores, set[int]]:
    """Per job id: its worker and PS steps, the cores of each role's steps, and the jobs with a job master step."""
    tasks: dict[int, list[TaskRecord]] = {}
    cores: _Cores = {}
    masters: set[int] = set()
    for step in steps:
        if step.name == MASTER_STEP:
            masters.add(step.job_id)
        role = step_role(step.name)
        start = _seconds(step.start_time)
        if role is None or start is None:
            continue
        end = _seconds(step.end_time)
        tasks.setdefault(step.job_id, []).append(TaskRecord(role, start, None if end is None else max(end, start)))
        if step.cpus:
            cores.setdefault((step.job_id, role), Counter())[step.cpus] += 1
    return tasks, cores, masters


def _is_ps(job: Job, tasks: Mapping[int, list[TaskRecord]], masters: set[int]) -> bool | None:
    """Whether a job is PS-mode (module docstring of :func:`collect`); None for a bad marker."""
    try:
        marker = decode_marker(job.comment)
    except MarkerError:
        return None
    if marker is not None:
        return marker.ps is not None
    return job.job_id in masters and {task.role for task in tasks.get(job.job_id, [])} == set(Role)


def _usual(counts: Counter[int] | None) -> int:
    """The cores most of a role's steps had (the larger on a tie); 0 when none said."""
    if not counts:
        return 0
    return max(counts.items(), key=lambda item: (item[1], item[0]))[0]


def ps_partitions(jobs: Iterable[Job], steps: Iterable[SlurmStep]) -> frozenset[str]:
    """The partitions of the PS-mode jobs among ``jobs`` (as :func:`collect` tells them)."""
    tasks, _, masters = _tasks_of(steps)
    return frozenset(name for job in jobs if _is_ps(job, tasks, masters) for name in job.partition.split(",") if name)


def collect(jobs: Iterable[Job], steps: Iterable[SlurmStep], partition: str) -> Collected:
    """The PS-mode jobs of ``partition`` with their worker and PS steps. A job is PS-mode by its comment, a marker
    with PS ranges (its request: the ranges' upper ends; its cores per process), or, when the accounting holds no
    comment (Slurm stores it only with ``AccountingStoreFlags=job_comment``), by its steps: a job master, workers
    and PS (its request: the most of each it ran at once; its cores per worker and per PS: what most of those steps
    had, DLRover's Brain may resize a process: the slot model has one size per role). The model's name is the job's
    name (``--job-name``): a PS-mode marker records sizes, not a model. A requeued job (one accounting record per
    run, the earlier ones ``REQUEUED``) is one job: its first submission, its last run's end."""
    tasks, step_cores, masters = _tasks_of(steps)
    by_id: dict[int, list[Job]] = {}
    shapes: dict[int, PsShape] = {}
    not_ps = bad = other = unsubmitted = by_steps = 0
    for job in jobs:
        kind = _is_ps(job, tasks, masters)
        if kind is None:
            bad += 1
            continue
        if not kind:
            not_ps += 1
            continue
        marker = decode_marker(job.comment)
        if marker is not None and marker.ps is not None:
            shapes[job.job_id] = marker.ps
        if partition not in job.partition.split(","):
            other += 1
            continue
        by_id.setdefault(job.job_id, []).append(job)
    records = []
    for job_id, runs in sorted(by_id.items()):
        submits = [t for t in (_seconds(run.submit_time) for run in runs) if t is not None]
        if not submits:
            unsubmitted += 1
            continue
        mine = sorted(tasks.get(job_id, []), key=lambda t: (t.start, t.role))
        shape = shapes.get(job_id)
        if shape is not None:
            request, cores = (shape.workers[1], shape.ps[1]), (shape.cpus_per_worker, shape.cpus_per_worker)
        else:
            first = min(t.start for t in mine)
            request = (concurrent(mine, Role.WORKER, first, math.inf), concurrent(mine, Role.PS, first, math.inf))
            cores = (_usual(step_cores.get((job_id, Role.WORKER))), _usual(step_cores.get((job_id, Role.PS))))
            if not all(cores):
                not_ps += 1  # no cores in the record: not the fields this module reads
                continue
            by_steps += 1
        starts = [t for t in (_seconds(run.start_time) for run in runs) if t is not None]
        last = max(runs, key=lambda run: run.submit_time or datetime.min.replace(tzinfo=UTC))
        records.append(
            JobRecord(
                job_id=job_id,
                model=runs[0].name,
                submit=min(submits),
                start=min(starts) if starts else None,
                end=None if last.state.is_active else _seconds(last.end_time),
                request_workers=request[0],
                request_ps=request[1],
                cores=cores[0],
                ps_cores=cores[1] if cores[1] != cores[0] else None,
                tasks=tuple(mine),
            )
        )
    return Collected(tuple(records), not_ps, bad, other, unsubmitted, by_steps)


# -- job records -> slots ---------------------------------------------------------------------------------------


def concurrent(tasks: Sequence[TaskRecord], role: Role, start: float, end: float) -> int:
    """The most tasks of ``role`` running at the same time within ``[start, end)``."""
    mine = [t for t in tasks if t.role is role and t.start < end and (t.end is None or t.end > start)]
    moments = {start, *(t.start for t in mine if t.start > start)}
    return max((sum(1 for t in mine if t.start <= m and (t.end is None or t.end > m)) for m in moments), default=0)


@dataclass(frozen=True, slots=True)
class _Job:
    """A record with its type and the slot grid's numbers."""

    record: JobRecord
    job_type: int
    arrival: int
    #: per slot index from its first task's slot on (may be < 0: before the window): (workers, ps)
    held: Mapping[int, tuple[int, int]]
    max_workers: int
    max_ps: int

    def at(self, slot: int) -> tuple[int, int]:
        return self.held.get(slot, (0, 0))


def _prepare(record: JobRecord, job_type: int, origin: float, seconds: float, last: int) -> _Job:
    tasks = record.tasks
    held: dict[int, tuple[int, int]] = {}
    if tasks:
        first = math.floor((min(t.start for t in tasks) - origin) / seconds)
        for slot in range(first, last + 1):
            lo = origin + slot * seconds
            counts = (concurrent(tasks, Role.WORKER, lo, lo + seconds), concurrent(tasks, Role.PS, lo, lo + seconds))
            if counts != (0, 0):
                held[slot] = counts
    most_w = max((w for w, _ in held.values()), default=0)
    most_p = max((p for _, p in held.values()), default=0)
    return _Job(
        record=record,
        job_type=job_type,
        arrival=max(0, math.floor((record.submit - origin) / seconds)),
        held=held,
        max_workers=max(record.request_workers, most_w),
        max_ps=max(record.request_ps, most_p),
    )


def _epochs_done(record: JobRecord, total: float, moment: float, until: float) -> float:
    """The estimate of the module docstring: ``total`` times the fraction of the job's run elapsed at ``moment``."""
    if record.start is None or moment <= record.start:
        return 0.0
    end = record.end if record.end is not None else until
    if end <= record.start:
        return 0.0
    return total * min((moment - record.start) / (end - record.start), 1.0)


def decision_of(inp: SlotInput, counts: Sequence[tuple[int, int]]) -> SlotDecision | None:
    """Slurm's allocation ``counts`` (workers, PS per job row) as DL²'s actions (module docstring); None when a
    task does not fit the servers by DL²'s placement."""
    packing = Packing(inp)
    kept = [(min(job.workers, w), min(job.ps, p)) for job, (w, p) in zip(inp.jobs, counts, strict=True)]
    phases = (kept, [(w - kw, p - kp) for (w, p), (kw, kp) in zip(counts, kept, strict=True)])
    for phase in phases:
        for row, (w, p) in enumerate(phase):
            pairs = min(w, p)
            actions = (SlotAction.BOTH,) * pairs + (SlotAction.WORKER,) * (w - pairs) + (SlotAction.PS,) * (p - pairs)
            for action in actions:
                if not packing.add(row, action):
                    return None
    if packing.possible():
        packing.add(-1, SlotAction.VOID)
    return packing.decision()


def _slot_types(catalogue: Sequence[JobType], present: Sequence[_Job]) -> tuple[JobType, ...] | None:
    """One type per catalogue name, with the present jobs' demands (cores per worker and per PS, no GPU); None
    when two jobs of one type differ in cores."""
    cores: dict[int, tuple[int, int]] = {}
    for job in present:
        mine = (job.record.cores, job.record.ps_cores or job.record.cores)
        if cores.setdefault(job.job_type, mine) != mine:
            return None
    return tuple(
        dataclasses.replace(kind, worker_gpus=0, worker_cpus=cores[k][0], ps_cpus=cores[k][1]) if k in cores else kind
        for k, kind in enumerate(catalogue)
    )


def history_slots(
    spec: StateSpec,
    catalogue: Sequence[JobType],
    servers: Servers,
    records: Iterable[JobRecord],
    *,
    start: datetime,
    end: datetime,
    assumed_epochs: float = ASSUMED_EPOCHS,
) -> HistorySamples:
    """Every whole slot of ``[start, end)`` with a job present, as input, Slurm's decision and DL²'s samples
    (module docstring). ``catalogue`` is the spec's job types, by name in the spec's order."""
    names = tuple(kind.name for kind in catalogue)
    if names != spec.type_names:
        raise ValueError(f"catalogue types {names!r} are not the spec's {spec.type_names!r}")
    if not (math.isfinite(assumed_epochs) and assumed_epochs > 0):
        raise ValueError(f"assumed_epochs must be > 0, got {assumed_epochs!r}")
    seconds = spec.slot_seconds
    origin, until = start.timestamp(), end.timestamp()
    count = math.floor((until - origin) / seconds)
    if count < 1:
        raise ValueError(
            f"history window {start.isoformat()} to {end.isoformat()} is shorter than one slot of {seconds:g} s"
        )
    unknown: Counter[str] = Counter()
    jobs: list[_Job] = []
    for record in records:
        if record.model not in names:
            unknown[record.model] += 1
            continue
        jobs.append(_prepare(record, names.index(record.model), origin, seconds, count - 1))
    jobs.sort(key=lambda job: (job.arrival, job.record.job_id))
    slots: list[TeacherSlot] = []
    mixed = 0
    for slot in range(count):
        lo, hi = origin + slot * seconds, origin + (slot + 1) * seconds
        present = [job for job in jobs if job.record.submit < hi and (job.record.end is None or job.record.end > lo)]
        if not present:
            continue
        types = _slot_types(catalogue, present)
        if types is None:
            mixed += 1
            continue
        rows = []
        for job in present:
            total = job.record.epochs_total or assumed_epochs
            workers, ps = job.at(slot - 1)
            rows.append(
                SlotJob(
                    job_id=job.record.job_id,
                    job_type=job.job_type,
                    arrival=job.arrival,
                    epochs_total=total,
                    epochs_done=_epochs_done(job.record, total, lo, until),
                    slots_run=sum(1 for s in job.held if s < slot),
                    workers=workers,
                    ps=ps,
                    request_workers=job.record.request_workers,
                    request_ps=job.record.request_ps,
                    max_workers=job.max_workers,
                    max_ps=job.max_ps,
                )
            )
        inp = SlotInput(slot, seconds, types, servers, tuple(rows))
        decision = decision_of(inp, [job.at(slot) for job in present])
        if decision is None:
            slots.append(TeacherSlot(slot, inp, SlotDecision(()), None))
            continue
        slots.append(TeacherSlot(slot, inp, decision, teacher_steps(spec, inp, decision)))
    return HistorySamples(tuple(slots), len(jobs), tuple(sorted(unknown.items())), mixed)
