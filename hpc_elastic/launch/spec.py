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

from hpc_elastic.collective import Backend
from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.est.levels import DeterminismLevel

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


@dataclass(frozen=True)
class SubmitSpec:
    """A training job: its script, its resources and its elastic range.

    GPU jobs run one worker process per GPU (``gpus`` of them now, between ``min_gpus`` and ``max_gpus`` when
    the scheduler resizes it). CPU jobs (``gpus == 0``) run ``procs`` processes of ``cpus_per_worker`` cores.
    ``workers`` is the number of logical workers N (the global data-parallel degree the hyper-parameters were
    designed for); it stays fixed whatever the number of processes, any number from 1 to N (EasyScale §3, Eq. 1a:
    the processes need not divide N).  ``level`` is the determinism level (D2 alone may mix GPU types).
    """

    script: Path
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
    ckpt_root: Path = Path("/tmp/hpc-elastic/gpfs/jobs")  # noqa: S108 - the dev cluster's GPFS stand-in
    profile: str | None = None
    job_name: str | None = None
    grace_s: int = DEFAULT_GRACE_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    max_requeues: int = DEFAULT_MAX_REQUEUES
    python: str = "python3"
    extra: tuple[str, ...] = field(default=())  # raw sbatch options, passed through after validation

    def __post_init__(self) -> None:
        _check(self)

    @property
    def processes(self) -> int:
        """Worker processes now: one per GPU, or ``procs`` on a CPU partition."""
        return self.gpus if self.gpus > 0 else (self.procs or self.logical_workers)

    @property
    def logical_workers(self) -> int:
        if self.workers is not None:
            return self.workers
        return self.gpus if self.gpus > 0 else (self.procs or 1)

    @property
    def elastic_range(self) -> tuple[int, int]:
        if self.gpus == 0:
            return self.processes, self.processes
        return (self.min_gpus or self.gpus, self.max_gpus or self.gpus)

    @property
    def name(self) -> str:
        return self.job_name or _NAME_SAFE.sub("-", self.script.stem)[:64] or "train"


_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.+-]")


def _check(spec: SubmitSpec) -> None:
    if spec.gpus < 0:
        raise ValueError(f"--gpus must be >= 0, got {spec.gpus}")
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
    if spec.cpus_per_worker < 1:
        raise ValueError(f"--cpus-per-worker must be >= 1, got {spec.cpus_per_worker}")
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
    if not 0 < spec.grace_s <= 3600:
        raise ValueError(f"--grace must be between 1 and 3600 seconds, got {spec.grace_s}")
    if not 0 <= spec.max_restarts <= 100:
        raise ValueError(f"--max-restarts must be between 0 and 100, got {spec.max_restarts}")
    if not 0 <= spec.max_requeues <= 1000:
        raise ValueError(f"--max-requeues must be between 0 and 1000, got {spec.max_requeues}")
    if not spec.ckpt_root.is_absolute():
        raise ValueError(f"--ckpt-root must be an absolute path on the shared filesystem, got {str(spec.ckpt_root)!r}")
    for option in spec.extra:
        if not option.startswith("--") or "\n" in option or "\x00" in option:
            raise ValueError(f"extra sbatch options must be one-line --long options, got {option!r}")
    if re.search(r"[\s\"'\\]", str(spec.ckpt_root)):
        raise ValueError(f"--ckpt-root must not contain spaces, quotes or backslashes, got {str(spec.ckpt_root)!r}")
    for arg in (*spec.args, str(spec.script), str(spec.ckpt_root)):
        if "\x00" in arg or "\n" in arg:
            raise ValueError(f"arguments and paths must be one line without NUL, got {arg!r}")


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
    "--ckpt-root": ("ckpt_root", Path),
    "--profile": ("profile", str),
    "--job-name": ("job_name", str),
    "--grace": ("grace_s", int),
    "--max-restarts": ("max_restarts", int),
    "--max-requeues": ("max_requeues", int),
}


def parse_directives(script_text: str) -> dict[str, Any]:
    """Options from ``#HPC-ELASTIC --gpus 4 --backend mpi`` lines of a script (``--opt=value`` works too).

    Only comment lines before the first command count, as with ``#SBATCH``. Raises ValueError with the line
    number on an unknown option or a bad value.
    """
    found: dict[str, Any] = {}
    for number, line in enumerate(script_text.splitlines(), start=1):
        stripped = line.strip()
        if number == 1 and stripped.startswith("#!"):
            continue
        if stripped and not stripped.startswith("#"):
            break
        if not stripped.startswith(DIRECTIVE):
            continue
        try:
            words = shlex.split(stripped[len(DIRECTIVE) :])
        except ValueError as exc:
            raise ValueError(f"script line {number}: {exc}") from None
        index = 0
        while index < len(words):
            word = words[index]
            key, _, inline = word.partition("=")
            if key not in _DIRECTIVE_OPTIONS:
                raise ValueError(f"script line {number}: unknown {DIRECTIVE} option {key!r}")
            if not inline:
                index += 1
                if index >= len(words):
                    raise ValueError(f"script line {number}: {key} needs a value")
                inline = words[index]
            name, kind = _DIRECTIVE_OPTIONS[key]
            try:
                found[name] = kind(inline)
            except ValueError:
                raise ValueError(f"script line {number}: bad value for {key}: {inline!r}") from None
            index += 1
    return found


def merge(directives: Mapping[str, Any], explicit: Mapping[str, Any], base: SubmitSpec) -> SubmitSpec:
    """``base`` updated by the script's directives, then by what was given on the command line."""
    known = {f.name for f in fields(SubmitSpec)}
    values = {k: v for k, v in {**directives, **explicit}.items() if v is not None}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown submit settings: {', '.join(sorted(unknown))}")
    if "backend" in values:
        values["backend"] = Backend.parse(values["backend"])
    if "level" in values:
        values["level"] = DeterminismLevel.parse(values["level"])
    return replace(base, **values)


# ------------------------------------------------------------------------------------------------ marker


class MarkerError(ValueError):
    """A job comment that starts with the marker's prefix but is not a valid marker (anyone can write one)."""


class MarkerUnit(StrEnum):
    GPU = "gpu"
    PROC = "proc"


#: The longest marker :meth:`JobMarker.encode` can write, with room to spare; a longer comment is refused unread.
MAX_MARKER_LENGTH = 512
_MARKER_KEYS = ("v", "workers", "min", "max", "unit", "backend", "gpu_type", "profile", "level")
_REQUIRED_KEYS = frozenset(("v", "workers", "min", "max", "unit", "backend"))
_COUNT = re.compile(r"[1-9][0-9]{0,5}")


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
    return JobMarker(
        workers=int(data["workers"]),
        min=int(data["min"]),
        max=int(data["max"]),
        unit=unit,
        backend=backend,
        gpu_type=data.get("gpu_type"),
        profile=data.get("profile"),
        level=level,
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
