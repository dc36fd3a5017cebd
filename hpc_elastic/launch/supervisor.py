"""The in-allocation wrapper (``wrappers/hpc-elastic-run``): start the workers, supervise, checkpoint-and-requeue.

1. Reads the allocation (:func:`hpc_elastic.env.read_job_environment`), prepares the job directory on the shared
   filesystem (``<ckpt-root>/<job name>-<job id>``, the same across requeues), clears a stop request left by the
   previous run, checks the allocation's GPU types against the job's (:mod:`hpc_elastic.launch.gpu_types`: a job
   below D2 keeps the type of its first allocation, written into its marker; an allocation of another type is
   requeued with a constraint on the job's type), and starts one worker process per task of the allocation with
   ``srun`` (``mpirun`` on request) through the one launcher (:mod:`hpc_elastic.launch.workers`).
2. On ``USR1`` (the plugin's ``scancel --signal=USR1 --batch``, or Slurm's ``--signal=B:USR1@grace`` before
   the time limit) it writes ``control/stop``; workers checkpoint at the next mini-batch boundary, rank 0 writes
   ``control/ack.json``, and they exit. A preemption or resize is then requeued (``scontrol requeue``); a time
   limit too, while the job has time-limit requeues left (``--max-requeues``, counted in the job directory); once
   they are spent the job ends at its time limit (TIMEOUT).
3. Slurm's own preemption sends ``TERM`` to the job's steps only: the workers checkpoint on it by themselves
   (:meth:`hpc_elastic.session.Session.should_stop`) and acknowledge; the wrapper asks Slurm why
   (:func:`hpc_elastic.launch.stops.sigterm_reason`): a preemption is requeued at once, a cancel or a node failure
   is left to Slurm.
4. When the worker step fails (a worker killed, a crash) without a stop request, the step is started again in the
   same allocation, at most ``max_restarts`` times (torch.distributed.elastic's restart budget); the workers
   resume from the newest valid checkpoint. ``HPC_ELASTIC_ATTEMPT`` tells them which attempt they are.
5. On ``TERM``/``INT`` to the wrapper itself (a cancel, the time limit reached, the end of a preemption's grace
   time) it stops the worker step at once (TERM, then KILL) and exits 128 + signal: Slurm decides what follows.
The loop is a small state machine (:class:`Phase`, :meth:`Supervisor.run`), as torch elastic's agent.
Workers run in their own process group, signalled as one: nothing outlives the wrapper.
The job directory, its control files and their formats are :mod:`hpc_elastic.jobdir`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend
from hpc_elastic.env import JobEnvironment
from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.jobdir import Ack, JobDir, StopNotice, StopReason, StopRequest, ack_answers
from hpc_elastic.launch.gpu_types import TypeAction, decide_gpu_type, feature_for_type
from hpc_elastic.launch.spec import MarkerError, check_ckpt_root, check_wrapper_limits, decode_marker, parse_number
from hpc_elastic.launch.stops import Action, after_stop, sigterm_reason, usr1_reason
from hpc_elastic.launch.workers import Launcher, WorkerGroup, WorkerStep, start_workers
from hpc_elastic.slurm.client import SlurmClient
from hpc_elastic.slurm.errors import SlurmError
from hpc_elastic.slurm.types import JobRef, Node

log = logging.getLogger(__name__)

#: seconds between two looks at the workers, the control files and the wrapper's signals
POLL_S = 0.2


class Phase(enum.StrEnum):
    """The wrapper's states; :meth:`Supervisor.run` goes from one to the next until ``done``."""

    START = "start"  # start the worker step (attempt n)
    RUNNING = "running"  # the step trains
    STOPPING = "stopping"  # a stop was requested: waiting for the checkpoint, within the grace period
    STOPPED = "stopped"  # checkpointed for a stop: requeue, leave the job to Slurm, or let the time limit end it
    FAILED = "failed"  # the step failed on its own: restart it in the allocation, within the budget
    SIGNALLED = "signalled"  # TERM/INT to the wrapper: stop the workers, exit
    DONE = "done"


@dataclass(frozen=True)
class WrapperConfig:
    ckpt_root: Path
    command: tuple[str, ...]
    backend: Backend = Backend.TORCH
    workers: int | None = None
    level: DeterminismLevel | None = None
    balance: BalanceMode | None = None
    grace_s: float = 120.0
    launcher: Launcher = Launcher.SRUN
    max_requeues: int = 0
    kill_timeout_s: float = 10.0
    max_restarts: int = 2

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no worker command given (put it after --)")
        check_ckpt_root(self.ckpt_root)
        check_wrapper_limits(grace_s=self.grace_s, max_restarts=self.max_restarts, max_requeues=self.max_requeues)
        if self.workers is not None and not 1 <= self.workers <= MAX_ESTS:
            raise ValueError(f"--workers must be between 1 and {MAX_ESTS}, got {self.workers}")
        if not 0 < self.kill_timeout_s < float("inf"):
            raise ValueError(f"kill timeout must be a positive number of seconds, got {self.kill_timeout_s}")
        if self.launcher is Launcher.LOCAL:
            raise ValueError("hpc-elastic-run starts workers with srun or mpirun inside an allocation")


# ------------------------------------------------------------------------------------------ pure parts


def take_usr1(handler: Callable[[int, FrameType | None], None]) -> Any:
    """Install ``handler`` for ``USR1`` and let a held one reach it; the previous handler. Slurm's time-limit
    warning (``--signal=B:USR1@grace``) comes at the first limit check once the grace is reached, which may be
    within a second of a run's start (a short limit, a long grace, a requeued run): ``wrappers/hpc-elastic-run``
    blocks ``USR1`` before anything else, so that one that comes before the handler is held pending, neither lost
    nor fatal, and delivered here."""
    previous = signal.signal(signal.SIGUSR1, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return previous


def usr1_reason_now(slurm: SlurmClient, job: JobEnvironment, now: float, grace_s: float) -> StopReason:
    """Why the checkpoint signal came (:func:`.stops.usr1_reason`), from Slurm's view of the job at ``now``: the
    scheduler daemon's notice in its ``AdminComment`` (for this incarnation), else a time limit if it is within
    grace + slack, else a preemption."""
    notice_reason, start, limit = None, None, None
    if job.job_id is not None:
        try:
            current = slurm.job(job.job_id)
            notice = StopNotice.decode(current.admin_comment)
            if notice is not None and notice.restarts == job.restart_count:
                notice_reason = notice.reason
            start, limit = current.start_time, current.time_limit_s
        except SlurmError as exc:
            log.warning("cannot read the job from Slurm (%s); treating USR1 as a preemption", exc)
    return usr1_reason(notice_reason, start, limit, datetime.fromtimestamp(now, tz=UTC), grace_s)


def sigterm_reason_now(slurm: SlurmClient, job: JobEnvironment, now: float) -> StopReason:
    """Why the workers (or the steps) got ``SIGTERM``, from Slurm's view of the job (:func:`.stops.sigterm_reason`)."""
    current = None
    if job.job_id is not None:
        try:
            current = slurm.job(job.job_id)
        except SlurmError as exc:
            log.warning("cannot read the job from Slurm (%s): SIGTERM of unknown cause", exc)
    return sigterm_reason(current, job.restart_count, datetime.fromtimestamp(now, tz=UTC))


class WarningDeadline:
    """When Slurm's time-limit warning is due, for a wrapper to act on it if it never comes: this run's end less the
    grace. Slurm sends ``USR1`` at a limit check once the grace is reached, and the first check may come within a
    second of the run's start, before the batch script's ``trap`` or while Python starts before
    ``wrappers/hpc-elastic-run`` blocks it: such a signal is lost (seen on the dev cluster under load), and the job
    would reach its limit without a checkpoint. Both wrappers (the data-parallel :class:`Supervisor` and the
    ps-mode one) then stop as if the warning had come, once (:meth:`due`)."""

    def __init__(self, at: float | None, grace_s: float) -> None:
        self.at, self.grace_s = at, grace_s

    @classmethod
    def read(cls, slurm: SlurmClient, job: JobEnvironment, grace_s: float) -> WarningDeadline:
        """The deadline of the job's run as Slurm tells it (none without a limit, or when Slurm cannot tell)."""
        if job.job_id is None:
            return cls(None, grace_s)
        try:
            current = slurm.job(job.job_id)
        except SlurmError as exc:
            log.warning("cannot read the job's time limit from Slurm (%s): only its USR1 warns", exc)
            return cls(None, grace_s)
        if current.start_time is None or current.time_limit_s is None:
            return cls(None, grace_s)
        return cls(current.start_time.timestamp() + current.time_limit_s - grace_s, grace_s)

    def reached(self, now: float) -> bool:
        """Whether the deadline has come and :meth:`due` has not said so yet."""
        return self.at is not None and now >= self.at

    def due(self, now: float) -> bool:
        """Whether the warning is due at ``now`` (ask only while no ``USR1`` came): True once, then never again."""
        if not self.reached(now):
            return False
        log.warning(
            "Slurm's time-limit warning did not come %.0fs before the limit: stopping as if it had", self.grace_s
        )
        self.at = None
        return True


@contextlib.contextmanager
def term_ignored() -> Iterator[None]:
    """``TERM`` ignored meanwhile, and by the children started meanwhile: a requeue of the wrapper's own job makes
    Slurm signal the whole batch step (``TERM``, ``KILL`` after ``KillWait``), which must not kill the ``scontrol``
    calls half-way."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def job_dir_of(ckpt_root: Path, job: JobEnvironment) -> JobDir:
    """``<ckpt-root>/<job name>-<job id>``; for a task of a job array ``<job name>-<array id>_<task id>``: the same
    across requeues, and one per task."""
    ref = job_ref_of(job)
    return JobDir.of(ckpt_root, job.job_name or "job", ref.job_id, ref.array_task_id)


def job_ref_of(job: JobEnvironment) -> JobRef:
    """How the wrapper addresses its own job in Slurm: ``<array>_<task>`` for an array task (the array's id alone
    names every task of the array), else its job id."""
    if job.job_id is None:
        raise ValueError("SLURM_JOB_ID is not set: hpc-elastic-run runs inside a Slurm allocation")
    if job.array_job_id is not None and job.array_task_id is not None:
        return JobRef(job.array_job_id, job.array_task_id)
    return JobRef(job.job_id)


# ------------------------------------------------------------------------------------------ the wrapper


class Supervisor:
    """Runs the worker step and reacts to signals. ``slurm``, ``clock`` and ``sleep`` are injectable."""

    def __init__(
        self,
        config: WrapperConfig,
        job: JobEnvironment,
        slurm: SlurmClient,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.job = job
        self.slurm = slurm
        self.clock = clock
        self.sleep = sleep
        self.job_dir = job_dir_of(config.ckpt_root, job)
        self._usr1 = False
        #: when Slurm's time-limit warning is due, if it does not come (read when the run starts)
        self._warning = WarningDeadline(None, config.grace_s)
        self._fatal: int | None = None
        self._stop_at_step: int | None = None
        # the loop's state (run())
        self._group: WorkerGroup | None = None
        self._attempt = 0
        self._ntasks = 1
        self._started_at = 0.0
        self._code = 0
        #: the stop acted on and when it was requested
        self._stop: tuple[StopReason, float] | None = None
        #: the GPU type the job keeps (below D2), once known; requeues carry it as a node constraint
        self.pinned_type: str | None = None
        self._node_gpu_types: tuple[tuple[str, str], ...] = ()

    # signal handlers only set flags; the loop acts on them
    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self._usr1 = True

    def _on_fatal(self, signum: int, frame: FrameType | None) -> None:
        self._fatal = signum

    def prepare(self) -> None:
        """Create the job directory, or check that the existing one is this user's and nobody else's to write into
        (:class:`~hpc_elastic.files.UnsafeFile` otherwise); set aside the stop request and acknowledgement of a
        previous incarnation (kept for the record) so that neither is taken for one of this run; remove the
        temporaries of writes a kill interrupted.  A stop for a chosen step that no checkpoint has acknowledged yet
        stands (:func:`hpc_elastic.jobdir.still_pending`)."""
        self.job_dir.prepare()
        standing = self.job_dir.standing_stop()
        self.job_dir.set_aside(int(self.clock()), keep_stop=standing is not None)
        self.job_dir.sweep_temporaries(self.clock())
        newest = sorted(self.job_dir.checkpoints.glob("ckpt-*"))
        log.info(
            "job %s restart %d in %s; newest checkpoint: %s%s",
            self.job.job_id,
            self.job.restart_count,
            self.job_dir.path,
            newest[-1].name if newest else "none",
            f"; a stop at step {standing.at_step} stands" if standing is not None else "",
        )

    def check_gpu_types(self) -> bool:
        """Whether this allocation's GPU types fit the job (see :mod:`hpc_elastic.launch.gpu_types`); pins the type of
        a first allocation into the job's marker.  An allocation that does not fit is requeued, constrained to the
        job's type.  Without a reading of Slurm the workers start (the runtime refuses mixed types below D2)."""
        if self.job.job_id is None or not self.job.gpus_per_task:
            return True
        try:
            job = self.slurm.job(self.job.job_id)
            nodes = self.slurm.nodes()
        except SlurmError as exc:
            log.warning("cannot read the allocation's GPU types (%s); the runtime checks them", exc)
            return True
        self._node_gpu_types = tuple(
            (n.name, n.gpus.by_type[0][0]) for n in nodes if n.name in job.nodes and n.gpus.total > 0
        )
        try:
            marker = decode_marker(job.comment)
        except MarkerError as exc:
            log.warning("the job's comment is not a valid hpc-elastic marker (%s): the scheduler ignores this job", exc)
            marker = None
        decision = decide_gpu_type(dict(job.gpus.by_type), marker.gpu_type if marker else None, self.config.level)
        self.pinned_type = decision.gpu_type if self.config.level is not DeterminismLevel.D2 else None
        log.info("GPU types: %s", decision.reason)
        if decision.action is TypeAction.PIN and marker is not None and decision.gpu_type is not None:
            pinned = replace(marker, gpu_type=decision.gpu_type).encode()
            try:
                self.slurm.update_job(job_ref_of(self.job), {"Comment": pinned})
            except SlurmError as exc:
                log.warning("cannot record the pinned GPU type in the job's comment: %s", exc)
        if decision.action is not TypeAction.REFUSE:
            return True
        self._requeue_pinned(nodes)
        return False

    def _requeue_pinned(self, nodes: Sequence[Node] | None = None) -> None:
        """Requeue the job; a job pinned to a GPU type waits for that type (a node feature that selects it).

        The constraint can only be set once the job is pending again: the two calls run with TERM ignored
        (:func:`term_ignored`), so the update is not killed half-way."""
        if self.job.job_id is None:
            return
        feature = None
        if self.pinned_type is not None:
            try:
                feature = feature_for_type(nodes if nodes is not None else self.slurm.nodes(), self.pinned_type)
            except SlurmError as exc:
                log.warning("cannot read the node features (%s): the requeued job may start on other GPUs", exc)
            if feature is None:
                log.warning("no node feature selects %s GPUs: the requeued job may start elsewhere", self.pinned_type)
        with term_ignored():
            self.slurm.requeue([job_ref_of(self.job)])
            if feature is not None:
                try:
                    self.slurm.update_job(job_ref_of(self.job), {"Features": feature})
                    log.info("requeued job %s: waits for %s GPUs (%s)", self.job.job_id, self.pinned_type, feature)
                except SlurmError as exc:
                    log.warning("cannot constrain the requeued job to %s GPUs: %s", self.pinned_type, exc)

    def _usr1_reason(self) -> StopReason:
        return usr1_reason_now(self.slurm, self.job, self.clock(), self.config.grace_s)

    def _sigterm_reason(self) -> StopReason:
        return sigterm_reason_now(self.slurm, self.job, self.clock())

    def step(self, ntasks: int, attempt: int) -> WorkerStep:
        """The worker step of this incarnation: ``ntasks`` processes, the job's N ESTs."""
        return WorkerStep(
            command=self.config.command,
            ntasks=ntasks,
            num_ests=self.config.workers or ntasks,
            job_dir=self.job_dir.path,
            backend=self.config.backend,
            launcher=self.config.launcher,
            level=self.config.level,
            balance=self.config.balance,
            gpus_per_task=self.job.gpus_per_task,
            node_gpu_types=self._node_gpu_types,
            restart_count=self.job.restart_count,
            attempt=attempt,
        )

    # -- the loop: one method per phase, each returns the next ---------------------------------------------

    def run(self) -> int:
        """Supervise the job's worker steps (after :meth:`prepare`); return the wrapper's exit code."""
        if not self.check_gpu_types():
            return 0  # requeued for an allocation of the job's GPU type
        # The tasks allocated now, not the submission's SLURM_NTASKS: a resize changes NumTasks between runs.
        ntasks = self.job.allocated_tasks or self.job.world_size
        if ntasks != self.job.world_size:
            log.info("the allocation has %d tasks (submitted with %d): resized", ntasks, self.job.world_size)
        self._ntasks = ntasks
        self._started_at = self.clock()
        self._warning = WarningDeadline.read(self.slurm, self.job, self.config.grace_s)
        previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_fatal),
            signal.SIGINT: signal.signal(signal.SIGINT, self._on_fatal),
            signal.SIGUSR1: take_usr1(self._on_usr1),
        }
        phases: dict[Phase, Callable[[], Phase]] = {
            Phase.START: self._start,
            Phase.RUNNING: self._running,
            Phase.STOPPING: self._stopping,
            Phase.STOPPED: self._stopped,
            Phase.FAILED: self._failed,
            Phase.SIGNALLED: self._signalled,
        }
        try:
            phase = Phase.START
            while phase is not Phase.DONE:
                phase = phases[phase]()
            return self._code
        finally:
            if self._group is not None:
                self._group.stop(self.clock, self.sleep)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _start(self) -> Phase:
        self._group = start_workers(self.step(self._ntasks, self._attempt), kill_timeout_s=self.config.kill_timeout_s)
        return Phase.RUNNING

    def _running(self) -> Phase:
        """The step trains.  Next: a stop requested (``control/stop``, or ours after ``USR1``), the workers'
        checkpoint after their own ``SIGTERM`` (Slurm's preemption signals the steps, not the wrapper), the step's
        end or failure, or a signal to the wrapper."""
        assert self._group is not None
        if self._fatal is not None:
            return Phase.SIGNALLED
        code = self._group.poll()
        self._stop = self._take_stop_request()
        if self._stop is not None:
            return Phase.STOPPING
        if self._own_stop_ack() is not None:
            reason = self._sigterm_reason()
            log.info("the workers checkpointed on SIGTERM; Slurm says: %s", reason.value)
            self._stop = (reason, self._started_at)
            return Phase.STOPPED
        if code is None:
            self.sleep(POLL_S)
            return Phase.RUNNING
        self._code = code
        if code == 0:
            log.info("workers finished with exit code 0")
            return Phase.DONE
        return Phase.FAILED

    def _stopping(self) -> Phase:
        """A stop was requested: wait for the checkpoint's acknowledgement (a requeue goes on at once: the checkpoint
        is durable then, and the workers' teardown need not delay the GPUs' release), or the workers' end, within
        the grace period (none for a stop at a chosen step: it comes when the workers reach it)."""
        assert self._group is not None and self._stop is not None
        if self._fatal is not None:
            return Phase.SIGNALLED
        reason, requested_at = self._stop
        code = self._group.poll()
        ack = self._acknowledged(requested_at)
        if ack is not None and self._action(reason, log_budget=False) is Action.REQUEUE:
            return Phase.STOPPED
        if code is not None:
            self._code = code
            # no acknowledgement: they ended before the step of a stop at a step, or, exiting 0 (workers that stop
            # acknowledge first), they ended their training
            if ack is None and (self._stop_at_step is not None or code == 0):
                before = "the step of the stop" if self._stop_at_step is not None else "acknowledging the stop"
                log.info("workers finished with exit code %d before %s", code, before)
                self._stop = None
                return Phase.DONE if code == 0 else Phase.FAILED
            return Phase.STOPPED
        if self._stop_at_step is None and self.clock() - requested_at > self.config.grace_s:
            log.error("workers did not stop within the %.0fs grace period", self.config.grace_s)
            self._group.stop(self.clock, self.sleep)
            return Phase.STOPPED
        self.sleep(POLL_S)
        return Phase.STOPPING

    def _stopped(self) -> Phase:
        """Checkpointed (or not, in time) for a stop: requeue, leave the job to Slurm, or let the time limit end it."""
        assert self._group is not None and self._stop is not None
        reason, requested_at = self._stop
        ack = self._acknowledged(requested_at)
        self._group.stop(self.clock, self.sleep)
        if ack is not None:
            log.info("checkpoint acknowledged at step %d: %s", ack.step, ack.checkpoint)
        else:
            log.error("no checkpoint acknowledgement after the stop request; the job resumes from an older one")
        action = self._action(reason, log_budget=True)
        if action is Action.REQUEUE:
            self._code = 0
            if self.job.job_id is not None:
                if reason is StopReason.TIMELIMIT:
                    self.job_dir.record_timelimit_requeue(self.job.restart_count)
                try:
                    self._requeue_pinned()
                    log.info("job %s requeued (%s)", self.job.job_id, reason.value)
                except SlurmError as exc:
                    log.error("cannot requeue job %s (%s): %s", self.job.job_id, reason.value, exc)
                    self._code = 1
            return Phase.DONE
        if action is Action.TIMEOUT:
            log.error(
                "time limit: the job's %d time-limit requeue(s) are spent (--max-requeues); it ends at its time limit",
                self.config.max_requeues,
            )
            while self._fatal is None:  # Slurm's TERM at the limit: the job ends TIMEOUT
                self.sleep(POLL_S)
            self._code = 128 + self._fatal
            return Phase.DONE
        log.info("the job ends as Slurm decided (%s)", reason.value)
        self._code = 0 if ack is not None else 1
        return Phase.DONE

    def _failed(self) -> Phase:
        """The step failed on its own (a worker killed, a crash): restart it within the budget, else end."""
        if self._attempt >= self.config.max_restarts:
            log.error("worker step failed (exit %d); restart budget of %d used", self._code, self._attempt)
            return Phase.DONE
        self._attempt += 1
        log.warning(
            "worker step failed (exit %d): restart %d of %d from the newest checkpoint",
            self._code,
            self._attempt,
            self.config.max_restarts,
        )
        return Phase.START

    def _signalled(self) -> Phase:
        """``TERM``/``INT`` to the wrapper: a cancel, the time limit itself, the end of a preemption's grace time,
        a node failure.  Slurm decides what follows (and kills what is left after ``KillWait``): stop the workers."""
        assert self._group is not None and self._fatal is not None
        self._group.signal(signal.SIGTERM)
        log.warning("received signal %d: stopping the workers now (%s)", self._fatal, self._sigterm_reason().value)
        self._group.stop(self.clock, self.sleep)
        self._code = 128 + self._fatal
        return Phase.DONE

    # -- the stop protocol ---------------------------------------------------------------------------------

    def _action(self, reason: StopReason, *, log_budget: bool) -> Action:
        """:func:`~hpc_elastic.launch.stops.after_stop` with the job's record of time-limit requeues; a record that
        cannot be read counts as a spent budget (never a requeue loop)."""
        try:
            done = len(self.job_dir.timelimit_requeues())
        except ValueError as exc:
            if log_budget:
                log.error("the time-limit requeue record is unreadable (%s): no more time-limit requeues", exc)
            done = self.config.max_requeues
        if log_budget and reason is StopReason.TIMELIMIT:
            log.info("time limit: %d of %d time-limit requeue(s) used", done, self.config.max_requeues)
        return after_stop(reason, timelimit_requeues=done, max_requeues=self.config.max_requeues)

    def _take_stop_request(self) -> tuple[StopReason, float] | None:
        """A stop to act on, and when it was requested: a ``control/stop`` already there (a stop at a chosen step,
        or one we wrote), else our own after a ``USR1`` (the scheduler daemon's checkpoint signal, or the time-limit
        warning)."""
        request = self.job_dir.read_stop()
        if request is not None:  # prepare() set aside older ones: this request is for this run
            reason = request.reason if request.reason is not StopReason.UNKNOWN else self._usr1_reason()
            self._stop_at_step = request.at_step
            when = "the next boundary" if request.at_step is None else f"step {request.at_step}"
            log.info("stop requested (%s): workers checkpoint at %s", reason.value, when)
            # An unreadable request has no time: the grace period starts now.
            return reason, request.requested_at if request.requested_at is not None else self.clock()
        if not self._usr1 and not self._warning.due(self.clock()):
            return None
        reason = self._usr1_reason()
        requested_at = self.clock()
        self.job_dir.request_stop(StopRequest(reason, requested_at))
        log.info("stop requested (%s): workers checkpoint at the next mini-batch boundary", reason.value)
        return reason, requested_at

    def _acknowledged(self, requested_at: float) -> Ack | None:
        """The workers' acknowledgement of the stop requested at ``requested_at``, if it has been written."""
        ack = self.job_dir.read_ack()
        if ack is None or not ack_answers(
            ack,
            job_id=self.job.job_id,
            restart_count=self.job.restart_count,
            requested_at=requested_at,
            now=self.clock(),
        ):
            return None
        return ack

    def _own_stop_ack(self) -> Ack | None:
        """An acknowledgement of this run written with no stop requested: the workers stopped on their own
        ``SIGTERM`` (its ``reason`` says ``sigterm``; a rank 0 that did not get the signal itself says ``unknown``)."""
        return self._acknowledged(self._started_at)


def parse_wrapper_args(argv: Sequence[str]) -> WrapperConfig:
    """``[--ckpt-root=DIR] [--backend=B] [--workers=N] [--level=d0|d1|d2] [--balance=none|est|lbbsp] [--grace=S]
    [--launcher=srun|mpirun] [--max-restarts=N] [--max-requeues=N] -- COMMAND...``"""
    if "--" not in argv:
        raise ValueError("usage: hpc-elastic-run [options] -- COMMAND [ARGS...]")
    split = list(argv).index("--")
    options, command = list(argv)[:split], tuple(argv)[split + 1 :]
    values: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key == "--ckpt-root" and value:
            values["ckpt_root"] = Path(value)
        elif key == "--backend" and value:
            values["backend"] = Backend.parse(value)
        elif key == "--level" and value:
            values["level"] = DeterminismLevel.parse(value)
        elif key == "--balance" and value:
            values["balance"] = BalanceMode.parse(value)
        elif key == "--workers" and value:
            values["workers"] = parse_number(value, key, int)
        elif key == "--grace" and value:
            values["grace_s"] = parse_number(value, key, float)
        elif key == "--launcher" and value:
            values["launcher"] = Launcher(value)
        elif key == "--max-restarts" and value:
            values["max_restarts"] = parse_number(value, key, int)
        elif key == "--max-requeues" and value:
            values["max_requeues"] = parse_number(value, key, int)
        else:
            raise ValueError(f"hpc-elastic-run: unknown or incomplete option {option!r}")
    if "ckpt_root" not in values:
        raise ValueError("hpc-elastic-run: --ckpt-root=DIR is required")
    return WrapperConfig(command=command, **values)
