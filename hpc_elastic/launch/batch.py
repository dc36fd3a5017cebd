"""The batch script ``hpc-elastic submit`` writes: pure text from a :class:`SubmitSpec` (golden-file tested).

``#SBATCH`` lines carry only validated values without spaces or quotes; everything in the shell body is
quoted with :func:`shlex.quote`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

from hpc_elastic import __version__
from hpc_elastic.jobdir import ARRAY_OUTPUT_PATTERN, OUTPUT_PATTERN
from hpc_elastic.launch.spec import DEFAULT_MAX_REQUEUES, DEFAULT_MAX_RESTARTS, Mode, SubmitSpec, encode_marker
from hpc_elastic.ps.config import STEP_MEM_MB_PER_CPU


def worker_command(spec: SubmitSpec) -> list[str]:
    """What each worker process runs: ``python SCRIPT ARGS`` for Python scripts, else the script itself."""
    if spec.script is None:
        raise ValueError("a ps-mode job runs no training script")
    script = str(spec.script)
    head = [spec.python, script] if spec.script.suffix == ".py" else [script]
    return [*head, *spec.args]


def _valued(*pairs: tuple[str, str | int | None]) -> list[str]:
    """``--name=value`` of the pairs whose value is set, in their order."""
    return [f"--{name}={value}" for name, value in pairs if value]


def sbatch_directives(spec: SubmitSpec) -> list[str]:
    """The ``#SBATCH`` options, in a fixed order: who pays and where, the size, the limits, when and whom to tell,
    what the wrapper needs, then the other sbatch options (``--sbatch-arg``, ``#SBATCH`` lines of the script)."""
    options = [f"--job-name={spec.name}"]
    options += _valued(
        ("array", spec.array),
        ("account", spec.account),
        ("qos", spec.qos),
        ("partition", spec.partition),
        ("reservation", spec.reservation),
        ("nodes", spec.nodes),
    )
    options.append(f"--ntasks={spec.processes}")
    if spec.gpus:
        per_task = f"{spec.gpu_type}:1" if spec.gpu_type else "1"
        options.append(f"--gpus-per-task={per_task}")
    options.append(f"--cpus-per-task={spec.cpus_per_worker}")
    options += _valued(
        ("mem", spec.mem),
        ("mem-per-gpu", spec.mem_per_gpu),
        ("mem-per-cpu", spec.mem_per_cpu),
        ("constraint", spec.constraint),
    )
    if spec.mode is Mode.PS and not (spec.mem or spec.mem_per_cpu):
        options.append(f"--mem-per-cpu={STEP_MEM_MB_PER_CPU}")  # what each of the job's steps asks for
    if spec.exclusive:
        options.append("--exclusive")
    options += _valued(
        ("time", spec.time),
        ("dependency", spec.dependency),
        ("mail-type", spec.mail_type.upper() if spec.mail_type else None),
        ("mail-user", spec.mail_user),
    )
    # each array task writes its own output file (%j alone is the task's own id, not the array's)
    output = ARRAY_OUTPUT_PATTERN if spec.array is not None else OUTPUT_PATTERN
    options += [
        "--requeue",
        f"--signal=B:USR1@{spec.grace_s}",
        "--open-mode=append",
        f"--output={spec.ckpt_root}/{output}",
        f"--comment={encode_marker(spec)}",
        *spec.extra,
    ]
    return options


def ps_wrapper_args(spec: SubmitSpec) -> list[str]:
    """The wrapper's options of a ps-mode job (:func:`hpc_elastic.ps.allocation.parse_args` reads them)."""
    assert spec.workers_range is not None and spec.ps_range is not None, "a ps-mode spec has both ranges"
    settings = (
        [f"--ps-config={json.dumps(json.loads(spec.ps_config), separators=(',', ':'))}"] if spec.ps_config else []
    )
    return [
        "--mode=ps",
        f"--ckpt-root={spec.ckpt_root}",
        "--workers-range={}:{}".format(*spec.workers_range),
        "--ps-range={}:{}".format(*spec.ps_range),
        f"--cpus-per-worker={spec.cpus_per_worker}",
        f"--grace={spec.grace_s}",
        *([f"--max-requeues={spec.max_requeues}"] if spec.max_requeues != DEFAULT_MAX_REQUEUES else []),
        *settings,
    ]


def render_batch_script(spec: SubmitSpec, wrapper: Sequence[str]) -> str:
    """The whole batch script; ``wrapper`` is the argv prefix that starts ``wrappers/hpc-elastic-run``."""
    lo, hi = spec.elastic_range
    if spec.mode is Mode.PS:
        assert spec.workers_range is not None and spec.ps_range is not None, "a ps-mode spec has both ranges"
        run = [*wrapper, *ps_wrapper_args(spec)]
        about = (
            f"# ps mode: job master, {spec.ps_range[0]}-{spec.ps_range[1]} PS, "
            f"{spec.workers_range[0]}-{spec.workers_range[1]} workers, {spec.cpus_per_worker} cores each"
        )
    else:
        run = [*wrapper, *_est_wrapper_args(spec), "--", *worker_command(spec)]
        about = (
            f"# logical workers {spec.logical_workers}; elastic range {lo}-{hi} "
            f"{'GPUs' if spec.gpus else 'processes'}; backend {spec.backend.value}"
        )
    lines = [
        "#!/bin/bash",
        f"# Written by hpc-elastic {__version__} (hpc-elastic submit). Resubmit rather than edit.",
        *(f"#SBATCH {option}" for option in sbatch_directives(spec)),
        "",
        "set -euo pipefail",
        "trap '' USR1  # Slurm's warning, until the wrapper takes it (it holds one that comes after its start)",
        about,
        "exec " + " ".join(shlex.quote(word) for word in run),
        "",
    ]
    return "\n".join(lines)


def _est_wrapper_args(spec: SubmitSpec) -> list[str]:
    return [
        f"--ckpt-root={spec.ckpt_root}",
        f"--backend={spec.backend.value}",
        f"--workers={spec.logical_workers}",
        *([f"--level={spec.level.value}"] if spec.level is not None else []),
        *([f"--balance={spec.balance.value}"] if spec.balance is not None else []),
        f"--grace={spec.grace_s}",
        *([f"--max-restarts={spec.max_restarts}"] if spec.max_restarts != DEFAULT_MAX_RESTARTS else []),
        *([f"--max-requeues={spec.max_requeues}"] if spec.max_requeues != DEFAULT_MAX_REQUEUES else []),
    ]
