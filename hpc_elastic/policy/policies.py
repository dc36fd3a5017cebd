"""Scheduling policies: Tiresias (Discretised 2D-LAS / 2D-Gittins) and the baselines it is compared with.

Every policy is an immutable object whose :meth:`Policy.schedule` turns a :class:`PassInput` into a
:class:`Decision`; the simulator and the Slurm daemon call the same objects. One pass costs O(n log n) for n jobs
(one sort plus vectorised bookkeeping), independent of the cluster size except for the jobs it places.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from numbers import Real
from typing import ClassVar

import numpy as np

from hpc_elastic.policy.core import (
    TIME_EPS,
    WalkResult,
    nonpreemptive_idle,
    nonpreemptive_walk,
    pin_wakeup,
    pinned_rows,
    preemptive_walk,
    starve_wakeup,
    starved_first,
    starved_rows,
)
from hpc_elastic.policy.easyscale import DEFAULT_FALLBACK_HOLD
from hpc_elastic.policy.elastic import elastic_walk, walk_sizes
from hpc_elastic.policy.gittins import GittinsTable, ReferenceIndex, ServiceDistribution, gittins_index_sup
from hpc_elastic.policy.mlfq import DEFAULT_THRESHOLDS, MlfqConfig, mlfq_update, mlfq_wakeup
from hpc_elastic.policy.placement import DEFAULT_PACK_LIMIT, FreeIndex
from hpc_elastic.policy.types import (
    BoolArray,
    Decision,
    FloatArray,
    IntArray,
    PassInput,
    PlacementMode,
    QueueChange,
    QueueChangeKind,
    Start,
)

DEFAULT_TIME_SLICE = 600.0
"""Gandiva-like time slice (seconds): our choice, Gandiva rotates jobs on the order of minutes."""

DEFAULT_MAX_AGE = 7 * 24 * 3600.0
"""Slurm's PriorityMaxAge default (7-00:00:00): the age factor saturates after a week."""

DEFAULT_MIN_HISTORY = 30
"""Job sizes 2D-Gittins needs before it uses them. Measured (bench/sched_gittins.py): an index built from the
first 10 sizes a cluster finished decided as 2D-LAS does, from the first 30 it was already better than 2D-LAS on a
heavy-tailed trace, and more sizes only helped; below this count the policy is 2D-LAS (Pseudocode 1 line 2)."""


class DeltaMode(StrEnum):
    """How 2D-Gittins picks the service quantum Δ."""

    #: Discretised 2D-Gittins (§3.2.3): Δ_i = Q_i^hi, and in the last queue the last finite quantum
    #: Δ_K = Q_{K-1}^hi, as the public Tiresias simulator does (one fixed Δ in every queue). The paper's Δ_K = ∞
    #: orders the last queue FIFO, which makes 2D-Gittins decide exactly as 2D-LAS whenever the higher queues
    #: are not overloaded (measured: the same JCT to the second on a heavy-tailed trace). No threshold: FIFO.
    QUEUE = "queue"
    #: Continuous 2D-Gittins (Pseudocode 1 line 11): sup over all Δ > 0, in every queue.
    SUP = "sup"
    #: The public Tiresias simulator's index (:class:`~hpc_elastic.policy.gittins.ReferenceIndex`): Δ = Q_1^hi
    #: in every queue, the index evaluated just below the next sample size with E over the sizes themselves.
    REFERENCE = "reference"


class QueueOrder(StrEnum):
    """The order of the jobs of one MLFQ queue (2D-LAS; ties of the 2D-Gittins index)."""

    #: Tiresias §3.2.3: FIFO by first start (jobs never started after the started ones, then by submission),
    #: and the jobs holding GPUs ahead of those waiting: inside a queue a waiting job never displaces a running
    #: one (MLFQ: only a job of a higher queue preempts), else a job preempted by a higher queue would in turn
    #: preempt a later-started job of its own queue when it resumes, and so on.
    START = "start"
    #: The public Tiresias simulator's queue lists: a job enters a queue at its tail (arrival, demotion,
    #: promotion); after every pass the jobs of a queue that hold GPUs move ahead of those that wait, each group
    #: keeping its order. The caller keeps the positions: ``Decision.positions`` back in ``JobTable.position``.
    LIST = "list"


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Knobs shared by the policies (each uses those that apply to it). Defaults follow the paper (§5.2)."""

    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    promote_knob: float = math.inf
    pack_limit: float = DEFAULT_PACK_LIMIT
    min_run_time: float = 0.0
    time_slice: float = DEFAULT_TIME_SLICE
    max_age: float = DEFAULT_MAX_AGE
    delta_mode: DeltaMode = DeltaMode.QUEUE
    queue_order: QueueOrder = QueueOrder.START
    history: ServiceDistribution | None = field(default=None, compare=False)
    #: 2D-Gittins uses a job-size history only from this many sizes on; with fewer it is 2D-LAS.
    min_history: int = DEFAULT_MIN_HISTORY
    #: EasyScale Role 3 (§3.4): seconds a job that fell back proposes no scale-out beyond its GPUs before, doubled
    #: for each fallback in a row (:meth:`~hpc_elastic.policy.hetero.ScaleOut.capped`).
    fallback_hold: float = DEFAULT_FALLBACK_HOLD
    #: STARVELIMIT of the MLFQ policies: seconds a job may wait (since it last began to) before it goes ahead of
    #: all others, lifting the pins it needs (:func:`~hpc_elastic.policy.core.starved_first`); ∞: never.
    starve_limit: float = math.inf

    def __post_init__(self) -> None:
        MlfqConfig(self.thresholds, self.promote_knob)  # validates both
        limit: object = self.starve_limit  # (a numpy number is fine, a bool is not)
        if isinstance(limit, bool) or not isinstance(limit, Real) or not float(limit) >= 1:  # (NaN too)
            raise ValueError(f"starve_limit must be >= 1 second (inf: never), got {self.starve_limit!r}")
        if isinstance(self.min_history, bool) or not isinstance(self.min_history, int) or self.min_history < 0:
            raise ValueError(f"min_history must be an int >= 0, got {self.min_history!r}")
        if not (math.isfinite(self.pack_limit)):
            raise ValueError(f"PACKLIMIT must be finite, got {self.pack_limit!r}")
        for name in ("min_run_time", "time_slice", "max_age", "fallback_hold"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.time_slice <= 0:
            raise ValueError(f"time_slice must be > 0 seconds, got {self.time_slice!r}")
        if self.max_age <= 0:
            raise ValueError(f"max_age must be > 0 seconds, got {self.max_age!r}")
        if not isinstance(self.delta_mode, DeltaMode):
            raise ValueError(f"delta_mode must be a DeltaMode, got {self.delta_mode!r}")
        if not isinstance(self.queue_order, QueueOrder):
            raise ValueError(f"queue_order must be a QueueOrder, got {self.queue_order!r}")


class Policy(ABC):
    """A scheduling policy: pure, immutable, one :meth:`schedule` call per pass."""

    name: ClassVar[str]
    preemptive: ClassVar[bool]
    #: whether :meth:`with_history` matters (2D-Gittins learns the job-size distribution).
    uses_history: ClassVar[bool] = False
    #: whether the policy resizes elastic jobs (``Decision.resizes``), also when no job waits.
    elastic: ClassVar[bool] = False
    #: whether its decisions choose a job's GPUs on several types at once (EasyScale's heterogeneous plans, or a
    #: move to another type): the Slurm daemon keeps a job on one type, so it refuses such a policy
    #: (:data:`~.registry.DAEMON_POLICY_NAMES`).
    plans_per_type: ClassVar[bool] = False
    #: True when, if every waiting job fits the free GPUs, a pass over the waiting jobs alone that starts them
    #: all places them exactly where a pass over all jobs would, and that pass would decide nothing else (no
    #: preemption, no wake-up since nobody is left waiting). Holds for the greedy walks of :mod:`.core`: with
    #: enough free GPUs every job fits in priority order and placement only looks at free GPUs. A caller (the
    #: simulator) may then leave the running jobs out of such a pass. (An ``elastic`` policy would also resize
    #: the running jobs: for it the shortcut holds only when no job is elastic.)
    fit_shortcut: bool = False

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options or PolicyOptions()

    @abstractmethod
    def schedule(self, inp: PassInput) -> Decision:
        """Decide which jobs start (and where), which are preempted, and queue changes."""

    def with_history(self, samples: Iterable[float]) -> Policy:
        """The same policy with a new job-size history (GPU-seconds of completed jobs)."""
        return self

    def with_options(self, options: PolicyOptions) -> Policy:
        """The same kind of policy with other knobs (e.g. a refitted PACKLIMIT, §3.3.2)."""
        return type(self)(options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


def _first_start_key(first_start: FloatArray) -> FloatArray:
    """FIFO by first start; never-started jobs after all started ones (§3.2.3): numpy's sorts place NaN (never
    started) after every number and treat NaNs as equal, so the column itself is the key."""
    return first_start


def _list_key(inp: PassInput, queue: IntArray) -> FloatArray:
    """QueueOrder.LIST: a job's place in its queue list; a job that entered its queue since the last pass (no
    place yet, or moved by this pass's demotion / promotion) is at the tail."""
    position = inp.jobs.position
    return np.where(np.isnan(position) | (queue != inp.jobs.queue), math.inf, position)


def _list_positions(inp: PassInput, queue: IntArray, order: IntArray, holding: BoolArray) -> FloatArray:
    """QueueOrder.LIST after the pass: per queue, the jobs holding GPUs ahead of those waiting, each in the
    order of the walk (the public simulator reorders its queue lists so after every event). Positions continue
    above those passed in, so they only ever grow."""
    known = inp.jobs.position[~np.isnan(inp.jobs.position)]
    base = float(known.max()) + 1.0 if known.size else 0.0
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    after = np.lexsort((rank, ~holding, queue))
    positions = np.empty(order.size, dtype=np.float64)
    positions[after] = base + np.arange(order.size)
    return positions


def _waiting_after(inp: PassInput, walk: WalkResult) -> BoolArray:
    """Jobs that wait after the pass: those left out, including the running jobs it preempts."""
    return ~walk.holding & walk.feasible


def _finish(
    inp: PassInput,
    order: IntArray,
    *,
    walk: WalkResult | None,
    starts: tuple[Start, ...],
    changes: tuple[QueueChange, ...],
    wakeup: float,
    infeasible: tuple[int, ...],
    idle_below: int = 0,
    positions: FloatArray | None = None,
    exact_wakeup: float = math.inf,
) -> Decision:
    """The pass's decision. ``wakeup`` is kept at least TIME_EPS after now (a crossing that a tolerance already
    counts must not wake the same instant again); ``exact_wakeup`` (> now) is kept as it is: moving a wake-up by
    a tolerance would make the time it happens depend on which passes ran before."""
    if math.isfinite(wakeup):
        wakeup = max(wakeup, inp.now + TIME_EPS)
    wakeup = min(wakeup, max(exact_wakeup, math.nextafter(inp.now, math.inf)))
    return Decision(
        starts=starts,
        preemptions=walk.preemptions if walk else (),
        resizes=walk.resizes if walk else (),
        queue_changes=changes,
        priority_order=order,
        next_wakeup=wakeup if math.isfinite(wakeup) else None,
        infeasible=infeasible,
        idle_below=idle_below,
        positions=positions,
    )


def _queue_changes(inp: PassInput, queue: IntArray, promoted: BoolArray | None) -> tuple[QueueChange, ...]:
    jobs = inp.jobs
    moved = queue != jobs.queue
    changed = (moved if promoted is None else moved | promoted).nonzero()[0]
    out: list[QueueChange] = []
    for row in changed.tolist():
        old, new = int(jobs.queue[row]), int(queue[row])
        up = promoted is not None and bool(promoted[row])
        kind = QueueChangeKind.PROMOTE if up else QueueChangeKind.DEMOTE
        out.append(QueueChange(row, int(jobs.job_ids[row]), old, new, kind, reset=up))
    return tuple(out)


class _MlfqPolicy(Policy):
    """Shared body of Discretised 2D-LAS and 2D-Gittins (Pseudocode 1 with §3.2.3 discretisation)."""

    preemptive = True
    fit_shortcut = True
    #: whether the order of the jobs stays fixed between wake-ups (False: it drifts with attained service).
    fixed_order: ClassVar[bool] = True
    #: whether inside a queue the jobs holding GPUs always rank ahead of the waiting ones.
    holders_first: bool = False

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.mlfq = MlfqConfig(self.options.thresholds, self.options.promote_knob)
        # Queue lists are reordered by every pass over all jobs, so every pass must see all jobs.
        self.fit_shortcut = self.options.queue_order is QueueOrder.START

    @abstractmethod
    def _order(self, inp: PassInput, queue: IntArray, attained: FloatArray) -> IntArray: ...

    def _walk(self, inp: PassInput, order: IntArray, pinned: BoolArray | None) -> WalkResult:
        mode, pack_limit = PlacementMode.SKEW_AWARE, self.options.pack_limit
        return preemptive_walk(inp, order, pinned, mode, pack_limit, deficit=self.fixed_order)

    def _walk_sizes(self, inp: PassInput) -> IntArray:
        """The GPUs :meth:`_walk` counts for a waiting job."""
        return inp.jobs.gpus

    def schedule(self, inp: PassInput) -> Decision:
        jobs = inp.jobs
        queue, promoted = mlfq_update(self.mlfq, jobs)
        limit = self.options.starve_limit
        size = None if math.isinf(limit) else self._walk_sizes(inp)  # (what the walk counts: computed once)
        starved = None if size is None else starved_rows(inp, limit, size)
        if starved is not None:  # STARVELIMIT: a starved job below the first queue is promoted to it
            raised = starved & (queue > 0)
            if raised.any():
                queue = np.where(raised, 0, queue)
                promoted = raised if promoted is None else promoted | raised
        # Promotion resets t_J and δ_J, hence a_J (§3.2.3), already for this pass.
        attained = jobs.attained if promoted is None else np.where(promoted, 0.0, jobs.attained)
        # (a pass over one job has one order: half of a simulated trace's passes, an arrival that fits the free GPUs)
        order = self._order(inp, queue, attained) if len(jobs) > 1 else np.zeros(len(jobs), dtype=np.int64)
        pinned = pinned_rows(inp, self.options.min_run_time)
        if starved is not None and size is not None:
            order, pinned = starved_first(inp, order, pinned, starved, size)
        walk = self._walk(inp, order, pinned)
        waiting = _waiting_after(inp, walk)
        wakeup = math.inf
        # (the next pass orders a starved job that started as any other, and lifts pins by the GPUs freed)
        idle_below = walk.deficit if self.fixed_order and starved is None else 0
        if waiting.any():
            # Jobs that hold GPUs after the pass (kept or started) accrue service from now on.
            wakeup = min(
                mlfq_wakeup(
                    self.mlfq,
                    inp.now,
                    jobs=jobs,
                    queue=queue,
                    attained=attained,
                    holding=walk.holding,
                    waiting=waiting,
                    gpus=walk.sizes,
                    holders_first=self.holders_first,
                ),
                pin_wakeup(inp, pinned, self.options.min_run_time, bool(walk.starts)),
            )
        listed = self.options.queue_order is QueueOrder.LIST
        return _finish(
            inp,
            order,
            walk=walk,
            starts=walk.starts,
            changes=_queue_changes(inp, queue, promoted),
            wakeup=wakeup,
            infeasible=walk.infeasible,
            idle_below=idle_below,
            positions=_list_positions(inp, queue, order, walk.holding) if listed else None,
            exact_wakeup=starve_wakeup(inp, waiting, limit, promoted),
        )


class TiresiasLas(_MlfqPolicy):
    """Discretised 2D-LAS (§3.2.3): queue by attained service, then the in-queue order (:class:`QueueOrder`)."""

    name = "tiresias-las"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.holders_first = self.options.queue_order is QueueOrder.START

    def _order(self, inp: PassInput, queue: IntArray, attained: FloatArray) -> IntArray:
        jobs = inp.jobs
        if self.options.queue_order is QueueOrder.LIST:
            return np.lexsort((jobs.submit, _list_key(inp, queue), queue))
        return np.lexsort((jobs.submit, _first_start_key(jobs.first_start), ~jobs.running, queue))


class Dl2GpuFallback(TiresiasLas):
    """The Slurm daemon's ``dl2`` on GPU jobs: DL²'s trained network decides the workers and PS of ps-mode jobs on
    CPU partitions once per slot (``slurm_plugin.dl2_slots``); GPU jobs are ordered and preempted exactly as under
    ``tiresias-las``, DL²'s fallback policy (its §4.1 state covers PS jobs only)."""

    name = "dl2"


class TiresiasLasElastic(TiresiasLas):
    """Discretised 2D-LAS decides who runs (§3.2.3) at every job's minimum GPUs; the GPUs no waiting job can use
    are lent to the elastic holders where they add the most throughput (:mod:`.elastic`)."""

    name = "tiresias-las+elastic"
    elastic = True

    def _walk(self, inp: PassInput, order: IntArray, pinned: BoolArray | None) -> WalkResult:
        return elastic_walk(inp, order, pinned, PlacementMode.SKEW_AWARE, self.options.pack_limit)

    def _walk_sizes(self, inp: PassInput) -> IntArray:
        return walk_sizes(inp)


class TiresiasGittins(_MlfqPolicy):
    """Discretised 2D-Gittins (§3.2.2-3.2.3): inside queue Q_i, highest G(a_J, Δ_i) first (:class:`DeltaMode`),
    ties in the in-queue order (:class:`QueueOrder`). Unlike 2D-LAS, a waiting job with a higher index displaces
    a running job of its own queue (§5.3.1: "jobs in the same queue are sorted based on their Gittins index value
    at every event"). Without a job-size history, or with fewer sizes than ``min_history``, the policy is 2D-LAS
    (Pseudocode 1 lines 2-3). The per-queue index tables are rebuilt by :meth:`with_history`.
    """

    name = "tiresias-gittins"
    uses_history = True
    # G(a, Δ) of a running job changes as it attains service, so its rank among its queue drifts between passes.
    fixed_order = False

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        dist = self.options.history
        if dist is None or len(dist) < self.options.min_history:  # too few sizes to go by: 2D-LAS
            dist = ServiceDistribution.from_samples(())
        self.distribution = dist
        self.tables: tuple[GittinsTable | ReferenceIndex, ...] = ()
        thresholds = self.mlfq.thresholds
        if len(self.distribution) and thresholds and self.options.delta_mode is DeltaMode.QUEUE:
            # Δ_i = Q_i^hi, and the last queue keeps the last finite quantum (DeltaMode.QUEUE)
            self.tables = tuple(GittinsTable.build(self.distribution, d) for d in thresholds)
        elif len(self.distribution) and thresholds and self.options.delta_mode is DeltaMode.REFERENCE:
            self.tables = (ReferenceIndex.build(self.distribution, thresholds[0]),)

    def with_history(self, samples: Iterable[float]) -> TiresiasGittins:
        return TiresiasGittins(replace(self.options, history=ServiceDistribution.from_samples(samples)))

    def index(self, queue: IntArray, attained: FloatArray) -> FloatArray:
        """G_J of every job (0 without a history, or without a finite quantum)."""
        if len(self.tables) == 1 and self.options.delta_mode is not DeltaMode.SUP:  # (two queues: one quantum)
            return self.tables[0].index(attained)
        out = np.zeros(attained.shape, dtype=np.float64)
        if not len(self.distribution):
            return out
        if self.options.delta_mode is DeltaMode.SUP:
            return gittins_index_sup(self.distribution, attained)
        if not self.tables:
            return out
        table_of_queue = np.minimum(queue, len(self.tables) - 1)
        for q, table in enumerate(self.tables):
            rows = (table_of_queue == q).nonzero()[0]
            if rows.size:
                out[rows] = table.index(attained[rows])
        return out

    def _order(self, inp: PassInput, queue: IntArray, attained: FloatArray) -> IntArray:
        jobs = inp.jobs
        gittins = self.index(queue, attained)
        if self.options.queue_order is QueueOrder.LIST:  # the public simulator: by index, then submission
            return np.lexsort((_list_key(inp, queue), jobs.submit, -gittins, queue))
        return np.lexsort((jobs.submit, _first_start_key(jobs.first_start), ~jobs.running, -gittins, queue))


class _OraclePolicy(Policy):
    """Shortest remaining first with oracle durations (§3.2.1), Tiresias placement (§5.1 "Baselines")."""

    preemptive = True
    fit_shortcut = True

    @abstractmethod
    def _size(self, inp: PassInput) -> FloatArray: ...

    def schedule(self, inp: PassInput) -> Decision:
        jobs = inp.jobs
        size = self._size(inp)
        order = np.lexsort((jobs.submit, size))  # (NaN: unknown, after every number)
        pinned = pinned_rows(inp, self.options.min_run_time)
        walk = preemptive_walk(inp, order, pinned, PlacementMode.SKEW_AWARE, self.options.pack_limit)
        wakeup = math.inf
        if _waiting_after(inp, walk).any():
            wakeup = pin_wakeup(inp, pinned, self.options.min_run_time, bool(walk.starts))
        # Remaining times of running jobs only shrink (they only move up), waiting jobs' stay: the order of the
        # walk cannot let a left-out job in without GPUs being freed.
        return _finish(
            inp,
            order,
            walk=walk,
            starts=walk.starts,
            changes=(),
            wakeup=wakeup,
            infeasible=walk.infeasible,
            idle_below=walk.deficit,
        )


class Srtf(_OraclePolicy):
    """Shortest remaining time first (remaining time known, e.g. from the trace)."""

    name = "srtf"

    def _size(self, inp: PassInput) -> FloatArray:
        return inp.jobs.remaining


class Srsf(_OraclePolicy):
    """Shortest remaining service first: remaining time x GPUs (§3.2.1, Table 1)."""

    name = "srsf"

    def _size(self, inp: PassInput) -> FloatArray:
        return inp.jobs.remaining * inp.jobs.gpus


class Gandiva(Policy):
    """Gandiva-like time slicing: gang round-robin with a fixed slice when the cluster is oversubscribed.

    A running job keeps its GPUs for ``time_slice`` seconds; after that it competes, keyed by the end of its
    slice, with waiting jobs keyed by when they began waiting, so that waiting jobs take turns. Rotations happen
    on a global clock (multiples of the slice), as Gandiva switches jobs in rounds, so a pass rotates many jobs
    at once instead of one pass per job.
    """

    name = "gandiva"
    preemptive = True
    fit_shortcut = True

    def schedule(self, inp: PassInput) -> Decision:
        jobs, now = inp.jobs, inp.now
        quantum = self.options.time_slice
        if len(jobs) > 1:
            key = np.where(jobs.running, now - jobs.run_time + quantum, now - jobs.current_wait)
            order = np.lexsort((jobs.submit, key))
        else:
            order = np.zeros(len(jobs), dtype=np.int64)  # (one job: one order)
        min_run = max(self.options.min_run_time, quantum)
        pinned = pinned_rows(inp, min_run)
        walk = preemptive_walk(inp, order, pinned, PlacementMode.SKEW_AWARE, self.options.pack_limit)
        wakeup = math.inf
        if _waiting_after(inp, walk).any():
            wakeup = pin_wakeup(inp, pinned, min_run, bool(walk.starts))
            if math.isfinite(wakeup):
                wakeup = math.ceil(wakeup / quantum - 1e-9) * quantum
        # keys (end of a running job's slice, start of a waiting job's wait) are fixed between passes
        return _finish(
            inp,
            order,
            walk=walk,
            starts=walk.starts,
            changes=(),
            wakeup=wakeup,
            infeasible=walk.infeasible,
            idle_below=walk.deficit,
        )


class Fifo(Policy):
    """YARN capacity scheduler as in Microsoft's cluster (§1, §5.1): FIFO, no preemption, consolidation
    required, head-of-line blocking."""

    name = "fifo"
    preemptive = False
    fit_shortcut = True
    skip: ClassVar[bool] = False

    def schedule(self, inp: PassInput) -> Decision:
        order = np.argsort(inp.jobs.submit, kind="stable")
        starts, index, rest, infeasible = nonpreemptive_walk(
            inp, order, skip=self.skip, mode=PlacementMode.STRICT, pack_limit=self.options.pack_limit
        )
        return _finish(
            inp,
            order,
            walk=None,
            starts=tuple(starts),
            changes=(),
            wakeup=math.inf,
            infeasible=infeasible,
            idle_below=nonpreemptive_idle(inp, rest, index, head=None if self.skip else PlacementMode.STRICT),
        )


class FifoSkip(Fifo):
    """ "Best effort" (§5.3): YARN-CS without head-of-line blocking; small jobs jump over blocked ones."""

    name = "fifo-skip"
    skip = True


class SlurmBackfill(Policy):
    """Slurm-like: multifactor priority from age only, then EASY backfill on time limits.

    Priority = min(age, PriorityMaxAge) (ties by submit time). Jobs start in priority order until the first that
    does not fit; it gets a reservation at the earliest time enough GPUs free up according to the running jobs'
    time limits (the shadow time). Later jobs may start now if they fit and either end before the shadow time
    or use only GPUs the reservation does not need. Jobs without a time limit are assumed to run forever.
    """

    name = "slurm-backfill"
    preemptive = False
    fit_shortcut = True

    def schedule(self, inp: PassInput) -> Decision:
        jobs, now = inp.jobs, inp.now
        age = np.minimum(np.maximum(now - jobs.submit, 0.0), self.options.max_age)
        order = np.lexsort((jobs.submit, -age))
        mode = PlacementMode.CONSOLIDATE
        pack_limit = self.options.pack_limit
        starts, index, rest, infeasible = nonpreemptive_walk(inp, order, skip=False, mode=mode, pack_limit=pack_limit)
        if rest.size:
            filled = self._backfill(inp, rest, starts, index)
            if filled:
                starts.extend(filled)
                rest = np.setdiff1d(rest, [s.row for s in filled], assume_unique=True)
        # Age order is submit order, and the shadow time only moves when jobs end: nothing new can start
        # before enough GPUs are freed for the smallest waiting job.
        return _finish(
            inp,
            order,
            walk=None,
            starts=tuple(starts),
            changes=(),
            wakeup=math.inf,
            infeasible=infeasible,
            idle_below=nonpreemptive_idle(inp, rest, index),
        )

    def _backfill(self, inp: PassInput, rest: IntArray, started: list[Start], index: FreeIndex) -> list[Start]:
        jobs, cluster, now = inp.jobs, inp.cluster, inp.now
        n_pools = cluster.n_pools
        pool_free = [index.pool_free(p) for p in range(n_pools)]
        if sum(pool_free) == 0:
            return []
        limit = np.where(np.isnan(jobs.time_limit), math.inf, jobs.time_limit)
        # Expected end and GPUs of every job holding GPUs (running or started by this pass), from time limits.
        run_rows = jobs.running.nonzero()[0]
        new_rows = np.array([s.row for s in started], dtype=np.int64)
        new_pools = np.array([cluster.pool[s.node_rows[0][0]] for s in started], dtype=np.int64)
        end_all = np.concatenate(
            (now + np.maximum(limit[run_rows] - jobs.executed[run_rows], 0.0), now + limit[new_rows])
        )
        pool_all = np.concatenate((jobs.pool[run_rows], new_pools))
        gpus_all = np.concatenate((jobs.gpus[run_rows], jobs.gpus[new_rows]))
        head = int(rest[0])
        g_head = int(jobs.gpus[head])
        head_mask = int(jobs.pool_mask[head])
        best: tuple[float, int, int] | None = None  # (shadow, extra, pool)
        for p in range(n_pools):
            if not head_mask >> p & 1:
                continue
            avail = pool_free[p]
            if avail >= g_head:
                shadow, extra = now, avail - g_head
            else:
                sel = pool_all == p
                ends = end_all[sel]
                by_end = np.argsort(ends, kind="stable")
                sorted_ends = ends[by_end]
                cum = avail + np.cumsum(gpus_all[sel][by_end])
                k = int(np.searchsorted(cum, g_head, side="left"))
                if k < cum.size:
                    shadow = float(sorted_ends[k])
                    # every job ending by the shadow time frees its GPUs then (ties included)
                    last = int(np.searchsorted(sorted_ends, shadow, side="right")) - 1
                    extra = int(cum[last]) - g_head
                else:
                    shadow, extra = math.inf, 0
            if best is None or (shadow, -extra, p) < (best[0], -best[1], best[2]):
                best = (shadow, extra, p)
        if best is None:
            return []
        shadow, extra, head_pool = best
        out: list[Start] = []
        total = sum(pool_free)
        later = rest[1:]
        for row in later[jobs.gpus[later] <= total].tolist():
            if total <= 0:
                break
            g = int(jobs.gpus[row])
            if g > total:
                continue
            mask = int(jobs.pool_mask[row])
            ends_by = now + float(limit[row])
            for p in sorted(range(n_pools), key=lambda q: (pool_free[q], q)):
                if not mask >> p & 1 or pool_free[p] < g:
                    continue
                short = ends_by <= shadow + TIME_EPS
                if p == head_pool and not short and g > extra:
                    continue
                placed = index.place(p, g, PlacementMode.CONSOLIDATE, float(jobs.skew[row]), self.options.pack_limit)
                if placed is None:
                    continue
                pool_free[p] -= g
                total -= g
                if p == head_pool and not short:
                    extra -= g
                alloc = tuple(placed)
                names = tuple((cluster.names[n], c) for n, c in alloc)
                out.append(Start(row, int(jobs.job_ids[row]), alloc, names))
                break
        return out


#: Every built-in policy class; :mod:`hpc_elastic.policy.registry` names them by their ``name``.
BUILTIN_POLICIES: tuple[type[Policy], ...] = (
    Fifo,
    FifoSkip,
    Srtf,
    Srsf,
    SlurmBackfill,
    Gandiva,
    TiresiasLas,
    TiresiasGittins,
    TiresiasLasElastic,
)
