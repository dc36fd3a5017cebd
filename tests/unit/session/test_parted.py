"""Parameters changed outside the optimizer on some processes only: the copies part, and the commit refuses
(before, rank 0's copy was checkpointed and the others trained on, each on its own parameters)."""

from __future__ import annotations

import sys
from pathlib import Path

from hpc_elastic.collective import Backend
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers
from tests.unit.session.launch import Run, base_env

WORKER = Path(__file__).with_name("parted_worker.py")


def run(tmp_path: Path, procs: int) -> tuple[int, str]:
    out = tmp_path / f"m{procs}"
    out.mkdir()
    step = WorkerStep(
        command=(sys.executable, str(WORKER)),
        ntasks=procs,
        num_ests=4,
        job_dir=out / "job",
        backend=Backend.TORCH,
        launcher=Launcher.LOCAL,
    )
    group = Run(start_workers(step, environ=base_env(), logs=out), out)
    code = group.wait()
    return code, "\n".join(group.outputs)


def test_a_commit_refuses_parameters_that_parted_between_processes(tmp_path: Path) -> None:
    code, output = run(tmp_path, 1)
    assert code == 0, output  # one process: one copy, nothing to part
    code, output = run(tmp_path, 2)
    assert code != 0 and "refused: step 1: the parameters of process(es) [1] differ from process 0's" in output
    assert not list((tmp_path / "m2" / "job" / "checkpoints").glob("ckpt-*"))
