"""The in-allocation wrapper (``wrappers/hpc-elastic-run``): start the workers, supervise, checkpoint-and-requeue.

1. Reads the allocation (:func:`hpc_elastic.env.read_job_environment`), prepares the job directory on the shared
   filesystem (``<ckpt-root>/<job name>-<job id>``, the same across requeues), clears a stop request left by the
   previous run, and starts one worker process per device with ``srun`` (``mpirun`` on request), with the
   rendezvous variables of the backend.
2. On ``USR1`` (the plugin's ``scancel --signal=USR1 --batch``, or Slurm's ``--signal=B:USR1@grace`` before
   the time limit) it writes ``control/stop``; workers checkpoint at the next mini-batch boundary, rank 0 writes
   ``control/ack.json``, and they exit. A preemption or resize is then requeued (``scontrol requeue``); a time
   limit is not, unless asked, since the job used the time it requested.
3. When the worker step fails (a worker killed, a crash) without a stop request, the step is started again in the
   same allocation, at most ``max_restarts`` times (torch.distributed.elastic's restart budget); the workers
   resume from the newest valid checkpoint. ``HPC_ELASTIC_ATTEMPT`` tells them which attempt they are.
4. On ``TERM``/``INT`` it stops the worker step at once (TERM, then KILL) and exits 128 + signal.
Workers run in their own process group, signalled as one: nothing outlives the wrapper.
The control files and their formats are :mod:`hpc_elastic.control`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_elastic.checkpoint.fs import atomic_write_bytes
from hpc_elastic.control import (
    ACK_FILE,
    CONTROL_DIR,
    STOP_FILE,
    Ack,
    StopReason,
    StopRequest,
    parse_ack,
    parse_stop,
    parse_stop_lenient,
)
from hpc_elastic.env import JobEnvironment, child_environment
from hpc_elastic.launch.spec import Backend
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.client import CliSlurm
from hpc_elastic.slurm.errors import SlurmError
from hpc_elastic.slurm.runner import spawn

log = logging.getLogger(__name__)

# A USR1 this close to the time limit (beyond the grace period) is the time-limit warning.
TIMELIMIT_SLACK_S = 60.0


class Launcher(enum.StrEnum):
    SRUN = "srun"
    MPIRUN = "mpirun"


@dataclass(frozen=True)
class WrapperConfig:
    ckpt_root: Path
    command: tuple[str, ...]
    backend: Backend = Backend.TORCH
    workers: int | None = None
    grace_s: float = 120.0
    launcher: Launcher = Launcher.SRUN
    requeue_on_timelimit: bool = False
    kill_timeout_s: float = 10.0
    max_restarts: int = 2

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no worker command given (put it after --)")
        if not self.grace_s > 0:
            raise ValueError(f"grace must be positive, got {self.grace_s}")
        if self.max_restarts < 0:
            raise ValueError(f"max restarts must be >= 0, got {self.max_restarts}")


# ------------------------------------------------------------------------------------------ pure parts


def job_directory(ckpt_root: Path, job: JobEnvironment) -> Path:
    if job.job_id is None:
        raise ValueError("SLURM_JOB_ID is not set: hpc-elastic-run runs inside a Slurm allocation")
    name = job.job_name or "job"
    return ckpt_root / f"{name}-{job.job_id}"


def classify_stop(
    requested: StopReason | None, start: datetime | None, limit_s: int | None, now: datetime, grace_s: float
) -> StopReason:
    """Why the job must stop: the plugin's stated reason, else a time limit if it is within grace + slack."""
    if requested is not None:
        return requested
    if start is not None and limit_s is not None:
        remaining = (start.timestamp() + limit_s) - now.timestamp()
        if remaining <= grace_s + TIMELIMIT_SLACK_S:
            return StopReason.TIMELIMIT
    return StopReason.PREEMPT


def should_requeue(reason: StopReason, requeue_on_timelimit: bool) -> bool:
    return reason is not StopReason.TIMELIMIT or requeue_on_timelimit


def worker_argv(config: WrapperConfig, ntasks: int, gpus_per_task: int = 0) -> list[str]:
    """The step that starts the workers: ``srun`` (PMIx for MPI/Horovod) or Open MPI's ``mpirun``."""
    if config.launcher is Launcher.MPIRUN:
        argv = ["mpirun", "-np", str(ntasks), "--mca", "btl", "tcp,self", "--bind-to", "none"]
        if os.geteuid() == 0:
            argv.insert(1, "--allow-run-as-root")
        return [*argv, *config.command]
    mpi = "pmix" if config.backend in (Backend.MPI, Backend.HOROVOD) else None
    return commands.srun_step(config.command, ntasks, mpi=mpi, gpus_per_task=gpus_per_task)


def worker_environment(
    config: WrapperConfig, job: JobEnvironment, job_dir: Path, ntasks: int, port: int, *, attempt: int = 0
) -> dict[str, str]:
    return {
        "HPC_ELASTIC_JOB_DIR": str(job_dir),
        "HPC_ELASTIC_BACKEND": config.backend.value,
        "HPC_ELASTIC_WORKERS": str(config.workers or ntasks),
        "HPC_ELASTIC_WORLD_SIZE": str(ntasks),
        "MASTER_ADDR": _master_address(),
        "MASTER_PORT": str(port),
        # The wrapper's own view; each task's rank comes from SLURM_PROCID / OMPI_COMM_WORLD_RANK.
        "HPC_ELASTIC_RESTART_COUNT": str(job.restart_count),
        "HPC_ELASTIC_ATTEMPT": str(attempt),
    }


def _master_address() -> str:
    """Rank 0 runs on the batch host (srun places task 0 on the first node): its resolvable address."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def read_ack(path: Path) -> Ack | None:
    """The acknowledgement in ``path``, or None when it is missing or not (yet) valid."""
    try:
        return parse_ack(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def read_stop_reason(path: Path) -> StopReason | None:
    """The reason the plugin wrote into ``control/stop`` before signalling, or None when it gave none."""
    try:
        return parse_stop(path.read_text()).reason
    except (OSError, UnicodeDecodeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------ the wrapper


class Supervisor:
    """Runs the worker step and reacts to signals. ``slurm``, ``clock`` and ``sleep`` are injectable."""

    def __init__(
        self,
        config: WrapperConfig,
        job: JobEnvironment,
        slurm: CliSlurm,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.job = job
        self.slurm = slurm
        self.clock = clock
        self.sleep = sleep
        self.job_dir = job_directory(config.ckpt_root, job)
        self.control = self.job_dir / CONTROL_DIR
        self._usr1 = False
        self._fatal: int | None = None

    # signal handlers only set flags; the loop acts on them
    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self._usr1 = True

    def _on_fatal(self, signum: int, frame: FrameType | None) -> None:
        self._fatal = signum

    def prepare(self) -> None:
        """Create the job directory; set aside the stop request and acknowledgement of a previous incarnation
        (kept for the record) so that neither is taken for one of this run."""
        self.control.mkdir(parents=True, exist_ok=True)
        (self.job_dir / "checkpoints").mkdir(exist_ok=True)
        stamp = int(self.clock())
        for name in (STOP_FILE, ACK_FILE):
            stale = self.control / name
            if stale.exists():
                stale.replace(self.control / f"{name}.handled-{stamp}")
        newest = sorted((self.job_dir / "checkpoints").glob("ckpt-*"))
        log.info(
            "job %s restart %d in %s; newest checkpoint: %s",
            self.job.job_id,
            self.job.restart_count,
            self.job_dir,
            newest[-1].name if newest else "none",
        )

    def requested_reason(self) -> StopReason | None:
        return read_stop_reason(self.control / STOP_FILE)

    def _stop_reason(self) -> StopReason:
        requested = self.requested_reason()
        start, limit = None, None
        if requested is None and self.job.job_id is not None:
            try:
                current = self.slurm.job(self.job.job_id)
                start, limit = current.start_time, current.time_limit_s
            except SlurmError as exc:
                log.warning("cannot read the job's time limit (%s); treating USR1 as a preemption", exc)
        return classify_stop(requested, start, limit, datetime.fromtimestamp(self.clock(), tz=UTC), self.config.grace_s)

    def run(self) -> int:
        self.prepare()
        # The tasks allocated now, not the submission's SLURM_NTASKS: a resize changes NumTasks between runs.
        ntasks = self.job.allocated_tasks or self.job.world_size
        if ntasks != self.job.world_size:
            log.info("the allocation has %d tasks (submitted with %d): resized", ntasks, self.job.world_size)
        argv = worker_argv(self.config, ntasks, gpus_per_task=self.job.gpus_per_task)
        previous = {
            signal.SIGUSR1: signal.signal(signal.SIGUSR1, self._on_usr1),
            signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_fatal),
            signal.SIGINT: signal.signal(signal.SIGINT, self._on_fatal),
        }
        try:
            attempt = 0
            while True:
                extra = worker_environment(self.config, self.job, self.job_dir, ntasks, _free_port(), attempt=attempt)
                proc = spawn(argv, child_environment(extra))
                try:
                    code, failed = self._supervise(proc)
                finally:
                    self._kill_group(proc)
                if not failed or attempt >= self.config.max_restarts:
                    if failed:
                        log.error("worker step failed (exit %d); restart budget of %d used", code, attempt)
                    return code
                attempt += 1
                log.warning(
                    "worker step failed (exit %d): restart %d of %d from the newest checkpoint",
                    code,
                    attempt,
                    self.config.max_restarts,
                )
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _supervise(self, proc: Any) -> tuple[int, bool]:
        """Watch one worker step. Return the wrapper's exit code and whether the step failed on its own (no stop
        was requested, no fatal signal): such a step may be restarted.

        A preemption or resize is requeued as soon as the checkpoint is acknowledged: the checkpoint is durable
        then, and the workers' own exit (process-group and interpreter teardown, seconds on a loaded node) need
        not delay the GPUs' release."""
        reason: StopReason | None = None
        requested_at = 0.0
        while proc.poll() is None:
            if self._fatal is not None:
                log.warning("received signal %d: stopping the workers now", self._fatal)
                self._kill_group(proc)
                return 128 + self._fatal, False
            if reason is None:
                reason, requested_at = self._take_stop_request()
            if reason is not None:
                if should_requeue(reason, self.config.requeue_on_timelimit) and self._acknowledged(requested_at):
                    return self._finish_stop(reason, requested_at), False
                if self.clock() - requested_at > self.config.grace_s:
                    log.error("workers did not stop within the %.0fs grace period", self.config.grace_s)
                    self._kill_group(proc)
                    break
            self.sleep(0.2)
        code = int(proc.wait())
        if reason is None:  # the workers may have seen the scheduler's stop file before its signal reached us
            reason, requested_at = self._take_stop_request()
        if reason is None:
            log.info("workers finished with exit code %d", code)
            return code, code != 0 and self._fatal is None
        return self._finish_stop(reason, requested_at), False

    def _take_stop_request(self) -> tuple[StopReason | None, float]:
        """A stop to act on, and when it was requested: the scheduler's ``control/stop`` (it writes the file,
        then signals; the workers may see the file first), else our own after a ``USR1`` (preemption by Slurm,
        or the time-limit warning)."""
        path = self.control / STOP_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        except (OSError, UnicodeDecodeError):
            text = ""
        if text is not None:  # prepare() set aside older ones: this request is for this run
            request = parse_stop_lenient(text)
            reason = request.reason if request.reason is not StopReason.UNKNOWN else self._stop_reason()
            log.info("stop requested by the scheduler (%s): workers checkpoint at the next boundary", reason.value)
            # An unreadable request has no time: the grace period starts now.
            return reason, request.requested_at if request.requested_at is not None else self.clock()
        if not self._usr1:
            return None, 0.0
        reason = self._stop_reason()
        requested_at = self.clock()
        atomic_write_bytes(path, StopRequest(reason, requested_at).to_json().encode())
        log.info("stop requested (%s): workers checkpoint at the next mini-batch boundary", reason.value)
        return reason, requested_at

    def _acknowledged(self, requested_at: float) -> Ack | None:
        """The workers' acknowledgement of the stop requested at ``requested_at``, if it has been written."""
        ack = read_ack(self.control / ACK_FILE)
        return ack if ack is not None and ack.written_at >= requested_at - 1.0 else None

    def _finish_stop(self, reason: StopReason, requested_at: float) -> int:
        ack = self._acknowledged(requested_at)
        if ack is not None:
            log.info("checkpoint acknowledged at step %d: %s", ack.step, ack.checkpoint)
        else:
            log.error("no checkpoint acknowledgement after the stop request; the job resumes from an older one")
        if should_requeue(reason, self.config.requeue_on_timelimit):
            if self.job.job_id is not None:
                self.slurm.requeue([self.job.job_id])
                log.info("job %s requeued (%s)", self.job.job_id, reason.value)
            return 0
        return 0 if ack is not None else 1

    def _kill_group(self, proc: Any) -> None:
        if proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers left in the group
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = self.clock() + self.config.kill_timeout_s
        while proc.poll() is None and self.clock() < deadline:
            self.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def parse_wrapper_args(argv: Sequence[str]) -> WrapperConfig:
    """``[--ckpt-root=DIR] [--backend=B] [--workers=N] [--grace=S] [--launcher=srun|mpirun]
    [--max-restarts=N] [--requeue-on-timelimit] -- COMMAND...``"""
    if "--" not in argv:
        raise ValueError("usage: hpc-elastic-run [options] -- COMMAND [ARGS...]")
    split = list(argv).index("--")
    options, command = list(argv)[:split], tuple(argv)[split + 1 :]
    values: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key == "--requeue-on-timelimit" and not value:
            values["requeue_on_timelimit"] = True
        elif key == "--ckpt-root" and value:
            values["ckpt_root"] = Path(value)
        elif key == "--backend" and value:
            values["backend"] = Backend(value)
        elif key == "--workers" and value:
            values["workers"] = int(value)
        elif key == "--grace" and value:
            values["grace_s"] = float(value)
        elif key == "--launcher" and value:
            values["launcher"] = Launcher(value)
        elif key == "--max-restarts" and value:
            values["max_restarts"] = int(value)
        else:
            raise ValueError(f"hpc-elastic-run: unknown or incomplete option {option!r}")
    if "ckpt_root" not in values:
        raise ValueError("hpc-elastic-run: --ckpt-root=DIR is required")
    return WrapperConfig(command=command, **values)
