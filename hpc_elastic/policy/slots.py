"""Parameter-server jobs scheduled in time slots (DL², §3.1 and §4.1): what a slot policy reads and decides.

A cluster of servers, each with GPUs and CPU cores. A job trains one model type with workers (each
``worker_gpus`` GPUs and ``worker_cpus`` cores) and parameter servers (``ps_cpus`` cores each). At the start of
every time slot a policy decides, for every job not yet done, how many workers and PS it runs during the slot
(DL² §3.2: "produces the numbers of workers and PSs for each job", anew each slot). A job's progress in a slot is
``speed(workers, ps) x slot_seconds`` epochs, with the speed functions of Optimus (EuroSys'18, §3.2) that DL²'s
simulations use (§6.2).

DL²'s actions (§4.1) are incremental: +1 worker, +1 PS, +1 of both to one job, or void. Every slot policy here
reports its decision also as that sequence (:attr:`SlotDecision.actions`), so a policy's decisions are labels
for DL²'s supervised bootstrap (§4.2).

Tasks go to servers by load balancing (§3.2: "Workers and PSs are placed on physical machines following the
placement policy in the cluster, such as load balancing"): :class:`Packing` places one task at a time on the
server with the most free units of the resource the task needs most, and refuses a task no server fits.

Pure: frozen dataclasses in, frozen dataclasses out; no clock, command or file.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


class SlotAction(StrEnum):
    """One inference's output for one job (DL² §4.1)."""

    WORKER = "worker"
    PS = "ps"
    BOTH = "both"
    #: stop allocating in this slot
    VOID = "void"


#: the actions on one job, in the order of the policy network's outputs (``3 x job + index``; void last)
JOB_ACTIONS: tuple[SlotAction, ...] = (SlotAction.WORKER, SlotAction.PS, SlotAction.BOTH)


class SpeedModel(StrEnum):
    """Optimus' two training-speed models (EuroSys'18, §3.2)."""

    #: asynchronous SGD: f(p, w) = w / (θ0 + θ1 w/p + θ2 w + θ3 p), steps (one worker's mini-batch) per second
    ASYNC = "async"
    #: synchronous SGD with a fixed global batch M: f(p, w) = 1 / (θ0 M/w + θ1 + θ2 w/p + θ3 w + θ4 p)
    SYNC = "sync"


def _int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class JobType:
    """A model type (DL² §4.1: jobs training similar architectures are one type) and its resource demands.

    ``theta`` are Optimus' coefficients (four for :attr:`SpeedModel.ASYNC`, five for :attr:`SpeedModel.SYNC`),
    ``batch`` the global batch M of the synchronous model, ``steps_per_epoch`` converts steps to epochs.
    """

    name: str
    worker_gpus: int
    worker_cpus: int
    ps_cpus: int
    model: SpeedModel
    theta: tuple[float, ...]
    steps_per_epoch: float
    batch: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("job type name must not be empty")
        _int(f"{self.name}: worker_gpus", self.worker_gpus, 0)
        _int(f"{self.name}: worker_cpus", self.worker_cpus, 0)
        _int(f"{self.name}: ps_cpus", self.ps_cpus, 1)
        if self.worker_gpus + self.worker_cpus == 0:
            raise ValueError(f"{self.name}: a worker needs a GPU or a core")
        if not isinstance(self.model, SpeedModel):
            raise ValueError(f"{self.name}: model must be a SpeedModel, got {self.model!r}")
        want = 4 if self.model is SpeedModel.ASYNC else 5
        if len(self.theta) != want:
            raise ValueError(f"{self.name}: the {self.model} model has {want} coefficients, got {self.theta!r}")
        for k, value in enumerate(self.theta):
            _number(f"{self.name}: theta[{k}]", value)
        _number(f"{self.name}: steps_per_epoch", self.steps_per_epoch, positive=True)
        _int(f"{self.name}: batch", self.batch, 1)

    def steps_per_second(self, workers: int, ps: int) -> float:
        """Optimus' f(p, w); 0 without a worker or a PS (a PS job needs both)."""
        if workers <= 0 or ps <= 0:
            return 0.0
        w, p, t = float(workers), float(ps), self.theta
        if self.model is SpeedModel.ASYNC:
            return w / (t[0] + t[1] * w / p + t[2] * w + t[3] * p)
        return 1.0 / (t[0] * self.batch / w + t[1] + t[2] * w / p + t[3] * w + t[4] * p)

    def epochs_per_second(self, workers: int, ps: int) -> float:
        return self.steps_per_second(workers, ps) / self.steps_per_epoch


@dataclass(frozen=True, slots=True)
class SlotJob:
    """One unfinished job at the start of a slot.

    ``workers``/``ps`` are what it ran with in the previous slot (0/0: it did not run). ``request_workers`` /
    ``request_ps`` are the user's specification, which the static schedulers (DRF as in YARN, Tiresias' gang
    jobs) allocate in full or not at all; ``max_workers`` / ``max_ps`` bound what any policy may give it.
    ``slots_run`` counts the slots in which it held tasks (DL² §4.1's state), ``service`` the GPU-seconds it has
    received so far (Tiresias' attained service, §3.2).
    """

    job_id: int
    job_type: int
    arrival: int
    epochs_total: float
    epochs_done: float = 0.0
    slots_run: int = 0
    workers: int = 0
    ps: int = 0
    request_workers: int = 1
    request_ps: int = 1
    max_workers: int = 16
    max_ps: int = 16
    service: float = 0.0

    def __post_init__(self) -> None:
        _int("job_id", self.job_id, 0)
        where = f"job {self.job_id}"
        _int(f"{where}: job_type", self.job_type, 0)
        _int(f"{where}: arrival", self.arrival, 0)
        _number(f"{where}: epochs_total", self.epochs_total, positive=True)
        _number(f"{where}: epochs_done", self.epochs_done)
        if self.epochs_done >= self.epochs_total:
            raise ValueError(f"{where}: epochs_done {self.epochs_done!r} leaves nothing of {self.epochs_total!r}")
        _int(f"{where}: slots_run", self.slots_run, 0)
        _int(f"{where}: max_workers", self.max_workers, 1)
        _int(f"{where}: max_ps", self.max_ps, 1)
        _int(f"{where}: request_workers", self.request_workers, 1)
        _int(f"{where}: request_ps", self.request_ps, 1)
        if self.request_workers > self.max_workers or self.request_ps > self.max_ps:
            raise ValueError(
                f"{where}: request {self.request_workers}w/{self.request_ps}ps exceeds its maximum "
                f"{self.max_workers}w/{self.max_ps}ps"
            )
        if not 0 <= _int(f"{where}: workers", self.workers, 0) <= self.max_workers:
            raise ValueError(f"{where}: workers {self.workers!r} exceeds max_workers {self.max_workers!r}")
        if not 0 <= _int(f"{where}: ps", self.ps, 0) <= self.max_ps:
            raise ValueError(f"{where}: ps {self.ps!r} exceeds max_ps {self.max_ps!r}")
        _number(f"{where}: service", self.service)

    @property
    def epochs_left(self) -> float:
        return self.epochs_total - self.epochs_done


@dataclass(frozen=True, slots=True)
class Servers:
    """The servers' GPUs and cores, one entry per server."""

    gpus: tuple[int, ...]
    cpus: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.gpus or len(self.gpus) != len(self.cpus):
            raise ValueError(f"servers need one GPU and one core count each, got {self.gpus!r} and {self.cpus!r}")
        for k, (g, c) in enumerate(zip(self.gpus, self.cpus, strict=True)):
            _int(f"server {k}: gpus", g, 0)
            _int(f"server {k}: cpus", c, 1)

    @classmethod
    def uniform(cls, count: int, gpus: int, cpus: int) -> Servers:
        _int("server count", count, 1)
        return cls((gpus,) * count, (cpus,) * count)

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus)

    @property
    def total_cpus(self) -> int:
        return sum(self.cpus)


@dataclass(frozen=True, slots=True)
class SlotInput:
    """One slot's decision problem. ``jobs`` are in arrival order (DL² §4.1 orders the state so)."""

    slot: int
    slot_seconds: float
    types: tuple[JobType, ...]
    servers: Servers
    jobs: tuple[SlotJob, ...]

    def __post_init__(self) -> None:
        _int("slot", self.slot, 0)
        _number("slot_seconds", self.slot_seconds, positive=True)
        if not self.types:
            raise ValueError("a slot needs at least one job type")
        seen: set[int] = set()
        for job in self.jobs:
            if job.job_id in seen:
                raise ValueError(f"job {job.job_id} appears twice in a slot")
            seen.add(job.job_id)
            if job.job_type >= len(self.types):
                raise ValueError(f"job {job.job_id}: job_type {job.job_type} is not one of {len(self.types)} types")
        order = [(job.arrival, job.job_id) for job in self.jobs]
        if order != sorted(order):
            first = next(b for a, b in itertools.pairwise(order) if b < a)
            raise ValueError(f"slot jobs must be in arrival order (then job id): job {first[1]} comes too late")

    def job_type(self, job: SlotJob) -> JobType:
        return self.types[job.job_type]

    def dominant_share(self, job: SlotJob, workers: int, ps: int) -> float:
        """The job's dominant share (DRF): the largest of its GPU and core shares of the cluster."""
        kind = self.job_type(job)
        gpu = workers * kind.worker_gpus / self.servers.total_gpus if self.servers.total_gpus else 0.0
        cpu = (workers * kind.worker_cpus + ps * kind.ps_cpus) / self.servers.total_cpus
        return max(gpu, cpu)


@dataclass(frozen=True, slots=True)
class Allocation:
    """A job's workers and PS for the slot, and the servers each task runs on (index into :class:`Servers`)."""

    job_id: int
    workers: int
    ps: int
    worker_servers: tuple[int, ...] = ()
    ps_servers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SlotDecision:
    """A slot's allocations (only jobs that get a task) and the incremental actions that built them.

    ``actions`` is ``((row, action), ...)`` with ``row`` the job's index in :attr:`SlotInput.jobs`; a sequence
    ends with a :attr:`SlotAction.VOID` row of -1 when the policy stopped before the cluster was full.
    """

    allocations: tuple[Allocation, ...]
    actions: tuple[tuple[int, SlotAction], ...] = ()

    def of(self, job_id: int) -> tuple[int, int]:
        """``(workers, ps)`` of a job; (0, 0) when it got nothing."""
        for alloc in self.allocations:
            if alloc.job_id == job_id:
                return alloc.workers, alloc.ps
        return 0, 0


@dataclass(frozen=True, slots=True)
class PackingMark:
    """A :class:`Packing`'s free resources and action count at one point (see :meth:`Packing.mark`)."""

    free_gpu: IntArray
    free_cpu: IntArray
    actions: int


class Packing:
    """Free GPUs and cores per server while a slot's tasks are placed, one task at a time.

    A working object of one decision (never stored): a policy builds one from :class:`SlotInput`, offers tasks
    with :meth:`add`, and turns what fitted into a :class:`SlotDecision` with :meth:`decision`.
    """

    __slots__ = ("_actions", "_free_cpu", "_free_gpu", "_inp", "_placed_ps", "_placed_workers")

    def __init__(self, inp: SlotInput) -> None:
        self._inp = inp
        self._free_gpu: IntArray = np.array(inp.servers.gpus, dtype=np.int64)
        self._free_cpu: IntArray = np.array(inp.servers.cpus, dtype=np.int64)
        self._placed_workers: list[list[int]] = [[] for _ in inp.jobs]
        self._placed_ps: list[list[int]] = [[] for _ in inp.jobs]
        self._actions: list[tuple[int, SlotAction]] = []

    def workers(self, row: int) -> int:
        return len(self._placed_workers[row])

    def ps(self, row: int) -> int:
        return len(self._placed_ps[row])

    @property
    def free_gpus(self) -> int:
        return int(self._free_gpu.sum())

    @property
    def free_cpus(self) -> int:
        return int(self._free_cpu.sum())

    def _server(self, gpus: int, cpus: int) -> int:
        """The server the task goes to (most free units of what it needs most, the first of equals), or -1 when
        none fits. A server that does not fit counts -1, below any that does (their free units are >= 0)."""
        fits = (self._free_gpu >= gpus) & (self._free_cpu >= cpus)
        key = self._free_gpu if gpus > 0 else self._free_cpu
        best = int(np.where(fits, key, -1).argmax())
        return best if fits[best] else -1

    def fits(self, row: int, action: SlotAction) -> bool:
        """Whether ``action`` on job ``row`` is possible now: within its maxima and the free resources."""
        if action is SlotAction.VOID:
            return True
        taken = self._take(row, action)
        if taken is None:
            return False
        self._give(row, *taken)
        return True

    def add(self, row: int, action: SlotAction) -> bool:
        """Carry out ``action`` on job ``row`` and record it; False (and nothing changed) when it does not fit."""
        if action is SlotAction.VOID:
            self._actions.append((-1, action))
            return True
        taken = self._take(row, action)
        if taken is None:
            return False
        worker, ps = taken
        if worker >= 0:
            self._placed_workers[row].append(worker)
        if ps >= 0:
            self._placed_ps[row].append(ps)
        self._actions.append((row, action))
        return True

    def _take(self, row: int, action: SlotAction) -> tuple[int, int] | None:
        """Take the free resources of the tasks ``action`` (not void) adds to job ``row``: the servers of its worker
        and of its PS (-1: none), or None, with nothing taken, when the job is at its maxima or they do not fit (a
        worker and a PS: the PS in what the worker leaves)."""
        job = self._inp.jobs[row]
        kind = self._inp.job_type(job)
        add_w = action in (SlotAction.WORKER, SlotAction.BOTH)
        add_p = action in (SlotAction.PS, SlotAction.BOTH)
        if (add_w and self.workers(row) >= job.max_workers) or (add_p and self.ps(row) >= job.max_ps):
            return None
        worker = ps = -1
        if add_w:
            worker = self._server(kind.worker_gpus, kind.worker_cpus)
            if worker < 0:
                return None
            self._free_gpu[worker] -= kind.worker_gpus
            self._free_cpu[worker] -= kind.worker_cpus
        if add_p:
            ps = self._server(0, kind.ps_cpus)
            if ps < 0:
                self._give(row, worker, -1)
                return None
            self._free_cpu[ps] -= kind.ps_cpus
        return worker, ps

    def _give(self, row: int, worker: int, ps: int) -> None:
        """Give back what :meth:`_take` took for job ``row``'s worker and PS on these servers (-1: none)."""
        kind = self._inp.job_type(self._inp.jobs[row])
        if worker >= 0:
            self._free_gpu[worker] += kind.worker_gpus
            self._free_cpu[worker] += kind.worker_cpus
        if ps >= 0:
            self._free_cpu[ps] += kind.ps_cpus

    def mark(self) -> PackingMark:
        """The state now, for :meth:`rollback` (an all-or-nothing gang of tasks)."""
        return PackingMark(self._free_gpu.copy(), self._free_cpu.copy(), len(self._actions))

    def rollback(self, mark: PackingMark) -> None:
        """Undo every action since ``mark`` (taken on this packing, with no rollback past it since)."""
        while len(self._actions) > mark.actions:
            row, action = self._actions.pop()
            if action in (SlotAction.WORKER, SlotAction.BOTH):
                self._placed_workers[row].pop()
            if action in (SlotAction.PS, SlotAction.BOTH):
                self._placed_ps[row].pop()
        self._free_gpu = mark.free_gpu.copy()
        self._free_cpu = mark.free_cpu.copy()

    def possible(self, rows: Sequence[int] | None = None) -> list[tuple[int, SlotAction]]:
        """Every non-void action that fits now, on ``rows`` (default: every job)."""
        rows = range(len(self._inp.jobs)) if rows is None else rows
        return [(row, action) for row in rows for action in JOB_ACTIONS if self.fits(row, action)]

    def decision(self) -> SlotDecision:
        return slot_decision(self._inp, self._placed_workers, self._placed_ps, self._actions)


def slot_decision(
    inp: SlotInput,
    worker_servers: Sequence[Sequence[int]],
    ps_servers: Sequence[Sequence[int]],
    actions: Sequence[tuple[int, SlotAction]],
) -> SlotDecision:
    """The decision of the tasks placed on these servers (per job row, in placement order) by these actions."""
    allocations = tuple(
        Allocation(job.job_id, len(w), len(p), tuple(w), tuple(p))
        for job, w, p in zip(inp.jobs, worker_servers, ps_servers, strict=True)
        if w or p
    )
    return SlotDecision(allocations, tuple(actions))


class SlotPolicy(ABC):
    """A policy of the slotted PS-job model: one :meth:`allocate` per slot, pure."""

    name: ClassVar[str]

    @abstractmethod
    def allocate(self, inp: SlotInput) -> SlotDecision:
        """The workers and PS of every job for slot ``inp.slot``."""
