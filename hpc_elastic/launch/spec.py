"""What a user asks for when submitting a training script, validated; and the ``#HPC-ELASTIC`` directives.

Pure: no Slurm, no clock. The script file is read by the caller and passed in as text.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from hpc_elastic.balance.mode import BalanceMode, check_balance
from hpc_elastic.collective import Backend
from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.ps.config import MAX_PROCESSES, PsJobConfig, settings_object

DIRECTIVE = "#HPC-ELASTIC"
MARKER = "hpc-elastic:"  # prefix of the job comment that marks a job as managed by the scheduler plugin
DEFAULT_GRACE_S = 120
DEFAULT_MAX_RESTARTS = 2  # in-allocation restarts of a failed worker step (the wrapper's restart budget)
DEFAULT_MAX_REQUEUES = 0  # requeues at the time limit (the job's --time): none, the job ends TIMEOUT
_TIME = re.compile(r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}(:\d{1,2})?)?)")
_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_GPU_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
#: a profile is a file name in the site's profile directory: no separator, no leading dot ("..", hidden files)
_PROFILE = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.@+-]{0,127}")
#: Slurm's memory sizes: a whole number with an optional unit (K, M, G, T; M when none); 0 means all of a node's
_MEM = re.compile(r"[0-9]{1,9}[KMGT]?")
#: node features joined by & | , with optional brackets, counts (``*2``) and ``!``: no spaces or quotes
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.+\-&|,!*\[\]()]{1,256}")
_DEPENDENCY_ITEM = r"(?:singleton|after(?:any|ok|notok|corr|burstbuffer)?(?::[1-9][0-9]*(?:_[0-9]+)?(?:\+[0-9]+)?)+)"
_DEPENDENCY = re.compile(rf"{_DEPENDENCY_ITEM}(?:[,?]{_DEPENDENCY_ITEM})*")
MAIL_TYPES = frozenset(
    {
        "NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
        "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS",
    }
)  # fmt: skip
_MAIL_USER = re.compile(r"[A-Za-z0-9_.+-]{1,64}(@[A-Za-z0-9.-]{1,253})?")
_ARRAY_ITEM = re.compile(r"([0-9]{1,7})(?:-([0-9]{1,7})(?::([0-9]{1,7}))?)?")
#: the largest array index accepted here (Slurm's default MaxArraySize is 1001: indices 0-1000)
MAX_ARRAY_INDEX = 1000
#: an sbatch option as hpc-elastic keeps it: ``--name`` or ``--name=value``, the value without spaces or quotes
_SBATCH_OPTION = re.compile(r"--([a-z][a-z0-9-]*)(?:=([^\s\"'\\`$;]+))?")


class Mode(StrEnum):
    """What a job runs: ``est``, a training script on EasyScale threads (data parallel, the default); ``ps``, a
    parameter-server job (:mod:`hpc_elastic.ps`: a job master, parameter servers and workers as job steps)."""

    EST = "est"
    PS = "ps"

    @classmethod
    def parse(cls, text: str) -> Mode:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"unknown --mode {text!r}: one of {', '.join(m.value for m in cls)}") from None


def parse_range(text: str, option: str) -> tuple[int, int]:
    """``A:B`` (``A <= B``, both >= 1) as a pair; ``ValueError`` naming ``option`` and the text otherwise."""
    lo, colon, hi = text.partition(":")
    if not colon or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise ValueError(f"bad {option} {text!r}: two whole numbers A:B, 1 <= A <= B")
    return int(lo), int(hi)


def parse_number(text: str, option: str, kind: type[int] | type[float]) -> float:
    """An option's value as ``kind`` (``int`` or ``float``); ``ValueError`` naming the option otherwise."""
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"bad {option} {text!r}: not {what}") from None


def check_range(value: tuple[int, int], option: str) -> None:
    """A PS job's ``--workers-range`` or ``--ps-range``: ``1 <= A <= B <= MAX_PROCESSES``."""
    lo, hi = value
    if lo < 1 or lo > hi:
        raise ValueError(f"bad {option} {lo}:{hi}: two whole numbers A:B, 1 <= A <= B")
    if hi > MAX_PROCESSES:
        raise ValueError(f"bad {option} {lo}:{hi}: a PS-mode job runs at most {MAX_PROCESSES} of them")


#: the bounds of the wrapper's own options, the same in ``hpc-elastic submit`` and ``hpc-elastic-run``
MAX_GRACE_S = 3600
MAX_RESTARTS = 100
MAX_REQUEUES = 1000


def check_wrapper_limits(*, grace_s: float, max_restarts: int = 0, max_requeues: int = 0) -> None:
    """The checkpoint grace (seconds, NaN and infinities refused), the restart budget within an allocation and the
    requeues at the time limit; ``ValueError`` naming the option."""
    if not 0 < grace_s <= MAX_GRACE_S:
        raise ValueError(f"--grace must be between 1 and {MAX_GRACE_S} seconds, got {grace_s}")
    if not 0 <= max_restarts <= MAX_RESTARTS:
        raise ValueError(f"--max-restarts must be between 0 and {MAX_RESTARTS}, got {max_restarts}")
    if not 0 <= max_requeues <= MAX_REQUEUES:
        raise ValueError(f"--max-requeues must be between 0 and {MAX_REQUEUES}, got {max_requeues}")


def check_ckpt_root(path: Path) -> None:
    """The checkpoint root, the same for ``hpc-elastic submit`` and ``hpc-elastic-run``: an absolute path (a job
    may start in any directory of any node) that a batch script's line holds as it is: no whitespace (a newline
    included), quote, backslash or NUL; ``ValueError`` otherwise."""
    if not path.is_absolute():
        raise ValueError(f"--ckpt-root must be an absolute path on the shared filesystem, got {str(path)!r}")
    if re.search(r"[\s\"'\\\x00]", str(path)):
        raise ValueError(f"--ckpt-root must not contain spaces, quotes or backslashes, got {str(path)!r}")


@dataclass(frozen=True)
class SubmitSpec:
    """A training job: its script, its resources and its elastic range.

    GPU jobs run one worker process per GPU (``gpus`` of them now, between ``min_gpus`` and ``max_gpus`` when
    the scheduler resizes it). CPU jobs (``gpus == 0``) run ``procs`` processes of ``cpus_per_worker`` cores.
    ``workers`` is the number of logical workers N (the global data-parallel degree the hyper-parameters were
    designed for); it stays fixed whatever the number of processes, any number from 1 to N (EasyScale §3, Eq. 1a:
    the processes need not divide N).  ``level`` is the determinism level (D2 alone may mix GPU types).
    ``balance`` is how the processes share the work (:class:`~hpc_elastic.balance.mode.BalanceMode`; None: the
    runtime's default, EST mode where N > M at d1/d2).

    ``mode`` ``ps`` submits a parameter-server job instead (no training script: ``script``, when given, is a JSON
    file of the job's :class:`~hpc_elastic.ps.config.PsJobConfig` settings, kept as ``ps_config``): the allocation
    holds one task for the job master, ``ps_range[1]`` for parameter servers and ``workers_range[1]`` for workers,
    ``cpus_per_worker`` cores each; the job starts with ``ps_range[0]`` PS and ``workers_range[1]`` workers.
    """

    script: Path | None
    args: tuple[str, ...] = ()
    gpus: int = 1
    min_gpus: int | None = None
    max_gpus: int | None = None
    gpu_type: str | None = None
    procs: int | None = None
    cpus_per_worker: int = 1
    nodes: int | None = None
    partition: str | None = None
    time: str | None = None
    backend: Backend = Backend.TORCH
    workers: int | None = None
    level: DeterminismLevel | None = None
    balance: BalanceMode | None = None
    ckpt_root: Path = Path("/tmp/hpc-elastic/gpfs/jobs")  # noqa: S108 - the dev cluster's GPFS stand-in
    profile: str | None = None
    job_name: str | None = None
    grace_s: int = DEFAULT_GRACE_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    max_requeues: int = DEFAULT_MAX_REQUEUES
    python: str = "python3"
    account: str | None = None
    qos: str | None = None
    mem: str | None = None
    mem_per_gpu: str | None = None
    mem_per_cpu: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    reservation: str | None = None
    dependency: str | None = None
    mail_type: str | None = None
    mail_user: str | None = None
    array: str | None = None  # a job array: each task is its own job of this size (see array_indices)
    extra: tuple[str, ...] = field(default=())  # other sbatch options, ``--name[=value]`` (see check_sbatch_arg)
    mode: Mode = Mode.EST
    workers_range: tuple[int, int] | None = None  # ps mode: fewest and most workers
    ps_range: tuple[int, int] | None = None  # ps mode: fewest and most parameter servers
    ps_config: str | None = None  # ps mode: the job's settings as a JSON object (sizes of data, model, shards)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def processes(self) -> int:
        """Worker processes now: one per GPU, or ``procs`` on a CPU partition; in ps mode the allocation's tasks
        (the job master, the most PS, the most workers)."""
        if self.mode is Mode.PS and self.workers_range is not None and self.ps_range is not None:
            return 1 + self.ps_range[1] + self.workers_range[1]
        return self.gpus if self.gpus > 0 else (self.procs or self.logical_workers)

    def ps_job_config(self) -> PsJobConfig:
        """The PS job this spec starts (ps mode): its settings with the first numbers of PS and workers."""
        if self.mode is not Mode.PS or self.workers_range is None or self.ps_range is None:
            raise ValueError("not a ps-mode job: --mode ps with --workers-range and --ps-range")
        return ps_job_config(self.ps_config, self.ps_range[0], self.workers_range[1])

    @property
    def logical_workers(self) -> int:
        if self.mode is Mode.PS:
            return self.processes
        if self.workers is not None:
            return self.workers
        return self.gpus if self.gpus > 0 else (self.procs or 1)

    @property
    def elastic_range(self) -> tuple[int, int]:
        if self.gpus == 0:
            return self.processes, self.processes
        return (self.min_gpus or self.gpus, self.max_gpus or self.gpus)

    @property
    def array_indices(self) -> tuple[int, ...]:
        """The task indices of ``--array`` (empty for a single job)."""
        return array_indices(self.array) if self.array is not None else ()

    @property
    def name(self) -> str:
        stem = self.script.stem if self.script is not None else self.mode.value
        return self.job_name or _NAME_SAFE.sub("-", stem)[:64] or "train"


_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.+-]")


def ps_job_config(settings: str | None, num_ps: int, num_workers: int) -> PsJobConfig:
    """A PS job's configuration from its settings (a JSON object, or None: the defaults) and its sizes;
    ``ValueError`` naming a bad setting."""
    data = settings_object(settings, "the PS job's settings") if settings is not None else {}
    sized = sorted({"num_ps", "num_workers"} & set(data))
    if sized:
        raise ValueError(f"the PS job's settings may not set {', '.join(sized)}: use --ps-range / --workers-range")
    return PsJobConfig.from_json({**data, "num_ps": num_ps, "num_workers": num_workers})


def _check_ps(spec: SubmitSpec) -> None:
    """A ps-mode spec: CPUs only, both ranges, none of the data-parallel options."""
    if spec.gpus:
        raise ValueError(f"--mode ps runs on CPUs: --gpus {spec.gpus} is refused (give --gpus 0 or none)")
    if spec.workers_range is None or spec.ps_range is None:
        raise ValueError("--mode ps needs --workers-range A:B and --ps-range C:D")
    check_range(spec.workers_range, "--workers-range")
    check_range(spec.ps_range, "--ps-range")
    refused = {
        "--procs": spec.procs,
        "--workers": spec.workers,
        "--level": spec.level,
        "--balance": spec.balance,
        "--array": spec.array,
        "--profile": spec.profile,
    }
    given = [option for option, value in refused.items() if value is not None]
    if given:
        raise ValueError(f"{given[0]} is refused with --mode ps: its sizes are --workers-range and --ps-range")
    if spec.backend is not Backend.TORCH or spec.args:
        raise ValueError("--mode ps takes no --backend and no script arguments")
    spec.ps_job_config()  # the settings' own checks


def _check(spec: SubmitSpec) -> None:
    if not isinstance(spec.mode, Mode):
        raise ValueError(f"unknown --mode {spec.mode!r}: one of {', '.join(m.value for m in Mode)}")
    if spec.mode is Mode.PS:
        _check_ps(spec)
    elif spec.workers_range is not None or spec.ps_range is not None or spec.ps_config is not None:
        raise ValueError("--workers-range and --ps-range need --mode ps")
    if spec.gpus < 0:
        raise ValueError(f"--gpus must be >= 0, got {spec.gpus}")
    for flag, count in (("--gpus", spec.gpus), ("--procs", spec.procs), ("--workers", spec.workers)):
        if count is not None and count > MAX_ESTS:  # the deterministic sum's bound on N, hence on M too
            raise ValueError(f"{flag} must be at most {MAX_ESTS}, got {count}")
    check_balance(spec.balance, spec.level)
    if spec.balance is BalanceMode.LBBSP and (
        spec.logical_workers != spec.processes or spec.elastic_range != (spec.processes, spec.processes)
    ):
        raise ValueError(
            f"--balance lbbsp runs one worker per process: --workers ({spec.logical_workers}) must equal the "
            f"processes ({spec.processes}) and the job cannot be resized (no --min-gpus/--max-gpus)"
        )
    if spec.gpus == 0 and (spec.min_gpus or spec.max_gpus or spec.gpu_type):
        raise ValueError("--min-gpus/--max-gpus/--gpu-type need --gpus >= 1")
    lo, hi = spec.min_gpus, spec.max_gpus
    if lo is not None and lo < 1:
        raise ValueError(f"--min-gpus must be >= 1, got {lo}")
    if hi is not None and hi < 1:
        raise ValueError(f"--max-gpus must be >= 1, got {hi}")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"--min-gpus ({lo}) is greater than --max-gpus ({hi})")
    if spec.gpus > 0 and lo is not None and spec.gpus < lo:
        raise ValueError(f"--gpus ({spec.gpus}) is below --min-gpus ({lo})")
    if spec.gpus > 0 and hi is not None and spec.gpus > hi:
        raise ValueError(f"--gpus ({spec.gpus}) is above --max-gpus ({hi})")
    if spec.procs is not None and spec.procs < 1:
        raise ValueError(f"--procs must be >= 1, got {spec.procs}")
    if not 1 <= spec.cpus_per_worker <= MAX_ESTS:
        raise ValueError(f"--cpus-per-worker must be between 1 and {MAX_ESTS}, got {spec.cpus_per_worker}")
    if spec.nodes is not None and spec.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {spec.nodes}")
    if spec.nodes is not None and spec.nodes > spec.processes:
        raise ValueError(f"--nodes ({spec.nodes}) is more than the {spec.processes} worker processes")
    if spec.workers is not None and spec.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {spec.workers}")
    top = spec.elastic_range[1]
    if spec.workers is not None and spec.workers < top:
        what = "--max-gpus" if spec.gpus and spec.max_gpus else "the number of processes"
        raise ValueError(
            f"--workers ({spec.workers}) must be at least {what} ({top}): N ESTs run on at most N processes"
        )
    if spec.time is not None and not _TIME.fullmatch(spec.time):
        raise ValueError(f"--time must be MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, got {spec.time!r}")
    if spec.gpu_type is not None and not _GPU_TYPE.fullmatch(spec.gpu_type):
        raise ValueError(f"bad --gpu-type {spec.gpu_type!r}")
    if spec.partition is not None and not _NAME.fullmatch(spec.partition.replace(",", "")):
        raise ValueError(f"bad --partition {spec.partition!r}")
    if spec.job_name is not None and not _NAME.fullmatch(spec.job_name):
        raise ValueError(f"bad job name {spec.job_name!r}: letters, digits and _.+- only, at most 64")
    if spec.profile is not None and not _PROFILE.fullmatch(spec.profile):
        raise ValueError(f"bad --profile {spec.profile!r}")
    check_wrapper_limits(grace_s=spec.grace_s, max_restarts=spec.max_restarts, max_requeues=spec.max_requeues)
    check_ckpt_root(spec.ckpt_root)
    _check_sbatch_values(spec)
    for option in spec.extra:
        check_sbatch_arg(option)
    for arg in (*spec.args, str(spec.script or "")):
        if "\x00" in arg or "\n" in arg:
            raise ValueError(f"arguments and paths must be one line without NUL, got {arg!r}")


def _check_sbatch_values(spec: SubmitSpec) -> None:
    """The options that end up as ``#SBATCH`` lines as they are: strict patterns, no spaces, quotes or newlines."""
    names = (("--account", spec.account), ("--qos", spec.qos), ("--reservation", spec.reservation))
    for option, value in names:
        if value is not None and not _NAME.fullmatch(value.replace(",", "") if option == "--reservation" else value):
            raise ValueError(f"bad {option} {value!r}: letters, digits and _.+- only, at most 64")
    mems = [
        (o, v)
        for o, v in (("--mem", spec.mem), ("--mem-per-gpu", spec.mem_per_gpu), ("--mem-per-cpu", spec.mem_per_cpu))
        if v is not None
    ]
    if len(mems) > 1:
        raise ValueError(
            f"{' and '.join(o for o, _ in mems)} exclude each other: give one of --mem, --mem-per-gpu, --mem-per-cpu"
        )
    for option, value in mems:
        if not _MEM.fullmatch(value):
            raise ValueError(f"bad {option} {value!r}: a size like 4096, 500M, 16G or 1T")
    if spec.mem_per_gpu is not None and spec.gpus == 0:
        raise ValueError("--mem-per-gpu needs --gpus >= 1 (use --mem-per-cpu for a CPU job)")
    if spec.constraint is not None and not _CONSTRAINT.fullmatch(spec.constraint):
        raise ValueError(f"bad --constraint {spec.constraint!r}: node features joined by &, | or , (no spaces)")
    if spec.dependency is not None and not _DEPENDENCY.fullmatch(spec.dependency):
        raise ValueError(
            f"bad --dependency {spec.dependency!r}: singleton or after[any|ok|notok|corr]:JOBID[:JOBID...], "
            "joined by , or ?"
        )
    if spec.mail_type is not None:
        unknown = [t for t in spec.mail_type.split(",") if t.upper() not in MAIL_TYPES]
        if unknown or not spec.mail_type:
            raise ValueError(f"bad --mail-type {spec.mail_type!r}: a comma list of {', '.join(sorted(MAIL_TYPES))}")
    if spec.mail_user is not None and not _MAIL_USER.fullmatch(spec.mail_user):
        raise ValueError(f"bad --mail-user {spec.mail_user!r}: a user name or an e-mail address")
    if spec.array is not None:
        array_indices(spec.array)
        lo, hi = spec.elastic_range
        if lo != hi:
            raise ValueError(
                f"--array needs a fixed size, got the elastic range {lo}-{hi} GPUs: the scheduler resizes a job "
                "through its job id, which names every task of the array"
            )
        if spec.dependency is not None and "singleton" in spec.dependency:
            raise ValueError(
                "--array with --dependency=singleton runs the tasks one after another: submit one job instead"
            )


def array_indices(text: str) -> tuple[int, ...]:
    """The indices of an ``--array`` spec (``0-3``, ``1,3,5``, ``0-15:5``, ``0-15%4``), sorted, each once.
    ``ValueError`` naming the spec when it is malformed, a range runs backwards, or an index is above
    :data:`MAX_ARRAY_INDEX`."""
    body, percent, throttle = text.partition("%")
    if percent and not (throttle.isdigit() and int(throttle) >= 1):
        raise ValueError(f"bad --array {text!r}: the limit after % must be a number >= 1")
    indices: set[int] = set()
    for item in body.split(","):
        match = _ARRAY_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"bad --array {text!r}: indices like 0-3, 1,3,5, 0-15:5 or 0-15%4")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        step = int(match.group(3)) if match.group(3) is not None else 1
        if last < first or step < 1:
            raise ValueError(f"bad --array {text!r}: range {item} runs backwards or has a zero step")
        if last > MAX_ARRAY_INDEX:
            raise ValueError(f"bad --array {text!r}: index {last} is above {MAX_ARRAY_INDEX}")
        indices.update(range(first, last + 1, step))
    return tuple(sorted(indices))


# ------------------------------------------------------------------------------------------ sbatch options

#: sbatch options ``--sbatch-arg`` and ``#SBATCH`` lines may not set: hpc-elastic decides them (task and GPU layout,
#: requeue and its signal, output files, the job marker in the comment, the environment the wrapper needs).
WRAPPER_OWNED: Mapping[str, str] = {
    "requeue": "every hpc-elastic job is requeueable",
    "no-requeue": "every hpc-elastic job is requeueable",
    "signal": "the wrapper sets the checkpoint signal (use --grace)",
    "ntasks": "the tasks follow --gpus / --procs",
    "ntasks-per-node": "the tasks follow --gpus / --procs",
    "ntasks-per-core": "the tasks follow --gpus / --procs",
    "ntasks-per-socket": "the tasks follow --gpus / --procs",
    "ntasks-per-gpu": "the tasks follow --gpus / --procs",
    "gpus": "use --gpus / --gpu-type",
    "gpus-per-node": "use --gpus / --gpu-type",
    "gpus-per-task": "use --gpus / --gpu-type",
    "gpus-per-socket": "use --gpus / --gpu-type",
    "gres": "use --gpus / --gpu-type",
    "tres-per-task": "use --gpus / --cpus-per-worker",
    "cpus-per-gpu": "use --cpus-per-worker",
    "output": "the wrapper appends the job's output to a file under --ckpt-root",
    "error": "the wrapper appends the job's output to a file under --ckpt-root",
    "open-mode": "the wrapper appends the job's output to a file under --ckpt-root",
    "comment": "the comment holds the scheduler's job marker",
    "wrap": "hpc-elastic writes the batch script",
    "export": "the wrapper needs the submitting environment",
    "parsable": "hpc-elastic reads the job id itself",
    "test-only": "hpc-elastic submits the job",
    "wait": "hpc-elastic submit returns once the job is queued",
    "hetjob": "heterogeneous jobs are not supported",
}

#: sbatch options with a first-class ``hpc-elastic submit`` option: ``#SBATCH`` lines are translated to it,
#: ``--sbatch-arg`` is refused (one way to say each thing).
FIRST_CLASS: Mapping[str, tuple[str, str, type]] = {
    "account": ("--account", "account", str),
    "qos": ("--qos", "qos", str),
    "mem": ("--mem", "mem", str),
    "mem-per-gpu": ("--mem-per-gpu", "mem_per_gpu", str),
    "mem-per-cpu": ("--mem-per-cpu", "mem_per_cpu", str),
    "constraint": ("--constraint", "constraint", str),
    "exclusive": ("--exclusive", "exclusive", bool),
    "reservation": ("--reservation", "reservation", str),
    "dependency": ("--dependency", "dependency", str),
    "mail-type": ("--mail-type", "mail_type", str),
    "mail-user": ("--mail-user", "mail_user", str),
    "array": ("--array", "array", str),
    "partition": ("--partition", "partition", str),
    "time": ("--time", "time", str),
    "job-name": ("--job-name", "job_name", str),
    "nodes": ("--nodes", "nodes", int),
    "cpus-per-task": ("--cpus-per-worker", "cpus_per_worker", int),
}

#: sbatch's short options and their long names (a short option hpc-elastic does not know is refused)
SHORT_OPTIONS: Mapping[str, str] = {
    "A": "account", "a": "array", "B": "extra-node-info", "b": "begin", "C": "constraint", "c": "cpus-per-task",
    "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile", "G": "gpus", "H": "hold", "i": "input",
    "J": "job-name", "k": "no-kill", "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes",
    "n": "ntasks", "O": "overcommit", "o": "output", "p": "partition", "Q": "quiet", "q": "qos",
    "S": "core-spec", "s": "oversubscribe", "t": "time", "W": "wait", "w": "nodelist", "x": "exclude",
}  # fmt: skip
#: short options that take no value
_SHORT_FLAGS = frozenset({"H", "k", "O", "Q", "s", "W"})


def sbatch_words(words: Sequence[str]) -> list[tuple[str, str | None]]:
    """``(long name, value or None)`` of sbatch command-line words: ``--name=value``, ``--name value``, ``--flag``,
    ``-Xvalue``, ``-X value``, ``-F`` (a flag). ``ValueError`` naming a word that is none of these."""
    out: list[tuple[str, str | None]] = []
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word[2:].partition("=")
            if not eq and index < len(words) and not words[index].startswith("-"):
                value, eq = words[index], "="
                index += 1
            out.append((name, value if eq else None))
        elif word.startswith("-") and len(word) >= 2 and word[1] in SHORT_OPTIONS:
            letter, rest = word[1], word[2:].removeprefix("=")
            if not rest and letter not in _SHORT_FLAGS:
                if index >= len(words):
                    raise ValueError(f"sbatch option -{letter} needs a value")
                rest = words[index]
                index += 1
            out.append((SHORT_OPTIONS[letter], rest or None))
        else:
            raise ValueError(f"not an sbatch option: {word!r} (use --name=value)")
    return out


def sbatch_arg(text: str) -> str:
    """One ``--sbatch-arg`` as hpc-elastic keeps it (``--name`` or ``--name=value``): ``-A x`` -> ``--account=x``.
    ``ValueError`` for more than one option, or one :func:`check_sbatch_arg` refuses."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"bad --sbatch-arg {text!r}: {exc}") from None
    options = sbatch_words(words)
    if len(options) != 1:
        raise ValueError(f"--sbatch-arg takes one sbatch option, got {text!r}")
    name, value = options[0]
    return check_sbatch_arg(f"--{name}" if value is None else f"--{name}={value}")


def check_sbatch_arg(option: str) -> str:
    """``option`` (``--name[=value]``) when hpc-elastic passes it to sbatch as it is, else ``ValueError`` saying why:
    not that form, a value with spaces or quotes, an option hpc-elastic owns (:data:`WRAPPER_OWNED`) or one with
    a first-class option (:data:`FIRST_CLASS`)."""
    match = _SBATCH_OPTION.fullmatch(option)
    if match is None:
        raise ValueError(f"bad sbatch option {option!r}: --name or --name=value, without spaces or quotes")
    name = match.group(1)
    if name in WRAPPER_OWNED:
        raise ValueError(f"sbatch option --{name} is refused: {WRAPPER_OWNED[name]}")
    if name in FIRST_CLASS:
        raise ValueError(f"sbatch option --{name} is refused: use hpc-elastic submit {FIRST_CLASS[name][0]}")
    return option


SBATCH = "#SBATCH"


def parse_sbatch_lines(script_text: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """What the ``#SBATCH`` lines of the user's script ask for: settings of first-class options, and the other
    sbatch options (``--name[=value]``). Read as sbatch reads them (before the first command; ``# comment``
    after an option ignored); a line hpc-elastic cannot honour is a ``ValueError`` with its line number."""
    found: dict[str, Any] = {}
    extra: dict[str, str] = {}
    for number, words in _comment_lines(script_text, SBATCH):
        try:
            options = sbatch_words(words)
        except ValueError as exc:
            raise ValueError(f"script line {number}: {exc}") from None
        for name, value in options:
            if name in FIRST_CLASS:
                _, field_name, kind = FIRST_CLASS[name]
                if kind is bool:
                    if value is not None:
                        raise ValueError(f"script line {number}: {SBATCH} --{name} takes no value here")
                    found[field_name] = True
                    continue
                if value is None:
                    raise ValueError(f"script line {number}: {SBATCH} --{name} needs a value")
                try:
                    found[field_name] = kind(value)
                except ValueError:
                    raise ValueError(f"script line {number}: bad value for {SBATCH} --{name}: {value!r}") from None
                continue
            try:
                extra[name] = check_sbatch_arg(f"--{name}" if value is None else f"--{name}={value}")
            except ValueError as exc:
                raise ValueError(f"script line {number}: {exc}") from None
    return found, tuple(extra.values())


def merge_extra(*groups: Sequence[str]) -> tuple[str, ...]:
    """Other sbatch options from several sources, a later source's option replacing an earlier one of its name."""
    out: dict[str, str] = {}
    for group in groups:
        for option in group:
            out.pop(option.partition("=")[0], None)
            out[option.partition("=")[0]] = option
    return tuple(out.values())


# --------------------------------------------------------------------------------------------- directives

_DIRECTIVE_OPTIONS: Mapping[str, tuple[str, type]] = {
    "--gpus": ("gpus", int),
    "--min-gpus": ("min_gpus", int),
    "--max-gpus": ("max_gpus", int),
    "--gpu-type": ("gpu_type", str),
    "--procs": ("procs", int),
    "--cpus-per-worker": ("cpus_per_worker", int),
    "--nodes": ("nodes", int),
    "--partition": ("partition", str),
    "--time": ("time", str),
    "--backend": ("backend", str),
    "--workers": ("workers", int),
    "--level": ("level", str),
    "--balance": ("balance", str),
    "--ckpt-root": ("ckpt_root", Path),
    "--profile": ("profile", str),
    "--job-name": ("job_name", str),
    "--grace": ("grace_s", int),
    "--max-restarts": ("max_restarts", int),
    "--account": ("account", str),
    "--qos": ("qos", str),
    "--mem": ("mem", str),
    "--mem-per-gpu": ("mem_per_gpu", str),
    "--mem-per-cpu": ("mem_per_cpu", str),
    "--constraint": ("constraint", str),
    "--exclusive": ("exclusive", bool),
    "--reservation": ("reservation", str),
    "--dependency": ("dependency", str),
    "--mail-type": ("mail_type", str),
    "--mail-user": ("mail_user", str),
    "--array": ("array", str),
    "--sbatch-arg": ("extra", tuple),  # repeatable
    "--max-requeues": ("max_requeues", int),
    "--mode": ("mode", str),
    "--workers-range": ("workers_range", str),
    "--ps-range": ("ps_range", str),
}


def _comment_lines(script_text: str, prefix: str) -> list[tuple[int, list[str]]]:
    """(line number, words) of the ``prefix`` lines before the first command (a shebang on line 1 and other
    comments are skipped, as sbatch does); a ``#`` word after whitespace starts a comment."""
    out: list[tuple[int, list[str]]] = []
    for number, line in enumerate(script_text.splitlines(), start=1):
        stripped = line.strip()
        if number == 1 and stripped.startswith("#!"):
            continue
        if stripped and not stripped.startswith("#"):
            break
        rest = stripped[len(prefix) :]
        if not stripped.startswith(prefix) or (rest and not rest[0].isspace()):
            continue
        try:
            out.append((number, shlex.split(rest, comments=True)))
        except ValueError as exc:
            raise ValueError(f"script line {number}: {exc}") from None
    return out


def parse_directives(script_text: str) -> dict[str, Any]:
    """Options from ``#HPC-ELASTIC --gpus 4 --backend mpi`` lines of a script (``--opt=value`` works too).

    Only comment lines before the first command count, as with ``#SBATCH``. Raises ValueError with the line
    number on an unknown option or a bad value. ``--sbatch-arg`` may be repeated (``extra``, in order).
    """
    found: dict[str, Any] = {}
    for number, words in _comment_lines(script_text, DIRECTIVE):
        index = 0
        while index < len(words):
            word = words[index]
            key, eq, inline = word.partition("=")
            if key not in _DIRECTIVE_OPTIONS:
                raise ValueError(f"script line {number}: unknown {DIRECTIVE} option {key!r}")
            name, kind = _DIRECTIVE_OPTIONS[key]
            index += 1
            if kind is bool:
                if eq:
                    raise ValueError(f"script line {number}: {key} takes no value")
                found[name] = True
                continue
            if not eq:
                if index >= len(words):
                    raise ValueError(f"script line {number}: {key} needs a value")
                inline = words[index]
                index += 1
            try:
                if kind is tuple:
                    found[name] = (*found.get(name, ()), sbatch_arg(inline))
                else:
                    found[name] = kind(inline)
            except ValueError as exc:
                detail = f": {exc}" if kind is tuple else ""
                raise ValueError(f"script line {number}: bad value for {key}: {inline!r}{detail}") from None
    return found


def merge(directives: Mapping[str, Any], explicit: Mapping[str, Any], base: SubmitSpec) -> SubmitSpec:
    """``base`` updated by the script's directives, then by what was given on the command line."""
    return merge_layers(base, directives, explicit)


_MEMORY_FIELDS = ("mem", "mem_per_gpu", "mem_per_cpu")


def merge_layers(base: SubmitSpec, *layers: Mapping[str, Any]) -> SubmitSpec:
    """``base`` updated by each layer of settings in turn (unset ones are None), a later layer winning: one
    memory option of a layer replaces any of an earlier one, and other sbatch options (``extra``) are merged by
    name (:func:`merge_extra`)."""
    known = {f.name for f in fields(SubmitSpec)}
    values: dict[str, Any] = {}
    extra: list[Sequence[str]] = [base.extra]
    for layer in layers:
        given = {k: v for k, v in layer.items() if v is not None}
        if any(name in given for name in _MEMORY_FIELDS):
            values.update(dict.fromkeys(_MEMORY_FIELDS))
        extra.append(given.pop("extra", ()))
        values.update(given)
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown submit settings: {', '.join(sorted(unknown))}")
    if values.get("backend") is not None:
        values["backend"] = Backend.parse(values["backend"])
    if values.get("level") is not None:
        values["level"] = DeterminismLevel.parse(values["level"])
    if values.get("balance") is not None:
        values["balance"] = BalanceMode.parse(values["balance"])
    if values.get("mode") is not None:
        values["mode"] = Mode.parse(str(values["mode"]))
    for name, option in (("workers_range", "--workers-range"), ("ps_range", "--ps-range")):
        if isinstance(values.get(name), str):
            values[name] = parse_range(values[name], option)
    if values.get("mode", base.mode) is Mode.PS and "gpus" not in values:
        values["gpus"] = 0  # a PS job runs on CPUs; asking for GPUs explicitly is refused
    return replace(base, **values, extra=merge_extra(*extra))


# ------------------------------------------------------------------------------------------------ marker


class MarkerError(ValueError):
    """A job comment that starts with the marker's prefix but is not a valid marker (anyone can write one)."""


class MarkerUnit(StrEnum):
    GPU = "gpu"
    PROC = "proc"


#: The longest marker :meth:`JobMarker.encode` can write, with room to spare; a longer comment is refused unread.
MAX_MARKER_LENGTH = 512
_MARKER_KEYS = (
    *("v", "workers", "min", "max", "unit", "backend", "gpu_type", "profile", "level"),
    *("ps_workers", "ps_servers", "cpw"),
)
_REQUIRED_KEYS = frozenset(("v", "workers", "min", "max", "unit", "backend"))
_COUNT = re.compile(r"[1-9][0-9]{0,5}")
_RANGE = re.compile(r"([1-9][0-9]{0,5})-([1-9][0-9]{0,5})")


@dataclass(frozen=True)
class PsShape:
    """A ps-mode job's sizes in its marker: the ranges of workers and of PS, and the cores of each process (the
    allocation holds the job master, the most PS and the most workers, ``cpus_per_worker`` cores each)."""

    workers: tuple[int, int]
    ps: tuple[int, int]
    cpus_per_worker: int

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("ps_workers", self.workers), ("ps_servers", self.ps)):
            if not 1 <= lo <= hi <= MAX_ESTS:
                raise MarkerError(f"marker {name} must be A-B with 1 <= A <= B <= {MAX_ESTS}, got {lo}-{hi}")
        if not 1 <= self.cpus_per_worker <= MAX_ESTS:
            raise MarkerError(f"marker cpw must be in [1, {MAX_ESTS}], got {self.cpus_per_worker}")

    @property
    def cores(self) -> int:
        """The allocation's cores beside the job master's: the most workers and PS, each of its cores."""
        return (self.workers[1] + self.ps[1]) * self.cpus_per_worker

    def check_scale(self, workers: int | None, ps: int | None) -> None:
        """``ValueError`` naming a size outside the job's ranges (None: unchanged)."""
        for what, value, (lo, hi) in (("--workers", workers, self.workers), ("--ps", ps, self.ps)):
            if value is not None and not lo <= value <= hi:
                raise ValueError(f"{what} {value} is outside the job's range {lo}:{hi}")


@dataclass(frozen=True)
class JobMarker:
    """What ``hpc-elastic submit`` recorded in a job's comment (and the wrapper adds: the pinned GPU type).

    Every field is checked on construction, because the daemon builds markers from comments any user can write:
    ``1 <= min <= max <= workers <= MAX_ESTS`` (N ESTs run on at most N devices, EasyScale §3), a ``proc`` job
    has one size (``min == max``), and the GPU type and profile are plain names (a profile is looked up by name
    in the site's profile directory, never as a path)."""

    workers: int
    min: int
    max: int
    unit: MarkerUnit
    backend: Backend
    gpu_type: str | None = None
    profile: str | None = None
    level: DeterminismLevel | None = None
    ps: PsShape | None = None  # a ps-mode job's ranges and cores per process

    def __post_init__(self) -> None:
        for name in ("workers", "min", "max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ESTS:
                raise MarkerError(f"marker {name} must be an integer in [1, {MAX_ESTS}], got {value!r}")
        if not self.min <= self.max <= self.workers:
            raise MarkerError(f"marker needs min <= max <= workers, got {self.min}, {self.max}, {self.workers}")
        if not isinstance(self.unit, MarkerUnit):
            raise MarkerError(f"marker unit must be a MarkerUnit, got {self.unit!r}")
        if self.unit is MarkerUnit.PROC and self.min != self.max:
            raise MarkerError(f"a proc marker has one size, got min={self.min} max={self.max}")
        if self.gpu_type is not None and not _GPU_TYPE.fullmatch(self.gpu_type):
            raise MarkerError(f"bad marker gpu_type {self.gpu_type!r}")
        if self.profile is not None and not _PROFILE.fullmatch(self.profile):
            raise MarkerError(f"bad marker profile {self.profile!r}: a name (letters, digits, _.@+-), not a path")

    @property
    def elastic(self) -> bool:
        """Whether the scheduler may resize the job (a GPU range)."""
        return self.unit is MarkerUnit.GPU and self.min < self.max

    def encode(self) -> str:
        """``hpc-elastic:v=1,workers=8,min=2,max=8,unit=gpu,backend=torch[,gpu_type=a100][,profile=NAME][,level=d2]``:
        no spaces or quotes, so it survives an ``#SBATCH --comment=`` line unchanged."""
        items = [
            ("v", "1"),
            ("workers", str(self.workers)),
            ("min", str(self.min)),
            ("max", str(self.max)),
            ("unit", self.unit.value),
            ("backend", self.backend.value),
        ]
        if self.gpu_type:
            items.append(("gpu_type", self.gpu_type))
        if self.profile:
            items.append(("profile", self.profile))
        if self.level is not None:
            items.append(("level", self.level.value))
        if self.ps is not None:
            items.append(("ps_workers", "{}-{}".format(*self.ps.workers)))
            items.append(("ps_servers", "{}-{}".format(*self.ps.ps)))
            items.append(("cpw", str(self.ps.cpus_per_worker)))
        return MARKER + ",".join(f"{k}={v}" for k, v in items)


def marker_of(spec: SubmitSpec) -> JobMarker:
    lo, hi = spec.elastic_range
    return JobMarker(
        workers=spec.logical_workers,
        min=lo,
        max=hi,
        unit=MarkerUnit.GPU if spec.gpus else MarkerUnit.PROC,
        backend=spec.backend,
        gpu_type=spec.gpu_type,
        profile=spec.profile,
        level=spec.level,
        ps=(
            PsShape(spec.workers_range, spec.ps_range, spec.cpus_per_worker)
            if spec.mode is Mode.PS and spec.workers_range is not None and spec.ps_range is not None
            else None
        ),
    )


def encode_marker(spec: SubmitSpec) -> str:
    """The job comment that marks a job for the scheduler plugin and records its elastic range."""
    return marker_of(spec).encode()


def decode_marker(comment: str) -> JobMarker | None:
    """The marker in a job comment; None when the job was not submitted through hpc-elastic (no prefix).

    Raises :class:`MarkerError` (naming what is wrong) for a comment with the prefix that is not a valid marker:
    too long, an item without ``=``, an unknown or repeated key, a missing one, a version other than 1, or a field
    out of its range (:class:`JobMarker` checks them)."""
    if not comment.startswith(MARKER):
        return None
    if len(comment) > MAX_MARKER_LENGTH:
        raise MarkerError(f"marker longer than {MAX_MARKER_LENGTH} characters")
    data: dict[str, str] = {}
    for item in comment[len(MARKER) :].split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise MarkerError(f"marker item {item[:32]!r} is not key=value")
        if key not in _MARKER_KEYS:
            raise MarkerError(f"unknown marker key {key[:32]!r}")
        if key in data:
            raise MarkerError(f"marker key {key!r} given twice")
        data[key] = value
    missing = sorted(_REQUIRED_KEYS - data.keys())
    if missing:
        raise MarkerError(f"marker lacks {', '.join(missing)}")
    if data["v"] != "1":
        raise MarkerError(f"marker version {data['v'][:8]!r} is not 1")
    for key in ("workers", "min", "max"):
        if not _COUNT.fullmatch(data[key]):
            raise MarkerError(f"marker {key} {data[key][:16]!r} is not a count")
    try:
        unit = MarkerUnit(data["unit"])
        backend = Backend.parse(data["backend"])
        level = DeterminismLevel.parse(data["level"]) if "level" in data else None
    except ValueError as exc:
        raise MarkerError(f"bad marker: {exc}") from None
    ps = _ps_shape(data)
    return JobMarker(
        workers=int(data["workers"]),
        min=int(data["min"]),
        max=int(data["max"]),
        unit=unit,
        backend=backend,
        gpu_type=data.get("gpu_type"),
        profile=data.get("profile"),
        level=level,
        ps=ps,
    )


def _ps_shape(data: dict[str, str]) -> PsShape | None:
    """The ps-mode sizes of a marker's items: all three of ``ps_workers``, ``ps_servers`` and ``cpw``, or none."""
    keys = [k for k in ("ps_workers", "ps_servers", "cpw") if k in data]
    if not keys:
        return None
    if len(keys) != 3:
        raise MarkerError("marker needs ps_workers, ps_servers and cpw together")
    ranges = [_RANGE.fullmatch(data[k]) for k in ("ps_workers", "ps_servers")]
    if ranges[0] is None or ranges[1] is None or not _COUNT.fullmatch(data["cpw"]):
        raise MarkerError(f"bad marker ps sizes {data['ps_workers'][:16]!r}, {data['ps_servers'][:16]!r}")
    workers, servers = ((int(m[1]), int(m[2])) for m in ranges if m is not None)
    return PsShape(workers, servers, int(data["cpw"]))


def check_ps_fits(spec: SubmitSpec, cores: Mapping[str, tuple[int, ...]], default_partition: str | None) -> None:
    """A ps-mode job's tasks must fit its partitions (``cores``: the cores of each node of each partition, from
    Slurm): ``ValueError`` naming the partition when its PS alone, or the whole job, need more cores than its nodes
    have, or one process more than a node."""
    if spec.mode is not Mode.PS or spec.ps_range is None:
        return
    names = spec.partition.split(",") if spec.partition else ([default_partition] if default_partition else [])
    unknown = [name for name in names if name not in cores]
    if unknown or not names:
        raise ValueError(f"no partition {unknown[0] if unknown else spec.partition!r} on this cluster")
    nodes = [c for name in names for c in cores[name]]
    where = ",".join(names)
    total, per_node = sum(nodes), max(nodes, default=0)
    shape = f"{len(nodes)} nodes x {per_node} cores" if len(set(nodes)) <= 1 else f"{len(nodes)} nodes"
    cpus = spec.cpus_per_worker
    if cpus > per_node:
        raise ValueError(f"--cpus-per-worker {cpus} is more than a node of partition {where} has ({per_node})")
    if spec.ps_range[1] * cpus > total:
        raise ValueError(
            f"--ps-range {spec.ps_range[0]}:{spec.ps_range[1]}: {spec.ps_range[1]} PS of {cpus} cores are more than "
            f"partition {where}'s {total} cores ({shape})"
        )
    if spec.processes * cpus > total:
        workers = spec.processes - 1 - spec.ps_range[1]
        raise ValueError(
            f"--workers-range/--ps-range: the job master, {spec.ps_range[1]} PS and {workers} workers of {cpus} cores"
            f" need {spec.processes * cpus} cores; partition {where} has {total} ({shape})"
        )


def check_gpu_type(spec: SubmitSpec, gpu_types: Mapping[str, frozenset[str]], default_partition: str | None) -> None:
    """``ValueError`` when ``--gpu-type`` names a type none of the job's partitions has (``gpu_types``: the GPU
    types of each partition's nodes, from Slurm)."""
    if spec.gpu_type is None:
        return
    names = spec.partition.split(",") if spec.partition else ([default_partition] if default_partition else [])
    unknown = [name for name in names if name not in gpu_types]
    if unknown:
        raise ValueError(f"no partition {unknown[0]!r} on this cluster")
    offered = sorted(set().union(*(gpu_types[name] for name in names))) if names else []
    if names and spec.gpu_type not in offered:
        where = ",".join(names)
        raise ValueError(f"partition {where} has no {spec.gpu_type} GPUs (it has: {', '.join(offered) or 'no GPUs'})")


def explicit_options(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Drop unset (None) values of command-line options."""
    return {name: value for name, value in pairs if value is not None}
