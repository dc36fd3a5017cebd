"""The one launcher: start the M worker processes of a job step with the runtime's environment, watch them as one
group, stop them as one.

Three ways to start them, one contract with the training script (:func:`hpc_elastic.init` reads it):

- ``srun`` inside a Slurm allocation (the wrapper's default): one task per worker, ``--gpus-per-task`` so each
  sees its own ``CUDA_VISIBLE_DEVICES``, ``--mpi=pmix`` for MPI and Horovod;
- ``mpirun`` inside an allocation (Open MPI's own launcher);
- ``local``, on this machine without Slurm (``hpc-elastic verify-determinism``, tests): M plain processes for the
  torch backend (ranks in ``HPC_ELASTIC_RANK``), ``mpirun`` for MPI and Horovod.

Every worker runs in its own process group; :meth:`WorkerGroup.stop` signals them all, so nothing outlives the
launcher.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend, horovod_available
from hpc_elastic.env import child_environment, format_node_gpu_types
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.levels import child_environment as determinism_environment
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.errors import SlurmUnavailable
from hpc_elastic.slurm.runner import spawn

MPIRUN_FLAGS = ("--oversubscribe", "--bind-to", "none")


class Launcher(enum.StrEnum):
    SRUN = "srun"
    MPIRUN = "mpirun"
    LOCAL = "local"


@dataclass(frozen=True)
class WorkerStep:
    """What one start of the workers runs: ``ntasks`` processes of ``command`` for a job of ``num_ests`` ESTs."""

    command: tuple[str, ...]
    ntasks: int
    num_ests: int
    job_dir: Path
    backend: Backend = Backend.TORCH
    launcher: Launcher = Launcher.SRUN
    level: DeterminismLevel | None = None
    balance: BalanceMode | None = None
    gpus_per_task: int = 0
    node_gpu_types: tuple[tuple[str, str], ...] = ()
    restart_count: int = 0
    attempt: int = 0

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no worker command given")
        if isinstance(self.ntasks, bool) or not isinstance(self.ntasks, int) or self.ntasks < 1:
            raise ValueError(f"the step needs at least one worker process, got {self.ntasks!r}")
        if self.ntasks > self.num_ests:
            raise ValueError(f"{self.ntasks} worker processes for {self.num_ests} logical workers: M must not exceed N")


def unavailable_reason(backend: Backend) -> str | None:
    """Why workers of ``backend`` cannot start on this machine (``mpirun``, mpi4py, Horovod missing), or None."""
    if backend is Backend.TORCH:
        return None
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (install Open MPI)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'hpc-elastic[mpi]')"
    if backend is Backend.HOROVOD and not horovod_available():
        return "Horovod is not installed with PyTorch support (scripts/build-horovod builds it)"
    return None


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Linux's default ephemeral range, where the file cannot be read
DEFAULT_EPHEMERAL = (32768, 60999)
#: the lowest port :func:`free_port` draws (above the registered services most hosts run)
LOWEST_PORT = 10240


def ephemeral_ports(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (and for a bind to port 0)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def _bindable(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def free_port(rng: random.Random | None = None, ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port no socket holds now, for rank 0's rendezvous listener (and any other listener started by another
    process). Drawn below the kernel's ephemeral range when there is room: a port the kernel hands out for a bind to
    port 0 lies in that range, and any outgoing connection of the host can be given it before the listener binds it
    (a TCPStore failed so with EADDRINUSE on a loaded host). Below the range only an explicit bind takes a port.
    Without room, or after 64 held draws, the kernel's choice."""
    low, _ = ephemeral if ephemeral is not None else ephemeral_ports()
    if low > LOWEST_PORT:
        draw = rng if rng is not None else random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(LOWEST_PORT, low)
            if _bindable(port):
                return port
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("", 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def master_address(launcher: Launcher) -> str:
    """Where rank 0 listens: on the batch host under srun/mpirun (task 0 runs on the first node), its resolvable
    address; on loopback for local runs."""
    if launcher is Launcher.LOCAL:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def worker_environment(step: WorkerStep, port: int) -> dict[str, str]:
    """The variables every worker of ``step`` gets (see :mod:`hpc_elastic.env`); ranks come per process."""
    env = {
        **determinism_environment(),
        "OMP_NUM_THREADS": "1",
        "HPC_ELASTIC_JOB_DIR": str(step.job_dir),
        "HPC_ELASTIC_BACKEND": step.backend.value,
        "HPC_ELASTIC_WORKERS": str(step.num_ests),
        "HPC_ELASTIC_WORLD_SIZE": str(step.ntasks),
        "MASTER_ADDR": master_address(step.launcher),
        "MASTER_PORT": str(port),
        "HPC_ELASTIC_RESTART_COUNT": str(step.restart_count),
        "HPC_ELASTIC_ATTEMPT": str(step.attempt),
    }
    if step.level is not None:
        env["HPC_ELASTIC_LEVEL"] = step.level.value
    if step.balance is not None:
        env["HPC_ELASTIC_BALANCE"] = step.balance.value
    if step.node_gpu_types:
        env["HPC_ELASTIC_GPU_TYPES"] = format_node_gpu_types(step.node_gpu_types)
    return env


def _mpirun(ntasks: int, command: Sequence[str], *extra: str) -> list[str]:
    argv = [shutil.which("mpirun") or "mpirun", *MPIRUN_FLAGS, *extra, "-np", str(ntasks)]
    if os.geteuid() == 0:
        argv.insert(1, "--allow-run-as-root")
    return [*argv, *command]


def worker_argv(step: WorkerStep, exports: Sequence[str] = ()) -> list[str]:
    """The command that starts the whole step (srun, or mpirun); for a local torch step each rank runs
    ``step.command`` itself.  ``exports``: variables mpirun must pass on to its processes (local runs)."""
    if step.launcher is Launcher.SRUN:
        mpi = "pmix" if step.backend in (Backend.MPI, Backend.HOROVOD) else None
        return commands.srun_step(step.command, step.ntasks, mpi=mpi, gpus_per_task=step.gpus_per_task)
    if step.launcher is Launcher.MPIRUN:  # inside an allocation: the shared-memory transport fails across fake nodes
        return _mpirun(step.ntasks, step.command, "--mca", "btl", "tcp,self")
    if step.backend is Backend.TORCH:
        return list(step.command)
    flags = [word for name in exports for word in ("-x", name)]
    return _mpirun(step.ntasks, step.command, *flags)


class WorkerGroup:
    """The processes of one step, each in its own session (process group).  One failure fails the group: the other
    processes are stopped, as srun's ``--kill-on-bad-exit`` does."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]], kill_timeout_s: float = 10.0) -> None:
        self.procs = list(procs)
        self.kill_timeout_s = kill_timeout_s

    def poll(self) -> int | None:
        """``None`` while the step runs; its exit code once every process ended (the first non-zero one, the
        others stopped) ."""
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c is not None and c != 0]
        if failed:
            self.stop()
            return failed[0]
        if any(c is None for c in codes):
            return None
        self._reap()
        return 0

    def wait(self, timeout_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
        """Wait for the step to end; stop it and raise :class:`HpcElasticError` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise HpcElasticError(f"the worker step did not finish within {timeout_s:.0f} s")
            sleep(0.05)
        return code

    def signal(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signum)

    def _reap(self) -> None:
        """Processes left in the groups of ended workers (data-loader workers, MPI helpers): kill them."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def stop(self, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        """TERM every process group, KILL what is left after ``kill_timeout_s``, reap."""
        self.signal(signal.SIGTERM)
        deadline = clock() + self.kill_timeout_s
        while any(p.poll() is None for p in self.procs) and clock() < deadline:
            sleep(0.1)
        self._reap()
        for p in self.procs:
            p.wait()


def start_workers(
    step: WorkerStep,
    *,
    environ: Mapping[str, str] | None = None,
    logs: Path | None = None,
    kill_timeout_s: float = 10.0,
) -> WorkerGroup:
    """Start the workers of ``step`` (returns at once).  ``environ``: the base environment (this process's when
    omitted).  ``logs``: a directory for their output (``rank<r>.log``, ``mpirun.log``); else they inherit ours."""
    base = worker_environment(step, free_port())
    argv = worker_argv(step, exports=sorted(base))
    procs: list[subprocess.Popen[bytes]] = []

    def launch(command: Sequence[str], extra: Mapping[str, str], log_name: str) -> None:
        env = child_environment({**base, **extra}, environ)
        try:
            if logs is None:
                procs.append(spawn(command, env))
                return
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / log_name, "ab") as out:
                procs.append(spawn(command, env, output=out))
        except SlurmUnavailable as exc:
            WorkerGroup(procs, kill_timeout_s).stop()
            raise HpcElasticError(f"cannot start the workers: {exc}") from exc

    if step.launcher is Launcher.LOCAL and step.backend is Backend.TORCH:
        for rank in range(step.ntasks):
            launch(argv, {"HPC_ELASTIC_RANK": str(rank), "HPC_ELASTIC_LOCAL_RANK": str(rank)}, f"rank{rank}.log")
    else:
        launch(argv, {}, f"{step.launcher.value}.log")
    return WorkerGroup(procs, kill_timeout_s)
