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
  Brain finds none.

A plan is applied through :class:`~hpc_elastic.ps.job.PsJob`: workers of another size or beyond the plan's count
scaled in (SIGTERM: their shards go back to TODO), PS of sizes the plan drops removed and the new ones added (each a
re-partition while the workers wait; a hot PS is thus replaced by a larger one), workers added; every process of
its plan's cores (an ``srun --exact`` step of them, or pinned to cores of its own here). No plan exceeds ``cores``,
the cores the PS job may use (the allocation's, less the job master's): Brain is given the cores not held as the
partition's free ones. Memory per process follows the cores (``STEP_MEM_MB_PER_CPU`` per core), at least what an
out-of-memory end gave its role: a process whose step Slurm ended for its memory comes back with twice it
(:func:`~hpc_elastic.policy.brain.out_of_memory`, asked by the job's launcher whenever it polls, see
:mod:`hpc_elastic.ps.allocation`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpc_elastic.policy.brain import (
    Estimates,
    JobLimits,
    Partition,
    ResourcePlan,
    Stage,
    Usage,
    adjust,
    estimate,
    optimize,
    sample_plan,
)
from hpc_elastic.ps.config import STEP_MEM_MB_PER_CPU
from hpc_elastic.ps.job import START_TIMEOUT_S, ProcessFailed, PsJob
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
    """A plan Brain chose, why, and the samples/s the job trained at under it."""

    stage: Stage
    plan: ResourcePlan
    samples_s: float
    estimates: Estimates | None = None

    def describe(self) -> str:
        w = self.plan.workers
        ps = "+".join(str(c) for c in self.plan.ps_cores)
        return (
            f"{self.stage.value}: {w.count} workers of {w.cores} cores, PS cores {ps}: {self.samples_s:,.0f} samples/s"
            f" ({'; '.join(self.plan.reasons)})"
        )


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
    ) -> None:
        if cores < 2 or cores_per_node < 1 or window_s <= 0 or max_adjust < 0:
            raise ValueError(
                f"bad Brain settings: cores={cores} cores_per_node={cores_per_node} window_s={window_s} "
                f"max_adjust={max_adjust}"
            )
        self.limits = limits
        self.cores = cores
        self.cores_per_node = cores_per_node
        self.mem_per_node_mb = mem_per_node_mb
        self.window_s = window_s
        self.max_adjust = max_adjust
        self.steps: list[BrainStep] = []
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

    def apply(self, job: PsJob, plan: ResourcePlan) -> None:
        """Make the job's processes those of ``plan`` (see the module's docstring)."""
        if plan.total_cores > self.cores:
            raise ValueError(f"a plan of {plan.total_cores} cores exceeds the job's {self.cores}")
        w = plan.workers
        for worker, cores in list(job.worker_cores.items()):
            if cores != w.cores:
                job.kill_worker(worker, signal.SIGTERM)
        while len(job.workers) > w.count:
            job.kill_worker(list(job.workers)[-1], signal.SIGTERM)
        want = list(plan.ps_cores)
        drop: list[int] = []
        for cores in job.ps_cores:
            if cores in want:
                want.remove(cores)
            else:
                drop.append(cores)
        while drop and len(job.ps) > 1:  # keep one PS: the parameters must live somewhere
            job.remove_ps(job.ps_cores.index(drop.pop()))
        for cores in want:
            job.add_ps(cores)
        for cores in drop:
            job.remove_ps(job.ps_cores.index(cores))
        while len(job.workers) < w.count:
            job.add_worker(cpus=w.cores)

    def run(self, job: PsJob, interrupt: Callable[[], bool] = _never) -> list[BrainStep]:
        """Sample, optimize, then adjust ``job`` until Brain finds nothing to fix or ``max_adjust`` steps were
        applied, or ``interrupt()`` says the job's wrapper has something to do (looked at while Brain waits; then
        Brain stops for good, ``interrupted``); the steps taken (``steps``). The job trains on afterwards."""
        self._interrupt = interrupt
        try:
            return self._run(job)
        except Interrupted:
            self.interrupted = True
            return self.steps

    def _run(self, job: PsJob) -> list[BrainStep]:
        plan = self.initial_plan()
        self.apply(job, plan)
        usage, rate = self.measure(job, plan)
        estimates = estimate(usage)
        self.steps.append(BrainStep(Stage.SAMPLE, plan, rate, estimates))
        held = plan.total_cores
        plan = optimize(estimates, self.limits, self.partition(held), ps_mem_mb=STEP_MEM_MB_PER_CPU, held_cores=held)
        self.apply(job, plan)
        usage, rate = self.measure(job, plan)
        self.steps.append(BrainStep(Stage.OPTIMIZE, plan, rate))
        for _ in range(self.max_adjust):
            found = adjust(usage, estimates, self.limits, self.partition(plan.total_cores))
            if found is None:
                break
            plan = found
            self.apply(job, plan)
            usage, rate = self.measure(job, plan)
            self.steps.append(BrainStep(Stage.ADJUST, plan, rate))
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
                "reasons": list(s.plan.reasons),
            }
            for s in self.steps
        ]
        return {
            "cores": self.cores,
            "steps": steps,
            "adjust_steps": self.adjust_steps,
            "interrupted": self.interrupted,
        }
