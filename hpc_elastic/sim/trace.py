"""Trace loaders: Tiresias CSV, Pollux/Sia workloads, Alibaba openb pods, Philly-style CSV.

Each loader returns a :class:`LoadedTrace` whose jobs are sorted by submit time (trace order among equal times)
and shifted so that the first submission is at t = 0. A malformed row raises :class:`TraceFormatError` naming the
file, the line and the bad value; with ``skip_bad_rows=True`` such rows are counted and skipped instead. Rows that
are well formed but are not GPU training jobs (openb pods without GPUs, zero-length pods) are counted as
``ignored``.

Provenance of the shared traces (``../shared/traces/README.md``):

- Tiresias: SymbioticLab/Tiresias @ 959f9b0 : simulator/ (Apache-2.0);
- Pollux: petuum/adaptdl @ osdi21-artifact : simulator/workloads/ (Apache-2.0);
- openb: alibaba/clusterdata @ 7a6c496 : cluster-trace-gpu-v2023/csv/ (CC-BY-4.0).
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from hpc_elastic.files import open_input
from hpc_elastic.policy.types import ScalingCurve
from hpc_elastic.sim.models import model_info


class TraceFormat(StrEnum):
    TIRESIAS = "tiresias"
    POLLUX = "pollux"
    OPENB = "openb"
    PHILLY = "philly"


class TraceFormatError(ValueError):
    """A malformed trace row or header: the message names the file, line and bad value."""


#: a number as trace files write it: ASCII digits, an optional fraction and exponent (Python's ``float`` also
#: takes ``1_0``, full-width and other scripts' digits, ``inf`` and ``nan``)
PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)

MAX_SECONDS = 1e9
"""The longest duration, and the latest arrival after the trace's first, a replay takes (about 31.7 years): past
it a job's end would overflow to infinity, and a time-slicing replay would run for days."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace: it needs ``gpus`` GPUs for ``duration`` seconds (at full speed, consolidated).
    ``name`` is the trace's own label for it; the simulator numbers jobs itself (job ids are ints everywhere).
    An elastic job may run on any GPU count in [``min_gpus``, ``max_gpus``], at the speedups of ``scaling``
    relative to its ``gpus`` (None: linear)."""

    name: str
    submit: float
    gpus: int
    duration: float
    model: str = ""
    skew: float | None = None
    checkpoint_bytes: float | None = None
    gpu_types: frozenset[str] | None = None
    time_limit: float | None = None
    line: int = 0
    min_gpus: int | None = None
    max_gpus: int | None = None
    scaling: ScalingCurve | None = None

    @property
    def elastic(self) -> bool:
        return self.min_gpus is not None and self.max_gpus is not None and self.min_gpus < self.max_gpus

    @property
    def service(self) -> float:
        """Size in GPU-seconds."""
        return self.gpus * self.duration


@dataclass(frozen=True, slots=True)
class LoadedTrace:
    path: str
    format: TraceFormat
    jobs: tuple[TraceJob, ...]
    skipped: int = 0
    ignored: int = 0

    def scaled(self, load_scale: float) -> LoadedTrace:
        """The same trace with inter-arrival times divided by ``load_scale`` (> 1 compresses: more load)."""
        if not (math.isfinite(load_scale) and load_scale > 0):
            raise ValueError(f"load scale must be a finite number > 0, got {load_scale!r}")
        if load_scale == 1.0:
            return self
        jobs = tuple(replace(job, submit=job.submit / load_scale) for job in self.jobs)
        _check_span(jobs, self.path, f" at load scale {load_scale:g}")
        return replace(self, jobs=jobs)


def _check_span(jobs: Sequence[TraceJob], path: str, note: str = "") -> None:
    """The arrivals (sorted, the first at 0) end within :data:`MAX_SECONDS`."""
    if jobs and jobs[-1].submit > MAX_SECONDS:
        last = jobs[-1]
        raise TraceFormatError(
            f"{path}:{last.line}: job {last.name!r} arrives {last.submit:g} s after the first{note}, later than "
            f"{MAX_SECONDS:g} s"
        )


class _Row:
    """Typed access to one CSV row with errors that name the line and the column."""

    __slots__ = ("line", "path", "row")

    def __init__(self, path: str, line: int, row: Mapping[str, str | None]) -> None:
        self.path, self.line, self.row = path, line, row

    def fail(self, message: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}:{self.line}: {message}")

    def text(self, column: str, *, required: bool = True) -> str:
        value = (self.row.get(column) or "").strip()
        if required and not value:
            raise self.fail(f"missing value in column {column!r}")
        return value

    def number(self, column: str, *, minimum: float | None = 0.0, required: bool = True) -> float | None:
        raw = self.text(column, required=required)
        if not raw:
            return None
        if not PLAIN_NUMBER.fullmatch(raw):
            raise self.fail(f"column {column!r} must be a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            raise self.fail(f"column {column!r} must be a finite number >= {minimum}, got {raw!r}")
        return value

    def value(self, column: str, *, minimum: float | None = 0.0) -> float:
        """A required number."""
        number = self.number(column, minimum=minimum)
        if number is None:  # pragma: no cover - number() raises for a missing required value
            raise self.fail(f"missing value in column {column!r}")
        return number

    def integer(self, column: str, *, minimum: int = 0) -> int:
        raw = self.text(column)
        try:
            if not PLAIN_NUMBER.fullmatch(raw):
                raise ValueError
            value = int(float(raw)) if "." in raw or "e" in raw.lower() else int(raw)
            if float(raw) != value:
                raise ValueError
        except (ValueError, OverflowError):  # (1e400: an infinity has no integer)
            raise self.fail(f"column {column!r} must be an integer, got {raw!r}") from None
        if value < minimum:
            raise self.fail(f"column {column!r} must be >= {minimum}, got {raw!r}")
        return value


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[_Row]:
    try:
        handle = open_input(path, encoding="utf-8", newline="")
    except OSError as exc:
        raise ValueError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    with handle:
        reader = csv.DictReader(handle)
        try:
            fieldnames = reader.fieldnames
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}:1: not UTF-8 text ({exc.reason})") from None
        header = [name.strip() for name in (fieldnames or [])]
        if not header:
            raise TraceFormatError(f"{path}:1: empty file, expected a header with {', '.join(required)}")
        missing = [name for name in required if name not in header]
        if missing:
            raise TraceFormatError(
                f"{path}:1: header lacks column(s) {', '.join(missing)} (found: {', '.join(header)})"
            )
        reader.fieldnames = header
        try:
            for row in reader:
                if None in row:
                    raise TraceFormatError(f"{path}:{reader.line_num}: more fields than the header has")
                if all(not (value or "").strip() for value in row.values()):
                    continue
                yield _Row(str(path), reader.line_num, row)
        except csv.Error as exc:
            raise TraceFormatError(f"{path}:{reader.line_num}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None


# Size of each Pollux application, GPU-hours: the midpoint (geometric) of the size class the Pollux paper
# (OSDI'21, Table 1) gives it: Small 0.1-1 (cifar10, ncf), Medium 1-10 (bert, deepspeech2), Large 10-100
# (yolov3), XLarge 100-1000 (imagenet). The workloads give the GPU count a user asked for (num_replicas); we
# assume linear scaling, so duration = size / num_replicas. This is our derivation, not the artifact's
# throughput models, and only the relative sizes matter for comparing schedulers.
POLLUX_GPU_HOURS: dict[str, float] = {
    "cifar10": math.sqrt(0.1 * 1.0),
    "ncf": math.sqrt(0.1 * 1.0),
    "bert": math.sqrt(1.0 * 10.0),
    "deepspeech2": math.sqrt(1.0 * 10.0),
    "yolov3": math.sqrt(10.0 * 100.0),
    "imagenet": math.sqrt(100.0 * 1000.0),
}


RowParser = Callable[[_Row], TraceJob | None]


def _load(
    path: Path, fmt: TraceFormat, required: tuple[str, ...], parse: RowParser, skip_bad_rows: bool
) -> LoadedTrace:
    jobs: list[TraceJob] = []
    skipped = ignored = 0
    for row in _rows(path, required):
        try:
            job = parse(row)
        except TraceFormatError:
            if not skip_bad_rows:
                raise
            skipped += 1
            continue
        if job is None:
            ignored += 1
            continue
        if job.duration > MAX_SECONDS:
            if not skip_bad_rows:
                raise row.fail(f"duration {job.duration:g} s is longer than {MAX_SECONDS:g} s")
            skipped += 1
            continue
        jobs.append(job)
    if not jobs:
        raise TraceFormatError(f"{path}: no usable job rows ({skipped} malformed, {ignored} ignored)")
    jobs.sort(key=lambda job: (job.submit, job.line))
    first = jobs[0].submit
    if first != 0.0:
        jobs = [replace(job, submit=job.submit - first) for job in jobs]
    _check_span(jobs, str(path))
    return LoadedTrace(str(path), fmt, tuple(jobs), skipped, ignored)


def _tiresias(row: _Row) -> TraceJob:
    model = row.text("model_name", required=False)
    info = model_info(model) if model else None
    duration = row.value("duration")
    if not duration:
        raise row.fail("column 'duration' must be > 0 seconds, got 0")
    return TraceJob(
        name=row.text("job_id", required=False) or f"job-{row.line}",
        submit=row.value("submit_time"),
        gpus=row.integer("num_gpu", minimum=1),
        duration=duration,
        model=model,
        skew=info.skew if info else None,
        checkpoint_bytes=info.checkpoint_bytes if info else None,
        line=row.line,
    )


def _pollux(row: _Row) -> TraceJob:
    app = row.text("application").lower()
    hours = POLLUX_GPU_HOURS.get(app)
    if hours is None:
        raise row.fail(f"unknown application {app!r}; known: {', '.join(sorted(POLLUX_GPU_HOURS))}")
    gpus = row.integer("num_replicas", minimum=1)
    info = model_info(app)
    return TraceJob(
        name=row.text("name"),
        submit=row.value("time"),
        gpus=gpus,
        duration=hours * 3600.0 / gpus,
        model=app,
        skew=info.skew if info else None,
        checkpoint_bytes=info.checkpoint_bytes if info else None,
        line=row.line,
    )


def _openb(row: _Row) -> TraceJob | None:
    """Pod = job: runs from creation_time to deletion_time on num_gpu GPUs (gpu_milli < 1000 pods share a GPU
    in the real cluster; we give them a whole GPU). Pods still running at the end of the trace are censored
    there. gpu_spec lists the allowed GPU types separated by '|'."""
    gpus = row.integer("num_gpu", minimum=0)
    created = row.value("creation_time")
    deleted = row.value("deletion_time")
    if deleted < created:
        raise row.fail(f"deletion_time {deleted:g} is before creation_time {created:g}")
    if gpus == 0 or deleted == created:
        return None
    row.integer("gpu_milli", minimum=0)
    spec = row.text("gpu_spec", required=False)
    types = frozenset(t.strip() for t in spec.split("|") if t.strip()) if spec else None
    return TraceJob(
        name=row.text("name"),
        submit=created,
        gpus=gpus,
        duration=deleted - created,
        gpu_types=types or None,
        line=row.line,
    )


def _timestamp(row: _Row, column: str) -> float:
    raw = row.text(column)
    try:
        stamp = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise row.fail(f"column {column!r} must be an ISO date-time, got {raw!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _philly(row: _Row) -> TraceJob:
    gpus = row.integer("num_gpus", minimum=1)
    duration = row.number("duration", required=False)
    if duration is None:
        gpu_time = row.number("gpu_time", required=False)
        if gpu_time is None:
            raise row.fail("needs 'duration' (or 'gpu_time')")
        duration = gpu_time / gpus
    if duration <= 0:
        raise row.fail(f"column 'duration' must be > 0 seconds, got {duration:g}")
    cluster = row.text("cluster", required=False)
    job_id = row.text("job_id", required=False) or row.text("jobid", required=False) or f"job-{row.line}"
    return TraceJob(
        name=job_id,
        submit=_timestamp(row, "timestamp"),
        gpus=gpus,
        duration=duration,
        model=cluster,
        line=row.line,
    )


_FORMATS: dict[TraceFormat, tuple[tuple[str, ...], RowParser]] = {
    TraceFormat.TIRESIAS: (("num_gpu", "submit_time", "duration"), _tiresias),
    TraceFormat.POLLUX: (("name", "time", "application", "num_replicas"), _pollux),
    TraceFormat.OPENB: (("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time"), _openb),
    TraceFormat.PHILLY: (("timestamp", "num_gpus"), _philly),
}


def load_trace(path: str | Path, fmt: TraceFormat | str, *, skip_bad_rows: bool = False) -> LoadedTrace:
    """Load a trace file in one of the :class:`TraceFormat` formats."""
    try:
        kind = TraceFormat(fmt)
    except ValueError:
        raise ValueError(
            f"unknown trace format {fmt!r}; choose from {', '.join(f.value for f in TraceFormat)}"
        ) from None
    required, parse = _FORMATS[kind]
    return _load(Path(path), kind, required, parse, skip_bad_rows)
