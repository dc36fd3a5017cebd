"""Start the M processes of an EST run on this machine: gloo via plain subprocesses (the rendezvous
``torchrun`` would do), MPI and Horovod via ``mpirun``.  The Slurm launcher of a later issue replaces
this; the contract with the script (:mod:`hpc_elastic.est.job`) stays."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_elastic.collective import horovod_available
from hpc_elastic.env import child_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.backends import CommBackend
from hpc_elastic.est.job import RunSpec
from hpc_elastic.est.levels import child_environment as determinism_environment

EXAMPLE_MODULE = "hpc_elastic.est.example"
MPIRUN_FLAGS = ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def mpi_unavailable_reason() -> str | None:
    """Why the mpi backend cannot run here, or ``None`` when it can."""
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (install Open MPI)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'hpc-elastic[mpi]')"
    return None


def backend_unavailable_reason(backend: CommBackend) -> str | None:
    if backend is CommBackend.MPI:
        return mpi_unavailable_reason()
    if backend is CommBackend.HOROVOD:
        if not horovod_available():
            return "Horovod is not installed with PyTorch support (scripts/build-horovod builds it)"
        return mpi_unavailable_reason()
    if backend is CommBackend.NCCL:
        import torch

        if not torch.cuda.is_available():
            return "nccl needs CUDA GPUs"
    if backend is CommBackend.LOCAL:
        return "the local backend runs in-process; use ESTRuntime directly"
    return None


@dataclass(frozen=True)
class LaunchResult:
    spec: RunSpec
    returncodes: tuple[int, ...]
    result: dict[str, Any] | None
    logs: tuple[Path, ...]
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes) and self.result is not None

    def tail(self, lines: int = 8) -> str:
        out: list[str] = []
        for log in self.logs:
            with contextlib.suppress(OSError):
                text = log.read_text(errors="replace").strip().splitlines()
                out.extend(f"[{log.name}] {line}" for line in text[-lines:])
        return "\n".join(out)


class RunningJob:
    """The processes of one launch (each in its own session, so it can be killed with its children)."""

    def __init__(self, spec: RunSpec, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        self.spec = spec
        self.procs = procs
        self.logs = logs
        self.started = time.monotonic()

    def poll(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process group this launch started (rank processes and their children)."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        limit = timeout_s if timeout_s is not None else self.spec.timeout_s
        deadline = self.started + limit
        codes: list[int] = []
        try:
            for p in self.procs:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            self.kill()
            raise HpcElasticError(
                f"run on {self.spec.procs} processes did not finish within {limit:.0f} s; logs: {self.logs[0].parent}"
            ) from None
        # a rank process that exits may leave data-loader or MPI helpers in its session: end them
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        result = None
        path = Path(self.spec.result_path)
        if path.is_file():
            with contextlib.suppress(OSError, ValueError):
                result = json.loads(path.read_text())
        return LaunchResult(self.spec, tuple(codes), result, tuple(self.logs), time.monotonic() - self.started)


def _command(script: Path | None, python: str) -> list[str]:
    return [python, "-m", EXAMPLE_MODULE] if script is None else [python, str(script)]


def start(
    spec: RunSpec,
    workdir: Path,
    script: Path | None = None,
    *,
    name: str = "run",
    python: str = sys.executable,
    mpirun_args: Sequence[str] = (),
) -> RunningJob:
    """Start ``script`` (default: the bundled example) on ``spec.procs`` processes; returns at once."""
    reason = backend_unavailable_reason(spec.backend)
    if reason:
        raise HpcElasticError(f"backend {spec.backend.value} unavailable: {reason}")
    if script is not None and not script.is_file():
        raise ValueError(f"training script {script} does not exist")
    workdir.mkdir(parents=True, exist_ok=True)
    Path(spec.result_path).unlink(missing_ok=True)
    spec_path = spec.write(workdir / f"{name}.spec.json")
    base = {**determinism_environment(), "HPC_ELASTIC_EST_SPEC": str(spec_path), "OMP_NUM_THREADS": "1"}
    cmd = _command(script, python)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    if spec.backend in (CommBackend.GLOO, CommBackend.NCCL):
        for rank in range(spec.procs):
            log = workdir / f"{name}.rank{rank}.log"
            env = child_environment({**base, "HPC_ELASTIC_EST_RANK": str(rank)})
            with open(log, "wb") as fh:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
                )
            logs.append(log)
    else:
        mpirun = shutil.which("mpirun") or "mpirun"
        exports: list[str] = []
        for key in base:
            exports += ["-x", key]
        full = [mpirun, *MPIRUN_FLAGS, *mpirun_args, "-np", str(spec.procs), *exports, *cmd]
        log = workdir / f"{name}.mpirun.log"
        with open(log, "wb") as fh:
            procs.append(
                subprocess.Popen(
                    full, env=child_environment(base), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        logs.append(log)
    return RunningJob(spec, procs, logs)


def launch(
    spec: RunSpec,
    workdir: Path,
    script: Path | None = None,
    *,
    name: str = "run",
    python: str = sys.executable,
    mpirun_args: Sequence[str] = (),
) -> LaunchResult:
    """Run to completion; raise :class:`HpcElasticError` (with the end of the logs) when it fails."""
    result = start(spec, workdir, script, name=name, python=python, mpirun_args=mpirun_args).wait()
    if not result.ok:
        codes = ",".join(map(str, result.returncodes))
        last = result.tail(3).splitlines()
        hint = last[-1] if last else "no output"
        raise HpcElasticError(f"run '{name}' failed (exit {codes}): {hint}; logs in {workdir}")
    return result
