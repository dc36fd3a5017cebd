"""The one module that reads environment variables.

Everything else in hpc-elastic receives these values as arguments or through the frozen
:class:`Environment` built here, so that library code stays testable and free of hidden inputs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend
from hpc_elastic.est.levels import DeterminismLevel

DEFAULT_GPFS_ROOT = Path("/tmp/hpc-elastic/gpfs")  # noqa: S108 - the dev cluster's stand-in for GPFS
DEFAULT_SLURM_TIMEOUT_S = 30.0
#: the longest timeout taken from the environment: a day (a larger one overflows the system's timers)
MAX_TIMEOUT_S = 86400.0
SLURM_BACKENDS = ("auto", "cli", "pyslurm")


@dataclass(frozen=True)
class Environment:
    """Settings that come from the process environment."""

    gpfs_root: Path = DEFAULT_GPFS_ROOT
    slurm_backend: str = "auto"
    slurm_timeout_s: float = DEFAULT_SLURM_TIMEOUT_S
    slurm_conf: Path | None = None
    profile_dir: Path | None = None


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {raw!r}")
    return value


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Build an :class:`Environment` from ``environ`` (``os.environ`` when omitted).

    Recognised variables:

    - ``HPC_ELASTIC_GPFS``: directory standing for the site's shared filesystem.
    - ``HPC_ELASTIC_SLURM_BACKEND``: ``auto`` (default), ``cli`` or ``pyslurm``.
    - ``HPC_ELASTIC_SLURM_TIMEOUT``: seconds one Slurm command may take (default 30).
    - ``HPC_ELASTIC_PROFILES``: directory of model profiles (default: ``profiles/`` of the source checkout).
    - ``SLURM_CONF``: Slurm's own variable, read only to report which configuration is in use.
    """
    env = os.environ if environ is None else environ
    backend = env.get("HPC_ELASTIC_SLURM_BACKEND", "auto").strip().lower() or "auto"
    if backend not in SLURM_BACKENDS:
        raise ValueError(f"HPC_ELASTIC_SLURM_BACKEND must be one of {', '.join(SLURM_BACKENDS)}, got {backend!r}")
    timeout_raw = env.get("HPC_ELASTIC_SLURM_TIMEOUT")
    timeout = (
        DEFAULT_SLURM_TIMEOUT_S if timeout_raw is None else _positive_float("HPC_ELASTIC_SLURM_TIMEOUT", timeout_raw)
    )
    gpfs = env.get("HPC_ELASTIC_GPFS")
    conf = env.get("SLURM_CONF")
    return Environment(
        gpfs_root=Path(gpfs) if gpfs else DEFAULT_GPFS_ROOT,
        slurm_backend=backend,
        slurm_timeout_s=timeout,
        slurm_conf=Path(conf) if conf else None,
        profile_dir=Path(env["HPC_ELASTIC_PROFILES"]) if env.get("HPC_ELASTIC_PROFILES") else None,
    )


def child_environment(overrides: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: this process's environment with ``overrides`` applied."""
    base = dict(os.environ if environ is None else environ)
    base.update(overrides)
    return base


# ----------------------------------------------------------------------------------------------------------
# Inside an allocation: what the wrapper (wrappers/hpc-elastic-run) and each worker process see.
#
# The wrapper reads Slurm's variables and sets the HPC_ELASTIC_* ones for every worker it starts:
#   HPC_ELASTIC_JOB_DIR      the job's directory on the shared filesystem: checkpoints/, control/, logs
#   HPC_ELASTIC_WORKERS      logical workers N (the global data-parallel degree the script was designed for)
#   HPC_ELASTIC_BACKEND      torch | mpi | horovod
#   HPC_ELASTIC_LEVEL        determinism level d0 | d1 | d2 (submit --level; default d1)
#   HPC_ELASTIC_BALANCE      none | est | lbbsp (submit --balance; default: est where N > M at d1/d2, else none)
#   HPC_ELASTIC_GPU_TYPES    the GPU type of each node of the allocation, "node1:a100,node3:v100" (from Slurm)
#   HPC_ELASTIC_RANK, HPC_ELASTIC_WORLD_SIZE, HPC_ELASTIC_LOCAL_RANK
#                            this process's place among the M worker processes (else read from srun's
#                            SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID or Open MPI's OMPI_COMM_WORLD_*)
#   MASTER_ADDR, MASTER_PORT torch.distributed rendezvous
#   HPC_ELASTIC_ATTEMPT      which start of the worker step inside this allocation (0, then 1.. after a restart)
#   HPC_ELASTIC_RESTART_COUNT
#                            the job's requeues as the wrapper read them (else SLURM_RESTART_COUNT)
# Control files (in HPC_ELASTIC_JOB_DIR/control): ``stop`` asks workers to checkpoint at the next mini-batch
# boundary and exit; ``ack.json`` is written by rank 0 once that checkpoint is committed.
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobEnvironment:
    """The allocation and this process's place in it."""

    job_id: int | None = None
    job_name: str = ""
    array_job_id: int | None = None  # a task of a job array: the array's job id (SLURM_ARRAY_JOB_ID) ...
    array_task_id: int | None = None  # ... and the task's index (SLURM_ARRAY_TASK_ID); None for other jobs
    restart_count: int = 0
    attempt: int = 0  # restarts of the worker step inside this allocation (HPC_ELASTIC_ATTEMPT, from the wrapper)
    node_list: str = ""
    num_nodes: int = 1
    node_name: str = ""
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES of this process / task
    gpus_per_task: int = 0  # the job's --gpus-per-task (SLURM_GPUS_PER_TASK, e.g. "a100:1")
    allocated_tasks: int | None = None  # tasks of the allocation now (SLURM_TASKS_PER_NODE), None outside one
    cpus_on_node: int | None = None
    cpus_per_node: tuple[int, ...] = ()  # the allocation's CPUs on each node of node_list (SLURM_JOB_CPUS_PER_NODE)
    mem_on_node_mb: int | None = None  # the allocation's memory on this node (SLURM_MEM_PER_NODE, or per CPU x CPUs)
    job_dir: Path | None = None
    workers: int | None = None
    backend: Backend = Backend.TORCH
    level: DeterminismLevel | None = None  # None: the script's choice (default d1)
    balance: BalanceMode | None = None  # None: the default of hpc_elastic.balance.mode.resolve_balance
    node_gpu_types: tuple[tuple[str, str], ...] = ()  # (node, GPU type) of the allocation, from the wrapper
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def _mem_on_node_mb(env: Mapping[str, str]) -> int | None:
    """The allocation's memory on this node in MB: ``SLURM_MEM_PER_NODE``, or ``SLURM_MEM_PER_CPU`` times
    ``SLURM_CPUS_ON_NODE``; None when Slurm set neither."""
    per_node = _int(env, "SLURM_MEM_PER_NODE")
    if per_node is not None:
        return per_node
    per_cpu, cpus = _int(env, "SLURM_MEM_PER_CPU"), _int(env, "SLURM_CPUS_ON_NODE")
    return per_cpu * cpus if per_cpu is not None and cpus is not None else None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return default


def _gpus_per_task(raw: str) -> int:
    """``SLURM_GPUS_PER_TASK``: ``1``, ``a100:1``, or ``a100:1,v100:1`` (types summed)."""
    total = 0
    for item in raw.split(","):
        count = item.strip().rsplit(":", 1)[-1]
        if count.isdigit():
            total += int(count)
    return total


def per_node_counts(raw: str) -> tuple[int, ...]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``8``, ``4(x2),3``) as one count per node, in node-list order; ``()`` when it
    is absent or unreadable."""
    counts: list[int] = []
    for item in raw.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            return ()
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(counts)


def tasks_per_node_total(raw: str) -> int | None:
    """Total of ``SLURM_TASKS_PER_NODE`` (``4``, ``2(x2),1``), or None when it is absent or unreadable.

    It follows the allocation the job has now: after the scheduler plugin changes ``NumTasks`` of a requeued job,
    the new batch step still inherits the original ``SLURM_NTASKS``/``SLURM_NPROCS`` from the submission, while
    ``SLURM_TASKS_PER_NODE`` describes the tasks actually allocated."""
    total = 0
    for item in raw.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            return None
        total += int(match.group(1)) * int(match.group(2) or 1)
    return total or None


def parse_node_gpu_types(raw: str) -> tuple[tuple[str, str], ...]:
    """``node1:a100,node3:v100`` -> ``(("node1", "a100"), ("node3", "v100"))``; ``ValueError`` on a bad item."""
    out: list[tuple[str, str]] = []
    for item in raw.split(","):
        if not item.strip():
            continue
        node, sep, gpu_type = item.strip().partition(":")
        if not sep or not node or not gpu_type:
            raise ValueError(f"HPC_ELASTIC_GPU_TYPES items must look like node:type, got {item!r}")
        out.append((node, gpu_type))
    return tuple(out)


def format_node_gpu_types(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f"{node}:{gpu_type}" for node, gpu_type in pairs)


def read_job_environment(environ: Mapping[str, str] | None = None) -> JobEnvironment:
    """The :class:`JobEnvironment` of this process (``os.environ`` when ``environ`` is omitted)."""
    env = os.environ if environ is None else environ
    try:
        backend = Backend.parse(env.get("HPC_ELASTIC_BACKEND", "torch").strip() or "torch")
    except ValueError as exc:
        raise ValueError(f"HPC_ELASTIC_BACKEND: {exc}") from None
    try:
        raw_level = env.get("HPC_ELASTIC_LEVEL", "").strip()
        level = DeterminismLevel.parse(raw_level) if raw_level else None
    except ValueError as exc:
        raise ValueError(f"HPC_ELASTIC_LEVEL: {exc}") from None
    try:
        raw_balance = env.get("HPC_ELASTIC_BALANCE", "").strip()
        balance = BalanceMode.parse(raw_balance) if raw_balance else None
    except ValueError as exc:
        raise ValueError(f"HPC_ELASTIC_BALANCE: {exc}") from None
    workers = _int(env, "HPC_ELASTIC_WORKERS")
    if workers is not None and workers < 1:
        raise ValueError(f"HPC_ELASTIC_WORKERS must be >= 1, got {workers}")
    # Open MPI's variables before Slurm's: under ``mpirun`` inside an allocation every process inherits the batch
    # step's SLURM_PROCID=0, while OMPI_COMM_WORLD_* are set per process (srun sets no OMPI_* before MPI_Init).
    rank = _first_int(env, ("HPC_ELASTIC_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"), 0)
    world = _first_int(env, ("HPC_ELASTIC_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"), 1)
    local = _first_int(env, ("HPC_ELASTIC_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"), 0)
    if not 0 <= rank < world:
        raise ValueError(f"process rank {rank} is outside a world of {world}")
    devices = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    job_dir = env.get("HPC_ELASTIC_JOB_DIR")
    array_job_id = _int(env, "SLURM_ARRAY_JOB_ID")
    array_task_id = _int(env, "SLURM_ARRAY_TASK_ID") if array_job_id is not None else None
    if (array_job_id is not None and array_job_id < 1) or (array_task_id is not None and array_task_id < 0):
        raise ValueError(f"SLURM_ARRAY_JOB_ID/SLURM_ARRAY_TASK_ID out of range: {array_job_id}, {array_task_id}")
    return JobEnvironment(
        job_id=_int(env, "SLURM_JOB_ID"),
        job_name=env.get("SLURM_JOB_NAME", ""),
        array_job_id=array_job_id if array_task_id is not None else None,
        array_task_id=array_task_id,
        restart_count=_first_int(env, ("HPC_ELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"), 0),
        attempt=_int(env, "HPC_ELASTIC_ATTEMPT", 0) or 0,
        node_list=env.get("SLURM_JOB_NODELIST", ""),
        num_nodes=_int(env, "SLURM_JOB_NUM_NODES", 1) or 1,
        node_name=env.get("SLURMD_NODENAME", ""),
        gpus=tuple(d for d in devices.split(",") if d and devices not in {"NoDevFiles", "-1"}),
        gpus_per_task=_gpus_per_task(env.get("SLURM_GPUS_PER_TASK", "")),
        allocated_tasks=tasks_per_node_total(env.get("SLURM_TASKS_PER_NODE", "")),
        cpus_on_node=_int(env, "SLURM_CPUS_ON_NODE"),
        cpus_per_node=per_node_counts(env.get("SLURM_JOB_CPUS_PER_NODE", "")),
        mem_on_node_mb=_mem_on_node_mb(env),
        job_dir=Path(job_dir) if job_dir else None,
        workers=workers,
        backend=backend,
        level=level,
        balance=balance,
        node_gpu_types=parse_node_gpu_types(env.get("HPC_ELASTIC_GPU_TYPES", "")),
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", 29500) or 29500,
    )
