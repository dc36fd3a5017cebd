"""DLRover's Brain in the loop of a running PS job (§4.2): sample, optimize, adjust, each plan applied to the job's
processes while it trains.

The decisions are :mod:`hpc_elastic.policy.brain`'s (pure); this module reads the processes and applies plans:

- **readings**: the job master's ``usage`` (each worker's CPU seconds and peak memory, sent with its leases; each
  PS's, asked then; the samples accepted) twice, ``window_s`` apart; :func:`usage_between` turns two readings into
  Brain's :class:`~hpc_elastic.policy.brain.Usage` (cores in use = CPU seconds per second) and samples/s;
- **sample**: the job starts with :func:`~hpc_elastic.policy.brain.sample_plan` (the fewest workers with a node's
  cores, a few PS); its readings give ``ŵ`` and ``ŝ`` (:func:`~hpc_elastic.policy.brain.estimate`);
- **optimize**: Eq. 10-11 (:func:`~hpc_elastic.policy.brain.optimize`), applied;
- **adjust**: at most ``max_adjust`` times, the first problem of the running job fixed
  (:func:`~hpc_elastic.policy.brain.adjust`: idle PS cores -> more workers, a hot PS -> a larger one), applied, until
  Brain finds none;
- **fallback** (ours, the paper is silent): every applied plan's samples/s (the window of :meth:`BrainAgent.measure`,
  after the change's warm-up) goes into a :class:`~hpc_elastic.policy.brain.PlanRecord`; a plan measured below the
  best observed one by more than ``tolerance`` is left for that one
  (:func:`~hpc_elastic.policy.brain.fall_back`), applied as any plan is, measured again, and adjust goes on from it;
  the plan left is never applied again (an adjust that proposes it ends the adjusts, ``refused`` with the reason).
  A window at whose end the job had no shard left to hand out measured the job's tail, not the plan: it is not
  recorded, and Brain stops there (``full_window`` false in the report).

A plan is applied through :class:`~hpc_elastic.ps.job.PsJob`: workers of another size or beyond the plan's count
scaled in (SIGTERM: their shards go back to TODO), PS of sizes the plan drops removed and the new ones added (each a
re-partition while the workers wait; a hot PS is thus replaced by a larger one), workers added; every process of
its plan's cores (an ``srun --exact`` step of them, or pinned to cores of its own here). Under ``srun`` a plan must
also fit the allocation's nodes (:meth:`BrainAgent.refusal`: the new steps placed beside those the plan keeps);
one that does not is refused with the reason (``refused`` in the report) and the job trains on with the plan it has;
a step Slurm still does not start (:class:`~hpc_elastic.ps.job.StepNotPlaced`) rolls the job back to the plan it had.
No plan exceeds ``cores``, the cores the PS job may use (the allocation's, less the job master's): Brain is given
the cores not held as the partition's free ones. Memory per process follows the cores (``STEP_MEM_MB_PER_CPU`` per
core), at least what an out-of-memory end gave its role: a process whose step Slurm ended for its memory comes back
with twice it (:func:`~hpc_elastic.policy.brain.out_of_memory`, asked by the job's launcher whenever it polls, see
:mod:`hpc_elastic.ps.allocation`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpc_elastic.policy.brain import (
    DEFAULT_FALLBACK_TOLERANCE,
    DEFAULT_HOT_THRESHOLD,
    Estimates,
    Fallback,
    JobLimits,
    Partition,
    PlanRecord,
    ResourcePlan,
    Stage,
    Usage,
    adjust,
    estimate,
    fall_back,
    optimize,
    sample_plan,
)
from hpc_elastic.ps.config import STEP_MEM_MB_PER_CPU
from hpc_elastic.ps.job import START_TIMEOUT_S, ProcessFailed, PsJob, StepNotPlaced
from hpc_elastic.ps.rpc import RemoteError

#: adjust steps at most, after optimize
DEFAULT_MAX_ADJUST = 4


@dataclass(frozen=True)
class Reading:
    """One answer of the master's ``usage``: its clock, the samples accepted so far, each live worker's last reading
    (CPU s, peak MiB, the master's clock when it came) and each PS's (CPU s, peak MiB) in partition order."""

    time: float
    samples: int
    workers: Mapping[str, tuple[float, float, float]]
    ps: tuple[tuple[float, float], ...]

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> Reading:
        return cls(
            time=float(reply["time"]),
            samples=int(reply["samples"]),
            workers={w: (float(u[0]), float(u[1]), float(u[2])) for w, u in reply["workers"].items()},
            ps=tuple((float(p["cpu_s"]), float(p["rss_mb"])) for p in reply["ps"]),
        )


def usage_between(before: Reading, after: Reading, plan: ResourcePlan) -> tuple[Usage, float]:
    """Brain's :class:`Usage` of ``plan`` between two readings, and the samples/s meanwhile. A worker's cores in use
    are its CPU seconds per second between its own two readings; a worker of the plan without two readings (just
    started) counts as the mean of the others. ``ValueError`` when the PS changed between the readings or no time
    passed."""
    span = after.time - before.time
    if span <= 0:
        raise ValueError(f"readings {span:.3f} s apart: take the second one later")
    if len(before.ps) != len(after.ps) or len(after.ps) != plan.num_ps:
        raise ValueError(f"{len(before.ps)} then {len(after.ps)} PS read for a plan of {plan.num_ps}")
    rates: list[float] = []
    rss: list[float] = []
    for worker, (cpu, mem, t) in after.workers.items():
        first = before.workers.get(worker)
        if first is not None and t > first[2]:
            rates.append(max(cpu - first[0], 0.0) / (t - first[2]))
            rss.append(mem)
    n = plan.workers.count
    mean = sum(rates) / len(rates) if rates else 0.0
    rates = (rates + [mean] * n)[:n]
    rss = (rss + [max(rss, default=1.0)] * n)[:n]
    ps_cpu = tuple(max(a[0] - b[0], 0.0) / span for a, b in zip(after.ps, before.ps, strict=True))
    usage = Usage(plan=plan, worker_cpu=tuple(rates), worker_rss_mb=tuple(rss), ps_cpu=ps_cpu)
    return usage, (after.samples - before.samples) / span


@dataclass(frozen=True)
class BrainStep:
    """A plan Brain chose, why, and the samples/s the job trained at under it; ``full_window``: whether the job had
    work left for its workers at the window's end (else the window measured the job's end, not the plan)."""

    stage: Stage
    plan: ResourcePlan
    samples_s: float
    estimates: Estimates | None = None
    full_window: bool = True

    def describe(self) -> str:
        w = self.plan.workers
        ps = "+".join(str(c) for c in self.plan.ps_cores)
        return (
            f"{self.stage.value}: {w.count} workers of {w.cores} cores, PS cores {ps}: {self.samples_s:,.0f} samples/s"
            f" ({'; '.join(self.plan.reasons)})"
        )


@dataclass(frozen=True)
class Refusal:
    """A plan Brain chose and did not apply (or rolled back), and why."""

    stage: Stage
    plan: ResourcePlan
    reason: str

    def to_json(self) -> dict[str, Any]:
        w = self.plan.workers
        return {"stage": self.stage.value, "workers": w.count, "worker_cores": w.cores,
                "ps_cores": list(self.plan.ps_cores), "reason": self.reason}  # fmt: skip


@dataclass(frozen=True)
class Changes:
    """What applying a plan does to the running job: the workers stopped, the PS removed (their indices now), the
    PS added (their cores), the workers added (their count, each of the plan's worker cores); ``kept_ps``: the index
    of a PS that is to go but stays until the new ones hold the parameters (every PS of the job is to go)."""

    stop_workers: tuple[str, ...]
    drop_ps: tuple[int, ...]
    add_ps: tuple[int, ...]
    add_workers: int
    kept_ps: int | None


def changes(plan: ResourcePlan, worker_cores: Mapping[str, int], ps_cores: tuple[int, ...]) -> Changes:
    """The changes that make a job of workers ``worker_cores`` (id -> cores, oldest first) and PS ``ps_cores`` that
    of ``plan``: workers of another size, then the newest beyond the plan's count, stop; PS of sizes the plan does
    not keep go, PS of the sizes it lacks come."""
    w = plan.workers
    stop = [worker for worker, cores in worker_cores.items() if cores != w.cores]
    staying = [worker for worker in worker_cores if worker not in stop]
    stop += staying[w.count :]
    want = list(plan.ps_cores)
    drop: list[int] = []
    for index, cores in enumerate(ps_cores):
        if cores in want:
            want.remove(cores)
        else:
            drop.append(index)
    kept = drop[0] if drop and len(drop) == len(ps_cores) else None
    add = tuple(sorted(want, reverse=True))  # the largest first, as the books place them
    return Changes(tuple(stop), tuple(drop), add, max(w.count - len(staying), 0), kept)


def _plan_json(plan: ResourcePlan) -> dict[str, Any]:
    w = plan.workers
    return {"workers": w.count, "worker_cores": w.cores, "ps_cores": list(plan.ps_cores)}


@dataclass(frozen=True)
class FallbackStep:
    """A fallback applied: the decision (the plan left and its samples/s, the best observed plan and its samples/s)
    and the samples/s measured again once the job ran the best plan anew."""

    decision: Fallback
    after_samples_s: float

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {
            "from": {**_plan_json(d.worse.plan), "samples_s": round(d.worse.samples_s, 1)},
            "to": {**_plan_json(d.best.plan), "samples_s": round(d.best.samples_s, 1)},
            "after_samples_s": round(self.after_samples_s, 1),
            "reason": d.plan.reasons[0],
        }


class Interrupted(Exception):
    """The job's wrapper has something to do (a stop, a user's scale request): Brain hands the job back."""


def _never() -> bool:
    return False


class BrainAgent:
    """Drive a job (started with :meth:`initial_plan`'s PS and no worker) through sample, optimize, adjust."""

    def __init__(
        self,
        limits: JobLimits,
        *,
        cores: int,
        cores_per_node: int,
        mem_per_node_mb: int,
        window_s: float = 3.0,
        max_adjust: int = DEFAULT_MAX_ADJUST,
        hot_threshold: float = DEFAULT_HOT_THRESHOLD,
        tolerance: float = DEFAULT_FALLBACK_TOLERANCE,
    ) -> None:
        if cores < 2 or cores_per_node < 1 or window_s <= 0 or max_adjust < 0 or not 0 <= tolerance < 1:
            raise ValueError(
                f"bad Brain settings: cores={cores} cores_per_node={cores_per_node} window_s={window_s} "
                f"max_adjust={max_adjust} tolerance={tolerance}"
            )
        self.limits = limits
        self.cores = cores
        self.cores_per_node = cores_per_node
        self.mem_per_node_mb = mem_per_node_mb
        self.window_s = window_s
        self.max_adjust = max_adjust
        self.hot_threshold = hot_threshold
        self.tolerance = tolerance
        self.steps: list[BrainStep] = []
        self.refused: list[Refusal] = []
        self.fallbacks: list[FallbackStep] = []
        self.record = PlanRecord()  # every plan applied and its samples/s
        self.interrupted = False  # whether :meth:`run` handed the job back before it was done
        self._interrupt: Callable[[], bool] = _never

    def partition(self, held: int) -> Partition:
        """What Brain may grow into: the PS job's cores not held by ``held``."""
        return Partition(self.cores_per_node, self.mem_per_node_mb, max(self.cores - held, 0))

    def initial_plan(self) -> ResourcePlan:
        """The sample stage's plan: the job starts with its PS (:meth:`run` adds the workers)."""
        return sample_plan(self.limits, self.partition(0), mem_mb=STEP_MEM_MB_PER_CPU)

    def _sleep(self, job: PsJob, seconds: float) -> None:
        """Wait, handling lost processes meanwhile; :class:`Interrupted` as soon as the wrapper asks for the job."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._interrupt():
                raise Interrupted
            job.poll()
            time.sleep(0.05)

    def read(self, job: PsJob) -> Reading:
        """The master's readings; while a PS does not answer (lost: the launcher replaces it), again."""
        assert job.master is not None, "start the job first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                reply, _ = job.master.call("usage")
            except RemoteError:
                if time.monotonic() > deadline:
                    raise
                self._sleep(job, 0.5)
                continue
            return Reading.from_reply(reply)

    def measure(self, job: PsJob, plan: ResourcePlan) -> tuple[Usage, float]:
        """Wait until every worker of ``plan`` trains (has leased), let it warm up for a window, then read it over
        one."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not set(job.workers) <= set(self.read(job).workers):
            if time.monotonic() > deadline:
                raise ProcessFailed(f"the workers did not lease within {START_TIMEOUT_S:.0f} s")
            self._sleep(job, 0.1)
        self._sleep(job, self.window_s)
        before = self.read(job)
        self._sleep(job, self.window_s)
        return usage_between(before, self.read(job), plan)

    def refusal(self, job: PsJob, plan: ResourcePlan) -> str | None:
        """Why ``plan`` cannot be applied to ``job`` (its new steps fit no node of the allocation beside the steps
        it keeps, :meth:`hpc_elastic.ps.placement.Nodes.refusal`), or None; always None without the allocation's
        nodes (the local launcher)."""
        if job.nodes is None:
            return None
        change = changes(plan, job.worker_cores, job.ps_cores)
        held = job.held_by_node()
        gone = [job.workers[w] for w in change.stop_workers]
        gone += [job.ps[i] for i in change.drop_ps if i != change.kept_ps]
        for proc in gone:
            if proc.node is not None:
                held[proc.node] -= proc.cpus
        # in the order apply() goes: the new PS beside a PS kept for the parameters, then, that one gone, the workers
        held, reason = job.nodes.placed(change.add_ps, held)
        if reason is not None:
            return reason
        if change.kept_ps is not None:
            kept = job.ps[change.kept_ps]
            if kept.node is not None:
                held[kept.node] -= kept.cpus
        return job.nodes.refusal([plan.workers.cores] * change.add_workers, held)

    def apply(self, job: PsJob, plan: ResourcePlan) -> None:
        """Make the job's processes those of ``plan`` (see the module's docstring)."""
        if plan.total_cores > self.cores:
            raise ValueError(f"a plan of {plan.total_cores} cores exceeds the job's {self.cores}")
        change = changes(plan, job.worker_cores, job.ps_cores)
        for worker in change.stop_workers:
            job.kill_worker(worker, signal.SIGTERM)
        drop = [job.ps[i] for i in change.drop_ps]
        kept = job.ps[change.kept_ps] if change.kept_ps is not None else None
        for proc in drop:  # one kept while all go: the parameters must live somewhere
            if proc is not kept:
                job.remove_ps(job.ps.index(proc))
        for cores in change.add_ps:
            job.add_ps(cores)
        if kept is not None:
            job.remove_ps(job.ps.index(kept))
        for _ in range(change.add_workers):
            job.add_worker(cpus=plan.workers.cores)

    def change_to(self, job: PsJob, plan: ResourcePlan, current: ResourcePlan) -> bool:
        """Apply ``plan`` to the job running ``current``, unless it does not fit the allocation; a step Slurm did
        not start rolls the job back to ``current``. Whether ``plan`` runs now (else its refusal is recorded)."""
        reason = self.refusal(job, plan)
        if reason is None:
            try:
                self.apply(job, plan)
                return True
            except StepNotPlaced as exc:
                reason = f"{exc}; rolled back"
                self.apply(job, current)
        self.refused.append(Refusal(plan.stage, plan, reason))
        return False

    def work_left(self, job: PsJob) -> bool:
        """Whether the job still has shards to hand out (TODO not empty, or an epoch to come): a window that ends
        without measures the last shards' tail, not the plan."""
        assert job.master is not None, "start the job first"
        status, _ = job.master.call("status")
        queues = status["queues"]
        return not status["finished"] and (queues["todo"] > 0 or queues["epoch"] < len(status["epochs"]) - 1)

    def measured(self, stage: Stage, job: PsJob, plan: ResourcePlan) -> tuple[Usage, bool]:
        """Measure ``plan`` running (:meth:`measure`) and record it as a step of ``stage``; in :attr:`record` only
        when the job had work left at the window's end (whether it had: the second value)."""
        usage, rate = self.measure(job, plan)
        full = self.work_left(job)
        if full:
            self.record = self.record.observe(plan, rate)
        self.steps.append(BrainStep(stage, plan, rate, full_window=full))
        return usage, full

    def fall_back(self, job: PsJob, plan: ResourcePlan, usage: Usage) -> tuple[ResourcePlan, Usage, bool]:
        """After ``plan`` was measured: back to the best observed plan when ``plan`` measured below it by more than
        the tolerance (:func:`~hpc_elastic.policy.brain.fall_back`), applied through :meth:`change_to` and measured
        again; the plan the job runs now, its usage, and whether its window was full (:meth:`measured`)."""
        decision = fall_back(self.record, plan, self.limits, self.partition(plan.total_cores), tolerance=self.tolerance)
        if decision is None:
            return plan, usage, True
        self.record = decision.record
        if not self.change_to(job, decision.plan, plan):
            return plan, usage, True
        usage, full = self.measured(Stage.FALLBACK, job, decision.plan)
        self.fallbacks.append(FallbackStep(decision, self.steps[-1].samples_s))
        return decision.plan, usage, full

    def run(self, job: PsJob, interrupt: Callable[[], bool] = _never) -> list[BrainStep]:
        """Sample, optimize, then adjust ``job`` until Brain finds nothing to fix or ``max_adjust`` steps were
        applied, or ``interrupt()`` says the job's wrapper has something to do (looked at while Brain waits; then
        Brain stops for good, ``interrupted``); after each plan measured, back to the best observed one when it is
        slower (:meth:`fall_back`); the steps taken (``steps``). The job trains on afterwards."""
        self._interrupt = interrupt
        try:
            return self._run(job)
        except Interrupted:
            self.interrupted = True
            return self.steps

    def _run(self, job: PsJob) -> list[BrainStep]:
        plan = self.initial_plan()
        reason = self.refusal(job, plan)
        if reason is not None:
            raise StepNotPlaced(f"Brain's sample plan does not fit the allocation: {reason}")
        self.apply(job, plan)
        usage, rate = self.measure(job, plan)
        estimates = estimate(usage)
        full = self.work_left(job)
        if full:
            self.record = self.record.observe(plan, rate)
        self.steps.append(BrainStep(Stage.SAMPLE, plan, rate, estimates, full))
        held = plan.total_cores
        found = optimize(estimates, self.limits, self.partition(held), ps_mem_mb=STEP_MEM_MB_PER_CPU, held_cores=held)
        if not self.change_to(job, found, plan):
            return self.steps
        plan = found
        usage, full = self.measured(Stage.OPTIMIZE, job, plan)
        if not full:  # the job is at its end: nothing more to measure
            return self.steps
        plan, usage, full = self.fall_back(job, plan, usage)
        if not full:
            return self.steps
        for _ in range(self.max_adjust):
            adjusted = adjust(
                usage, estimates, self.limits, self.partition(plan.total_cores), hot_threshold=self.hot_threshold
            )
            if adjusted is None:
                break
            if self.record.rejects(adjusted):  # measured slower than a plan the job ran: not again
                self.refused.append(Refusal(adjusted.stage, adjusted, "measured slower before (fallback): not again"))
                break
            if not self.change_to(job, adjusted, plan):
                break
            plan = adjusted
            usage, full = self.measured(Stage.ADJUST, job, plan)
            if not full:
                break
            plan, usage, full = self.fall_back(job, plan, usage)
            if not full:
                break
        return self.steps

    @property
    def adjust_steps(self) -> int:
        return sum(1 for s in self.steps if s.stage is Stage.ADJUST)

    def report(self) -> dict[str, Any]:
        """The steps taken, as JSON."""
        steps = [
            {
                "stage": s.stage.value,
                "workers": s.plan.workers.count,
                "worker_cores": s.plan.workers.cores,
                "ps_cores": list(s.plan.ps_cores),
                "samples_s": round(s.samples_s, 1),
                "full_window": s.full_window,
                "reasons": list(s.plan.reasons),
            }
            for s in self.steps
        ]
        return {
            "cores": self.cores,
            "steps": steps,
            "adjust_steps": self.adjust_steps,
            "refused": [r.to_json() for r in self.refused],
            "fallbacks": [f.to_json() for f in self.fallbacks],
            "interrupted": self.interrupted,
        }
