"""Discrete-event simulator of a GPU cluster under a scheduling policy (Tiresias §5.1 "Simulator").

Events: job arrival, completion, and policy wake-ups (a demotion threshold crossed while jobs wait, a
promotion due, a minimum run time or time slice ending), optionally aligned to periodic scheduling ticks. Time
jumps from one event to the next; after the events of an instant, one scheduling pass runs when anything changed,
and its starts, preemptions and queue changes are applied.

Model:

- a job needs ``duration`` seconds of work on its ``gpus`` GPUs; it runs ``spread_slowdown`` times slower while
  placed on several nodes if its skew exceeds ``skew_sensitive`` (Tiresias §2.2, Figure 3: skewed models such
  as VGG lose speed when not consolidated);
- a preempted job is checkpointed to the shared filesystem and restored when it resumes (§2.2, Figures 4-5): it
  then first spends ``2 x checkpoint_bytes / bandwidth + restart_overhead`` seconds on its GPUs before making
  progress again (default bandwidth 1.2 GB/s, Tiresias's GPFS, §5.1 "Testbed");
- attained service a_J accrues at ``gpus`` GPU-seconds per second of wall time on GPUs, overheads included;
- optionally (``refit_pack_limit``) PACKLIMIT is refitted during the replay from the observed (placement, speed)
  pairs of the jobs started so far with :func:`hpc_elastic.policy.placement.fit_pack_limit` (§3.3.2,
  "Determining PACKLIMIT"), as the paper does periodically from job history.

The job state lives in numpy arrays; one pass hands the policy a :class:`JobTable` of the active jobs built with
a dozen vectorised gathers, so a replay costs roughly (number of events) x (cost of one pass).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from hpc_elastic.policy.gittins import ServiceDistribution
from hpc_elastic.policy.placement import PlacementSample, fit_pack_limit
from hpc_elastic.policy.policies import Policy
from hpc_elastic.policy.types import ClusterState, Decision, FloatArray, IntArray, JobTable, PassInput
from hpc_elastic.sim.cluster import NodeSpec
from hpc_elastic.sim.models import DEFAULT_CHECKPOINT_BYTES
from hpc_elastic.sim.trace import TraceJob

DEFAULT_BANDWIDTH = 1.2e9
"""Shared-filesystem bandwidth, bytes/s: GPFS read/write throughput per machine in Tiresias's testbed (§5.1)."""

_PENDING, _RUNNING, _DONE = 1, 2, 3
_COMPLETION, _WAKE = 1, 2
_TICK = -1
# columns of the per-job state tables
_SUBMIT, _SINCE, _OVERHEAD, _SPEED, _ATT, _EXE, _WAIT, _FIRST, _SKEW, _REMAIN, _LIMIT, _POS = range(12)
_F_COLUMNS = 12
_GPUS, _STATUS, _QUEUE, _MASK, _POOL = range(5)
_I_COLUMNS = 5


class EventKind(StrEnum):
    ARRIVE = "arrive"
    START = "start"
    PREEMPT = "preempt"
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
        checks = {
            "bandwidth": self.bandwidth > 0,
            "restart_overhead": self.restart_overhead >= 0,
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
    log: tuple[SimEvent, ...] = ()
    #: PACKLIMIT in force at the end of the replay (differs from the policy's knob after a refit).
    pack_limit: float = math.nan

    @property
    def jct(self) -> FloatArray:
        return self.end - self.submit

    @property
    def finished(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.end)))


ProgressFn = Callable[[int, int], None]


class Simulator:
    """Replays ``jobs`` on ``nodes`` under ``policy``. One instance runs once."""

    def __init__(
        self, jobs: Sequence[TraceJob], nodes: Sequence[NodeSpec], policy: Policy, config: SimConfig | None = None
    ) -> None:
        if not nodes:
            raise ValueError("the cluster has no nodes")
        self.config = config or SimConfig()
        self.policy = policy
        self.nodes = tuple(nodes)
        self.cluster0 = ClusterState.from_nodes([node.view() for node in self.nodes])
        typed = self.cluster0.pool_names != ("",)
        pool_cap = np.bincount(self.cluster0.pool, weights=self.cluster0.total, minlength=self.cluster0.n_pools)
        ordered = sorted(jobs, key=lambda job: (job.submit, job.line))
        keep: list[TraceJob] = []
        dropped: list[str] = []
        masks: list[int] = []
        for job in ordered:
            mask = self.cluster0.pool_mask(job.gpu_types if typed else None)
            best = max((pool_cap[p] for p in range(self.cluster0.n_pools) if mask >> p & 1), default=0)
            if job.gpus > best:
                dropped.append(job.name)
                continue
            keep.append(job)
            masks.append(mask)
        self.jobs = tuple(keep)
        self.dropped = tuple(dropped)
        n = len(keep)
        cfg = self.config
        self.ids = np.arange(n, dtype=np.int64)
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

    # ------------------------------------------------------------------ run
    def run(self, progress: ProgressFn | None = None) -> SimResult:
        cfg = self.config
        n = len(self.jobs)
        cluster0 = self.cluster0
        node_pool = cluster0.pool
        free = cluster0.total.copy()
        # Per-job state in two row-major tables, so that a pass gathers the active rows in two operations;
        # the names below are column views into them.
        fstate = np.zeros((n, _F_COLUMNS), dtype=np.float64)
        istate = np.zeros((n, _I_COLUMNS), dtype=np.int64)
        fstate[:, _SUBMIT] = self.submit
        fstate[:, _SPEED] = 1.0
        fstate[:, _FIRST] = math.nan
        fstate[:, _SKEW] = self.skew
        fstate[:, _REMAIN] = self.work
        fstate[:, _LIMIT] = self.time_limit
        fstate[:, _POS] = math.nan
        istate[:, _GPUS] = self.gpus
        istate[:, _MASK] = self.pool_mask
        istate[:, _POOL] = -1
        since = fstate[:, _SINCE]
        overhead = fstate[:, _OVERHEAD]
        speed = fstate[:, _SPEED]
        att_base = fstate[:, _ATT]
        exe_base = fstate[:, _EXE]
        wait_base = fstate[:, _WAIT]
        first_start = fstate[:, _FIRST]
        remaining = fstate[:, _REMAIN]
        status = istate[:, _STATUS]
        queue = istate[:, _QUEUE]
        pool = istate[:, _POOL]
        end = np.full(n, math.nan)
        alloc = np.empty(n, dtype=object)
        alloc[:] = [()] * n
        owed = np.zeros(n, dtype=np.float64)  # restore overhead owed at the next start
        version = np.zeros(n, dtype=np.int64)
        preempts = np.zeros(n, dtype=np.int64)
        pend_total = np.zeros(n, dtype=np.float64)
        service_total = np.zeros(n, dtype=np.float64)
        busy = 0.0
        preempt_cost = 0.0
        log: list[SimEvent] = []
        record = cfg.record_events

        policy = self.policy
        learn = policy.uses_history and cfg.history is None
        if policy.uses_history and cfg.history is not None:
            policy = policy.with_history(cfg.history.samples.tolist())
        history: list[float] = []
        next_refresh = 1
        # (model, consolidated) -> [skew, Σ speed, count] of the runs started so far, for the PACKLIMIT refit.
        observed: dict[tuple[str, bool], list[float]] = {}
        n_observed = 0
        next_refit = 1
        preemptive = policy.preemptive

        active_arr = np.zeros(0, dtype=np.int64)  # rows of arrived, unfinished jobs (sorted)
        arrived: list[int] = []
        departed: list[int] = []
        # A non-preemptive policy ranks new jobs last, so arrivals alone only matter if one fits the free GPUs.
        lazy_arrivals = not policy.preemptive
        n_pending = 0
        pending_gpus = 0  # GPUs wanted by the waiting jobs
        shortcut = cfg.fit_shortcut and policy.fit_shortcut
        shortcuts = 0
        # Decision.idle_below of the last pass, and the GPUs completions have freed since it ran.
        idle_below = 0
        freed = 0
        heap: list[tuple[float, int, int, int, int]] = []
        seq = 0
        wake_gen = 0
        tick_pending = math.inf
        next_arrival = 0
        completed = 0
        events = passes = 0
        report_every = max(1, n // 200)
        started_wall = time.perf_counter()
        now = 0.0
        interval = cfg.sched_interval

        def stop(row: int, t: float) -> float:
            """Account a running job's run up to t; free its GPUs. Returns the wall seconds it ran."""
            nonlocal busy
            el = t - since[row]
            g = self.gpus[row]
            att_base[row] += g * el
            exe_base[row] += el
            service_total[row] += g * el
            busy += g * el
            for node, count in alloc[row]:
                free[node] += count
            alloc[row] = ()
            pool[row] = -1
            return float(el)

        def table_of(rows: IntArray, now: float) -> JobTable:
            """The policy's view of these jobs at ``now`` (a few vectorised gathers)."""
            fg = fstate[rows]
            ig = istate[rows]
            running = ig[:, _STATUS] == _RUNNING
            g_rows = ig[:, _GPUS]
            el = now - fg[:, _SINCE]
            el_run = np.where(running, el, 0.0)
            progress_run = np.maximum(el_run - fg[:, _OVERHEAD], 0.0) * fg[:, _SPEED]
            return JobTable(
                job_ids=self.ids[rows],
                gpus=g_rows,
                submit=fg[:, _SUBMIT],
                running=running,
                attained=fg[:, _ATT] + g_rows * el_run,
                executed=fg[:, _EXE] + el_run,
                # δ_J: waiting since the job first ran after its arrival / last promotion, all spells (§3.2.3)
                waiting=np.where(running | (fg[:, _EXE] <= 0.0), 0.0, fg[:, _WAIT] + el),
                current_wait=np.where(running, 0.0, el),
                run_time=el_run,
                first_start=fg[:, _FIRST],
                queue=ig[:, _QUEUE],
                skew=fg[:, _SKEW],
                pool_mask=ig[:, _MASK],
                pool=ig[:, _POOL],
                alloc=alloc[rows],
                remaining=np.maximum(fg[:, _REMAIN] - progress_run, 0.0),
                time_limit=fg[:, _LIMIT],
                position=fg[:, _POS],
            )

        while True:
            t_arr = float(self.submit[next_arrival]) if next_arrival < n else math.inf
            t_heap = heap[0][0] if heap else math.inf
            t_next = min(t_arr, t_heap)
            if math.isinf(t_next):
                break
            now = float(t_next)
            changed = arrival = False
            free_total = int(free.sum()) if lazy_arrivals else 0
            # -- arrivals
            while next_arrival < n and self.submit[next_arrival] <= now:
                row = next_arrival
                next_arrival += 1
                status[row] = _PENDING
                since[row] = self.submit[row]
                arrived.append(row)
                n_pending += 1
                pending_gpus += int(self.gpus[row])
                if not lazy_arrivals or self.gpus[row] <= free_total:
                    changed = arrival = True
                elif cfg.skip_idle_passes:  # it can start once free GPUs reach its size (free_total = after + freed)
                    idle_below = min(idle_below, max(int(self.gpus[row]) - free_total + freed, 1))
                events += 1
                if record:
                    log.append(SimEvent(now, EventKind.ARRIVE, int(self.ids[row])))
            # -- completions and wake-ups due now
            wake = tick_now = False
            while heap and heap[0][0] <= now:
                _, _, kind, row, tag = heapq.heappop(heap)
                events += 1
                if kind == _COMPLETION:
                    if tag != version[row] or status[row] != _RUNNING:
                        continue
                    stop(row, now)
                    status[row] = _DONE
                    end[row] = now
                    remaining[row] = 0.0
                    departed.append(row)
                    changed = True
                    freed += int(self.gpus[row])
                    completed += 1
                    history.append(float(service_total[row]))
                    if record:
                        log.append(SimEvent(now, EventKind.COMPLETE, int(self.ids[row]), int(queue[row])))
                    if progress is not None and completed % report_every == 0:
                        progress(completed, n)
                elif tag == _TICK:  # periodic scheduling tick
                    tick_pending = math.inf
                    tick_now = True
                elif tag == wake_gen:  # only the latest pass's wake-up counts
                    wake = True
            if not (changed or wake or tick_now):
                continue
            if not (arrival or wake or tick_now) and freed < idle_below:
                continue  # the last pass said no completion this small can change its decision
            if interval > 0 and not tick_now:
                # Periodic scheduling: passes happen on ticks (multiples of the interval) only.
                tick = math.ceil(now / interval) * interval
                if tick > now:
                    if tick < tick_pending:
                        tick_pending = tick
                        seq += 1
                        heapq.heappush(heap, (tick, seq, _WAKE, -1, _TICK))
                    continue
            if n_pending == 0:
                continue
            if not preemptive and not free.any():
                continue
            # -- learned job-size history for 2D-Gittins
            if learn and len(history) >= next_refresh:
                policy = policy.with_history(history)
                next_refresh = max(int(len(history) * cfg.history_growth), len(history) + 1)
            # -- PACKLIMIT refitted from observed placements (§3.3.2)
            if cfg.refit_pack_limit and n_observed >= next_refit:
                policy = _refit(policy, observed, cfg.refit_tolerance)
                next_refit = max(int(n_observed * cfg.history_growth), n_observed + 1)
            # -- one scheduling pass
            if departed:
                active_arr = np.delete(active_arr, np.searchsorted(active_arr, departed))
                departed.clear()
            if arrived:
                active_arr = np.concatenate((active_arr, np.asarray(arrived, dtype=np.int64)))
                arrived.clear()
            cluster = ClusterState(
                names=cluster0.names,
                pool=node_pool,
                total=cluster0.total,
                free=free.copy(),
                switch=cluster0.switch,
                pool_names=cluster0.pool_names,
                index=cluster0.index,
            )
            rows = active_arr
            decision: Decision | None = None
            if shortcut and pending_gpus <= int(free.sum()):
                # Every waiting job may fit the free GPUs: ask the policy about the waiting jobs alone; if it
                # starts them all, a full pass would have decided exactly that (Policy.fit_shortcut).
                waiting_rows = rows[status[rows] == _PENDING]
                table = table_of(waiting_rows, now)
                sub = policy.schedule(PassInput(now, table, cluster))
                if len(sub.starts) == waiting_rows.size and not sub.preemptions:
                    decision, rows = sub, waiting_rows
                    shortcuts += 1
            if decision is None:
                table = table_of(rows, now)
                decision = policy.schedule(PassInput(now, table, cluster))
            passes += 1
            idle_below, freed = (decision.idle_below if cfg.skip_idle_passes else 0), 0
            if decision.positions is not None:
                fstate[rows, _POS] = decision.positions
            # -- apply: queue changes, preemptions, starts
            for change in decision.queue_changes:
                row = int(rows[change.row])
                queue[row] = change.queue
                if change.reset:
                    att_base[row] = exe_base[row] = wait_base[row] = 0.0
                    if status[row] == _PENDING:
                        pend_total[row] += now - since[row]
                        since[row] = now
                    else:  # (policies only promote waiting jobs)
                        att_base[row] = -float(self.gpus[row]) * (now - since[row])
                        exe_base[row] = -(now - since[row])
                if record:
                    kind_ = EventKind.PROMOTE if change.reset else EventKind.DEMOTE
                    log.append(
                        SimEvent(now, kind_, change.job_id, change.queue, attained=float(table.attained[change.row]))
                    )
            for pre in decision.preemptions:
                row = int(rows[pre.row])
                ran = stop(row, now)
                remaining[row] = max(remaining[row] - max(ran - overhead[row], 0.0) * speed[row], 0.0)
                status[row] = _PENDING
                since[row] = now
                version[row] += 1
                preempts[row] += 1
                pending_gpus += int(self.gpus[row])
                cost = 2.0 * self.ckpt[row] / cfg.bandwidth + cfg.restart_overhead
                owed[row] = cost
                preempt_cost += cost
                n_pending += 1
                if record:
                    log.append(SimEvent(now, EventKind.PREEMPT, pre.job_id, int(queue[row])))
            for start in decision.starts:
                row = int(rows[start.row])
                if status[row] != _PENDING:
                    raise RuntimeError(f"policy {policy.name} started job {start.job_id} that is not pending")
                for node, count in start.node_rows:
                    if free[node] < count:
                        raise RuntimeError(
                            f"policy {policy.name} placed job {start.job_id} on {cluster0.names[node]} "
                            f"which has {int(free[node])} free GPUs, not {count}"
                        )
                    free[node] -= count
                pend_total[row] += now - since[row]
                if exe_base[row] > 0.0:  # a waiting spell after the job ran counts toward δ_J
                    wait_base[row] += now - since[row]
                status[row] = _RUNNING
                n_pending -= 1
                pending_gpus -= int(self.gpus[row])
                since[row] = now
                alloc[row] = start.node_rows
                pool[row] = node_pool[start.node_rows[0][0]]
                spread = len(start.node_rows) > 1
                skewed = not math.isnan(self.skew[row]) and self.skew[row] > cfg.skew_sensitive
                speed[row] = 1.0 / cfg.spread_slowdown if (spread and skewed) else 1.0
                if cfg.refit_pack_limit and self.models[row] and not math.isnan(self.skew[row]):
                    obs = observed.setdefault((self.models[row], not spread), [float(self.skew[row]), 0.0, 0.0])
                    obs[1] += float(speed[row])
                    obs[2] += 1.0
                    n_observed += 1
                overhead[row] = owed[row]
                owed[row] = 0.0
                if math.isnan(first_start[row]):
                    first_start[row] = now
                version[row] += 1
                finish = now + overhead[row] + remaining[row] / speed[row]
                seq += 1
                heapq.heappush(heap, (float(finish), seq, _COMPLETION, row, int(version[row])))
                if record:
                    log.append(SimEvent(now, EventKind.START, start.job_id, int(queue[row]), start.allocation))
            if decision.next_wakeup is not None:
                wake_gen += 1
                seq += 1
                heapq.heappush(heap, (decision.next_wakeup, seq, _WAKE, -1, wake_gen))
        if progress is not None:
            progress(completed, n)
        return SimResult(
            policy=self.policy.name,
            job_ids=tuple(int(x) for x in self.ids.tolist()),
            names=tuple(job.name for job in self.jobs),
            gpus=self.gpus,
            submit=self.submit,
            first_start=first_start.copy(),
            end=end,
            queue_delay=pend_total,
            preemptions=preempts,
            preemption_cost=preempt_cost,
            busy_gpu_seconds=busy,
            capacity_gpus=int(cluster0.total.sum()),
            dropped=self.dropped,
            events=events,
            passes=passes,
            shortcut_passes=shortcuts,
            wall_seconds=time.perf_counter() - started_wall,
            log=tuple(log),
            pack_limit=policy.options.pack_limit,
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
