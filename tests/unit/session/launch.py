"""Start real worker processes in tests through the one launcher (:mod:`hpc_elastic.launch.workers`, ``local``
mode): plain processes for torch.distributed, ``mpirun`` for MPI and Horovod.  Every process started here is ended
here."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_elastic.collective import Backend
from hpc_elastic.launch.workers import Launcher, WorkerGroup, WorkerStep, start_workers, unavailable_reason

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "wrappers" / "examples" / "train_mlp.py"
RUN_TIMEOUT_S = 240.0
MPI_REASON = unavailable_reason(Backend.MPI)
HVD_REASON = unavailable_reason(Backend.HOROVOD)


def base_env() -> dict[str, str]:
    """This process's environment without anything that would place the workers elsewhere."""
    drop = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HOROVOD_", "HPC_ELASTIC_", "MASTER_", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@dataclass
class Run:
    group: WorkerGroup
    logs: Path
    result_file: Path | None = None
    outputs: list[str] = field(default_factory=list)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.group.wait(timeout)
        finally:
            self.group.stop()
            self.outputs = [log.read_text(errors="replace") for log in sorted(self.logs.glob("*.log"))]

    def kill(self) -> None:
        self.group.stop()

    def running(self) -> bool:
        return self.group.poll() is None

    def result(self) -> dict[str, Any]:
        """The RESULT rank 0 wrote (``--result``: a file, since mpirun interleaves the ranks' output)."""
        if self.result_file is None or not self.result_file.exists():
            raise AssertionError("no result file; output:\n" + "\n".join(self.outputs))
        doc: dict[str, Any] = json.loads(self.result_file.read_text())
        return doc


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
    """``world`` processes of ``script`` with ``workers`` ESTs on ``backend``, output in a fresh folder of ``logs``."""
    stamp = time.time_ns()
    out = logs / f"run-{stamp}"
    result = out / "result.json"
    argv = [sys.executable, str(script), *args]
    if script.parent == EXAMPLE.parent:  # the examples write their RESULT to --result
        argv += ["--result", str(result)]
    step = WorkerStep(
        command=tuple(argv),
        ntasks=world,
        num_ests=workers,
        job_dir=job_dir,
        backend=Backend.parse(backend),
        launcher=Launcher.LOCAL,
    )
    return Run(start_workers(step, environ=base_env(), logs=out), out, result)


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
        if not run.running():
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
