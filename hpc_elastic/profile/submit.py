"""``hpc-elastic profile run --submit``: the sbatch command and batch script of a profile job (pure).

Nothing here runs a process: the Slurm adapter (``SlurmClient.submit(options=..., script_text=...)`` in
:mod:`hpc_elastic.slurm`) submits what this builds, so that a site can profile each GPU type it has. The job runs
the same ``profile run`` with ``--device cuda --device-type <GPU type>``, so the profile is keyed by the site's
Slurm GPU type.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_elastic.slurm import commands

_SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")
DEFAULT_TIME_LIMIT = "00:30:00"


def _slurm_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _SLURM_NAME_RE.match(value):
        raise ValueError(f"{what} must be a Slurm name (letters, digits, _ . + -), got {value!r}")
    return value


@dataclass(frozen=True)
class SubmitRequest:
    """A profile to run as a batch job: where, on which GPU type, and the ``profile run`` arguments."""

    partition: str
    run_args: tuple[str, ...]  # what follows "profile run" in the job
    gpu_type: str | None = None  # None: a CPU profile on that partition
    job_name: str = "hpc-elastic-profile"
    time_limit: str = DEFAULT_TIME_LIMIT
    program: tuple[str, ...] = ("hpc-elastic",)
    output: str | None = None  # sbatch --output (%j = job id); None: Slurm's slurm-%j.out in the submit directory

    def __post_init__(self) -> None:
        _slurm_name("partition", self.partition)
        _slurm_name("job name", self.job_name)
        if self.gpu_type is not None:
            _slurm_name("GPU type", self.gpu_type)
        if not _TIME_RE.match(self.time_limit):
            raise ValueError(f"time limit must look like [D-]HH:MM:SS, got {self.time_limit!r}")
        if self.output is not None and (not self.output or "\n" in self.output):
            raise ValueError(f"the job output path must be one non-empty line, got {self.output!r}")
        if not self.run_args or not self.program:
            raise ValueError("a profile job needs a program and at least the MODEL argument")


def profile_job_command(request: SubmitRequest) -> list[str]:
    """The command the job runs: ``<program> profile run <run_args...>``."""
    return [*request.program, "profile", "run", *request.run_args]


def sbatch_options(request: SubmitRequest) -> list[str]:
    """sbatch options of one single-task profile job (one GPU of ``gpu_type`` when given)."""
    options = [
        f"--job-name={request.job_name}",
        f"--partition={request.partition}",
        "--nodes=1",
        "--ntasks=1",
    ]
    if request.gpu_type is not None:
        options.append(f"--gres=gpu:{request.gpu_type}:1")
    options.append(f"--time={request.time_limit}")
    if request.output is not None:
        options.append(f"--output={request.output}")
    return options


def job_script(request: SubmitRequest) -> str:
    """The batch script (given to sbatch on standard input): runs ``profile run`` in the job's allocation."""
    return "\n".join(
        [
            "#!/bin/bash",
            "# hpc-elastic profile job: measures one model on this node's device type.",
            "set -euo pipefail",
            f"exec {shlex.join(profile_job_command(request))}",
            "",
        ]
    )


def build_sbatch_argv(request: SubmitRequest) -> list[str]:
    """The full sbatch argv; :func:`job_script` goes to its standard input."""
    return commands.sbatch(None, sbatch_options(request))


def remote_run_args(
    model_spec: str,
    *,
    gpu_type: str | None,
    options: Sequence[tuple[str, str | None]],
) -> tuple[str, ...]:
    """``profile run`` arguments for the job: MODEL, then ``--device cuda --device-type T`` for a GPU type,
    then ``options`` (``(flag, value)``; value None for a bare flag) in the order given."""
    args: list[str] = [model_spec]
    if gpu_type is not None:
        args += ["--device", "cuda", "--device-type", gpu_type]
    for flag, value in options:
        if not flag.startswith("--"):
            raise ValueError(f"option flags start with --, got {flag!r}")
        args.append(flag)
        if value is not None:
            args.append(value)
    return tuple(args)
