"""Inputs and outputs of one scheduling pass.

Pure data: nothing here runs a command, reads a clock, an environment variable or a file.

Two ways to describe the jobs of a pass:

- :class:`JobView` / :class:`NodeView`: one frozen object per job / node, convenient for a daemon that reads
  the live cluster (``squeue``/``sinfo``) and for tests;
- :class:`JobTable` / :class:`ClusterState`: the same information column by column (numpy arrays), which is
  what the policies compute on. ``JobTable.from_views`` and ``ClusterState.from_nodes`` convert; the simulator
  fills the columns directly so that a pass over thousands of jobs costs a few vectorised operations.

Units: times in seconds, attained service in GPU-seconds (Tiresias §3.2: a_J = W_J x t_J).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
ObjArray = npt.NDArray[np.object_]
T = TypeVar("T")

#: A job's GPUs on the nodes of a pass: ``((node_row, gpus), ...)``.
RowAllocation = tuple[tuple[int, int], ...]
#: The same with node names: ``(("node17", 4), ...)``.
NamedAllocation = tuple[tuple[str, int], ...]

MAX_POOLS = 62


class JobStatus(StrEnum):
    """State of a job as the policy sees it."""

    PENDING = "pending"
    RUNNING = "running"


class QueueChangeKind(StrEnum):
    """Why a job changes queue (Tiresias §3.2.3, Figure 9)."""

    DEMOTE = "demote"
    PROMOTE = "promote"


class PlacementMode(StrEnum):
    """How a job's GPUs are chosen among the free GPUs (Tiresias §3.3)."""

    #: Tiresias: consolidate when the job's skew exceeds PACKLIMIT, else minimise fragmentation.
    SKEW_AWARE = "skew-aware"
    #: fewest nodes possible now (best effort): used for skewed jobs.
    CONSOLIDATE = "consolidate"
    #: YARN-CS: the minimum number of nodes an empty cluster would need, or the job waits (§1, §2.2).
    STRICT = "strict"
    #: fill the most-used nodes first so that whole nodes stay free (minimise fragmentation).
    SPREAD = "spread"


@dataclass(frozen=True, slots=True)
class ScalingCurve:
    """Throughput of a data-parallel job on n GPUs relative to one GPU, measured at a few GPU counts.

    Between measured counts the speedup is interpolated linearly in log2(n); beyond the last one
    Amdahl's law n / (1 + σ (n - 1)) continues it, σ fitted to the last measurement (one measured count: linear).
    A speedup never exceeds n (measurements above linear are noise) and never decreases with more GPUs (a job
    given more GPUs than help it would leave the rest idle).
    """

    gpus: tuple[int, ...] = (1,)
    speedup: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if not self.gpus or self.gpus[0] != 1 or len(self.gpus) != len(self.speedup):
            raise ValueError(f"a scaling curve starts at 1 GPU and has one speedup per count, got {self!r}")
        if any(b <= a for a, b in zip(self.gpus, self.gpus[1:], strict=False)):
            raise ValueError(f"scaling curve GPU counts must increase, got {self.gpus!r}")
        if not all(math.isfinite(v) and v > 0 for v in self.speedup):
            raise ValueError(f"scaling curve speedups must be finite and > 0, got {self.speedup!r}")

    def at(self, n: int) -> float:
        """Speedup on ``n`` >= 1 GPUs."""
        if n < 1:
            raise ValueError(f"a job runs on at least one GPU, got {n!r}")
        return _speedups(self, n)[n - 1]

    def interpolated(self, n: int) -> float:
        """The speedup on ``n`` GPUs read off the measurements, before the caps of :meth:`at`."""
        gpus, speedup = self.gpus, self.speedup
        if n >= gpus[-1]:
            last, value = gpus[-1], min(speedup[-1], float(gpus[-1]))
            sigma = (last / value - 1.0) / (last - 1) if last > 1 else 0.0
            return n / (1.0 + sigma * (n - 1))
        i = next(k for k in range(1, len(gpus)) if gpus[k] > n)
        lo, hi = math.log2(gpus[i - 1]), math.log2(gpus[i])
        w = (math.log2(n) - lo) / (hi - lo)
        return speedup[i - 1] + w * (speedup[i] - speedup[i - 1])


@functools.lru_cache(maxsize=4096)
def _speedups(curve: ScalingCurve, n: int) -> tuple[float, ...]:
    """Speedups on 1..n GPUs: never above linear, never decreasing."""
    out: list[float] = []
    best = 0.0
    for count in range(1, n + 1):
        best = max(best, min(curve.interpolated(count), float(count)))
        out.append(best)
    return tuple(out)


#: Throughput proportional to the GPU count.
LINEAR = ScalingCurve()


class RowSlice(Sequence[T]):
    """The items of a larger array at the given rows, looked up when read (a pass reads few of them)."""

    __slots__ = ("_items", "_rows")

    def __init__(self, items: ObjArray, rows: IntArray) -> None:
        self._items = items
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...
    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        if isinstance(index, slice):
            return [self._items[row] for row in self._rows[index].tolist()]
        return self._items[self._rows[index]]  # type: ignore[no-any-return]


def _first_duplicate(names: Iterable[T]) -> T | None:
    seen: set[T] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _finite_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node: its GPUs (all of one type) and how many are free now."""

    name: str
    total_gpus: int
    free_gpus: int
    gpu_type: str = ""
    switch: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("node name must not be empty")
        if isinstance(self.total_gpus, bool) or not isinstance(self.total_gpus, int) or self.total_gpus < 0:
            raise ValueError(f"node {self.name}: total_gpus must be an int >= 0, got {self.total_gpus!r}")
        if (
            isinstance(self.free_gpus, bool)
            or not isinstance(self.free_gpus, int)
            or not 0 <= self.free_gpus <= self.total_gpus
        ):
            raise ValueError(
                f"node {self.name}: free_gpus must be an int in [0, {self.total_gpus}], got {self.free_gpus!r}"
            )


@dataclass(frozen=True, slots=True)
class JobView:
    """One job as a scheduling pass sees it.

    ``attained_service`` (a_J, GPU-seconds), ``executed_time`` (t_J) and ``waiting_time`` (δ_J: the seconds it
    has waited, over all its waiting spells, since it first ran after arriving or being promoted; 0 before; a
    running job keeps what it waited) are
    the values *now*, counted since the job arrived or was last promoted (§3.2.3: promotion resets t_J and δ_J,
    hence a_J). ``current_wait`` is how long a waiting job has waited since it last began to (arrival, end of its
    last run, promotion), the key of time slicing. ``run_time`` is how long a running job has
    run since it last (re)started: a job is not preempted again before it has run ``min_run_time``.
    ``remaining_time`` (oracle, for SRTF/SRSF) and ``time_limit`` (for backfill) are optional.
    ``gpu_types`` restricts the GPU types the job may use (None: any). ``allocation`` lists a running job's GPUs.
    ``min_gpus``/``max_gpus`` describe an elastic job: it may run on any GPU count in [min, max] (the elastic
    policies guarantee it ``min_gpus`` and grow it with spare GPUs; the others place it at ``gpus``), at the
    speedups of ``scaling`` (None: linear).
    ``queue_position`` is the job's place in its queue for :attr:`QueueOrder.LIST <hpc_elastic.policy.policies.
    QueueOrder.LIST>` (the caller keeps it from :attr:`Decision.positions`; None: it entered since the last pass).
    """

    job_id: int
    gpus: int
    submit_time: float
    status: JobStatus = JobStatus.PENDING
    attained_service: float = 0.0
    executed_time: float = 0.0
    waiting_time: float = 0.0
    current_wait: float = 0.0
    run_time: float = 0.0
    first_start_time: float | None = None
    queue: int = 0
    skew: float | None = None
    gpu_types: frozenset[str] | None = None
    allocation: NamedAllocation = ()
    remaining_time: float | None = None
    time_limit: float | None = None
    min_gpus: int | None = None
    max_gpus: int | None = None
    queue_position: float | None = None
    scaling: ScalingCurve | None = None

    def __post_init__(self) -> None:
        if isinstance(self.job_id, bool) or not isinstance(self.job_id, int) or self.job_id < 0:
            raise ValueError(f"job_id must be an int >= 0, got {self.job_id!r}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"job {self.job_id}: gpus must be an int >= 1, got {self.gpus!r}")
        if not isinstance(self.status, JobStatus):
            raise ValueError(f"job {self.job_id}: status must be a JobStatus, got {self.status!r}")
        if not (isinstance(self.submit_time, (int, float)) and math.isfinite(self.submit_time)):
            raise ValueError(f"job {self.job_id}: submit_time must be finite, got {self.submit_time!r}")
        for name in ("attained_service", "executed_time", "waiting_time", "current_wait", "run_time"):
            _finite_nonneg(f"job {self.job_id}: {name}", getattr(self, name))
        for name in ("remaining_time", "time_limit", "first_start_time", "queue_position"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"job {self.job_id}: {name} must be finite or None, got {value!r}")
        if isinstance(self.queue, bool) or not isinstance(self.queue, int) or self.queue < 0:
            raise ValueError(f"job {self.job_id}: queue must be an int >= 0, got {self.queue!r}")
        if self.skew is not None and not (isinstance(self.skew, (int, float)) and math.isfinite(self.skew)):
            raise ValueError(f"job {self.job_id}: skew must be finite or None, got {self.skew!r}")
        if self.status is JobStatus.RUNNING:
            if not self.allocation:
                raise ValueError(f"job {self.job_id}: a running job needs an allocation")
            held = sum(count for _, count in self.allocation)
            if held != self.gpus:
                raise ValueError(f"job {self.job_id}: allocation holds {held} GPUs, job has {self.gpus}")
        elif self.allocation:
            raise ValueError(f"job {self.job_id}: a pending job has no allocation, got {self.allocation!r}")
        for name in ("min_gpus", "max_gpus"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"job {self.job_id}: {name} must be an int >= 1 or None, got {value!r}")
        if (self.min_gpus is None) != (self.max_gpus is None) or (
            self.min_gpus is not None and self.max_gpus is not None and self.min_gpus > self.max_gpus
        ):
            raise ValueError(
                f"job {self.job_id}: an elastic job needs min_gpus <= max_gpus, got {self.min_gpus!r}, "
                f"{self.max_gpus!r}"
            )


@dataclass(frozen=True, eq=False)
class ClusterState:
    """The nodes of a pass, column by column. Nodes are grouped in *pools* by GPU type.

    ``capacity`` (GPUs per pool) is derived, and so is what :meth:`fewest_nodes` reads.
    """

    names: tuple[str, ...]
    pool: IntArray
    total: IntArray
    free: IntArray
    switch: IntArray
    pool_names: tuple[str, ...]
    index: Mapping[str, int] = field(repr=False)
    capacity: IntArray = field(init=False, repr=False)
    #: per pool, then for the whole cluster, the running sums of the nodes' GPUs, largest node first
    _largest_first: tuple[IntArray, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("pool", "total", "free", "switch"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ClusterState.{name} has {len(getattr(self, name))} entries, expected {n}")
        if len(self.pool_names) > MAX_POOLS:
            raise ValueError(f"at most {MAX_POOLS} GPU types are supported, got {len(self.pool_names)}")
        self._check_free(self.free)
        n_pools = len(self.pool_names)
        capacity = np.bincount(self.pool, weights=self.total, minlength=n_pools).astype(np.int64)
        object.__setattr__(self, "capacity", capacity)
        sums = tuple(np.cumsum(np.sort(self.total[self.pool == p])[::-1]) for p in range(n_pools))
        sums += (np.cumsum(np.sort(self.total)[::-1]),)
        object.__setattr__(self, "_largest_first", sums)

    def _check_free(self, free: IntArray) -> None:
        if len(free) != len(self.names):
            raise ValueError(f"ClusterState.free has {len(free)} entries, expected {len(self.names)}")
        if len(free) and not (int(free.min()) >= 0 and bool((free <= self.total).all())):
            bad = int(np.flatnonzero((free < 0) | (free > self.total))[0])
            raise ValueError(f"node {self.names[bad]}: free GPUs {int(free[bad])} outside [0, total]")

    def with_free(self, free: IntArray, *, check: bool = True) -> ClusterState:
        """The same nodes with other free GPU counts (what a caller passing many passes builds for each);
        ``check=False`` for a caller that keeps them consistent itself (the simulator)."""
        if check:
            self._check_free(free)
        out = object.__new__(ClusterState)
        out.__dict__.update(self.__dict__)
        out.__dict__["free"] = free
        return out

    @property
    def n_pools(self) -> int:
        return len(self.pool_names)

    def fewest_nodes(self, gpus: int, pool: int | None = None) -> int:
        """The fewest nodes of ``pool`` (None: of any pool) that hold ``gpus`` GPUs when they are empty: the
        largest nodes first (with nodes of one size, ceil(gpus / size)). YARN-CS's consolidation (§2.2), and what
        placing a job on more nodes than this spreads it."""
        sums = self._largest_first[pool] if pool is not None else self._largest_first[-1]
        if gpus < 1 or not sums.size or gpus > int(sums[-1]):
            where = f"pool {self.pool_names[pool]!r}" if pool is not None else "the cluster"
            raise ValueError(f"{gpus!r} GPUs do not fit {where} ({int(sums[-1]) if sums.size else 0} GPUs)")
        return int(np.searchsorted(sums, gpus)) + 1

    def spread(self, node_rows: Sequence[tuple[int, int]]) -> bool:
        """Whether an allocation ((node index, GPUs), ...) is on more nodes than the fewest that hold its GPUs (of
        its pool when it is on one type, of the whole cluster otherwise): Tiresias' spread placement, the one
        PACKLIMIT's refit compares with a consolidated one (§3.3.2)."""
        if len(node_rows) <= 1:
            return False
        pools = {int(self.pool[node]) for node, _ in node_rows}
        gpus = sum(count for _, count in node_rows)
        return len(node_rows) > self.fewest_nodes(gpus, pools.pop() if len(pools) == 1 else None)

    def pool_mask(self, gpu_types: Iterable[str] | None) -> int:
        """Bit mask of the pools a job may use (all pools for None; 0 if none of its types exists here)."""
        if gpu_types is None:
            return (1 << self.n_pools) - 1
        mask = 0
        for t in gpu_types:
            if t in self.pool_names:
                mask |= 1 << self.pool_names.index(t)
        return mask

    @classmethod
    def from_nodes(cls, nodes: Sequence[NodeView]) -> ClusterState:
        names = tuple(node.name for node in nodes)
        index = {name: i for i, name in enumerate(names)}
        if len(index) != len(names):
            raise ValueError(f"node {_first_duplicate(names)!r} appears twice")
        pool_names = tuple(sorted({node.gpu_type for node in nodes}))
        switches = sorted({node.switch for node in nodes})
        return cls(
            names=names,
            pool=np.array([pool_names.index(node.gpu_type) for node in nodes], dtype=np.int64),
            total=np.array([node.total_gpus for node in nodes], dtype=np.int64),
            free=np.array([node.free_gpus for node in nodes], dtype=np.int64),
            switch=np.array([switches.index(node.switch) for node in nodes], dtype=np.int64),
            pool_names=pool_names,
            index=index,
        )


@dataclass(frozen=True, eq=False)
class JobTable:
    """The jobs of a pass, column by column (row i of every column is job i). Treat as read-only.

    Missing optional values are NaN (``first_start``, ``skew``, ``remaining``, ``time_limit``, ``position``).
    ``pool`` is the pool a running job holds its GPUs in (its first node's when it holds several types; -1 for
    pending jobs). ``pool_mask`` has bit p set when the
    job may use pool p. ``alloc`` holds a :data:`RowAllocation` per running job (empty tuple for pending jobs).
    ``alloc`` and ``scaling`` are sequences (tuples, or a :class:`RowSlice` of a caller's arrays).
    ``min_gpus``/``max_gpus`` bound an elastic job's GPU count (both ``gpus`` for a rigid job); ``scaling`` holds
    its :class:`ScalingCurve` (None: linear).
    """

    job_ids: IntArray
    gpus: IntArray
    submit: FloatArray
    running: BoolArray
    attained: FloatArray
    executed: FloatArray
    waiting: FloatArray
    current_wait: FloatArray
    run_time: FloatArray
    first_start: FloatArray
    queue: IntArray
    skew: FloatArray
    pool_mask: IntArray
    pool: IntArray
    alloc: Sequence[RowAllocation]
    remaining: FloatArray
    time_limit: FloatArray
    position: FloatArray
    min_gpus: IntArray
    max_gpus: IntArray
    scaling: Sequence[ScalingCurve | None]

    def __post_init__(self) -> None:
        n = len(self.job_ids)
        for name in self.__dataclass_fields__:
            if len(getattr(self, name)) != n:
                raise ValueError(f"JobTable.{name} has {len(getattr(self, name))} rows, expected {n}")

    @classmethod
    def unchecked(cls, **columns: Any) -> JobTable:
        """A table from columns the caller guarantees are consistent (the simulator builds one per pass): the
        row counts are not checked again."""
        if columns.keys() != cls.__dataclass_fields__.keys():
            raise ValueError(f"JobTable.unchecked needs every column, got {sorted(columns)}")
        table = object.__new__(cls)
        table.__dict__.update(columns)
        return table

    @classmethod
    def derived(cls, columns: dict[str, Any], later: dict[str, Callable[[], Any]]) -> JobTable:
        """Like :meth:`unchecked`, with the columns of ``later`` computed on first read (a pass of one policy
        reads only some of them; the simulator derives them from its state at the pass's time)."""
        fields = cls.__dataclass_fields__.keys()
        # (every column once: as many names as columns, none unknown)
        if len(columns) + len(later) != len(fields) or not (fields >= columns.keys() and fields >= later.keys()):
            raise ValueError(f"JobTable.derived needs every column once, got {sorted(columns)} and {sorted(later)}")
        table = object.__new__(_DerivedJobTable)
        table.__dict__.update(columns)
        table.__dict__["_later"] = dict(later)
        return table

    def __len__(self) -> int:
        return len(self.job_ids)

    @classmethod
    def from_views(cls, jobs: Sequence[JobView], cluster: ClusterState) -> JobTable:
        """Columns from :class:`JobView` objects; node names in allocations must exist in ``cluster``."""
        nan = math.nan
        ids = np.array([job.job_id for job in jobs], dtype=np.int64)
        if len(set(ids.tolist())) != len(jobs):
            raise ValueError(f"job {_first_duplicate([job.job_id for job in jobs])!r} appears twice")
        allocs: list[RowAllocation] = []
        pools = np.full(len(jobs), -1, dtype=np.int64)
        for i, job in enumerate(jobs):
            rows: list[tuple[int, int]] = []
            for node, count in job.allocation:
                row = cluster.index.get(node)
                if row is None:
                    raise ValueError(f"job {job.job_id}: allocation names unknown node {node!r}")
                rows.append((row, count))
            allocs.append(tuple(rows))
            if rows:  # a job on several types (an EasyScale plan across types): its first node's, as the simulator
                pools[i] = int(cluster.pool[rows[0][0]])
        held = np.zeros(len(cluster.names), dtype=np.int64)
        for held_rows in allocs:
            for node_row, count in held_rows:
                held[node_row] += count
        over = np.flatnonzero(held > cluster.total - cluster.free)
        if over.size:
            bad = int(over[0])
            raise ValueError(
                f"node {cluster.names[bad]}: running jobs hold {int(held[bad])} GPUs but only "
                f"{int(cluster.total[bad] - cluster.free[bad])} are in use"
            )
        return cls(
            job_ids=ids,
            gpus=np.array([job.gpus for job in jobs], dtype=np.int64),
            submit=np.array([job.submit_time for job in jobs], dtype=np.float64),
            running=np.array([job.status is JobStatus.RUNNING for job in jobs], dtype=np.bool_),
            attained=np.array([job.attained_service for job in jobs], dtype=np.float64),
            executed=np.array([job.executed_time for job in jobs], dtype=np.float64),
            waiting=np.array([job.waiting_time for job in jobs], dtype=np.float64),
            current_wait=np.array([job.current_wait for job in jobs], dtype=np.float64),
            run_time=np.array([job.run_time for job in jobs], dtype=np.float64),
            first_start=np.array(
                [nan if job.first_start_time is None else job.first_start_time for job in jobs], dtype=np.float64
            ),
            queue=np.array([job.queue for job in jobs], dtype=np.int64),
            skew=np.array([nan if job.skew is None else job.skew for job in jobs], dtype=np.float64),
            pool_mask=np.array([cluster.pool_mask(job.gpu_types) for job in jobs], dtype=np.int64),
            pool=pools,
            alloc=tuple(allocs),
            remaining=np.array([nan if job.remaining_time is None else job.remaining_time for job in jobs]),
            time_limit=np.array([nan if job.time_limit is None else job.time_limit for job in jobs]),
            position=np.array([nan if job.queue_position is None else job.queue_position for job in jobs]),
            min_gpus=np.array([job.gpus if job.min_gpus is None else job.min_gpus for job in jobs], dtype=np.int64),
            max_gpus=np.array([job.gpus if job.max_gpus is None else job.max_gpus for job in jobs], dtype=np.int64),
            scaling=tuple(job.scaling for job in jobs),
        )


@dataclass(frozen=True, eq=False)
class PassInput:
    """Everything one scheduling pass needs: the time, the jobs, the nodes."""

    now: float
    jobs: JobTable
    cluster: ClusterState

    def __post_init__(self) -> None:
        if not math.isfinite(self.now):
            raise ValueError(f"now must be finite, got {self.now!r}")


@dataclass(frozen=True, slots=True)
class Start:
    """Start (or resume) a pending job on these GPUs."""

    row: int
    job_id: int
    node_rows: RowAllocation
    allocation: NamedAllocation


@dataclass(frozen=True, slots=True)
class Preemption:
    """Stop a running job (checkpoint + requeue) so that higher-priority jobs can use its GPUs."""

    row: int
    job_id: int


@dataclass(frozen=True, slots=True)
class SizeChange:
    """Run a running elastic job on another number of GPUs, placed on these (a checkpoint and a restart)."""

    row: int
    job_id: int
    gpus: int
    node_rows: RowAllocation
    allocation: NamedAllocation


@dataclass(frozen=True, slots=True)
class QueueChange:
    """Move a job to another MLFQ queue; ``reset`` asks the caller to zero t_J, δ_J and a_J (§3.2.3)."""

    row: int
    job_id: int
    old_queue: int
    queue: int
    kind: QueueChangeKind
    reset: bool


@dataclass(frozen=True, eq=False)
class Decision:
    """The outcome of one pass.

    ``priority_order`` lists every row, highest priority first (a daemon can turn it into Slurm priorities).
    ``next_wakeup`` is the earliest time at which this policy could decide differently even if nothing else
    happens (a demotion threshold crossed while jobs wait, a promotion, a minimum run time ending, a time
    slice ending); None when no such time exists. ``infeasible`` lists pending rows that can never fit the
    cluster (more GPUs than any allowed pool has).

    ``idle_below`` lets an event-driven caller skip useless passes: until ``next_wakeup``, as long as no job
    arrives and the running jobs that ended since this pass freed fewer than ``idle_below`` GPUs in total, a new
    pass would start and preempt nothing (the policy's order is fixed between wake-ups and the walk is greedy).
    0 means "always run the next pass".

    ``resizes`` (elastic policies) changes the GPUs of running elastic jobs; their new GPUs are placed after the
    preemptions and before the starts, and never overlap them.

    ``positions`` (policies ordering queues as lists, :attr:`QueueOrder.LIST <hpc_elastic.policy.policies.
    QueueOrder.LIST>`): every row's place in its queue after the pass, to be passed back in ``JobTable.position``;
    None for the other policies.
    """

    starts: tuple[Start, ...]
    preemptions: tuple[Preemption, ...]
    queue_changes: tuple[QueueChange, ...]
    priority_order: IntArray
    next_wakeup: float | None
    infeasible: tuple[int, ...] = ()
    idle_below: int = 0
    positions: FloatArray | None = None
    resizes: tuple[SizeChange, ...] = ()


class _DerivedJobTable(JobTable):
    """A :class:`JobTable` whose later columns (:meth:`JobTable.derived`) are computed once, when first read."""

    def __getattr__(self, name: str) -> Any:  # only called for columns not computed yet
        later = self.__dict__.get("_later")
        if later is None or name not in later:
            raise AttributeError(f"JobTable has no column {name!r}")
        value = later.pop(name)()
        self.__dict__[name] = value
        return value
