"""Typed, frozen views of Slurm jobs, nodes and partitions.

These are what the rest of hpc-elastic sees of Slurm: the parsers in :mod:`hpc_elastic.slurm.parse` build them
from Slurm's JSON (or ``--parsable2`` text) and policy code consumes them without knowing where they came from.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime


class JobState(enum.StrEnum):
    """Base job states of Slurm (``squeue``/``sacct`` ``job_state``), flags such as REQUEUED are separate."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    RESIZING = "RESIZING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    #: pending and held: the reservation it asked for was deleted
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    REVOKED = "REVOKED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    UNKNOWN = "UNKNOWN"

    @property
    def is_active(self) -> bool:
        """The job holds or waits for resources (it is not finished)."""
        return self in _ACTIVE

    @property
    def is_running(self) -> bool:
        """The job holds an allocation now."""
        return self in _HOLDS_ALLOCATION

    @property
    def is_pending(self) -> bool:
        return self in (
            JobState.PENDING,
            JobState.REQUEUE_HOLD,
            JobState.REQUEUE_FED,
            JobState.REQUEUED,
            JobState.RESV_DEL_HOLD,
        )

    @classmethod
    def parse(cls, raw: str) -> JobState:
        """Map Slurm's spelling (``RUNNING``, ``CANCELLED by 0``, ``R`` short codes) to a state."""
        text = raw.strip().upper()
        if not text:
            return cls.UNKNOWN
        word = text.split()[0].rstrip("+")
        if word in _SHORT_CODES:
            return _SHORT_CODES[word]
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN


_ACTIVE = frozenset(
    {
        JobState.PENDING,
        JobState.CONFIGURING,
        JobState.RUNNING,
        JobState.RESIZING,
        JobState.SUSPENDED,
        JobState.COMPLETING,
        JobState.REQUEUED,
        JobState.REQUEUE_HOLD,
        JobState.REQUEUE_FED,
        JobState.RESV_DEL_HOLD,
        JobState.SIGNALING,
        JobState.STAGE_OUT,
        JobState.STOPPED,
    }
)
_HOLDS_ALLOCATION = frozenset(
    {
        JobState.CONFIGURING,
        JobState.RUNNING,
        JobState.RESIZING,
        JobState.SUSPENDED,
        JobState.COMPLETING,
        JobState.SIGNALING,
        JobState.STOPPED,
    }
)
_SHORT_CODES = {
    "PD": JobState.PENDING,
    "CF": JobState.CONFIGURING,
    "R": JobState.RUNNING,
    "RS": JobState.RESIZING,
    "S": JobState.SUSPENDED,
    "CG": JobState.COMPLETING,
    "CD": JobState.COMPLETED,
    "CA": JobState.CANCELLED,
    "F": JobState.FAILED,
    "TO": JobState.TIMEOUT,
    "NF": JobState.NODE_FAIL,
    "PR": JobState.PREEMPTED,
    "BF": JobState.BOOT_FAIL,
    "DL": JobState.DEADLINE,
    "OOM": JobState.OUT_OF_MEMORY,
    "RQ": JobState.REQUEUED,
    "RH": JobState.REQUEUE_HOLD,
    "RF": JobState.REQUEUE_FED,
    "RD": JobState.RESV_DEL_HOLD,
    "SE": JobState.SPECIAL_EXIT,
    "RV": JobState.REVOKED,
    "ST": JobState.STOPPED,
    "SI": JobState.SIGNALING,
    "SO": JobState.STAGE_OUT,
}


class NodeState(enum.StrEnum):
    """Base node states; flags (DRAIN, NOT_RESPONDING, ...) are kept in :attr:`Node.flags`."""

    IDLE = "IDLE"
    MIXED = "MIXED"
    ALLOCATED = "ALLOCATED"
    COMPLETING = "COMPLETING"
    DOWN = "DOWN"
    DRAINED = "DRAINED"
    DRAINING = "DRAINING"
    FUTURE = "FUTURE"
    RESERVED = "RESERVED"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, raw: str) -> NodeState:
        text = raw.strip().upper().rstrip("*~#!%$@^-+")
        aliases = {
            "ALLOC": cls.ALLOCATED,
            "DRAIN": cls.DRAINED,
            "DRNG": cls.DRAINING,
            "COMP": cls.COMPLETING,
            "RESV": cls.RESERVED,
            "UNK": cls.UNKNOWN,
            "FUTR": cls.FUTURE,
            "MIX": cls.MIXED,
        }
        if text in aliases:
            return aliases[text]
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN


class PartitionState(enum.StrEnum):
    UP = "UP"
    DOWN = "DOWN"
    DRAIN = "DRAIN"
    INACTIVE = "INACTIVE"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, raw: str) -> PartitionState:
        try:
            return cls(raw.strip().upper())
        except ValueError:
            return cls.UNKNOWN


@dataclass(frozen=True)
class GpuCounts:
    """GPUs by type, e.g. ``{"a100": 2}``; GPUs of no declared type are counted under ``""``."""

    by_type: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, counts: Mapping[str, int] | Iterable[tuple[str, int]]) -> GpuCounts:
        items = counts.items() if isinstance(counts, Mapping) else counts
        merged: dict[str, int] = {}
        for gpu_type, count in items:
            if count < 0:
                raise ValueError(f"GPU count must be >= 0, got {count} for type {gpu_type!r}")
            if count:
                merged[gpu_type] = merged.get(gpu_type, 0) + count
        return cls(tuple(sorted(merged.items())))

    @property
    def total(self) -> int:
        return sum(count for _, count in self.by_type)

    def get(self, gpu_type: str) -> int:
        return sum(count for name, count in self.by_type if name == gpu_type)

    def as_dict(self) -> dict[str, int]:
        return dict(self.by_type)

    def minus(self, other: GpuCounts) -> GpuCounts:
        left = self.as_dict()
        for gpu_type, count in other.by_type:
            left[gpu_type] = max(0, left.get(gpu_type, 0) - count)
        return GpuCounts.of(left)

    def __str__(self) -> str:
        return ",".join(f"{name or 'gpu'}:{count}" for name, count in self.by_type) or "-"


@dataclass(frozen=True)
class JobRef:
    """How ``scontrol`` addresses one job: ``<job id>``, or ``<array job id>_<task id>`` for a task of a job array.

    An array task has a job id of its own, but one task's own id is the array's id, and Slurm applies a requeue or
    an update of that id to every task of the array (22.05, measured on the dev cluster): an array task is always
    addressed as ``<array>_<task>``."""

    job_id: int  # the array's job id for an array task
    array_task_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.job_id, bool) or not isinstance(self.job_id, int) or self.job_id < 1:
            raise ValueError(f"job id must be a positive integer, got {self.job_id!r}")
        task = self.array_task_id
        if task is not None and (isinstance(task, bool) or not isinstance(task, int) or task < 0):
            raise ValueError(f"array task id must be a non-negative integer, got {task!r}")

    def __str__(self) -> str:
        return str(self.job_id) if self.array_task_id is None else f"{self.job_id}_{self.array_task_id}"


@dataclass(frozen=True)
class Job:
    """One Slurm job as ``squeue``/``sacct`` report it. Times are timezone-aware UTC; ``None`` when unset."""

    job_id: int
    name: str
    user: str
    state: JobState
    user_id: int | None = None
    partition: str = ""
    account: str = ""
    array_job_id: int | None = None
    array_task_id: int | None = None
    het_job_id: int | None = None
    het_job_offset: int | None = None
    submit_time: datetime | None = None
    eligible_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    time_limit_s: int | None = None  # None: no limit
    nodes: tuple[str, ...] = ()
    node_count: int = 0
    gpus: GpuCounts = field(default_factory=GpuCounts)
    cpus: int = 0
    tasks: int | None = None  # squeue's task count (follows NumTasks updates); None where not reported
    memory_mb: int | None = None
    priority: int | None = None
    site_factor: int | None = None
    comment: str = ""
    admin_comment: str = ""  # set by Slurm administrators only (the scheduler daemon's stop notice)
    restart_count: int = 0
    exit_code: int | None = None
    signal: int | None = None
    pending_reason: str = ""
    requeue: bool | None = None
    elapsed_s: int | None = None
    #: when Slurm's own preemption chose the job (its GraceTime runs from here); None when it did not
    preempt_time: datetime | None = None

    @property
    def gpu_count(self) -> int:
        return self.gpus.total

    @property
    def ref(self) -> JobRef:
        """How to address this job in ``scontrol`` (an array task as ``<array>_<task>``)."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return JobRef(self.array_job_id, self.array_task_id)
        return JobRef(self.job_id)


@dataclass(frozen=True)
class Step:
    """One job step as ``sacct`` reports it: ``step_id`` ``"0"``, ``"1"``, ... or ``"batch"``/``"extern"``; its
    memory (``mem_mb``, what it was allocated) and its largest resident set (``max_rss_mb``, from the accounting
    gather plugin; None without one)."""

    job_id: int
    step_id: str
    name: str
    state: JobState
    exit_code: int | None = None
    signal: int | None = None
    mem_mb: int | None = None
    max_rss_mb: float | None = None
    #: when it started and ended (None: not started, or still running), where the query asked for them
    start_time: datetime | None = None
    end_time: datetime | None = None
    #: its cores (``AllocCPUS``), where the query asked for them
    cpus: int | None = None

    @property
    def out_of_memory(self) -> bool:
        """Whether Slurm ended the step for its memory: the state ``OUT_OF_MEMORY`` (the cgroup's OOM killer), or a
        step killed (``SIGKILL``) whose resident set had passed its memory (``JobAcctGatherParams=OverMemoryKill``
        of ``jobacct_gather/linux``, which Slurm 22.05 records as ``CANCELLED`` with signal 9: the poll that killed
        it is the one whose reading exceeded the limit). A step killed otherwise (``scancel --signal=KILL``) stays
        under its memory."""
        if self.state is JobState.OUT_OF_MEMORY:
            return True
        return (
            self.signal == 9
            and self.mem_mb is not None
            and self.max_rss_mb is not None
            and self.max_rss_mb > self.mem_mb
        )

    @property
    def number(self) -> int | None:
        """The step's number, None for the batch and extern steps."""
        return int(self.step_id) if self.step_id.isdigit() else None


@dataclass(frozen=True)
class Node:
    """One compute node (``sinfo --json``)."""

    name: str
    state: NodeState
    flags: tuple[str, ...] = ()
    cpus: int = 0
    cpus_allocated: int = 0
    memory_mb: int = 0
    memory_allocated_mb: int = 0
    gpus: GpuCounts = field(default_factory=GpuCounts)
    gpus_allocated: GpuCounts = field(default_factory=GpuCounts)
    partitions: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    reason: str = ""

    @property
    def gpus_free(self) -> GpuCounts:
        return self.gpus.minus(self.gpus_allocated)

    @property
    def available(self) -> bool:
        """The node can run new work (not down, drained, draining or not responding)."""
        bad_flags = {"DRAIN", "DRAINED", "DRAINING", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "MAINTENANCE"}
        return self.state not in (
            NodeState.DOWN,
            NodeState.DRAINED,
            NodeState.DRAINING,
            NodeState.UNKNOWN,
            NodeState.FUTURE,
        ) and not bad_flags.intersection(self.flags)


@dataclass(frozen=True)
class Partition:
    """One partition (``scontrol show partition --oneliner``)."""

    name: str
    state: PartitionState
    nodes: tuple[str, ...] = ()
    default: bool = False
    max_time_s: int | None = None  # None: no limit
    priority_tier: int = 1
    preempt_mode: str = ""
    total_cpus: int = 0
