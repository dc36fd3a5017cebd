"""The body of a ps-mode batch job (``hpc-elastic-run --mode=ps ...``, written by ``hpc-elastic submit --mode ps``):
inside the allocation it starts the job master, the parameter servers and the workers, each as a job step of its
own (:class:`hpc_elastic.ps.job.PsJob` with the ``srun`` launcher), watches them until training ends and leaves the
master's final status in the job directory (``<job dir>/ps/status.json``, and on stdout, the job's output).

The job directory is the one of every hpc-elastic job (:class:`hpc_elastic.jobdir.JobDir`): the processes' logs and
addresses in ``ps/``, the PS job's checkpoints in ``checkpoints/``, taken every :data:`CHECKPOINT_EVERY` shards
done, from which a lost parameter server is recovered in the running job.

    hpc-elastic-run --mode=ps --ckpt-root=DIR --workers-range=A:B --ps-range=C:D [--cpus-per-worker=N]
                    [--grace=S] [--max-requeues=N] [--ps-config=JSON]

The allocation holds room for the job master, D PS and B workers, N cores each. With fixed sizes (``A == B`` and
``C == D``) the job runs C parameter servers and B workers. With a range to choose from, DLRover's Brain chooses
(:class:`hpc_elastic.ps.brain_agent.BrainAgent`, beside the job master): it starts the job with its sample plan,
then applies its optimize and adjust plans as new steps. Its budget ``C_total`` is the ``(B + D) · N`` cores asked
for; its partition is the allocation: the cores the master does not hold (an allocation of whole nodes, say with
``--exclusive``, holds more than the budget: Brain's adjust may grow into them, as the paper lets it), and ``C_max``
the largest share of a node beside the master, so that a hot PS may be replaced by a step of more than N cores.
Each step goes on a node of the allocation where it fits (:mod:`hpc_elastic.ps.placement`, from
``SLURM_JOB_NODELIST`` and ``SLURM_JOB_CPUS_PER_NODE``); a plan whose steps fit no node is refused with the reason,
and a step Slurm does not start within a bound rolls the plan back (:class:`hpc_elastic.ps.brain_agent.BrainAgent`).
Brain's steps and refusals go into the status (``brain``).

Out of memory: a process whose step ended other than cleanly is looked up in Slurm's accounting
(:meth:`PsWrapper.step_end`); one Slurm ended for its memory comes back as a new step with the memory of Brain's
adjust (:meth:`PsWrapper.memory_after_oom`: twice what it had, within the allocation's memory on a node); each such
end goes into the status (``oom``).

Stops, as a data-parallel job's (:mod:`hpc_elastic.launch.stops` decides, :class:`PsWrapper` acts): on ``USR1``
(the scheduler daemon's checkpoint signal with its notice in the job's ``AdminComment``, the time-limit warning of
``--signal=B:USR1@grace``, a user's ``scancel --signal=USR1 --batch``; at the run's end less the grace when that
warning was lost: :class:`~hpc_elastic.launch.supervisor.WarningDeadline`) or a ``control/stop`` request, the wrapper
has the master checkpoint the PS parameters, its queues and the ledger as one cut, acknowledges it in
``control/ack.json``, stops the steps and requeues the job (a time limit while ``--max-requeues`` lasts; a cancel
or Slurm's own requeue is left to Slurm). A run that finds a checkpoint in the job directory restores it (the
queues DOING-first, the ledger with the parameters): a requeued job goes on where it stopped, and one requeued by
Slurm without a stop (a node lost) from its latest periodic checkpoint. ``TERM``/``INT`` to the wrapper (a cancel,
the time limit itself) stop the steps at once. Exit status: 0 when training finished with every sample counted
exactly once per epoch, or the job was requeued; 1 otherwise.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from hpc_elastic.checkpoint import layout
from hpc_elastic.env import JobEnvironment, read_environment, read_job_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.files import atomic_write_bytes
from hpc_elastic.jobdir import (
    Ack,
    Progress,
    ScaleNotice,
    ScaleReply,
    ScaleRequest,
    StopReason,
    StopRequest,
    next_progress,
)
from hpc_elastic.launch.spec import (
    check_ckpt_root,
    check_range,
    check_wrapper_limits,
    parse_number,
    parse_range,
    ps_job_config,
)
from hpc_elastic.launch.stops import Action, after_stop
from hpc_elastic.launch.supervisor import (
    WarningDeadline,
    job_dir_of,
    job_ref_of,
    sigterm_reason_now,
    take_usr1,
    term_ignored,
    usr1_reason_now,
)
from hpc_elastic.policy.brain import Group, JobLimits, Partition, Range, ResourcePlan, Role, Stage, out_of_memory
from hpc_elastic.ps import checkpoint as ps_checkpoint
from hpc_elastic.ps.brain_agent import BrainAgent
from hpc_elastic.ps.config import STEP_MEM_MB_PER_CPU, PsJobConfig
from hpc_elastic.ps.job import OutOfMemory, ProcessFailed, PsJob, PsLauncher, StepNotPlaced, exit_on_signal
from hpc_elastic.ps.placement import Nodes
from hpc_elastic.slurm import connect
from hpc_elastic.slurm.client import SlurmClient
from hpc_elastic.slurm.errors import SlurmError
from hpc_elastic.slurm.parse import expand_hostlist
from hpc_elastic.slurm.types import Step

#: the PS job checkpoints parameters, queues and ledger after every this many shards done
CHECKPOINT_EVERY = 8
#: the wrapper waits this long for training to end (the job's time limit ends it first)
WAIT_S = 7 * 24 * 3600.0
#: seconds Brain lets a plan warm up, then reads it over
BRAIN_WINDOW_S = 2.0
#: seconds between two looks at the job's processes, its control files and the wrapper's signals
POLL_S = 0.2
#: seconds Slurm's accounting may take to record how a step ended
STEP_END_WAIT_S = 10.0
#: seconds a job master that stopped answering may take to exit: its connection resets as the kernel closes its
#: sockets, before the process (or the srun that runs it) can be reaped
MASTER_EXIT_WAIT_S = 10.0


@dataclass(frozen=True)
class PsWrapperConfig:
    ckpt_root: Path
    workers_range: tuple[int, int]
    ps_range: tuple[int, int]
    cpus_per_worker: int = 1
    grace_s: float = 120.0
    settings: str | None = None
    max_requeues: int = 0  # requeues at the time limit (``--max-requeues``)

    def __post_init__(self) -> None:
        check_ckpt_root(self.ckpt_root)
        check_range(self.workers_range, "--workers-range")
        check_range(self.ps_range, "--ps-range")
        if not 1 <= self.cpus_per_worker <= MAX_ESTS:
            raise ValueError(f"--cpus-per-worker must be between 1 and {MAX_ESTS}, got {self.cpus_per_worker}")
        check_wrapper_limits(grace_s=self.grace_s, max_requeues=self.max_requeues)

    def job_config(self) -> PsJobConfig:
        return ps_job_config(self.settings, self.ps_range[0], self.workers_range[1])

    @property
    def cores(self) -> int:
        """The cores of the allocation beside the job master's."""
        return (self.workers_range[1] + self.ps_range[1]) * self.cpus_per_worker

    def brain(self, nodes: Nodes | None = None) -> BrainAgent | None:
        """Brain for a job with sizes to choose (a range of workers or of PS), else None. Its budget is the cores
        asked for (:attr:`cores`); given the allocation's ``nodes``, it may use their cores beside the job master's
        task and a process may have the largest share of a node beside it; without them (local processes), the
        budget and processes of at most the task size."""
        (w_lo, w_hi), (p_lo, p_hi) = self.workers_range, self.ps_range
        if w_lo == w_hi and p_lo == p_hi:
            return None
        config = self.job_config()
        steps = config.epochs * -(-config.num_samples // config.batch_size)
        limits = JobLimits(c_total=self.cores, workers=Range(w_lo, w_hi), ps=Range(p_lo, p_hi), total_steps=steps)
        cores, c_max = self.cores, self.cpus_per_worker
        if nodes is not None:
            master = nodes.place(self.cpus_per_worker, {})
            if master is None:
                raise ValueError(f"no node of the allocation {nodes.cpus} holds the job master's task")
            beside = {master: self.cpus_per_worker}
            cores, c_max = nodes.total - self.cpus_per_worker, nodes.largest_free(beside)
        return BrainAgent(
            limits,
            cores=cores,
            cores_per_node=c_max,
            mem_per_node_mb=STEP_MEM_MB_PER_CPU * c_max,
            window_s=BRAIN_WINDOW_S,
            hot_threshold=config.hot_threshold,
        )


@dataclass(frozen=True)
class ScaleDecision:
    """What a scale request comes to: the sizes to set, or why it is refused (``refusal``; the sizes unchanged)."""

    workers: int
    ps: int
    refusal: str | None = None


def decide_scale(
    request: ScaleRequest, workers: int, ps_cores: tuple[int, ...], config: PsWrapperConfig, cores: int
) -> ScaleDecision:
    """A scale request against the running job (``workers`` workers, PS of ``ps_cores`` cores each): the counts
    asked for (the running ones where the request leaves one out), within the job's ranges; the job it asks for is
    the user's shape, every process of the job's task size (``cpus_per_worker``: :func:`apply_sizes` replaces the
    processes Brain gave another size), at most the allocation's ``cores`` beside the master
    (:meth:`PsWrapper.allocation_cores`). Whether its steps fit the nodes is :meth:`PsWrapper.scale`'s check."""
    want_w = request.workers if request.workers is not None else workers
    want_p = request.ps if request.ps is not None else len(ps_cores)
    for what, value, (lo, hi) in (("workers", want_w, config.workers_range), ("ps", want_p, config.ps_range)):
        if not lo <= value <= hi:
            return ScaleDecision(workers, len(ps_cores), f"{what} {value} is outside the job's range {lo}:{hi}")
    need = (want_w + want_p) * config.cpus_per_worker
    if need > cores:
        return ScaleDecision(
            workers,
            len(ps_cores),
            f"{want_w} workers and {want_p} PS of {config.cpus_per_worker} cores need {need} cores; the allocation "
            f"has {cores}",
        )
    return ScaleDecision(want_w, want_p)


def parse_args(argv: Sequence[str]) -> PsWrapperConfig:
    """The wrapper's ps-mode options (``--mode=ps`` first); ``ValueError`` naming a bad or missing one."""
    if not argv or argv[0] != "--mode=ps":
        raise ValueError("usage: hpc-elastic-run --mode=ps --ckpt-root=DIR --workers-range=A:B --ps-range=C:D ...")
    values: dict[str, Any] = {}
    for option in argv[1:]:
        key, _, value = option.partition("=")
        if key == "--ckpt-root" and value:
            values["ckpt_root"] = Path(value)
        elif key == "--workers-range" and value:
            values["workers_range"] = parse_range(value, key)
        elif key == "--ps-range" and value:
            values["ps_range"] = parse_range(value, key)
        elif key == "--cpus-per-worker" and value:
            values["cpus_per_worker"] = parse_number(value, key, int)
        elif key == "--grace" and value:
            values["grace_s"] = parse_number(value, key, float)
        elif key == "--max-requeues" and value:
            values["max_requeues"] = parse_number(value, key, int)
        elif key == "--ps-config" and value:
            values["settings"] = value
        else:
            raise ValueError(f"hpc-elastic-run: unknown or incomplete option {option!r}")
    missing = [o for o, k in (("--ckpt-root", "ckpt_root"), ("--workers-range", "workers_range"),
                              ("--ps-range", "ps_range")) if k not in values]  # fmt: skip
    if missing:
        raise ValueError(f"hpc-elastic-run --mode=ps: {missing[0]} is required")
    config = PsWrapperConfig(**values)
    config.job_config()  # the settings' own checks
    return config


class Outcome(StrEnum):
    """How the wrapper's watch over a running PS job ended."""

    FINISHED = "finished"  # training ended (the master's final status)
    STOPPED = "stopped"  # stopped for a stop request: checkpointed, the steps to be stopped, then after_stop
    LOST = "lost"  # the job master's step ended under the wrapper (Slurm signalled the steps): ask Slurm why


class PsWrapper:
    """The wrapper of one incarnation of a ps-mode job. ``slurm``, ``clock`` and the launcher are injectable (the
    tests run the processes locally)."""

    def __init__(
        self,
        config: PsWrapperConfig,
        job: JobEnvironment,
        slurm: SlurmClient,
        *,
        launcher: PsLauncher = PsLauncher.SRUN,
        clock: Callable[[], float] = time.time,
        steps: Callable[[int], list[Step]] | None = None,
        liveness_s: float | None = None,
    ) -> None:
        if job.job_id is None:
            raise ValueError("hpc-elastic-run --mode=ps runs inside a Slurm allocation (no SLURM_JOB_ID)")
        self.config = config
        self.job = job
        self.slurm = slurm
        self.launcher = launcher
        self.clock = clock
        self.job_dir = job_dir_of(config.ckpt_root, job)
        self.steps = steps  # a job's steps from Slurm's accounting: how a process's step ended (out of memory?)
        self.liveness_s = liveness_s  # the job master's worker liveness timeout (default: the master's own)
        self.ps_job: PsJob | None = None
        self.usr1 = False
        #: ``USR2``: the scheduler daemon's scale notice waits in the job's AdminComment
        self.usr2 = False
        self._notice_at: float | None = None  # the requested_at of the last scale notice taken
        #: the stop acted on: its reason and when it was requested
        self.stop: tuple[StopReason, float] | None = None
        self.progress: Progress | None = None  # this run's last progress record
        #: when Slurm's time-limit warning is due, if it does not come (read when the run starts)
        self.warning = WarningDeadline(None, config.grace_s)

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self.usr1 = True

    def _on_usr2(self, signum: int, frame: FrameType | None) -> None:
        self.usr2 = True

    def prepare(self) -> bool:
        """Create or check the job directory, set aside a previous incarnation's stop and acknowledgement, remove the
        temporaries of writes a kill interrupted; whether this run restores the job (a checkpoint of an earlier run
        exists)."""
        self.job_dir.prepare()
        self.job_dir.set_aside(int(self.clock()))
        self.job_dir.sweep_temporaries(self.clock())
        return ps_checkpoint.latest(self.job_dir.checkpoints) is not None

    def run(self) -> int:
        """Run the PS job in this allocation; the exit status (see the module's docstring)."""
        restore = self.prepare()
        self.warning = WarningDeadline.read(self.slurm, self.job, self.config.grace_s)
        previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, exit_on_signal),  # a cancel, the time limit: stop the steps
            signal.SIGINT: signal.signal(signal.SIGINT, exit_on_signal),
            signal.SIGUSR1: take_usr1(self._on_usr1),
            signal.SIGUSR2: signal.signal(signal.SIGUSR2, self._on_usr2),
        }
        try:
            return self._run(restore)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def nodes(self) -> Nodes | None:
        """The allocation's nodes and CPUs on each, where the steps are placed (``srun``); None for local processes.
        ``ValueError`` when Slurm's environment does not tell them."""
        if self.launcher is not PsLauncher.SRUN:
            return None
        names, counts = expand_hostlist(self.job.node_list), self.job.cpus_per_node
        if not names or not counts:
            raise ValueError("SLURM_JOB_NODELIST and SLURM_JOB_CPUS_PER_NODE must tell the allocation's nodes")
        return Nodes.of(names, counts)

    def _run(self, restore: bool) -> int:
        config = self.config
        job_config, ps_cpus = config.job_config(), None
        nodes = self.nodes()
        agent = config.brain(nodes)
        if agent is not None:
            first = agent.initial_plan()
            job_config, ps_cpus = replace(job_config, num_ps=first.num_ps, num_workers=0), first.ps_cores[0]
        restarts = self.job.restart_count
        print(
            f"hpc-elastic-run: ps job {self.job.job_id} restart {restarts}: "
            + (f"restores {ps_checkpoint.latest(self.job_dir.checkpoints)}" if restore else "starts from scratch"),
            file=sys.stderr,
            flush=True,
        )
        ps_job = PsJob(
            job_config,
            self.job_dir.ps,
            checkpoint_dir=self.job_dir.checkpoints,
            checkpoint_every=CHECKPOINT_EVERY,
            restore=restore,
            worker_prefix="w" if restarts == 0 else f"r{restarts}w",  # ids of this incarnation, in the ledger
            launcher=self.launcher,
            cpus_per_process=config.cpus_per_worker,
            ps_cpus=ps_cpus,
            step_end=self.step_end if self.steps is not None else None,
            memory_after_oom=self.memory_after_oom,
            nodes=nodes,
            liveness_s=self.liveness_s,
        )
        self.ps_job = ps_job
        with ps_job:
            if agent is not None:
                try:
                    agent.run(ps_job, interrupt=self.wanted)
                except (ValueError, HpcElasticError) as exc:  # Brain cannot go on here: train on with what runs
                    print(f"hpc-elastic-run: Brain stopped: {exc}", file=sys.stderr, flush=True)
                    if not ps_job.workers:
                        ps_job.add_worker()
            outcome, status = self.watch(ps_job)
            if outcome is Outcome.FINISHED:  # while the PS still run
                status["held_out"] = ps_job.held_out()
        if outcome is Outcome.FINISHED:
            if agent is not None:
                status["brain"] = agent.report()
            status["oom"] = [record.to_json() for record in ps_job.oom]
            text = json.dumps(status)
            atomic_write_bytes(self.job_dir.ps / "status.json", text.encode())
            print(text, flush=True)
            good = status["finished"] and all(e["exactly_once"] for e in status["epochs"])
            return 0 if good else 1
        return self.after(outcome, status)

    # -- out of memory ----------------------------------------------------------------------------------------------

    def step_end(self, name: str) -> Step | None:
        """How the latest step named ``name`` (a process of the PS job) ended, from Slurm's accounting, which may
        take a moment to record it; None when it does not say within :data:`STEP_END_WAIT_S`."""
        assert self.steps is not None and self.job.job_id is not None
        deadline = time.monotonic() + STEP_END_WAIT_S
        while True:
            try:
                found = [s for s in self.steps(self.job.job_id) if s.name == name and s.number is not None]
            except SlurmError as exc:
                print(f"hpc-elastic-run: cannot read the steps: {exc}", file=sys.stderr, flush=True)
                found = []
            if found:
                last = max(found, key=lambda s: s.number or 0)
                if not last.state.is_active:
                    return last
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)

    def memory_after_oom(self, end: OutOfMemory) -> int:
        """Brain's adjust for a process that ran out of memory (:func:`hpc_elastic.policy.brain.out_of_memory`):
        the memory it comes back with, within the allocation's memory on a node. ``ValueError`` when there is none
        (a worker that cannot get twice its memory; a PS whose fix would be more PS, which this job does not add)."""
        assert self.ps_job is not None
        job, config = self.ps_job, self.config
        worker_mem = max(job.worker_mem_mb.values(), default=STEP_MEM_MB_PER_CPU * config.cpus_per_worker)
        workers = Group(
            len(job.workers) + (end.role is Role.WORKER),
            max(job.worker_cores.values(), default=config.cpus_per_worker),
            end.mem_mb if end.role is Role.WORKER else worker_mem,
        )
        ps_mem = end.mem_mb if end.role is Role.PS else max(job.ps_mem_mb)
        plan = ResourcePlan(workers, job.ps_cores, ps_mem, Stage.ADJUST)
        limits = JobLimits(config.cores, Range(*config.workers_range), Range(*config.ps_range))
        node_mb = self.job.mem_on_node_mb or STEP_MEM_MB_PER_CPU * config.cpus_per_worker
        new = out_of_memory(plan, end.role, end.mem_mb, limits, Partition(config.cpus_per_worker, node_mb, 0))
        if new is None or new.num_ps != plan.num_ps:
            raise ValueError(
                f"{end.process} needs more than {end.mem_mb} MiB and a node of the allocation has {node_mb}"
            )
        print(f"hpc-elastic-run: Brain: {'; '.join(new.reasons)}", file=sys.stderr, flush=True)
        return new.workers.mem_mb if end.role is Role.WORKER else new.ps_mem_mb

    # -- the watch ------------------------------------------------------------------------------------------------

    def watch(self, ps_job: PsJob) -> tuple[Outcome, dict[str, Any]]:
        """Watch the running job until training ends, a stop is requested (checkpointed here, before the steps
        stop), or the job master's step ends under it. The outcome and the master's last status."""
        deadline = time.monotonic() + WAIT_S
        while True:
            if _master_ended(ps_job):
                return Outcome.LOST, {}
            stop = self.take_stop()
            if stop is not None:
                self.stop = stop
                try:
                    return Outcome.STOPPED, self.checkpoint_for_stop(ps_job, stop[0])
                except HpcElasticError as exc:  # no checkpoint of the stop: the next run restores an older one
                    print(f"hpc-elastic-run: no checkpoint for the stop: {exc}", file=sys.stderr, flush=True)
                    return Outcome.STOPPED, {}
            try:
                ps_job.poll()
                self.scale(ps_job)
                status = ps_job.status()
                self.record_progress(ps_job, status)
            except HpcElasticError:
                if _master_ended(ps_job, within_s=MASTER_EXIT_WAIT_S):  # Slurm signalled the steps: the PS and
                    return Outcome.LOST, {}  # the master went first
                raise
            if status["finished"] and not ps_job.workers:
                return Outcome.FINISHED, status
            if not ps_job.workers and not status["finished"]:
                raise ProcessFailed(f"no worker left and training not finished: {status['queues']}")
            if time.monotonic() > deadline:
                raise ProcessFailed(f"training not finished within {WAIT_S:.0f} s: {status['queues']}")
            time.sleep(POLL_S)

    def record_progress(self, ps_job: PsJob, status: dict[str, Any]) -> None:
        """``control/progress.json`` (at most every :data:`~hpc_elastic.jobdir.PROGRESS_EVERY_S`): shards done,
        workers and PS running, epochs complete of the job's epochs (what the scheduler's DL² policy reads). A failed
        write is reported, never fatal."""
        epochs = status.get("epochs", [])
        record = next_progress(
            self.progress,
            step=int(status.get("shards_done", 0)),
            now=self.clock(),
            world_size=max(1, len(ps_job.workers)),
            restart_count=self.job.restart_count,
            attempt=0,
        )
        if record is None:
            return
        done = float(sum(1 for epoch in epochs if epoch.get("complete")))
        record = replace(record, ps=max(1, len(ps_job.ps)), epochs_done=done, epochs_total=float(max(1, len(epochs))))
        try:
            self.job_dir.record_progress(record)
        except OSError as exc:
            print(f"hpc-elastic-run: progress not recorded: {exc}", file=sys.stderr, flush=True)
            return
        self.progress = record

    def scale(self, ps_job: PsJob) -> ScaleReply | None:
        """Apply a scale request, or refuse it with the reason, and answer it in ``control/scale-reply.json``; None
        when there was none. A request is the user's in the job directory (``hpc-elastic scale``,
        :meth:`hpc_elastic.jobdir.JobDir.take_scale`), else, after ``USR2``, the scheduler daemon's notice in the
        job's AdminComment (:meth:`scale_notice`)."""
        try:
            request = self.job_dir.take_scale(int(self.clock()))
        except ValueError as exc:
            return self._reply(ps_job, None, str(exc))
        if request is None:
            request = self.scale_notice()
        if request is None:
            return None
        cores = self.allocation_cores(ps_job)
        decision = decide_scale(request, len(ps_job.workers), ps_job.ps_cores, self.config, cores)
        if decision.refusal is None:
            decision = replace(decision, refusal=self.node_refusal(ps_job, decision))
        if decision.refusal is not None:  # refused before any step is stopped or started
            return self._reply(ps_job, request.requested_at, decision.refusal)
        try:
            apply_sizes(ps_job, decision.workers, decision.ps, self.config.cpus_per_worker)
        except StepNotPlaced as exc:  # a PS step Slurm did not start within the bound: the job goes on from here
            return self._reply(ps_job, request.requested_at, str(exc))
        return self._reply(ps_job, request.requested_at, None)

    def scale_notice(self) -> ScaleRequest | None:
        """After ``USR2``: the daemon's scale notice for this incarnation in the job's AdminComment
        (:class:`hpc_elastic.jobdir.ScaleNotice`), once; None when there is none, it is for another incarnation, it
        was taken already, or Slurm cannot be read (logged)."""
        if not self.usr2 or self.job.job_id is None:
            return None
        self.usr2 = False
        try:
            notice = ScaleNotice.decode(self.slurm.job(self.job.job_id).admin_comment)
        except SlurmError as exc:
            print(f"hpc-elastic-run: USR2 but the job cannot be read: {exc}", file=sys.stderr, flush=True)
            return None
        if notice is None or notice.restarts != self.job.restart_count or notice.requested_at == self._notice_at:
            return None
        self._notice_at = notice.requested_at
        return notice.request

    def node_refusal(self, ps_job: PsJob, decision: ScaleDecision) -> str | None:
        """Why applying a scale decision would start a step that fits no node of the allocation: :func:`apply_sizes`
        tried on the job's :class:`Books` first; None when every step fits, or for local processes."""
        books = Books.of(ps_job)
        if books is None:
            return None
        try:
            apply_sizes(books, decision.workers, decision.ps, self.config.cpus_per_worker)
        except StepNotPlaced as exc:
            return str(exc)
        return None

    def allocation_cores(self, ps_job: PsJob) -> int:
        """The allocation's cores beside the job master's task: of its nodes (``srun``), else
        :attr:`PsWrapperConfig.cores`."""
        if ps_job.nodes is None:
            return self.config.cores
        return ps_job.nodes.total - self.config.cpus_per_worker

    def _reply(self, ps_job: PsJob, requested_at: float | None, refusal: str | None) -> ScaleReply:
        workers, ps = len(ps_job.workers), len(ps_job.ps)
        reason = f"refused: {refusal}" if refusal is not None else f"applied: {workers} workers, {ps} PS"
        reply = ScaleReply(requested_at, refusal is None, reason, workers, ps, self.clock())
        self.job_dir.reply_scale(reply)
        print(f"hpc-elastic-run: scale request {reason}", file=sys.stderr, flush=True)
        return reply

    def wanted(self) -> bool:
        """Whether the wrapper has something to do: a stop (``USR1``, ``control/stop``, the time-limit warning due
        and lost) or a scale request (the user's file, the daemon's ``USR2``)."""
        return (
            self.usr1
            or self.usr2
            or self.warning.reached(self.clock())
            or self.job_dir.stop_path.exists()
            or self.job_dir.scale_path.exists()
        )

    def take_stop(self) -> tuple[StopReason, float] | None:
        """A stop to act on: a ``control/stop`` of this run, else one after a ``USR1`` (the scheduler daemon's
        checkpoint signal, the time-limit warning, a user's ``scancel --signal=USR1 --batch``), written to
        ``control/stop`` for the record."""
        request = self.job_dir.read_stop()
        if request is not None:  # prepare() set aside older ones: this request is for this run
            reason = request.reason if request.reason is not StopReason.UNKNOWN else self.usr1_reason()
            return reason, request.requested_at if request.requested_at is not None else self.clock()
        if not self.usr1 and not self.warning.due(self.clock()):
            return None
        reason, requested_at = self.usr1_reason(), self.clock()
        self.job_dir.request_stop(StopRequest(reason, requested_at))
        return reason, requested_at

    def usr1_reason(self) -> StopReason:
        return usr1_reason_now(self.slurm, self.job, self.clock(), self.config.grace_s)

    def checkpoint_for_stop(self, ps_job: PsJob, reason: StopReason) -> dict[str, Any]:
        """Stop the workers (as a scale-in: their shards in hand go back to TODO), then checkpoint the PS parameters,
        the master's queues and the ledger as one cut (the master holds its lock), the last of this run, and
        acknowledge it in ``control/ack.json`` (``step``: the checkpoint's number); the master's status then."""
        for worker in list(ps_job.workers):
            ps_job.kill_worker(worker, signal.SIGTERM)
        seq = ps_job.checkpoint()
        assert self.job.job_id is not None
        where = self.job_dir.checkpoints / layout.dir_name(seq)
        self.job_dir.acknowledge(Ack(self.job.job_id, self.job.restart_count, seq, where, self.clock(), reason))
        status = ps_job.status()
        print(
            f"hpc-elastic-run: stop ({reason.value}): checkpoint {seq} at {status['queues']}",
            file=sys.stderr,
            flush=True,
        )
        return status

    # -- after the steps stopped ---------------------------------------------------------------------------------

    def after(self, outcome: Outcome, status: dict[str, Any]) -> int:
        """The steps have stopped: requeue the job (it restores from the checkpoint), leave it to Slurm, or wait
        for the time limit to end it (:func:`hpc_elastic.launch.stops.after_stop`)."""
        if outcome is Outcome.LOST:
            reason = sigterm_reason_now(self.slurm, self.job, self.clock())
            print(f"hpc-elastic-run: the job master's step ended; Slurm says: {reason.value}", file=sys.stderr)
        else:
            assert self.stop is not None
            reason = self.stop[0]
        try:
            done = len(self.job_dir.timelimit_requeues())
        except ValueError:
            done = self.config.max_requeues  # an unreadable record: a spent budget, never a requeue loop
        action = after_stop(reason, timelimit_requeues=done, max_requeues=self.config.max_requeues)
        if action is Action.REQUEUE:
            if reason is StopReason.TIMELIMIT:
                self.job_dir.record_timelimit_requeue(self.job.restart_count)
            try:
                with term_ignored():  # the requeue signals the batch step: finish the call first
                    self.slurm.requeue([job_ref_of(self.job)])
            except SlurmError as exc:
                print(f"hpc-elastic-run: cannot requeue ({reason.value}): {exc}", file=sys.stderr, flush=True)
                return 1
            print(f"hpc-elastic-run: requeued ({reason.value})", file=sys.stderr, flush=True)
            return 0
        if action is Action.TIMEOUT:
            print("hpc-elastic-run: time-limit requeues spent: the job ends at its time limit", file=sys.stderr)
            while True:  # Slurm's TERM at the limit ends the wrapper (exit_on_signal)
                time.sleep(POLL_S)
        print(f"hpc-elastic-run: the job ends as Slurm decided ({reason.value})", file=sys.stderr, flush=True)
        return 0 if outcome is Outcome.STOPPED else 1


def _master_ended(ps_job: PsJob, within_s: float = 0.0) -> bool:
    """Whether the job master's process has exited, waiting up to ``within_s`` seconds for it."""
    if ps_job.master_proc is None:
        return False
    try:
        ps_job.master_proc.popen.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        return False
    return True


class Scalable(Protocol):
    """What :func:`apply_sizes` changes: a running :class:`hpc_elastic.ps.job.PsJob`, or :class:`Books` of one."""

    @property
    def worker_cores(self) -> dict[str, int]: ...

    @property
    def ps_cores(self) -> tuple[int, ...]: ...

    def kill_worker(self, worker: str, sig: signal.Signals = ...) -> object: ...

    def remove_ps(self, index: int = ...) -> object: ...

    def replace_ps(self, index: int, cpus: int) -> object: ...

    def add_ps(self, cpus: int | None = ..., mem_mb: int | None = ...) -> object: ...

    def add_worker(self, delay: float | None = ..., cpus: int | None = ..., mem_mb: int | None = ...) -> object: ...


def apply_sizes(job: Scalable, workers: int, ps: int, cpus: int) -> None:
    """Scale the running job to ``workers`` workers and ``ps`` PS of ``cpus`` cores each (the job's task size: a
    user's request takes the job from Brain, whose plans may have given processes other sizes), each change an
    ``srun`` step inside the allocation, the cores freed before the cores taken: the workers not kept leave
    (SIGTERM: their shards go back to TODO; kept are the oldest of the task size), PS are removed (those of another
    size first), a PS of another size is replaced by one of the task size, PS are added (each a re-partition of the
    parameters while the workers wait), then workers are added (DLRover's worker and PS elasticity, paper §5.3)."""
    keep = [w for w, c in job.worker_cores.items() if c == cpus][:workers]
    for worker in [w for w in job.worker_cores if w not in keep][::-1]:  # the newest first
        job.kill_worker(worker, signal.SIGTERM)
    while len(job.ps_cores) > ps:
        other = [i for i, c in enumerate(job.ps_cores) if c != cpus]
        job.remove_ps(other[-1] if other else -1)
    while other := [i for i, c in enumerate(job.ps_cores) if c != cpus]:
        job.replace_ps(other[0], cpus)
    while len(job.ps_cores) < ps:
        job.add_ps(cpus)
    while len(job.worker_cores) < workers:
        job.add_worker(cpus=cpus)


class Books:
    """The srun launcher's books of a running job (the node and cores of each step, placed as
    :meth:`hpc_elastic.ps.job.PsJob` places them), on which :func:`apply_sizes` is tried first: every step it would
    start, in its order, beside those it would have stopped by then. Pure: no process is touched."""

    def __init__(self, nodes: Nodes, master: tuple[str, int], workers: dict[str, tuple[str, int]],
                 ps: list[tuple[str, int]]) -> None:  # fmt: skip
        self.nodes = nodes
        self._steps: dict[str, tuple[str, int]] = {"master": master, **workers}
        self._workers = list(workers)
        self._ps: list[str] = []
        self._n = 0
        for node, cores in ps:
            self._ps.append(self._name("ps"))
            self._steps[self._ps[-1]] = (node, cores)

    @classmethod
    def of(cls, job: PsJob) -> Books | None:
        """The books of ``job``'s placed steps; None for local processes."""
        steps = [job.master_proc, *job.workers.values(), *job.ps]
        if job.nodes is None or any(p is None or p.node is None for p in steps):
            return None
        assert job.master_proc is not None and job.master_proc.node is not None
        placed = {w: (p.node, p.cpus) for w, p in job.workers.items() if p.node is not None}
        return cls(job.nodes, (job.master_proc.node, job.master_proc.cpus), placed,
                   [(p.node, p.cpus) for p in job.ps if p.node is not None])  # fmt: skip

    def _name(self, kind: str) -> str:
        self._n += 1
        return f"new-{kind}{self._n}"

    def _place(self, name: str, what: str, cpus: int) -> None:
        held: dict[str, int] = {}
        for on, cores in self._steps.values():
            held[on] = held.get(on, 0) + cores
        node = self.nodes.place(cpus, held)
        if node is None:
            raise StepNotPlaced(f"a new {what}: {self.nodes.refusal([cpus], held)}")
        self._steps[name] = (node, cpus)

    @property
    def worker_cores(self) -> dict[str, int]:
        return {w: self._steps[w][1] for w in self._workers}

    @property
    def ps_cores(self) -> tuple[int, ...]:
        return tuple(self._steps[p][1] for p in self._ps)

    def kill_worker(self, worker: str, sig: signal.Signals = signal.SIGKILL) -> None:
        self._workers.remove(worker)
        del self._steps[worker]

    def remove_ps(self, index: int = -1) -> None:
        del self._steps[self._ps.pop(index)]

    def replace_ps(self, index: int, cpus: int) -> None:
        self.add_ps(cpus)
        self.remove_ps(index)

    def add_ps(self, cpus: int | None = None, mem_mb: int | None = None) -> None:
        assert cpus is not None
        name = self._name("ps")
        self._place(name, "PS", cpus)
        self._ps.append(name)

    def add_worker(self, delay: float | None = None, cpus: int | None = None, mem_mb: int | None = None) -> None:
        assert cpus is not None
        name = self._name("w")
        self._place(name, "worker", cpus)
        self._workers.append(name)


def main(argv: Sequence[str]) -> int:
    try:
        config = parse_args(argv)
        slurm = connect(read_environment())
        wrapper = PsWrapper(config, read_job_environment(), slurm, steps=slurm.steps)
    except (ValueError, HpcElasticError) as exc:
        print(f"hpc-elastic-run: error: {exc}", file=sys.stderr)
        return 2
    return wrapper.run()
