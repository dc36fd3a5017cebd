"""The batch script ``hpc-elastic submit`` writes: pure text from a :class:`SubmitSpec` (golden-file tested).

``#SBATCH`` lines carry only validated values without spaces or quotes; everything in the shell body is
quoted with :func:`shlex.quote`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from hpc_elastic import __version__
from hpc_elastic.launch.spec import DEFAULT_MAX_REQUEUES, DEFAULT_MAX_RESTARTS, SubmitSpec, encode_marker


def worker_command(spec: SubmitSpec) -> list[str]:
    """What each worker process runs: ``python SCRIPT ARGS`` for Python scripts, else the script itself."""
    script = str(spec.script)
    head = [spec.python, script] if spec.script.suffix == ".py" else [script]
    return [*head, *spec.args]


def sbatch_directives(spec: SubmitSpec) -> list[str]:
    """The ``#SBATCH`` options, in a fixed order."""
    options = [f"--job-name={spec.name}"]
    if spec.partition:
        options.append(f"--partition={spec.partition}")
    if spec.nodes:
        options.append(f"--nodes={spec.nodes}")
    options.append(f"--ntasks={spec.processes}")
    if spec.gpus:
        per_task = f"{spec.gpu_type}:1" if spec.gpu_type else "1"
        options.append(f"--gpus-per-task={per_task}")
    options.append(f"--cpus-per-task={spec.cpus_per_worker}")
    if spec.time:
        options.append(f"--time={spec.time}")
    options += [
        "--requeue",
        f"--signal=B:USR1@{spec.grace_s}",
        "--open-mode=append",
        f"--output={spec.ckpt_root}/%x-%j.out",
        f"--comment={encode_marker(spec)}",
        *spec.extra,
    ]
    return options


def render_batch_script(spec: SubmitSpec, wrapper: Sequence[str]) -> str:
    """The whole batch script; ``wrapper`` is the argv prefix that starts ``wrappers/hpc-elastic-run``."""
    lo, hi = spec.elastic_range
    run = [
        *wrapper,
        f"--ckpt-root={spec.ckpt_root}",
        f"--backend={spec.backend.value}",
        f"--workers={spec.logical_workers}",
        *([f"--level={spec.level.value}"] if spec.level is not None else []),
        f"--grace={spec.grace_s}",
        *([f"--max-restarts={spec.max_restarts}"] if spec.max_restarts != DEFAULT_MAX_RESTARTS else []),
        *([f"--max-requeues={spec.max_requeues}"] if spec.max_requeues != DEFAULT_MAX_REQUEUES else []),
        "--",
        *worker_command(spec),
    ]
    lines = [
        "#!/bin/bash",
        f"# Written by hpc-elastic {__version__} (hpc-elastic submit). Resubmit rather than edit.",
        *(f"#SBATCH {option}" for option in sbatch_directives(spec)),
        "",
        "set -euo pipefail",
        f"# logical workers {spec.logical_workers}; elastic range {lo}-{hi} "
        f"{'GPUs' if spec.gpus else 'processes'}; backend {spec.backend.value}",
        "exec " + " ".join(shlex.quote(word) for word in run),
        "",
    ]
    return "\n".join(lines)
