"""The srun argv of a PS-mode process: one task, its own CPUs and memory, its own step name."""

from __future__ import annotations

import pytest

from hpc_elastic.slurm import commands


def test_one_process_is_one_exact_step_of_its_own() -> None:
    argv = commands.srun_single(["python", "-m", "hpc_elastic.ps", "ps"], name="ps0", cpus=2, mem_mb=700)
    assert argv[0] == "srun" and argv[-4:] == ["python", "-m", "hpc_elastic.ps", "ps"]
    assert {"--ntasks=1", "--nodes=1", "--cpus-per-task=2", "--mem=700M", "--exact", "--job-name=ps0"} <= set(argv)


@pytest.mark.parametrize(("command", "cpus", "mem"), [([], 1, 1), (["x"], 0, 1), (["x"], 1, 0)])
def test_bad_steps_are_refused(command: list[str], cpus: int, mem: int) -> None:
    with pytest.raises(ValueError):
        commands.srun_single(command, name="x", cpus=cpus, mem_mb=mem)
