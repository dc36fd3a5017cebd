"""The slotted PS-job simulator (DL² §3.1-3.2, §4.3, simulations of §6.2-6.4).

Time is cut into slots of ``slot_seconds`` (20 minutes, §6.2). At the start of every slot the policy decides the
workers and PS of every arrived, unfinished job (:class:`~hpc_elastic.policy.slots.SlotPolicy`); during the slot a
job trains ``speed_factor x f(w, p) / steps_per_epoch`` epochs per second (Optimus' speed function of its type,
scaled by the job's hidden speed factor, §6.4), less the seconds it spends starting or rescaling: a job whose
(workers, PS) changed from the previous slot pauses ``rescale_seconds`` (DL² §5's hot scaling: the workers block
only while parameters move, seconds), and a job that did not run in the previous slot pauses ``start_seconds``
(launching its containers and loading its last checkpoint, tens of seconds as DL² Fig. 11 measures). A job that
reaches its epochs mid-slot finishes at that exact instant (its JCT has sub-slot resolution); its resources stay
idle for the rest of the slot (they are allocated per slot). The slot's reward is DL² Eq. 1: the sum over jobs
of the epochs trained in the slot over the job's total epochs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpc_elastic.policy.slot_registry import SLOT_POLICY_NAMES, SlotPolicyFactory, make_slot_policy
from hpc_elastic.policy.slot_tiresias import gang_fits
from hpc_elastic.policy.slots import JobType, Servers, SlotDecision, SlotInput, SlotJob, SlotPolicy
from hpc_elastic.sim.ps_jobs import (
    DEFAULT_SERVERS,
    JOB_TYPES,
    MAX_JOBS,
    SLOT_SECONDS,
    Arrival,
    SlotTraceJob,
    from_gpu_trace,
    generate,
)
from hpc_elastic.sim.trace import TraceFormat, load_trace

#: DL² §5 hot scaling: parameters move while the workers keep training, the block is short (§6.3, Fig. 11-12)
DEFAULT_RESCALE_SECONDS = 5.0
#: starting or resuming a job: containers, framework start and checkpoint load (Fig. 11's checkpointing: tens of s)
DEFAULT_START_SECONDS = 30.0
#: the safety bound on slots (about 3.8 years of 20-minute slots)
DEFAULT_MAX_SLOTS = 100_000


@dataclass(frozen=True, slots=True)
class SlotConfig:
    """The simulated cluster and its costs."""

    servers: Servers
    types: tuple[JobType, ...] = JOB_TYPES
    slot_seconds: float = SLOT_SECONDS
    rescale_seconds: float = DEFAULT_RESCALE_SECONDS
    max_slots: int = DEFAULT_MAX_SLOTS
    start_seconds: float = DEFAULT_START_SECONDS

    def __post_init__(self) -> None:
        if not isinstance(self.servers, Servers):
            raise ValueError(f"servers must be Servers, got {self.servers!r}")
        if not self.types:
            raise ValueError("a slot simulation needs at least one job type")
        if not (math.isfinite(self.slot_seconds) and self.slot_seconds > 0):
            raise ValueError(f"slot_seconds must be > 0, got {self.slot_seconds!r}")
        for name, value in (("rescale_seconds", self.rescale_seconds), ("start_seconds", self.start_seconds)):
            if not (math.isfinite(value) and 0 <= value <= self.slot_seconds):
                raise ValueError(f"{name} must be in [0, slot_seconds], got {value!r}")
        if isinstance(self.max_slots, bool) or not isinstance(self.max_slots, int) or self.max_slots < 1:
            raise ValueError(f"max_slots must be an int >= 1, got {self.max_slots!r}")


@dataclass(frozen=True, slots=True)
class SlotOutcome:
    """What one slot produced: DL² Eq. 1's reward, the epochs each running job trained, the jobs that finished."""

    reward: float
    epochs: tuple[tuple[int, float], ...]
    finished: tuple[int, ...]


SlotObserver = Callable[[SlotInput, SlotDecision, SlotOutcome], None]


@dataclass(frozen=True, slots=True)
class SlotResult:
    """One run: per-job JCT in seconds (arrival slot's start to finish), cluster metrics and a digest."""

    policy: str
    jct: tuple[tuple[int, float], ...]
    avg_jct: float
    makespan: float
    rewards: tuple[float, ...]
    gpu_util: float
    cpu_util: float
    rescales: int
    starts: int
    unfinished: tuple[int, ...]
    slots: int
    digest: str

    def summary(self) -> dict[str, Any]:
        """The scalar metrics, for JSON."""
        return {
            "policy": self.policy,
            "jobs": len(self.jct) + len(self.unfinished),
            "finished": len(self.jct),
            "unfinished": len(self.unfinished),
            "avg_jct_s": self.avg_jct,
            "avg_jct_slots": self.avg_jct / SLOT_SECONDS if math.isfinite(self.avg_jct) else self.avg_jct,
            "makespan_s": self.makespan,
            "slots": self.slots,
            "reward": float(sum(self.rewards)),
            "gpu_util": self.gpu_util,
            "cpu_util": self.cpu_util,
            "rescales": self.rescales,
            "starts": self.starts,
            "digest": self.digest,
        }


def _digest(finish: dict[int, float], unfinished: Sequence[int]) -> str:
    """sha256 of the canonical per-job result: ``id:finish-seconds-as-hex`` sorted by id, then the unfinished."""
    text = ";".join(f"{job}:{finish[job].hex()}" for job in sorted(finish))
    text += "|" + ",".join(str(job) for job in sorted(unfinished))
    return hashlib.sha256(text.encode()).hexdigest()


def validate_decision(policy: str, inp: SlotInput, decision: SlotDecision) -> None:
    """Reject a decision the cluster cannot carry out: ValueError naming the policy and the job.

    Every allocation names a job of the slot once, within its maxima, with one server per task; the tasks fit
    every server's GPUs and cores.
    """
    rows = {job.job_id: job for job in inp.jobs}
    servers = inp.servers
    n = len(servers.gpus)
    gpu = np.zeros(n, dtype=np.int64)
    cpu = np.zeros(n, dtype=np.int64)
    seen: set[int] = set()
    for alloc in decision.allocations:
        where = f"policy {policy!r}, slot {inp.slot}, job {alloc.job_id}"
        job = rows.get(alloc.job_id)
        if job is None:
            raise ValueError(f"{where}: not a job of this slot (not arrived, finished or unknown)")
        if alloc.job_id in seen:
            raise ValueError(f"{where}: allocated twice")
        seen.add(alloc.job_id)
        if not (0 <= alloc.workers <= job.max_workers and 0 <= alloc.ps <= job.max_ps):
            raise ValueError(f"{where}: {alloc.workers}w/{alloc.ps}ps outside 0..{job.max_workers}w/0..{job.max_ps}ps")
        if len(alloc.worker_servers) != alloc.workers or len(alloc.ps_servers) != alloc.ps:
            raise ValueError(
                f"{where}: {alloc.workers}w/{alloc.ps}ps placed on {len(alloc.worker_servers)} and "
                f"{len(alloc.ps_servers)} servers"
            )
        kind = inp.job_type(job)
        for server in (*alloc.worker_servers, *alloc.ps_servers):
            if not 0 <= server < n:
                raise ValueError(f"{where}: server {server} is not one of {n}")
        for server in alloc.worker_servers:
            gpu[server] += kind.worker_gpus
            cpu[server] += kind.worker_cpus
        for server in alloc.ps_servers:
            cpu[server] += kind.ps_cpus
        over = np.flatnonzero((gpu > np.asarray(servers.gpus)) | (cpu > np.asarray(servers.cpus)))
        if over.size:
            k = int(over[0])
            raise ValueError(
                f"{where}: server {k} over capacity ({int(gpu[k])}/{servers.gpus[k]} GPUs, "
                f"{int(cpu[k])}/{servers.cpus[k]} cores)"
            )


class SlotSimulator:
    """Runs a trace of PS jobs under a :class:`SlotPolicy`, one slot at a time (module docstring)."""

    def __init__(self, config: SlotConfig, jobs: Sequence[SlotTraceJob]) -> None:
        ids = [job.job_id for job in jobs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"job ids of a slot trace must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")
        for job in jobs:
            if job.job_type >= len(config.types):
                raise ValueError(f"job {job.job_id}: job_type {job.job_type} is not one of {len(config.types)}")
        runs = {t: gang_fits(config.servers, config.types[t], 1, 1) for t in {job.job_type for job in jobs}}
        never = [job for job in jobs if not runs[job.job_type]]
        if never:  # it would wait until max_slots under every policy
            kind = config.types[never[0].job_type]
            raise ValueError(
                f"{len(never)} job(s) can never run on these servers: one worker ({kind.worker_gpus} GPUs, "
                f"{kind.worker_cpus} cores) and one PS ({kind.ps_cpus} cores) of {kind.name} do not fit "
                f"(job {never[0].job_id})"
            )
        self.config = config
        self.jobs: tuple[SlotTraceJob, ...] = tuple(sorted(jobs, key=lambda job: (job.arrival, job.job_id)))

    def run(self, policy: SlotPolicy, observer: SlotObserver | None = None) -> SlotResult:
        cfg = self.config
        jobs = self.jobs
        slot_s = cfg.slot_seconds
        done = [0.0] * len(jobs)
        service = [0.0] * len(jobs)
        slots_run = [0] * len(jobs)
        prev: list[tuple[int, int]] = [(0, 0)] * len(jobs)
        finish: dict[int, float] = {}
        active: list[int] = []  # indices into jobs, in arrival order
        nxt = 0  # next job to arrive
        rewards: list[float] = []
        gpu_seconds = cpu_seconds = 0.0
        rescales = starts = 0
        slot = 0
        slots = 0
        while (active or nxt < len(jobs)) and slot < cfg.max_slots:
            if not active and jobs[nxt].arrival > slot:  # an idle cluster skips to the next arrival
                slot = jobs[nxt].arrival
                continue
            while nxt < len(jobs) and jobs[nxt].arrival <= slot:
                active.append(nxt)
                nxt += 1
            inp = SlotInput(
                slot,
                slot_s,
                cfg.types,
                cfg.servers,
                tuple(
                    SlotJob(
                        jobs[i].job_id,
                        jobs[i].job_type,
                        jobs[i].arrival,
                        jobs[i].epochs_total,
                        epochs_done=done[i],
                        slots_run=slots_run[i],
                        workers=prev[i][0],
                        ps=prev[i][1],
                        request_workers=jobs[i].request_workers,
                        request_ps=jobs[i].request_ps,
                        max_workers=jobs[i].max_workers,
                        max_ps=jobs[i].max_ps,
                        service=service[i],
                    )
                    for i in active
                ),
            )
            decision = policy.allocate(inp)
            validate_decision(policy.name, inp, decision)
            got = {alloc.job_id: (alloc.workers, alloc.ps) for alloc in decision.allocations}
            reward = 0.0
            trained: list[tuple[int, float]] = []
            ended: list[int] = []
            still: list[int] = []
            for i in active:
                job = jobs[i]
                kind = cfg.types[job.job_type]
                w, p = got.get(job.job_id, (0, 0))
                before = prev[i]
                prev[i] = (w, p)
                if w == 0 and p == 0:
                    still.append(i)
                    continue
                cost = 0.0
                if before == (0, 0):
                    cost, starts = cfg.start_seconds, starts + 1
                elif before != (w, p):
                    cost, rescales = cfg.rescale_seconds, rescales + 1
                slots_run[i] += 1
                rate = job.speed_factor * kind.epochs_per_second(w, p)
                left = job.epochs_total - done[i]
                useful = slot_s - cost
                busy = slot_s  # seconds the job holds its resources this slot
                # finished when what it has done reaches the total as the sum is kept (``rate x useful`` a hair
                # below ``left`` can still round ``done + rate x useful`` up to the total)
                if rate > 0 and done[i] + rate * useful >= job.epochs_total:
                    busy = cost + min(useful, left / rate)
                    epochs = left
                    finish[job.job_id] = slot * slot_s + busy
                    ended.append(job.job_id)
                else:
                    epochs = rate * useful
                    done[i] += epochs
                    still.append(i)
                gpus = w * kind.worker_gpus
                service[i] += gpus * busy
                gpu_seconds += gpus * busy
                cpu_seconds += (w * kind.worker_cpus + p * kind.ps_cpus) * busy
                reward += epochs / job.epochs_total
                trained.append((job.job_id, epochs))
            active = still
            rewards.append(reward)
            slots += 1
            if observer is not None:
                observer(inp, decision, SlotOutcome(reward, tuple(trained), tuple(ended)))
            slot += 1

        unfinished = tuple(sorted(job.job_id for job in jobs if job.job_id not in finish))
        by_id = {job.job_id: job for job in jobs}
        jct = tuple((job, finish[job] - by_id[job].arrival * slot_s) for job in sorted(finish))
        makespan = max(finish.values(), default=0.0) if not unfinished else slot * slot_s
        avg = sum(t for _, t in jct) / len(jct) if jct else math.nan
        capacity = makespan if makespan > 0 else math.inf
        return SlotResult(
            policy=policy.name,
            jct=jct,
            avg_jct=avg,
            makespan=makespan,
            rewards=tuple(rewards),
            gpu_util=gpu_seconds / (cfg.servers.total_gpus * capacity) if cfg.servers.total_gpus else 0.0,
            cpu_util=cpu_seconds / (cfg.servers.total_cpus * capacity),
            rescales=rescales,
            starts=starts,
            unfinished=unfinished,
            slots=slots,
            digest=_digest(finish, unfinished),
        )


#: jobs of a generated trace when none is given
DEFAULT_JOBS = 200


@dataclass(frozen=True, slots=True)
class PsExperiment:
    """One ``simulate-ps`` run: policies on one trace, generated (:func:`~hpc_elastic.sim.ps_jobs.generate`) or
    converted from a GPU trace file (:func:`~hpc_elastic.sim.ps_jobs.from_gpu_trace`)."""

    policies: tuple[str, ...] = SLOT_POLICY_NAMES
    seed: int = 0
    jobs: int | None = None
    servers: Servers = DEFAULT_SERVERS
    load: float = 3.0
    arrival: Arrival = Arrival.DIURNAL
    variation: float = 0.0
    trace: Path | None = None
    trace_format: TraceFormat | None = None
    time_scale: float = 1.0
    slot_seconds: float = SLOT_SECONDS

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("name at least one slot policy")
        if self.jobs is not None and not 1 <= self.jobs <= MAX_JOBS:
            raise ValueError(f"jobs must be 1..{MAX_JOBS:,}, got {self.jobs!r}")
        if (self.trace is None) != (self.trace_format is None):
            raise ValueError("a trace file needs its format, and a format needs a trace file")

    def config(self) -> SlotConfig:
        return SlotConfig(self.servers, slot_seconds=self.slot_seconds)

    def trace_jobs(self) -> tuple[SlotTraceJob, ...]:
        """The experiment's PS jobs."""
        if self.trace is None or self.trace_format is None:
            return generate(
                self.seed,
                self.jobs or DEFAULT_JOBS,
                self.servers,
                arrival=self.arrival,
                load=self.load,
                variation=self.variation,
                slot_seconds=self.slot_seconds,
            )
        loaded = load_trace(self.trace, self.trace_format).jobs
        if self.jobs is not None:
            loaded = loaded[: self.jobs]
        return from_gpu_trace(
            loaded,
            seed=self.seed,
            servers=self.servers,
            slot_seconds=self.slot_seconds,
            time_scale=self.time_scale,
            variation=self.variation,
        )


def run_ps_experiment(
    experiment: PsExperiment, extra: dict[str, SlotPolicyFactory] | None = None
) -> tuple[SlotResult, ...]:
    """Every policy of ``experiment`` on its trace (policies are built first: an unknown name runs nothing)."""
    policies = [make_slot_policy(name, extra) for name in experiment.policies]
    jobs = experiment.trace_jobs()
    if not jobs:
        raise ValueError("the trace has no jobs")
    simulator = SlotSimulator(experiment.config(), jobs)
    return tuple(simulator.run(policy) for policy in policies)
