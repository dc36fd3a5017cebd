"""Discrete-event simulator of a GPU cluster under a scheduling policy (Tiresias §5.1 "Simulator").

Events: job arrival, completion, and policy wake-ups (a demotion threshold crossed while jobs wait, a
promotion due, a minimum run time or time slice ending), optionally aligned to periodic scheduling ticks. Time
jumps from one event to the next; the events of an instant go to their handlers (:meth:`_Replay.arrive`,
:meth:`_Replay.complete`, :meth:`_Replay.wake`), then one scheduling pass runs when anything changed
(:meth:`_Replay.schedule`) and its decision is applied (:meth:`_Replay.apply`: demotions / promotions,
preemptions, resizes, starts).

Two models of the cluster (:class:`SimModel`):

- ``realistic`` (default):

  - a job needs ``duration`` seconds of work on its ``gpus`` GPUs; it runs ``spread_slowdown`` times slower while
    placed on more nodes than the fewest that can hold it if its skew exceeds ``skew_sensitive`` (Tiresias §2.2,
    Figure 3: skewed models such as VGG lose speed when not consolidated, and consolidated means "the same or the
    minimum number of servers": a 16-GPU job on two whole 8-GPU nodes runs at its trace speed);
  - a preempted job is checkpointed to the shared filesystem and restored when it resumes (§2.2, Figures 4-5): it
    then first spends ``2 x checkpoint_bytes / bandwidth + restart_overhead`` seconds on its GPUs before making
    progress again (default bandwidth 1.2 GB/s, Tiresias's GPFS, §5.1 "Testbed"); a resized elastic job pays the
    same (checkpoint, restart on its new GPUs);
- ``reference``: the public Tiresias simulator's model (its ``--scheme=count``): GPUs are counted per GPU type
  (the nodes of a type merge into one), preemptions and resizes cost nothing, nothing runs slower when spread,
  the MLFQ policies order their queues as that simulator's lists (:attr:`QueueOrder.LIST`) and 2D-Gittins uses
  its approximation of the index (:attr:`DeltaMode.REFERENCE`).

In both, attained service a_J accrues at the job's current GPUs x wall time on GPUs, overheads included; an
elastic job on n GPUs progresses at ``scaling(n) / scaling(gpus)`` times its speed on its trace size. A job whose
scaling is an :class:`~hpc_elastic.policy.hetero.EstProfile` (capability per GPU type, heterogeneous clusters)
progresses at Eq. 1d's throughput of the plan it runs on the GPUs it holds per type, relative to that on its
requested GPUs of its requested type (so its trace duration stays its work); after a scale-out the replay records
the observed speeds before and after in its profile (:class:`~hpc_elastic.policy.hetero.ScaleOut`, for Role 3),
with the time of a scale-out observed slower and the failures in a row before it (Role 3's back-off).
Optionally (``refit_pack_limit``) PACKLIMIT is refitted during the replay from the observed (placement, speed)
pairs of the jobs started so far with :func:`hpc_elastic.policy.placement.fit_pack_limit` (§3.3.2,
"Determining PACKLIMIT"), as the paper does periodically from job history.

The job state lives in numpy arrays; one pass hands the policy a :class:`JobTable` of the active jobs built with
a few vectorised gathers, so a replay costs roughly (number of passes) x (cost of one pass).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.policy.gittins import ServiceDistribution
from hpc_elastic.policy.hetero import EstProfile, ScaleOut
from hpc_elastic.policy.placement import PlacementSample, fit_pack_limit
from hpc_elastic.policy.policies import DeltaMode, Policy, QueueOrder
from hpc_elastic.policy.types import (
    LINEAR,
    ClusterState,
    Decision,
    FloatArray,
    IntArray,
    JobTable,
    PassInput,
    RowAllocation,
    RowSlice,
    ScalingCurve,
)
from hpc_elastic.sim.cluster import NodeSpec
from hpc_elastic.sim.models import DEFAULT_CHECKPOINT_BYTES
from hpc_elastic.sim.trace import MAX_SECONDS, TraceJob

DEFAULT_BANDWIDTH = 1.2e9
"""Shared-filesystem bandwidth, bytes/s: GPFS read/write throughput per machine in Tiresias's testbed (§5.1)."""

_PENDING, _RUNNING, _DONE = 1, 2, 3
_COMPLETION, _WAKE = 1, 2
_TICK = -1
#: the wake-up tag of a scale-out observed slower: Role 3's pass (whatever passes ran since)
_OBSERVED = -2
_PURGE_AT = 4096  # stale completion events the heap may hold before they leave it
#: preemptions in a row of one job, each before it did any work, after which a replay is called stalled
FRUITLESS_LIMIT = 1000
# columns of the per-job state tables
_SUBMIT, _SINCE, _OVERHEAD, _SPEED, _ATT, _EXE, _WAIT, _FIRST, _SKEW, _REMAIN, _LIMIT, _POS = range(12)
_F_COLUMNS = 12
_GPUS, _STATUS, _QUEUE, _MASK, _POOL, _MIN, _MAX = range(7)
_I_COLUMNS = 7


class ReplayStalled(HpcElasticError):
    """A replay that cannot end under its policy: a job left waiting forever, or preempted again and again before
    it does any work."""


class SimModel(StrEnum):
    """What the simulated cluster is like (see the module doc)."""

    REALISTIC = "realistic"
    REFERENCE = "reference"


class EventKind(StrEnum):
    ARRIVE = "arrive"
    START = "start"
    PREEMPT = "preempt"
    RESIZE = "resize"
    COMPLETE = "complete"
    DEMOTE = "demote"
    PROMOTE = "promote"


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One recorded event (with ``SimConfig.record_events``): allocation is ``((node, gpus), ...)``."""

    time: float
    kind: EventKind
    job_id: int
    queue: int = 0
    allocation: tuple[tuple[str, int], ...] = ()
    attained: float = 0.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: SimModel = SimModel.REALISTIC
    bandwidth: float = DEFAULT_BANDWIDTH
    restart_overhead: float = 0.0
    default_checkpoint_bytes: float = DEFAULT_CHECKPOINT_BYTES
    spread_slowdown: float = 1.5
    skew_sensitive: float = 0.5
    sched_interval: float = 0.0
    time_limit_factor: float = 1.0
    #: Fixed job-size history for 2D-Gittins; None learns it from the jobs completed so far.
    history: ServiceDistribution | None = field(default=None, compare=False)
    #: Rebuild the learned history when the number of completed jobs has grown by this factor.
    history_growth: float = 1.1
    #: Refit PACKLIMIT from observed (placement, speed) pairs while replaying (§3.3.2).
    refit_pack_limit: bool = False
    #: A model is placement-sensitive when consolidated speed >= this x spread speed (for the refit).
    refit_tolerance: float = 1.1
    #: Skip the passes a policy's ``Decision.idle_below`` proves useless (same results, fewer passes).
    skip_idle_passes: bool = True
    #: Decide on the waiting jobs alone when they all fit the free GPUs (policies with ``fit_shortcut``).
    fit_shortcut: bool = True
    record_events: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, SimModel):
            raise ValueError(f"simulator setting model must be a SimModel, got {self.model!r}")
        checks = {
            "bandwidth": self.bandwidth > 0,
            "restart_overhead": 0 <= self.restart_overhead <= MAX_SECONDS,
            "default_checkpoint_bytes": self.default_checkpoint_bytes >= 0,
            "spread_slowdown": self.spread_slowdown >= 1,
            "sched_interval": self.sched_interval >= 0,
            "time_limit_factor": self.time_limit_factor > 0,
            "history_growth": self.history_growth > 1,
            "refit_tolerance": self.refit_tolerance >= 1,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and ok):
                raise ValueError(f"simulator setting {name} is out of range: {value!r}")


@dataclass(frozen=True, eq=False)
class Timeline:
    """The cluster after every instant with events: jobs waiting and GPUs held (by running jobs)."""

    time: FloatArray
    waiting: IntArray
    busy_gpus: IntArray


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-job outcomes (arrays over the simulated jobs, trace order) and totals."""

    policy: str
    job_ids: tuple[int, ...]  # the position of each job in the simulated trace (submission order)
    names: tuple[str, ...]  # the trace's labels
    gpus: IntArray
    submit: FloatArray
    first_start: FloatArray
    end: FloatArray
    queue_delay: FloatArray
    preemptions: IntArray
    preemption_cost: float
    busy_gpu_seconds: float
    capacity_gpus: int
    dropped: tuple[str, ...]
    events: int
    passes: int
    wall_seconds: float
    #: passes decided on the waiting jobs alone (``SimConfig.fit_shortcut``)
    shortcut_passes: int
    timeline: Timeline
    resizes: IntArray
    #: seconds of checkpoint + restart paid by resized elastic jobs
    resize_cost: float = 0.0
    log: tuple[SimEvent, ...] = ()
    #: PACKLIMIT in force at the end of the replay (differs from the policy's knob after a refit).
    pack_limit: float = math.nan
    model: SimModel = SimModel.REALISTIC
    #: per job (trace order), the last scale-out observed of a job with a profile per GPU type (Role 3's input)
    scale_outs: tuple[ScaleOut | None, ...] = ()

    @property
    def jct(self) -> FloatArray:
        return self.end - self.submit

    @property
    def finished(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.end)))


ProgressFn = Callable[[int, int], None]


def count_nodes(nodes: Sequence[NodeSpec]) -> tuple[NodeSpec, ...]:
    """The reference model's cluster: one node per GPU type holding all its GPUs (GPUs are only counted)."""
    totals: dict[str, int] = {}
    for node in nodes:
        totals[node.gpu_type] = totals.get(node.gpu_type, 0) + node.gpus
    return tuple(NodeSpec(f"count-{gpu_type or 'gpu'}", gpus, gpu_type) for gpu_type, gpus in totals.items())


class Simulator:
    """Replays ``jobs`` on ``nodes`` under ``policy``. One instance runs once."""

    def __init__(
        self, jobs: Sequence[TraceJob], nodes: Sequence[NodeSpec], policy: Policy, config: SimConfig | None = None
    ) -> None:
        if not nodes:
            raise ValueError("the cluster has no nodes")
        self.config = cfg = config or SimConfig()
        self.reference = cfg.model is SimModel.REFERENCE
        if self.reference:
            nodes = count_nodes(nodes)
            reference = replace(policy.options, queue_order=QueueOrder.LIST, delta_mode=DeltaMode.REFERENCE)
            policy = policy.with_options(reference)
        self.policy = policy
        self.nodes = tuple(nodes)
        self.cluster0 = ClusterState.from_nodes([node.view() for node in self.nodes])
        typed = self.cluster0.pool_names != ("",)
        pool_cap = np.bincount(self.cluster0.pool, weights=self.cluster0.total, minlength=self.cluster0.n_pools)
        keep: list[TraceJob] = []
        dropped: list[str] = []
        masks: list[int] = []
        for job in sorted(jobs, key=lambda job: (job.submit, job.line)):
            mask = self.cluster0.pool_mask(job.gpu_types if typed else None)
            best = max((pool_cap[p] for p in range(self.cluster0.n_pools) if mask >> p & 1), default=0)
            if job.gpus > best:
                dropped.append(job.name)
                continue
            keep.append(job)
            masks.append(mask)
        self.jobs = tuple(keep)
        self.dropped = tuple(dropped)
        self.ids = np.arange(len(keep), dtype=np.int64)
        self.gpus = np.array([job.gpus for job in keep], dtype=np.int64)
        self.submit = np.array([job.submit for job in keep], dtype=np.float64)
        self.work = np.array([job.duration for job in keep], dtype=np.float64)
        self.skew = np.array([math.nan if job.skew is None else job.skew for job in keep], dtype=np.float64)
        self.models = tuple(job.model for job in keep)
        self.ckpt = np.array(
            [cfg.default_checkpoint_bytes if job.checkpoint_bytes is None else job.checkpoint_bytes for job in keep],
            dtype=np.float64,
        )
        self.pool_mask = np.array(masks, dtype=np.int64)
        self.time_limit = np.array(
            [job.duration * cfg.time_limit_factor if job.time_limit is None else job.time_limit for job in keep],
            dtype=np.float64,
        )
        # Elastic jobs: their GPU range (capped by the largest pool they may use) and scaling curve.
        self.min_gpus = self.gpus.copy()
        self.max_gpus = self.gpus.copy()
        self.scaling = np.empty(len(keep), dtype=object)
        self.scaling[:] = [job.scaling for job in keep]
        for row, job in enumerate(keep):
            if isinstance(job.scaling, EstProfile):
                missing = {self.cluster0.pool_names[p] for p in range(self.cluster0.n_pools) if masks[row] >> p & 1}
                missing -= {t for t, _ in job.scaling.capability}
                if missing or job.scaling.base_type not in dict(job.scaling.capability):
                    raise ValueError(f"job {job.name}: no capability for GPU type(s) {sorted(missing)}")
            if job.elastic and job.min_gpus is not None and job.max_gpus is not None:
                allowed = [int(pool_cap[p]) for p in range(self.cluster0.n_pools) if masks[row] >> p & 1]
                # (a job with a profile per GPU type may run on several types at once)
                cap = sum(allowed) if isinstance(job.scaling, EstProfile) else max(allowed)
                self.min_gpus[row] = min(job.min_gpus, job.gpus)
                self.max_gpus[row] = max(min(job.max_gpus, cap), job.gpus)

    def run(self, progress: ProgressFn | None = None) -> SimResult:
        return _Replay(self, progress).run()


class _Replay:
    """The mutable state of one replay and its event handlers."""

    def __init__(self, sim: Simulator, progress: ProgressFn | None) -> None:
        self.sim = sim
        self.cfg = cfg = sim.config
        self.progress = progress
        # each job's speed model; a profile per GPU type learns its scale-outs during this replay only
        self.scaling = sim.scaling.copy()
        n = self.n = len(sim.jobs)
        cluster0 = sim.cluster0
        self.free = cluster0.total.copy()
        self.free_total = int(self.free.sum())  # (kept in step with free)
        self.capacity = int(cluster0.total.sum())
        # Per-job state in two column-major tables (a row per column): a pass gathers the columns its policy reads,
        # each contiguous, for the active jobs only.
        self.fstate = fstate = np.zeros((_F_COLUMNS, n), dtype=np.float64)
        self.istate = istate = np.zeros((_I_COLUMNS, n), dtype=np.int64)
        fstate[_SUBMIT] = sim.submit
        fstate[_SPEED] = 1.0
        fstate[_FIRST] = math.nan
        fstate[_SKEW] = sim.skew
        fstate[_REMAIN] = sim.work
        fstate[_LIMIT] = sim.time_limit
        fstate[_POS] = math.nan
        istate[_GPUS] = sim.gpus
        istate[_MASK] = sim.pool_mask
        istate[_POOL] = -1
        istate[_MIN] = sim.min_gpus
        istate[_MAX] = sim.max_gpus
        # per-job scalars read and written one job at a time: Python lists (cheaper to index than arrays)
        self.end: list[float] = [math.nan] * n
        self.alloc = np.empty(n, dtype=object)
        self.alloc[:] = [()] * n
        self.owed: list[float] = [0.0] * n  # restore overhead owed at the next start
        self.version: list[int] = [0] * n
        self.preempts: list[int] = [0] * n
        #: each job's preemptions in a row that came before it did any work (its restore not done)
        self.fruitless: list[int] = [0] * n
        self.resizes: list[int] = [0] * n
        # speed and GPUs per type of a job just checkpointed for a resize (jobs with an EstProfile)
        self.before: dict[int, tuple[float, tuple[tuple[str, int], ...]]] = {}
        self.pend_total: list[float] = [0.0] * n
        self.service_total: list[float] = [0.0] * n
        self.busy = 0.0  # GPU-seconds held
        self.busy_gpus = 0
        self.preempt_cost = self.resize_cost = 0.0
        self.log: list[SimEvent] = []
        self.record = cfg.record_events
        # the cost of a checkpoint + restore per job (0 in the reference model)
        stop_cost = np.zeros(n) if sim.reference else 2.0 * sim.ckpt / cfg.bandwidth + cfg.restart_overhead
        self.stop_cost: list[float] = stop_cost.tolist()
        self.spread_slowdown = 1.0 if sim.reference else cfg.spread_slowdown
        self.node_pool: list[int] = sim.cluster0.pool.tolist()
        self.skew: list[float] = sim.skew.tolist()
        self.base_gpus: list[int] = sim.gpus.tolist()

        policy = sim.policy
        self.learn = policy.uses_history and cfg.history is None
        if policy.uses_history and cfg.history is not None:
            policy = policy.with_history(cfg.history.samples.tolist())
        self.policy = policy
        self.history: list[float] = []
        self.next_refresh = 1
        # (model, consolidated) -> [skew, Σ speed, count] of the runs started so far, for the PACKLIMIT refit.
        self.observed: dict[tuple[str, bool], list[float]] = {}
        self.n_observed = 0
        self.next_refit = 1

        self.active = np.zeros(0, dtype=np.int64)  # rows of arrived, unfinished jobs (sorted)
        self.arrived: list[int] = []
        self.departed: list[int] = []
        # A non-preemptive policy ranks new jobs last, so arrivals alone only matter if one fits the free GPUs.
        self.lazy_arrivals = not policy.preemptive
        self.pending: set[int] = set()  # rows of the waiting jobs
        self.pending_gpus = 0  # GPUs wanted by the waiting jobs
        # an elastic policy with elastic jobs also passes when nothing waits: to grow jobs into free GPUs
        self.grows = policy.elastic and bool((sim.max_gpus > sim.min_gpus).any())
        self.shortcut = cfg.fit_shortcut and policy.fit_shortcut and not self.grows
        self.shortcuts = 0
        # Decision.idle_below of the last pass, and the GPUs completions have freed since it ran.
        self.idle_below = 0
        self.freed = 0
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        # Completion events made stale by a preemption or resize: counted while in the heap; moved out of it by
        # _purge into the sorted times of `ghosts` (instants with no effect, still replayed and counted).
        self.stale = 0
        self.ghosts: list[float] = [math.inf]
        self.next_ghost = 0
        self.wake_gen = 0
        self.tick_pending = math.inf
        self.next_arrival = 0
        self.completed = 0
        self.events = self.passes = 0
        self.report_every = max(1, n // 200)
        # what the events of the current instant changed
        self.changed = self.arrival = self.woken = self.ticked = False
        self.t_log: list[float] = []
        self.w_log: list[int] = []
        self.b_log: list[int] = []

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        started = time.perf_counter()
        submit = [*self.sim.submit.tolist(), math.inf]  # (a sentinel after the last arrival)
        heap, heappop = self.heap, heapq.heappop
        t_log, w_log, b_log = self.t_log, self.w_log, self.b_log
        pending = self.pending
        n = self.n
        while True:
            t_arr = submit[self.next_arrival]
            ghosts = self.ghosts
            now = min(t_arr, heap[0][0], ghosts[self.next_ghost]) if heap else min(t_arr, ghosts[self.next_ghost])
            if now == math.inf:
                break
            self.changed = self.arrival = self.woken = self.ticked = False
            free_total = self.free_total if self.lazy_arrivals else 0
            while submit[self.next_arrival] <= now:
                self.arrive(self.next_arrival, now, free_total)
                self.next_arrival += 1
            while heap and heap[0][0] <= now:
                _, _, kind, row, tag = heappop(heap)
                self.events += 1
                if kind == _COMPLETION:
                    self.complete(row, tag, now)
                else:
                    self.wake(tag)
            while ghosts[self.next_ghost] <= now:  # stale completions: nothing to do but count them
                self.next_ghost += 1
                self.events += 1
            if (self.changed or self.woken or self.ticked) and self.pass_due(now):
                self.schedule(now)
            t_log.append(now)
            w_log.append(len(pending))
            b_log.append(self.busy_gpus)
        if self.progress is not None:
            self.progress(self.completed, n)
        if self.completed < n:  # nothing is left to happen: a job that never ends is the policy's fault
            row = next(r for r in range(n) if math.isnan(self.end[r]))
            raise ReplayStalled(
                f"policy {self.policy.name} left {n - self.completed} of {n} jobs unfinished on a cluster where "
                f"nothing else happens (first: {self.sim.jobs[row].name!r}, {int(self.sim.gpus[row])} GPUs)"
            )
        return self.result(time.perf_counter() - started)

    def pass_due(self, now: float) -> bool:
        """Whether the events of this instant call for a scheduling pass (or a tick for one, with periodic
        scheduling)."""
        if not (self.changed or self.woken or self.ticked):
            return False
        if not (self.arrival or self.woken or self.ticked) and self.freed < self.idle_below:
            return False  # the last pass said no completion this small can change its decision
        interval = self.cfg.sched_interval
        if interval > 0 and not self.ticked:
            # Periodic scheduling: passes happen on ticks (multiples of the interval) only.
            tick = math.ceil(now / interval) * interval
            if tick > now:
                if tick < self.tick_pending:
                    self.tick_pending = tick
                    self.push(tick, _WAKE, -1, _TICK)
                return False
        if not self.pending and not self.grows:
            return False
        return self.policy.preemptive or self.free_total > 0

    def push(self, at: float, kind: int, row: int, tag: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, row, tag))

    def drop_completion(self) -> None:
        """A running job's pending completion event went stale (preempted, resized). Once the stale events
        outnumber the others, they leave the heap (every pop costs log of its size): their times become ghosts,
        instants replayed in order with nothing to do, as their stale events would have been."""
        self.stale += 1
        if self.stale < _PURGE_AT or 2 * self.stale < len(self.heap):
            return
        version, status = self.version, self.istate[_STATUS]
        live: list[tuple[float, int, int, int, int]] = []
        dead: list[float] = []
        for entry in self.heap:
            _, _, kind, row, tag = entry
            if kind == _COMPLETION and (tag != version[row] or status[row] != _RUNNING):
                dead.append(entry[0])
            else:
                live.append(entry)
        heapq.heapify(live)
        self.heap[:] = live
        dead.extend(self.ghosts[self.next_ghost :])  # (ends with the sentinel ∞)
        dead.sort()
        self.ghosts, self.next_ghost, self.stale = dead, 0, 0

    # ------------------------------------------------------------------------------------------ events

    def arrive(self, row: int, now: float, free_total: int) -> None:
        """A job is submitted: it waits (from its submit time) for the next pass."""
        self.istate[_STATUS, row] = _PENDING
        self.fstate[_SINCE, row] = self.sim.submit[row]
        self.arrived.append(row)
        self.pending.add(row)
        gpus = int(self.sim.gpus[row])
        self.pending_gpus += gpus
        if not self.lazy_arrivals or gpus <= free_total:
            self.changed = self.arrival = True
        elif self.cfg.skip_idle_passes:  # it can start once free GPUs reach its size (free_total = after + freed)
            self.idle_below = min(self.idle_below, max(gpus - free_total + self.freed, 1))
        self.events += 1
        if self.record:
            self.log.append(SimEvent(now, EventKind.ARRIVE, int(self.sim.ids[row])))

    def complete(self, row: int, version: int, now: float) -> None:
        """A running job's work is done (unless the completion event is stale: it was preempted or resized)."""
        i = self.istate[:, row]
        if version != self.version[row] or i[_STATUS] != _RUNNING:
            return
        gpus = int(i[_GPUS])
        self.stop(row, now)
        i[_STATUS] = _DONE
        self.end[row] = now
        self.fstate[_REMAIN, row] = 0.0
        self.departed.append(row)
        self.changed = True
        self.freed += gpus
        self.completed += 1
        self.history.append(self.service_total[row])
        if self.record:
            self.log.append(SimEvent(now, EventKind.COMPLETE, int(self.sim.ids[row]), int(self.istate[_QUEUE, row])))
        if self.progress is not None and self.completed % self.report_every == 0:
            self.progress(self.completed, self.n)

    def wake(self, tag: int) -> None:
        """A periodic scheduling tick, the wake-up the last pass asked for (a demotion or promotion due, a
        minimum run time ending; only the latest pass's wake-up counts), or a scale-out observed slower."""
        if tag == _TICK:
            self.tick_pending = math.inf
            self.ticked = True
        elif tag in {self.wake_gen, _OBSERVED}:
            self.woken = True

    def stop(self, row: int, now: float) -> float:
        """Account a running job's run up to ``now`` (service, and the work done past its restore overhead);
        free its GPUs. Returns the work done."""
        f = self.fstate[:, row]  # (a view: one job's scalars are cheaper to reach through it)
        v = f.tolist()
        el = now - v[_SINCE]
        i = self.istate[:, row]
        gpus = i.item(_GPUS)
        f[_ATT] = v[_ATT] + gpus * el
        f[_EXE] = v[_EXE] + el
        done: float = max(el - v[_OVERHEAD], 0.0) * v[_SPEED]
        f[_REMAIN] = max(v[_REMAIN] - done, 0.0)
        self.service_total[row] += gpus * el
        self.busy += gpus * el
        self.busy_gpus -= gpus
        self.free_total += gpus
        free = self.free
        for node, count in self.alloc[row]:
            free[node] = free.item(node) + count
        self.alloc[row] = ()
        i[_POOL] = -1
        return done

    # ------------------------------------------------------------------------------------------ a pass

    def schedule(self, now: float) -> None:
        """One scheduling pass over the active jobs (or over the waiting ones alone, when they all fit)."""
        cfg = self.cfg
        if self.learn and len(self.history) >= self.next_refresh:  # learned job-size history for 2D-Gittins
            self.policy = self.policy.with_history(self.history)
            self.next_refresh = max(int(len(self.history) * cfg.history_growth), len(self.history) + 1)
        if cfg.refit_pack_limit and self.n_observed >= self.next_refit:  # PACKLIMIT refitted (§3.3.2)
            self.policy = _refit(self.policy, self.observed, cfg.refit_tolerance)
            self.next_refit = max(int(self.n_observed * cfg.history_growth), self.n_observed + 1)
        if self.departed:
            keep = np.ones(self.active.size, dtype=np.bool_)
            keep[self.active.searchsorted(self.departed)] = False
            self.active = self.active[keep]
            self.departed.clear()
        if self.arrived:
            self.active = np.concatenate((self.active, np.asarray(self.arrived, dtype=np.int64)))
            self.arrived.clear()
        cluster = self.sim.cluster0.with_free(self.free, check=False)  # (read only, and only during the pass)
        rows = self.active
        decision: Decision | None = None
        if self.shortcut and self.pending_gpus <= self.free_total:
            # Every waiting job may fit the free GPUs: ask the policy about the waiting jobs alone; if it starts
            # them all, a full pass would have decided exactly that (Policy.fit_shortcut).
            waiting_rows = np.array(sorted(self.pending), dtype=np.int64)
            table = self.table(waiting_rows, now)
            sub = self.policy.schedule(PassInput(now, table, cluster))
            if len(sub.starts) == waiting_rows.size and not sub.preemptions:
                decision, rows = sub, waiting_rows
                self.shortcuts += 1
        if decision is None:
            table = self.table(rows, now)
            decision = self.policy.schedule(PassInput(now, table, cluster))
        self.passes += 1
        self.idle_below, self.freed = (decision.idle_below if cfg.skip_idle_passes else 0), 0
        self.apply(decision, rows, table, now)

    def table(self, rows: IntArray, now: float) -> JobTable:
        """The policy's view of these jobs at ``now``: the columns every pass reads gathered now, the others when
        first read (one contiguous gather per column)."""
        fstate, istate = self.fstate, self.istate
        running = istate[_STATUS].take(rows) == _RUNNING
        gpus = istate[_GPUS].take(rows)
        el = now - fstate[_SINCE].take(rows)
        el_run = np.where(running, el, 0.0)
        columns = {
            "job_ids": rows,  # a job's id is its row
            "gpus": gpus,
            "submit": fstate[_SUBMIT].take(rows),
            "running": running,
            "run_time": el_run,
            "pool_mask": istate[_MASK].take(rows),
            "alloc": RowSlice(self.alloc, rows),
            "scaling": RowSlice(self.scaling, rows),
        }

        def gather(table: FloatArray | IntArray, column: int) -> Callable[[], FloatArray | IntArray]:
            return lambda: table[column].take(rows)

        # Columns only some policies read, computed on first read (the same values).
        later: dict[str, Callable[[], FloatArray | IntArray]] = {
            "first_start": gather(fstate, _FIRST),
            "queue": gather(istate, _QUEUE),
            "skew": gather(fstate, _SKEW),
            "pool": gather(istate, _POOL),
            "time_limit": gather(fstate, _LIMIT),
            "position": gather(fstate, _POS),
            "min_gpus": gather(istate, _MIN),
            "max_gpus": gather(istate, _MAX),
            "attained": lambda: fstate[_ATT].take(rows) + gpus * el_run,
            "executed": lambda: fstate[_EXE].take(rows) + el_run,
            # δ_J: waiting since the job first ran after its arrival / last promotion, all spells (§3.2.3)
            "waiting": lambda: fstate[_WAIT].take(rows) + np.where(running | (fstate[_EXE].take(rows) <= 0.0), 0.0, el),
            "current_wait": lambda: np.where(running, 0.0, el),
            "remaining": lambda: np.maximum(
                fstate[_REMAIN].take(rows)
                - np.maximum(el_run - fstate[_OVERHEAD].take(rows), 0.0) * fstate[_SPEED].take(rows),
                0.0,
            ),
        }
        return JobTable.derived(columns, later)

    # ------------------------------------------------------------------------------------------ a decision

    def apply(self, decision: Decision, rows: IntArray, table: JobTable, now: float) -> None:
        """Carry out a pass's decision: queue changes, preemptions, resizes, starts (in that order: the GPUs of
        the preempted and shrunk jobs are those the others are placed on)."""
        if decision.positions is not None:
            self.fstate[_POS, rows] = decision.positions
        # (a row's job id is its row in the simulator's tables)
        for change in decision.queue_changes:
            self.change_queue(change.job_id, change.queue, change.reset, now)
            if self.record:
                kind = EventKind.PROMOTE if change.reset else EventKind.DEMOTE
                attained = float(table.attained[change.row])
                self.log.append(SimEvent(now, kind, change.job_id, change.queue, attained=attained))
        for pre in decision.preemptions:
            self.preempt(pre.job_id, now)
        resized = [size.job_id for size in decision.resizes]
        for row in resized:  # every resized job lets go of its GPUs before any is placed again
            self.checkpoint(row, now)
        for row, size in zip(resized, decision.resizes, strict=True):
            self.resize(row, size.gpus, size.node_rows, now)
        for start in decision.starts:
            self.start(start.job_id, start.node_rows, now)
        self.wake_gen += 1  # a wake-up an earlier pass asked for no longer counts, even if this one asks none
        if decision.next_wakeup is not None:
            self.push(decision.next_wakeup, _WAKE, -1, self.wake_gen)

    def change_queue(self, row: int, queue: int, reset: bool, now: float) -> None:
        """Demotion, or promotion (which resets t_J, δ_J and a_J, §3.2.3)."""
        fstate = self.fstate
        self.istate[_QUEUE, row] = queue
        if not reset:
            return
        fstate[_ATT, row] = fstate[_EXE, row] = fstate[_WAIT, row] = 0.0
        if self.istate[_STATUS, row] == _PENDING:
            self.pend_total[row] += now - fstate[_SINCE, row]
            fstate[_SINCE, row] = now
        else:  # (policies only promote waiting jobs)
            fstate[_ATT, row] = -float(self.istate[_GPUS, row]) * (now - fstate[_SINCE, row])
            fstate[_EXE, row] = -(now - fstate[_SINCE, row])

    def preempt(self, row: int, now: float) -> None:
        """Checkpoint and requeue a running job: its progress is banked, it owes a restore at its next start."""
        if self.stop(row, now) > 0:
            self.fruitless[row] = 0
        else:
            self.fruitless[row] += 1
            if self.fruitless[row] >= FRUITLESS_LIMIT:
                starving = math.isfinite(self.policy.options.starve_limit)
                raise ReplayStalled(
                    f"policy {self.policy.name} preempted job {self.sim.jobs[row].name!r} {FRUITLESS_LIMIT} times "
                    f"in a row before it did any work (each restart first restores for "
                    f"{self.stop_cost[row]:g} s): the replay would never end; a minimum run time longer than the "
                    "restore (--min-run-time) lets every run do work"
                    + (", as does a --starve-limit longer than the restore" if starving else "")
                )
        i = self.istate[:, row]
        i[_STATUS] = _PENDING
        gpus = i[_GPUS] = self.base_gpus[row]  # it waits for the GPUs it asked for
        self.fstate[_SINCE, row] = now
        self.version[row] += 1
        self.preempts[row] += 1
        self.pending_gpus += gpus
        cost = self.stop_cost[row]
        self.owed[row] = cost
        self.preempt_cost += cost
        self.pending.add(row)
        self.drop_completion()
        if self.record:
            self.log.append(SimEvent(now, EventKind.PREEMPT, int(self.sim.ids[row]), int(self.istate[_QUEUE, row])))

    def checkpoint(self, row: int, now: float) -> None:
        """The first half of a resize: the running elastic job checkpoints and lets go of its GPUs."""
        if self.istate[_STATUS, row] != _RUNNING:
            raise RuntimeError(f"policy {self.policy.name} resized job {row} that is not running")
        if isinstance(self.scaling[row], EstProfile):
            self.before[row] = (float(self.fstate[_SPEED, row]), self.per_type(self.alloc[row]))
        self.stop(row, now)

    def resize(self, row: int, gpus: int, node_rows: RowAllocation, now: float) -> None:
        """The second half: the job restarts from its checkpoint on ``gpus`` GPUs (it does not wait)."""
        self.istate[_GPUS, row] = gpus
        cost = self.stop_cost[row]
        self.resizes[row] += 1
        self.resize_cost += cost
        self.run_on(row, gpus, node_rows, now, overhead=cost, kind=EventKind.RESIZE)
        before = self.before.pop(row, None)
        profile = self.scaling[row]
        if before is not None and isinstance(profile, EstProfile) and gpus > sum(n for _, n in before[1]):
            # Role 3's observation once the job runs on its new GPUs (after its restore), with the failures in a row
            # before it; one slower is stamped with that time and calls for a pass then (the fallback's)
            last = profile.scale_out
            observed = ScaleOut(
                before[0],
                float(self.fstate[_SPEED, row]),
                before[1],
                earlier=last.failures if last else 0,
                grown=self.per_type(node_rows),
            )
            if observed.worse:
                observed = replace(observed, at=now + cost)
                self.push(now + cost, _WAKE, -1, _OBSERVED)
            self.scaling[row] = replace(profile, scale_out=observed)
        self.drop_completion()

    def per_type(self, node_rows: RowAllocation) -> tuple[tuple[str, int], ...]:
        """GPUs per type of an allocation, sorted by type."""
        names, pools = self.sim.cluster0.pool_names, self.node_pool
        counts: dict[str, int] = {}
        for node, count in node_rows:
            counts[names[pools[node]]] = counts.get(names[pools[node]], 0) + count
        return tuple(sorted(counts.items()))

    def start(self, row: int, node_rows: RowAllocation, now: float) -> None:
        """Start (or resume) a waiting job on these GPUs."""
        f, i = self.fstate[:, row], self.istate[:, row]
        v = f.tolist()
        status, gpus = i.item(_STATUS), i.item(_GPUS)
        if status != _PENDING:
            raise RuntimeError(f"policy {self.policy.name} started job {row} that is not pending")
        self.pend_total[row] += now - v[_SINCE]
        if v[_EXE] > 0.0:  # a waiting spell after the job ran counts toward δ_J
            f[_WAIT] = v[_WAIT] + (now - v[_SINCE])
        self.pending.discard(row)
        self.pending_gpus -= gpus
        # (an elastic job may start on more)
        gpus = node_rows[0][1] if len(node_rows) == 1 else sum(count for _, count in node_rows)
        if math.isnan(v[_FIRST]):
            f[_FIRST] = now
        overhead = self.owed[row]
        self.owed[row] = 0.0
        self.run_on(row, gpus, node_rows, now, overhead=overhead, kind=EventKind.START)

    def run_on(
        self, row: int, gpus: int, node_rows: RowAllocation, now: float, *, overhead: float, kind: EventKind
    ) -> None:
        """Put a job on these ``gpus`` GPUs from ``now``: its speed, and its completion event."""
        sim, free = self.sim, self.free
        f, i = self.fstate[:, row], self.istate[:, row]
        for node, count in node_rows:
            have = free.item(node)
            if have < count:
                raise RuntimeError(
                    f"policy {self.policy.name} placed job {row} on {sim.cluster0.names[node]} "
                    f"which has {have} free GPUs, not {count}"
                )
            free[node] = have - count
        self.busy_gpus += gpus
        self.free_total -= gpus
        pool = self.node_pool[node_rows[0][0]]
        i[_GPUS], i[_STATUS], i[_POOL] = gpus, _RUNNING, pool
        self.alloc[row] = node_rows
        spread = sim.cluster0.spread(node_rows)
        skew = self.skew[row]
        skewed = not math.isnan(skew) and skew > self.cfg.skew_sensitive
        speed = 1.0 / self.spread_slowdown if (spread and skewed) else 1.0
        if self.cfg.refit_pack_limit and sim.models[row] and not math.isnan(skew):
            obs = self.observed.setdefault((sim.models[row], not spread), [skew, 0.0, 0.0])
            obs[1] += speed
            obs[2] += 1.0
            self.n_observed += 1
        base = self.base_gpus[row]
        curve: ScalingCurve = self.scaling[row] or LINEAR
        if isinstance(curve, EstProfile):  # Eq. 1d of its plan on its GPUs per type, relative to its request
            speed *= curve.throughput(dict(self.per_type(node_rows))) / curve.throughput({curve.base_type: base})
        elif gpus != base:
            speed *= curve.at(gpus) / curve.at(base)
        f[_SINCE], f[_SPEED], f[_OVERHEAD] = now, speed, overhead
        version = self.version[row] = self.version[row] + 1
        self.push(now + overhead + f.item(_REMAIN) / speed, _COMPLETION, row, version)
        if self.record:
            named = tuple((sim.cluster0.names[node], count) for node, count in node_rows)
            self.log.append(SimEvent(now, kind, int(sim.ids[row]), i.item(_QUEUE), named))

    # ------------------------------------------------------------------------------------------ the result

    def result(self, wall: float) -> SimResult:
        sim = self.sim
        return SimResult(
            policy=sim.policy.name,
            job_ids=tuple(int(x) for x in sim.ids.tolist()),
            names=tuple(job.name for job in sim.jobs),
            gpus=sim.gpus,
            submit=sim.submit,
            first_start=self.fstate[_FIRST].copy(),
            end=np.array(self.end, dtype=np.float64),
            queue_delay=np.array(self.pend_total, dtype=np.float64),
            preemptions=np.array(self.preempts, dtype=np.int64),
            preemption_cost=self.preempt_cost,
            busy_gpu_seconds=self.busy,
            capacity_gpus=self.capacity,
            dropped=sim.dropped,
            events=self.events,
            passes=self.passes,
            shortcut_passes=self.shortcuts,
            wall_seconds=wall,
            timeline=Timeline(
                np.array(self.t_log, dtype=np.float64),
                np.array(self.w_log, dtype=np.int64),
                np.array(self.b_log, dtype=np.int64),
            ),
            resizes=np.array(self.resizes, dtype=np.int64),
            resize_cost=self.resize_cost,
            log=tuple(self.log),
            pack_limit=self.policy.options.pack_limit,
            model=sim.config.model,
            scale_outs=tuple(s.scale_out if isinstance(s, EstProfile) else None for s in self.scaling),
        )


def _refit(policy: Policy, observed: dict[tuple[str, bool], list[float]], tolerance: float) -> Policy:
    """The policy with PACKLIMIT refitted from the mean speed of every (model, placement) observed."""
    samples = [
        PlacementSample(model, skew, consolidated, total / count)
        for (model, consolidated), (skew, total, count) in observed.items()
    ]
    current = policy.options.pack_limit
    fitted = fit_pack_limit(samples, tolerance=tolerance, current=current)
    return policy if fitted == current else policy.with_options(replace(policy.options, pack_limit=fitted))
