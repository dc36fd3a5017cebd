"""Start real worker processes the way the wrapper does: plain env vars for torch.distributed, ``mpirun`` for MPI and
Horovod.  Every process started here is ended here, by its own id."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "wrappers" / "examples" / "train_mlp.py"
MPIRUN = ("mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "tcp,self")
RUN_TIMEOUT_S = 240.0


def mpi_unavailable_reason() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed"
    return None


def horovod_unavailable_reason() -> str | None:
    if importlib.util.find_spec("horovod") is None:
        return "horovod not installed"
    try:
        import horovod.torch  # noqa: F401
    except ImportError as exc:
        return f"horovod not installed (horovod.torch does not import: {exc})"
    return mpi_unavailable_reason()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def base_env(job_dir: Path, workers: int, backend: str) -> dict[str, str]:
    """This process's environment without anything that would place the workers elsewhere."""
    drop = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HOROVOD_", "HPC_ELASTIC_", "MASTER_", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        {
            "HPC_ELASTIC_JOB_DIR": str(job_dir),
            "HPC_ELASTIC_WORKERS": str(workers),
            "HPC_ELASTIC_BACKEND": backend,
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "OMP_NUM_THREADS": "1",
        }
    )
    return env


@dataclass
class Run:
    procs: list[subprocess.Popen[str]]
    logs: list[Path]
    result_file: Path | None = None
    outputs: list[str] = field(default_factory=list)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        try:
            for p in self.procs:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        finally:
            self.kill()
            self.outputs = [log.read_text() for log in self.logs]
        return codes

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)

    def result(self) -> dict[str, Any]:
        """The RESULT rank 0 wrote (``--result``: a file, since mpirun interleaves the ranks' output)."""
        if self.result_file is None or not self.result_file.exists():
            raise AssertionError("no result file; output:\n" + "\n".join(self.outputs))
        doc: dict[str, Any] = json.loads(self.result_file.read_text())
        return doc


def _popen(argv: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[str]:
    with open(log, "w") as fh:
        return subprocess.Popen(list(argv), env=dict(env), stdout=fh, stderr=subprocess.STDOUT, text=True, cwd=REPO)


def launch(
    backend: str,
    world: int,
    job_dir: Path,
    args: Sequence[str],
    *,
    workers: int,
    logs: Path,
    script: Path = EXAMPLE,
) -> Run:
    """``world`` processes of ``script`` on ``backend`` (torch: one Popen per rank with HPC_ELASTIC_RANK etc.;
    mpi, horovod: one mpirun)."""
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.time_ns()
    env = base_env(job_dir, workers, backend)
    result = logs / f"{stamp}-result.json"
    argv = [sys.executable, str(script), *args]
    if script.parent == EXAMPLE.parent:  # the examples write their RESULT to --result
        argv += ["--result", str(result)]
    if backend == "torch":
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "HPC_ELASTIC_WORLD_SIZE": str(world)})
        procs, paths = [], []
        for rank in range(world):
            path = logs / f"{stamp}-torch-rank{rank}.log"
            rank_env = {**env, "HPC_ELASTIC_RANK": str(rank), "HPC_ELASTIC_LOCAL_RANK": str(rank)}
            procs.append(_popen(argv, rank_env, path))
            paths.append(path)
        return Run(procs, paths, result)
    path = logs / f"{stamp}-{backend}.log"
    return Run([_popen([*MPIRUN, "-np", str(world), *argv], env, path)], [path], result)


def write_stop(job_dir: Path, reason: str = "preempt") -> None:
    """What the wrapper does: create control/stop atomically."""
    control = job_dir / "control"
    control.mkdir(parents=True, exist_ok=True)
    tmp = control / ".stop.tmp"
    tmp.write_text(json.dumps({"reason": reason, "requested_at": time.time()}))
    os.replace(tmp, control / "stop")


def clear_control(job_dir: Path) -> None:
    """What the wrapper does before starting the workers of a new incarnation."""
    for name in ("stop", "ack.json"):
        (job_dir / "control" / name).unlink(missing_ok=True)


def trace_steps(trace: Path) -> set[int]:
    steps: set[int] = set()
    for path in trace.glob("trace-*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                steps.add(json.loads(line)["step"])
    return steps


def wait_for_steps(run: Run, trace: Path, at_least: int, timeout: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while len(trace_steps(trace)) < at_least:
        if any(p.poll() is not None for p in run.procs):
            run.wait(5)
            raise AssertionError("a worker exited before the stop:\n" + "\n".join(run.outputs))
        if time.monotonic() > deadline:
            run.kill()
            raise AssertionError(f"fewer than {at_least} steps after {timeout} s")
        time.sleep(0.05)


def read_traces(trace: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(trace.glob("trace-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records
