"""Argv builders for every Slurm command hpc-elastic runs: pure, validated, tested for their exact argv.

Nothing here runs a command; :mod:`hpc_elastic.slurm.runner` does. Values are validated before they reach an
argv so that a bad job id or field value is a :class:`ValueError` naming it, never a half-applied change.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from hpc_elastic.slurm.parse import (
    FIELD_SEPARATOR,
    SACCT_STEP_FIELDS,
    SACCT_STEP_TIME_FIELDS,
    SQUEUE_TEXT_FIELDS,
    sacct_text_fields,
)
from hpc_elastic.slurm.types import JobRef


class JobAction(enum.StrEnum):
    """``scontrol <action> <job list>`` actions."""

    REQUEUE = "requeue"
    HOLD = "hold"
    RELEASE = "release"
    SUSPEND = "suspend"
    RESUME = "resume"


# Job fields hpc-elastic changes with ``scontrol update``; values are checked by the matching pattern.
_INT = re.compile(r"-?\d+")
_NONNEG = re.compile(r"\d+")
_HOSTLIST = re.compile(r"[A-Za-z0-9_.\-\[\],]*")
_TIME = re.compile(r"(UNLIMITED|INFINITE|\d+(-\d+)?(:\d+){0,2})", re.IGNORECASE)
_NUM_NODES = re.compile(r"(\d+(-\d+)?|ALL)", re.IGNORECASE)
UPDATABLE_FIELDS: Mapping[str, re.Pattern[str]] = {
    "Priority": _NONNEG,
    "SiteFactor": _INT,
    "Nice": _INT,
    "NumNodes": _NUM_NODES,
    # A pending job's size (elastic resize after a requeue): with --gpus-per-task the GPUs follow NumTasks
    # when the job starts; NumCPUs must be lowered with it (22.05, measured on the dev cluster).
    "NumTasks": re.compile(r"[1-9]\d*"),
    "NumCPUs": re.compile(r"[1-9]\d*"),
    "ReqNodeList": _HOSTLIST,
    "ExcNodeList": _HOSTLIST,
    "TimeLimit": _TIME,
    "Comment": re.compile(r"[^\n\r\x00]*"),
    # administrators only: the scheduler daemon's stop notice (hpc_elastic.jobdir.StopNotice), or empty
    "AdminComment": re.compile(r"(hpc-elastic-(stop|scale):[a-z0-9=,.]{1,120})?"),
    # A pending job's GPUs: 22.05 keeps the GPU request of the submission when NumTasks changes (a job shrunk
    # below it cannot start where only the new count is free; measured on the dev cluster): TresPerJob follows it
    "TresPerJob": re.compile(r"gres:gpu(:[A-Za-z0-9_.-]+)?:[1-9]\d*"),
    # A pending job's node constraint (a requeued job pinned to one GPU type: 22.05 cannot change its GPU type)
    "Features": re.compile(r"[A-Za-z0-9_.+-]+([&|][A-Za-z0-9_.+-]+)*"),
    # A pending job's reservation (the nodes the scheduler daemon holds for a resized job: create_reservation)
    "Reservation": re.compile(r"[A-Za-z0-9_.-]{0,64}"),
}


def size_fields(tasks: int, cpus: int, gpu_type: str | None, *, gpus_per_task: int = 1) -> dict[str, str | int]:
    """The fields that give a pending job a new size: ``tasks`` tasks (processes), ``cpus`` CPUs in all, up to one
    node per task, and ``gpus_per_task`` GPUs of ``gpu_type`` (any type: None) per task."""
    if isinstance(tasks, bool) or not isinstance(tasks, int) or tasks < 1:
        raise ValueError(f"tasks must be a positive integer, got {tasks!r}")
    fields: dict[str, str | int] = {"NumTasks": tasks, "NumCPUs": cpus, "NumNodes": f"1-{tasks}"}
    if gpus_per_task:
        typed = f"{gpu_type}:" if gpu_type else ""
        fields["TresPerJob"] = f"gres:gpu:{typed}{tasks * gpus_per_task}"
    return fields


def span_fields(
    tasks: int, cpus: int, nodes: Sequence[str], excluded: Sequence[str], reservation: str | None = None
) -> list[dict[str, str | int]]:
    """The two updates that give a pending job ``tasks`` GPUs on exactly ``nodes`` (one untyped GPU per task, the
    job's ``--gpus-per-task=1``): first the node lists, then the size. Slurm 22.05 fills the nodes in its order,
    each with as many tasks as it has free GPUs before the next (block distribution), so the GPUs per type follow
    from the nodes chosen (:func:`slurm_plugin.easyscale.span_nodes`); ``excluded``: the partition's other nodes.
    No nodes: any (empty lists clear the job's earlier ones). ``reservation``: the one that holds the nodes for the
    job (:func:`scontrol_create_reservation`), set with the node lists.
    Two updates: in one, 22.05 drops a ``NumNodes`` below the count of the old ``ReqNodeList`` (measured on the
    dev cluster)."""
    if isinstance(tasks, bool) or not isinstance(tasks, int) or tasks < 1:
        raise ValueError(f"tasks must be a positive integer, got {tasks!r}")
    if len(nodes) > tasks:
        raise ValueError(f"need at most {tasks} nodes for {tasks} tasks, got {list(nodes)!r}")
    if set(nodes) & set(excluded):
        raise ValueError(f"nodes both required and excluded: {sorted(set(nodes) & set(excluded))}")
    lists: dict[str, str | int] = {"ReqNodeList": ",".join(nodes), "ExcNodeList": ",".join(excluded)}
    if reservation is not None:
        lists["Reservation"] = reservation
    return [
        lists,
        {
            "NumTasks": tasks,
            "NumCPUs": cpus,
            "NumNodes": len(nodes) if nodes else f"1-{tasks}",
            "TresPerJob": f"gres:gpu:{tasks}",
        },
    ]


SIGNAL_NAMES = frozenset(
    {"HUP", "INT", "QUIT", "ABRT", "KILL", "USR1", "USR2", "PIPE", "ALRM", "TERM", "CONT", "STOP", "TSTP", "URG"}
)


def job_id_list(job_ids: Iterable[int]) -> list[int]:
    """Validated, de-duplicated job ids in their given order."""
    out: list[int] = []
    for job_id in job_ids:
        if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
            raise ValueError(f"job id must be a positive integer, got {job_id!r}")
        if job_id not in out:
            out.append(job_id)
    return out


def job_ref(job: int | JobRef) -> str:
    """``scontrol``'s name of one job: a job id, or ``<array>_<task>`` for an array task (:class:`JobRef`)."""
    if isinstance(job, JobRef):
        return str(job)
    (checked,) = job_id_list([job])
    return str(checked)


def job_refs(jobs: Iterable[int | JobRef]) -> list[str]:
    """Validated, de-duplicated ``scontrol``/``scancel`` names of jobs (:func:`job_ref`) in their given order."""
    refs: list[str] = []
    for job in jobs:
        ref = job_ref(job)
        if ref not in refs:
            refs.append(ref)
    return refs


def _refs_or_raise(jobs: Iterable[int | JobRef]) -> str:
    refs = job_refs(jobs)
    if not refs:
        raise ValueError("no job id given")
    return ",".join(refs)


def _ids_or_raise(job_ids: Iterable[int]) -> str:
    ids = job_id_list(job_ids)
    if not ids:
        raise ValueError("no job id given")
    return ",".join(map(str, ids))


def squeue_json(job_ids: Iterable[int] | None = None) -> list[str]:
    argv = ["squeue", "--all", "--json"]
    if job_ids is not None:
        argv.append(f"--jobs={_ids_or_raise(job_ids)}")
    return argv


def squeue_text(job_ids: Iterable[int] | None = None) -> list[str]:
    fmt = FIELD_SEPARATOR.join(code for _, code in SQUEUE_TEXT_FIELDS)
    argv = ["squeue", "--all", "--noheader", "--states=all", f"--format={fmt}"]
    if job_ids is not None:
        argv.append(f"--jobs={_ids_or_raise(job_ids)}")
    return argv


def sinfo_json() -> list[str]:
    return ["sinfo", "--json"]


def scontrol_show_nodes() -> list[str]:
    return ["scontrol", "show", "node", "--oneliner"]


def scontrol_show_partitions() -> list[str]:
    return ["scontrol", "show", "partition", "--oneliner"]


def _slurm_time(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError(f"time must be timezone-aware, got {moment!r}")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _sacct_window(start: datetime, end: datetime | None, job_ids: Iterable[int] | None) -> list[str]:
    if end is not None and end < start:
        raise ValueError(f"history window ends ({end.isoformat()}) before it starts ({start.isoformat()})")
    argv = ["--allusers", "--duplicates", f"--starttime={_slurm_time(start)}"]
    if end is not None:
        argv.append(f"--endtime={_slurm_time(end)}")
    if job_ids is not None:
        argv.append(f"--jobs={_ids_or_raise(job_ids)}")
    return argv


def sacct_json(start: datetime, end: datetime | None = None, job_ids: Iterable[int] | None = None) -> list[str]:
    """Jobs (allocations, every requeue as its own record) in a time window. Times are sent in UTC, so the
    command runs with ``TZ=UTC``."""
    return ["sacct", "--json", *_sacct_window(start, end, job_ids)]


def sacct_text(
    start: datetime, end: datetime | None = None, job_ids: Iterable[int] | None = None, *, user_text: bool = True
) -> list[str]:
    """Jobs in a time window as ``|``-separated text; without ``user_text`` not the fields a user writes (see
    :data:`~hpc_elastic.slurm.parse.SACCT_USER_TEXT`)."""
    return [
        "sacct",
        "--parsable2",
        "--noheader",
        "--allocations",
        f"--format={','.join(sacct_text_fields(user_text=user_text))}",
        *_sacct_window(start, end, job_ids),
    ]


def sacct_steps(job_id: int) -> list[str]:
    """The steps of one job from accounting (:data:`~hpc_elastic.slurm.parse.SACCT_STEP_FIELDS`)."""
    (ident,) = job_id_list([job_id])
    return [
        "sacct",
        "--parsable2",
        "--noheader",
        f"--format={','.join(SACCT_STEP_FIELDS)}",
        f"--jobs={ident}",
    ]


def sacct_step_times(start: datetime, end: datetime | None = None) -> list[str]:
    """Every job step, with its start, end and cores, of the jobs in a time window
    (:data:`~hpc_elastic.slurm.parse.SACCT_STEP_TIME_FIELDS`; the jobs' own lines come too)."""
    return [
        "sacct",
        "--parsable2",
        "--noheader",
        f"--format={','.join(SACCT_STEP_TIME_FIELDS)}",
        *_sacct_window(start, end, None),
    ]


def sprio_site_factors(job_ids: Iterable[int] | None = None) -> list[str]:
    argv = ["sprio", "--noheader", "--format=%i|%S"]
    if job_ids is not None:
        argv.append(f"--jobs={_ids_or_raise(job_ids)}")
    return argv


def sbatch(script: str | None, options: Sequence[str] = ()) -> list[str]:
    """``sbatch --parsable [options] [script]``; ``script=None`` reads the script from standard input."""
    for option in options:
        if not option.startswith("-") or "\n" in option or "\x00" in option:
            raise ValueError(f"sbatch option must start with '-' and be one line, got {option!r}")
    argv = ["sbatch", "--parsable", *options]
    if script is not None:
        if not script or script.startswith("-"):
            raise ValueError(f"bad batch script path {script!r}")
        argv.append(script)
    return argv


def scontrol_update(job: int | JobRef, fields: Mapping[str, str | int]) -> list[str]:
    """``scontrol update JobId=<id> Key=Value ...`` for the fields in :data:`UPDATABLE_FIELDS`."""
    ref = job_ref(job)
    if not fields:
        raise ValueError("scontrol update needs at least one field")
    argv = ["scontrol", "update", f"JobId={ref}"]
    for key, raw in fields.items():
        pattern = UPDATABLE_FIELDS.get(key)
        if pattern is None:
            raise ValueError(f"cannot update job field {key!r}; allowed: {', '.join(UPDATABLE_FIELDS)}")
        value = str(raw)
        if isinstance(raw, bool) or not pattern.fullmatch(value):
            raise ValueError(f"bad value for {key}: {raw!r}")
        argv.append(f"{key}={value}")
    return argv


def scontrol_action(action: JobAction, jobs: Iterable[int | JobRef]) -> list[str]:
    return ["scontrol", JobAction(action).value, _refs_or_raise(jobs)]


_RESERVATION = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a reservation's name, or a node's
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def _reservation_name(name: str) -> str:
    if not isinstance(name, str) or not _RESERVATION.fullmatch(name):
        raise ValueError(f"bad reservation name {name!r}")
    return name


def scontrol_create_reservation(name: str, nodes: Sequence[str], user: str, duration_s: float) -> list[str]:
    """``scontrol create reservation`` of whole ``nodes`` for ``user``'s jobs that ask for it, from now for
    ``duration_s`` (rounded up to whole seconds): ``IGNORE_JOBS`` (the jobs running on the nodes keep running) and
    ``FLEX`` (a job in it keeps running once it ends: without FLEX, 22.05 ends a job when its reservation ends,
    measured on the dev cluster)."""
    if not nodes or any(not isinstance(n, str) or not _RESERVATION.fullmatch(n) for n in nodes):
        raise ValueError(f"bad reservation nodes {list(nodes)!r}")
    if not isinstance(user, str) or not _USER.fullmatch(user):
        raise ValueError(f"bad reservation user {user!r}")
    if isinstance(duration_s, bool) or not isinstance(duration_s, int | float) or not 0 < duration_s < 86400:
        raise ValueError(f"reservation duration must be in (0, 86400) seconds, got {duration_s!r}")
    seconds = int(-(-duration_s // 1))
    duration = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return [
        "scontrol",
        "create",
        "reservation",
        f"ReservationName={_reservation_name(name)}",
        f"Users={user}",
        f"Nodes={','.join(nodes)}",
        "StartTime=now",
        f"Duration={duration}",
        "Flags=IGNORE_JOBS,FLEX",
    ]


def scontrol_end_reservation(name: str) -> list[str]:
    """End a reservation now (``EndTime=now``; Slurm then purges it): 22.05 refuses ``scontrol delete`` while a
    job runs in it ("Requested reservation is in use")."""
    return ["scontrol", "update", f"ReservationName={_reservation_name(name)}", "EndTime=now"]


def sacctmgr_accounts() -> list[str]:
    """The accounts of Slurm's accounting, one name a line."""
    return ["sacctmgr", "--parsable2", "--noheader", "show", "account", "format=Account"]


def scancel(
    job_ids: Iterable[int | JobRef], signal: str | None = None, *, batch: bool = False, full: bool = False
) -> list[str]:
    """``scancel [--signal=SIG] [--batch|--full] ids``: without a signal the jobs are cancelled. An array task is
    named ``<array>_<task>`` (:class:`JobRef`): its array's id would reach every task."""
    if batch and full:
        raise ValueError("scancel: --batch and --full exclude each other")
    argv = ["scancel"]
    if signal is not None:
        name = signal.upper().removeprefix("SIG")
        if name not in SIGNAL_NAMES and not (name.isdigit() and 0 < int(name) < 65):
            raise ValueError(f"unknown signal {signal!r}")
        argv.append(f"--signal={name}")
    if batch:
        argv.append("--batch")
    if full:
        argv.append("--full")
    argv.extend(job_refs(job_ids))
    if len(argv) == 1 + (signal is not None) + batch + full:
        raise ValueError("no job id given")
    return argv


def scontrol_version() -> list[str]:
    return ["scontrol", "--version"]


def scontrol_ping() -> list[str]:
    return ["scontrol", "ping"]


def srun_single(
    command: Sequence[str],
    *,
    name: str,
    cpus: int = 1,
    mem_mb: int = 1024,
    node: str | None = None,
    immediate_s: int | None = None,
) -> list[str]:
    """``srun`` of one process as a step of its own inside an allocation (a PS-mode job's master, PS or worker):
    exactly ``cpus`` CPUs and ``mem_mb`` MB of the allocation (``--exact``), so the steps run side by side and one
    started later (a worker added) gets its CPU while the others go on, or waits for one to be free. ``node``: on
    that node of the allocation (``--nodelist``); ``immediate_s``: the step fails when its resources are not free
    within that many seconds (``--immediate``) instead of waiting for them."""
    if not command:
        raise ValueError("srun needs a command")
    if cpus < 1 or mem_mb < 1:
        raise ValueError(f"a step needs at least one CPU and 1 MB, got cpus={cpus} mem_mb={mem_mb}")
    if immediate_s is not None and immediate_s < 1:
        raise ValueError(f"--immediate needs at least one second, got {immediate_s}")
    return [
        "srun",
        "--ntasks=1",
        "--nodes=1",
        *([f"--nodelist={node}"] if node is not None else []),
        *([f"--immediate={immediate_s}"] if immediate_s is not None else []),
        f"--cpus-per-task={cpus}",
        f"--mem={mem_mb}M",
        "--exact",
        f"--job-name={name}",
        "--unbuffered",
        "--kill-on-bad-exit=1",
        *command,
    ]


def srun_step(
    command: Sequence[str],
    ntasks: int,
    *,
    mpi: str | None = None,
    gpus_per_task: int = 0,
    kill_on_bad_exit: bool = True,
) -> list[str]:
    """``srun`` of the worker step inside an allocation: one task per worker process.

    ``gpus_per_task`` must be given to srun itself: a step does not bind GPUs to tasks from the batch job's
    ``--gpus-per-task`` (22.05: every task then sees no ``CUDA_VISIBLE_DEVICES``).
    """
    if ntasks < 1:
        raise ValueError(f"srun needs at least one task, got {ntasks}")
    if not command:
        raise ValueError("srun needs a command")
    if mpi is not None and mpi not in {"pmix", "pmi2", "none"}:
        raise ValueError(f"unknown MPI plugin {mpi!r}")
    if gpus_per_task < 0:
        raise ValueError(f"gpus per task must be >= 0, got {gpus_per_task}")
    argv = ["srun", f"--ntasks={ntasks}", "--unbuffered"]
    if gpus_per_task:
        argv.append(f"--gpus-per-task={gpus_per_task}")
    if kill_on_bad_exit:
        argv.append("--kill-on-bad-exit=1")
    if mpi:
        argv.append(f"--mpi={mpi}")
    return [*argv, *command]
