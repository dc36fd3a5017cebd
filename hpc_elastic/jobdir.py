"""One job's directory on the shared filesystem and the control protocol around it: every path, every format,
every read and write of it (one owner, as submitit's ``JobPaths``).

Layout, ``<ckpt-root>/<job name>-<job id>/`` (the same across requeues), owned by the job's user::

    checkpoints/    0700  the checkpoint store (hpc_elastic.checkpoint)
    control/        0755  stop, ack.json and their predecessors set aside (*.handled-<time>)
    logs/           0700  worker logs of tools that start workers themselves (verify-determinism)
    (the directory itself is 0711: the scheduler daemon may reach control/ack.json, not list the job's files)

Who writes what (see SECURITY.md for the threat model):

- the **scheduler daemon** writes nothing here.  It asks a job to stop with the checkpoint signal alone
  (``scancel --signal=USR1 --batch``), after putting its reason into the job's ``AdminComment``, a Slurm field
  that only Slurm administrators may set (:class:`StopNotice`).  It reads ``control/ack.json`` through
  :meth:`JobDir.read_ack_as`: no link followed, every component owned by the job's user, a bounded regular file;
  an acknowledgement counts only inside the window of :func:`ack_answers`.
- the **wrapper** (the job's user) creates the directory (:meth:`JobDir.prepare` refuses one that another user made
  or may write into), turns the signal into ``control/stop`` (:class:`StopRequest`), and reads the acknowledgement.
- the **workers** read ``control/stop`` at mini-batch boundaries; rank 0 writes ``control/ack.json`` (:class:`Ack`)
  once the checkpoint of the stop is committed.

``stop``::

    {"reason": "preempt" | "timelimit" | "resize" | ..., "requested_at": <epoch seconds>[, "at_step": <int>]}

Its existence is the request; workers see it at the next mini-batch boundary (with ``at_step``, at the first boundary
where the training step is ``at_step`` or later: a stop at a chosen step, as ``hpc-elastic verify-determinism`` uses
for its resizes).  A file that is empty or not (yet) valid JSON still means "stop", with reason ``unknown``.

``ack.json`` (written atomically)::

    {"job_id": <int or null>, "restart_count": <int>, "step": <int>, "checkpoint": "<absolute path>",
     "written_at": <epoch seconds>[, "reason": "<the stop acted on>"]}

The workers also stop on their own ``SIGTERM`` (Slurm's preemption signals the job's steps, not the wrapper): then
no ``stop`` file exists and the acknowledgement says ``"reason": "sigterm"``.

``scale`` (a ps-mode job's user, ``hpc-elastic scale``, atomically; read and set aside by the job's wrapper,
:mod:`hpc_elastic.ps.allocation`)::

    {"workers": <int >= 1>, "ps": <int >= 1>, "requested_at": <epoch seconds>}     (either size may be left out)

The wrapper reads it only as a plain file of its own user (no link, no FIFO, at most :data:`MAX_CONTROL_BYTES`),
checks it against the job's ranges and its allocation's cores, and answers in ``scale-reply.json`` (atomically)::

    {"requested_at": <epoch seconds or null>, "applied": <bool>, "reason": "<why refused, or what was done>",
     "workers": <int>, "ps": <int>, "written_at": <epoch seconds>}

``timelimit-requeues.json`` (the wrapper's record, written atomically)::

    {"restarts": [<the restart count of each incarnation requeued at its time limit>, ...]}

``progress.json`` (rank 0, atomically, at most every :data:`PROGRESS_EVERY_S` seconds and at the end of a run; read
by ``hpc-elastic job``)::

    {"step": <int>, "written_at": <epoch seconds>, "steps_per_s": <float or null>, "world_size": <int>,
     "restart_count": <int>, "attempt": <int>, "device_types": ["a100", ...], "workers": <N>}

A ps-mode job's wrapper writes it too (step: shards done, world_size: its workers), with ``"ps": <int>``,
``"epochs_done": <complete epochs>`` and ``"epochs_total": <int>``: what the scheduler's DL² policy reads of it.

``result.pkl`` (rank 0 of a job submitted with :func:`hpc_elastic.submit`, atomically): the pickled outcome of the
function, read back by ``Job.result()``.  The pickled call itself waits, before the job has an id, in
``<ckpt-root>/calls/`` (0700) under a random name (:func:`call_path`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from hpc_elastic.balance.speeds import check_capability
from hpc_elastic.checkpoint import layout
from hpc_elastic.files import UnsafeFile, atomic_write_bytes, loads_json, private_dir, read_owned, sweep_temporaries

CONTROL = "control"
CHECKPOINTS = "checkpoints"
PS = "ps"
LOGS = "logs"
STOP = "stop"
ACK = "ack.json"
SCALE = "scale"
SCALE_REPLY = "scale-reply.json"
REQUEUES = "timelimit-requeues.json"
PROGRESS = "progress.json"
RESULT = "result.pkl"
CALLS = "calls"
#: sbatch's ``--output`` of a job, below its checkpoint root (``%x``: the job name, ``%j``: its id)
OUTPUT_PATTERN = "%x-%j.out"
ARRAY_OUTPUT_PATTERN = "%x-%A_%a.out"  # an array task's output: named as its job directory
HANDLED = ".handled-"
#: rank 0 rewrites the progress record at most this often
PROGRESS_EVERY_S = 5.0
#: a rate is measured over at least this many seconds
MIN_RATE_WINDOW_S = 1.0
#: the most bytes a checkpoint manifest may hold when listed (``hpc-elastic job``)
MAX_MANIFEST_BYTES = 1 << 20
#: the newest checkpoints and past stop requests a listing reads at most
MAX_LISTED = 20
#: the most bytes a control file may hold (a stop request or an acknowledgement is ~200)
MAX_CONTROL_BYTES = 4096
#: the largest count (processes, logical workers, parameter servers) and rate (steps per second) a progress record
#: may report: far past any job's, and small enough that the daemon's arithmetic on them stays finite
MAX_REPORTED_COUNT = 1 << 20
MAX_STEPS_PER_S = 1e9
#: an acknowledgement counts when written between the stop request and now, give or take this much clock skew
ACK_CLOCK_SLACK_S = 5.0
JOB_DIR_MODE = 0o711
CONTROL_MODE = 0o755
PRIVATE_MODE = 0o700


class StopReason(StrEnum):
    """Why a job stops.  The wrapper requeues it after the checkpoint (:func:`hpc_elastic.launch.stops.after_stop`)
    for a preemption, a resize, a time limit within the job's ``--max-requeues``, and a ``SIGTERM`` it cannot
    explain; it leaves the job to Slurm after a cancel, or once Slurm requeued it (a node failure)."""

    PREEMPT = "preempt"  # the scheduler daemon's, or Slurm's own preemption (its GraceTime)
    TIMELIMIT = "timelimit"  # the job's time limit comes (Slurm's --signal=B:USR1@grace)
    RESIZE = "resize"  # the scheduler daemon resizes the job
    CANCEL = "cancel"  # the user's scancel: the job ends CANCELLED
    REQUEUED = "requeued"  # Slurm requeued the job itself (a node failed, a preemption's grace time ended)
    SIGTERM = "sigterm"  # the workers got SIGTERM; the wrapper asks Slurm which of the above it was
    UNKNOWN = "unknown"  # a stop file that cannot be parsed (still a stop)


_REASONS = ", ".join(r.value for r in StopReason if r is not StopReason.UNKNOWN)


def _epoch(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be epoch seconds, got {value!r}")
    return float(value)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _bounded_count(value: Any, what: str) -> int:
    count = _count(value, what)
    if not 1 <= count <= MAX_REPORTED_COUNT:
        raise ValueError(f"{what} must be in [1, {MAX_REPORTED_COUNT}], got {value!r}")
    return count


def _reason(value: Any) -> StopReason:
    try:
        reason = StopReason(value) if isinstance(value, str) else None
    except ValueError:
        reason = None
    if reason is None or reason is StopReason.UNKNOWN:
        raise ValueError(f"stop reason must be one of {_REASONS}, got {value!r}")
    return reason


@dataclass(frozen=True)
class StopRequest:
    reason: StopReason
    requested_at: float | None
    at_step: int | None = None

    def __post_init__(self) -> None:
        if self.at_step is not None:
            _count(self.at_step, "stop at_step")

    def to_json(self) -> str:
        doc: dict[str, Any] = {"reason": self.reason.value, "requested_at": self.requested_at}
        if self.at_step is not None:
            doc["at_step"] = self.at_step
        return json.dumps(doc, sort_keys=True)


def _json_object(text: str, what: str) -> dict[str, Any]:
    doc = loads_json(text, what)
    if not isinstance(doc, dict):
        raise ValueError(f"{what} must hold a JSON object, got {str(doc)[:80]!r}")
    return doc


def parse_stop(text: str) -> StopRequest:
    """Parse the content of a ``stop`` file; raise ``ValueError`` naming what is wrong."""
    doc = _json_object(text, "stop file")
    reason = _reason(doc.get("reason"))
    at = _epoch(doc.get("requested_at"), "stop requested_at")
    step = doc.get("at_step")
    return StopRequest(reason, at, None if step is None else _count(step, "stop at_step"))


def parse_stop_lenient(text: str) -> StopRequest:
    """Like :func:`parse_stop`, but a malformed (e.g. half-written) file is a stop with reason ``unknown``."""
    try:
        return parse_stop(text)
    except ValueError:
        return StopRequest(StopReason.UNKNOWN, None)


@dataclass(frozen=True)
class Ack:
    job_id: int | None
    restart_count: int
    step: int
    checkpoint: Path
    written_at: float
    #: the stop the workers acted on (``sigterm`` when they stopped on their own signal); None: not said
    reason: StopReason | None = None

    def __post_init__(self) -> None:
        if self.job_id is not None and (isinstance(self.job_id, bool) or not isinstance(self.job_id, int)):
            raise ValueError(f"job_id must be an integer or None, got {self.job_id!r}")
        _count(self.restart_count, "restart_count")
        _count(self.step, "step")
        _epoch(self.written_at, "ack written_at")

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            "step": self.step,
            "checkpoint": str(self.checkpoint),
            "written_at": self.written_at,
            **({"reason": self.reason.value} if self.reason is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True) + "\n"


def parse_ack(text: str) -> Ack:
    """Parse ``ack.json``; raise ``ValueError`` naming what is wrong."""
    doc = _json_object(text, "ack file")
    missing = [k for k in ("job_id", "restart_count", "step", "checkpoint", "written_at") if k not in doc]
    if missing:
        raise ValueError(f"ack file lacks {missing[0]!r}")
    if not isinstance(doc["checkpoint"], str) or not doc["checkpoint"]:
        raise ValueError(f"ack checkpoint must be a path, got {doc['checkpoint']!r}")
    reason = doc.get("reason")
    return Ack(
        doc["job_id"],
        doc["restart_count"],
        doc["step"],
        Path(doc["checkpoint"]),
        _epoch(doc["written_at"], "ack"),
        None if reason is None else _ack_reason(reason),
    )


def _ack_reason(value: Any) -> StopReason:
    """An acknowledgement's reason: a request's, or ``unknown`` from a rank 0 that stopped because another rank saw
    the stop file first (the group stops together, :meth:`hpc_elastic.session.Session.should_stop`)."""
    if value == StopReason.UNKNOWN.value:
        return StopReason.UNKNOWN
    return _reason(value)


def parse_requeues(text: str) -> tuple[int, ...]:
    """Parse ``timelimit-requeues.json``; raise ``ValueError`` naming what is wrong."""
    doc = _json_object(text, "time-limit requeue record")
    restarts = doc.get("restarts")
    if not isinstance(restarts, list):
        raise ValueError(f"time-limit requeue record needs a list 'restarts', got {restarts!r}")
    return tuple(sorted({_count(r, "requeued restart count") for r in restarts}))


def _size(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SCALE:
        raise ValueError(f"{what} must be an integer in [1, {MAX_SCALE}], got {value!r}")
    return value


#: the most workers or PS a scale request may name (a sanity bound; the job's ranges decide)
MAX_SCALE = 4096


@dataclass(frozen=True)
class ScaleRequest:
    """Set a running ps-mode job's number of workers and of parameter servers (None: keep it)."""

    workers: int | None
    ps: int | None
    requested_at: float

    def __post_init__(self) -> None:
        _size(self.workers, "scale workers")
        _size(self.ps, "scale ps")
        if self.workers is None and self.ps is None:
            raise ValueError("a scale request names workers, ps or both")
        _epoch(self.requested_at, "scale requested_at")

    def to_json(self) -> str:
        doc: dict[str, Any] = {"requested_at": self.requested_at}
        doc.update({k: v for k, v in (("workers", self.workers), ("ps", self.ps)) if v is not None})
        return json.dumps(doc, sort_keys=True) + "\n"


def parse_scale(text: str) -> ScaleRequest:
    """Parse a ``scale`` file; ``ValueError`` naming what is wrong (an unknown key too)."""
    doc = _json_object(text, "scale request")
    unknown = sorted(set(doc) - {"workers", "ps", "requested_at"})
    if unknown:
        raise ValueError(f"scale request has an unknown key {unknown[0][:32]!r}")
    at = _epoch(doc.get("requested_at"), "scale requested_at")
    return ScaleRequest(_size(doc.get("workers"), "scale workers"), _size(doc.get("ps"), "scale ps"), at)


@dataclass(frozen=True)
class ScaleReply:
    """The wrapper's answer to a scale request: applied, or refused with the reason; the sizes after it."""

    requested_at: float | None
    applied: bool
    reason: str
    workers: int
    ps: int
    written_at: float

    def to_json(self) -> str:
        doc = {
            "requested_at": self.requested_at,
            "applied": self.applied,
            "reason": self.reason,
            "workers": self.workers,
            "ps": self.ps,
            "written_at": self.written_at,
        }
        return json.dumps(doc, sort_keys=True) + "\n"


def parse_scale_reply(text: str) -> ScaleReply:
    """Parse ``scale-reply.json``; ``ValueError`` naming what is wrong."""
    doc = _json_object(text, "scale reply")
    at = doc.get("requested_at")
    applied, reason = doc.get("applied"), doc.get("reason")
    if not isinstance(applied, bool) or not isinstance(reason, str):
        raise ValueError(f"scale reply needs a bool 'applied' and a str 'reason', got {applied!r}, {reason!r}")
    return ScaleReply(
        None if at is None else _epoch(at, "scale reply requested_at"),
        applied,
        reason[:500],
        _count(doc.get("workers"), "scale reply workers"),
        _count(doc.get("ps"), "scale reply ps"),
        _epoch(doc.get("written_at"), "scale reply written_at"),
    )


def still_pending(request: StopRequest, ack: Ack | None) -> bool:
    """Whether a stop request outlives a restart of the job: one for a chosen step (``at_step``) stands until a
    checkpoint at or after that step is acknowledged; any other request belongs to the incarnation it stopped."""
    return request.at_step is not None and (ack is None or ack.step < request.at_step)


def ack_answers(ack: Ack, *, job_id: int | None, restart_count: int, requested_at: float, now: float) -> bool:
    """Whether ``ack`` acknowledges the stop requested at ``requested_at`` of incarnation ``restart_count`` of job
    ``job_id``: the same job and incarnation, written after the request and not after ``now`` (both give or take
    :data:`ACK_CLOCK_SLACK_S`).  An acknowledgement from the future or of an older stop never counts, so a forged one
    cannot keep a job's GPUs: without a valid one the daemon requeues at the end of the grace period."""
    return (
        (job_id is None or ack.job_id == job_id)
        and ack.restart_count == restart_count
        and requested_at - ACK_CLOCK_SLACK_S <= ack.written_at <= now + ACK_CLOCK_SLACK_S
    )


@dataclass(frozen=True)
class Progress:
    """Where a run stands, as rank 0 last recorded it: its step, the steps per second since its previous record
    (None for the first record of a run), its processes and their device types, and which incarnation
    (``restart_count``: Slurm requeues) and attempt (restarts of the worker step inside one allocation) it is.
    ``capability``: the observed ``C_i`` per device type (EST mini-batches per second per device, sorted by type:
    :func:`hpc_elastic.balance.speeds.capability_by_type`), the job's telemetry for the scheduler; empty until the
    first window of steps is timed. ``d2``: the run trains at determinism level D2, so the model scanner found every
    operator of its model covered (EasyScale §3.3) and its bits do not depend on the device types: the D2 guard
    under which the scheduler may plan the job across GPU types (§3.4)."""

    step: int
    written_at: float
    steps_per_s: float | None
    world_size: int
    restart_count: int
    attempt: int
    device_types: tuple[str, ...] = ()
    workers: int | None = None  # N, the logical workers (Slurm's accounting may not keep the job's marker)
    capability: tuple[tuple[str, float], ...] = ()
    d2: bool = False
    #: a ps-mode job's: its parameter servers, and the epochs complete of its total (None for other jobs)
    ps: int | None = None
    epochs_done: float | None = None
    epochs_total: float | None = None

    def __post_init__(self) -> None:
        _count(self.step, "progress step")
        if self.ps is not None:
            _bounded_count(self.ps, "progress ps")
        if (self.epochs_done is None) != (self.epochs_total is None):
            raise ValueError("progress epochs_done and epochs_total go together")
        if self.epochs_done is not None and self.epochs_total is not None:
            _epoch(self.epochs_done, "progress epochs_done")
            if _epoch(self.epochs_total, "progress epochs_total") <= 0 or self.epochs_done > self.epochs_total:
                raise ValueError(
                    f"progress epochs must be 0 <= done <= total > 0, got {self.epochs_done!r} of {self.epochs_total!r}"
                )
        if not isinstance(self.d2, bool):
            raise ValueError(f"progress d2 must be true or false, got {self.d2!r}")
        object.__setattr__(self, "capability", check_capability(self.capability, "progress capability"))
        if self.workers is not None:
            _bounded_count(self.workers, "progress workers")
        _epoch(self.written_at, "progress written_at")
        if self.steps_per_s is not None and _epoch(self.steps_per_s, "progress steps_per_s") > MAX_STEPS_PER_S:
            raise ValueError(f"progress steps_per_s must be <= {MAX_STEPS_PER_S:g}, got {self.steps_per_s!r}")
        _bounded_count(self.world_size, "progress world_size")
        _count(self.restart_count, "progress restart_count")
        _count(self.attempt, "progress attempt")
        if not all(isinstance(t, str) and 0 < len(t) <= 64 for t in self.device_types):
            raise ValueError(f"progress device_types must be short names, got {self.device_types!r}")

    def to_json(self) -> str:
        doc = {
            "step": self.step,
            "written_at": self.written_at,
            "steps_per_s": self.steps_per_s,
            "world_size": self.world_size,
            "restart_count": self.restart_count,
            "attempt": self.attempt,
            "device_types": list(self.device_types),
            "workers": self.workers,
            "capability": [list(pair) for pair in self.capability],
            "d2": self.d2,
        }
        if self.ps is not None:
            doc["ps"] = self.ps
        if self.epochs_done is not None:
            doc["epochs_done"], doc["epochs_total"] = self.epochs_done, self.epochs_total
        return json.dumps(doc, sort_keys=True) + "\n"


def parse_progress(text: str) -> Progress:
    """Parse ``progress.json``; raise ``ValueError`` naming what is wrong."""
    doc = _json_object(text, "progress file")
    missing = [k for k in ("step", "written_at", "world_size", "restart_count", "attempt") if k not in doc]
    if missing:
        raise ValueError(f"progress file lacks {missing[0]!r}")
    types = doc.get("device_types", [])
    if not isinstance(types, list):
        raise ValueError(f"progress device_types must be a list, got {types!r}")
    return Progress(
        doc["step"],
        doc["written_at"],
        doc.get("steps_per_s"),
        doc["world_size"],
        doc["restart_count"],
        doc["attempt"],
        tuple(types),
        doc.get("workers"),
        check_capability(doc.get("capability", []), "progress capability"),
        doc.get("d2", False),
        doc.get("ps"),
        doc.get("epochs_done"),
        doc.get("epochs_total"),
    )


def next_progress(
    previous: Progress | None,
    *,
    step: int,
    now: float,
    world_size: int,
    restart_count: int,
    attempt: int,
    device_types: tuple[str, ...] = (),
    workers: int | None = None,
    capability: tuple[tuple[str, float], ...] = (),
    d2: bool = False,
    force: bool = False,
) -> Progress | None:
    """The record to write after ``step`` at ``now``, or None when ``previous`` (this run's last record) is younger
    than :data:`PROGRESS_EVERY_S` (unless ``force``: the end of a run).  The rate is the steps per second since
    ``previous`` when at least :data:`MIN_RATE_WINDOW_S` passed, else the previous rate."""
    if previous is not None and not force and now - previous.written_at < PROGRESS_EVERY_S:
        return None
    rate = previous.steps_per_s if previous is not None else None
    if previous is not None and now - previous.written_at >= MIN_RATE_WINDOW_S and step >= previous.step:
        rate = (step - previous.step) / (now - previous.written_at)
    return Progress(step, now, rate, world_size, restart_count, attempt, device_types, workers, capability, d2)


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint as a listing sees it: its manifest read (bounded), its files not hashed."""

    step: int
    created_at: float
    size_bytes: int
    world_size: int


@dataclass(frozen=True)
class PastStop:
    """A stop request a previous incarnation of the job handled (``control/stop.handled-<time>``)."""

    request: StopRequest
    set_aside_at: float


# ------------------------------------------------------------------------------ the daemon's note in Slurm

NOTICE_PREFIX = "hpc-elastic-stop:"
_NOTICE = re.compile(r"hpc-elastic-stop:reason=([a-z]+),at=([0-9]{1,12}(?:\.[0-9]{1,6})?),restarts=([0-9]{1,6})")


@dataclass(frozen=True)
class StopNotice:
    """Why the daemon signals a job, in the job's ``AdminComment`` (set by Slurm administrators only, readable by the
    job's user): the wrapper reads it when the checkpoint signal arrives.  ``restarts`` names the incarnation it is
    for, so a notice left from an earlier one is not taken for a new signal (Slurm's own time-limit warning)."""

    reason: StopReason
    requested_at: float
    restarts: int

    def encode(self) -> str:
        return f"{NOTICE_PREFIX}reason={self.reason.value},at={self.requested_at:.3f},restarts={self.restarts}"

    @classmethod
    def decode(cls, text: str) -> StopNotice | None:
        """The notice in an ``AdminComment``, or None (no notice, or not one of ours)."""
        match = _NOTICE.fullmatch(text.strip())
        if match is None:
            return None
        try:
            return cls(_reason(match[1]), float(match[2]), int(match[3]))
        except ValueError:
            return None


SCALE_NOTICE_PREFIX = "hpc-elastic-scale:"
_SCALE_NOTICE = re.compile(
    r"hpc-elastic-scale:workers=([0-9]{1,6}),ps=([0-9]{1,6}),at=([0-9]{1,12}(?:\.[0-9]{1,6})?),restarts=([0-9]{1,6})"
)


@dataclass(frozen=True)
class ScaleNotice:
    """The scheduler daemon's scale request for a running ps-mode job (DL² in the daemon), in the job's
    ``AdminComment`` like :class:`StopNotice`: only Slurm administrators may set it, so the job's wrapper trusts it
    whatever user the job runs as, and the daemon writes nothing into a user's directory. The wrapper reads it when
    ``USR2`` arrives and answers in ``control/scale-reply.json`` with ``requested_at``; ``restarts`` names the
    incarnation it is for."""

    workers: int
    ps: int
    requested_at: float
    restarts: int

    def __post_init__(self) -> None:
        if _size(self.workers, "scale notice workers") is None or _size(self.ps, "scale notice ps") is None:
            raise ValueError("a scale notice names workers and ps")
        _epoch(self.requested_at, "scale notice requested_at")
        _count(self.restarts, "scale notice restarts")

    def encode(self) -> str:
        return (
            f"{SCALE_NOTICE_PREFIX}workers={self.workers},ps={self.ps},at={self.requested_at:.3f},"
            f"restarts={self.restarts}"
        )

    @classmethod
    def decode(cls, text: str) -> ScaleNotice | None:
        """The notice in an ``AdminComment``, or None (no notice, or not one of ours)."""
        match = _SCALE_NOTICE.fullmatch(text.strip())
        if match is None:
            return None
        try:
            return cls(int(match[1]), int(match[2]), float(match[3]), int(match[4]))
        except ValueError:
            return None

    @property
    def request(self) -> ScaleRequest:
        return ScaleRequest(self.workers, self.ps, self.requested_at)


# ------------------------------------------------------------------------------------------ the directory


def leaf_name(name: str, job_id: int, array_task_id: int | None = None) -> str:
    """``<name>-<job id>``, or ``<name>-<array job id>_<task id>`` for a task of a job array (its own job id
    differs between tasks but the pair names it as Slurm does); ``ValueError`` for a job name that is not one plain
    path component (``/``, ``..``, NUL, a newline, a leading dot), so that a job name can never point outside its
    root."""
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
        raise ValueError(f"job id must be a positive integer, got {job_id!r}")
    task = array_task_id
    if task is not None and (isinstance(task, bool) or not isinstance(task, int) or task < 0):
        raise ValueError(f"array task id must be a non-negative integer, got {task!r}")
    if not name or "/" in name or "\x00" in name or "\n" in name or name.startswith(".") or len(name) > 200:
        raise ValueError(f"job name {name!r} cannot name a job directory")
    return f"{name}-{job_id}" if task is None else f"{name}-{job_id}_{task}"


@dataclass(frozen=True)
class JobDir:
    """The directory of one job: ``path`` is ``<root>/<name>-<id>``."""

    path: Path

    @classmethod
    def of(cls, root: Path, name: str, job_id: int, array_task_id: int | None = None) -> JobDir:
        """``<root>/<name>-<job id>``; an array task's: ``<root>/<name>-<array job id>_<task id>``."""
        return cls(Path(root) / leaf_name(name, job_id, array_task_id))

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def control(self) -> Path:
        return self.path / CONTROL

    @property
    def ps(self) -> Path:
        """A ps-mode job's process logs, addresses and final status (:mod:`hpc_elastic.ps.allocation`)."""
        return self.path / PS

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def stop_path(self) -> Path:
        return self.control / STOP

    @property
    def ack_path(self) -> Path:
        return self.control / ACK

    @property
    def progress_path(self) -> Path:
        return self.control / PROGRESS

    @property
    def result_path(self) -> Path:
        return self.path / RESULT

    @property
    def requeues_path(self) -> Path:
        return self.control / REQUEUES

    # -- the job's side (the job's user) ------------------------------------------------------------------------

    def prepare(self) -> JobDir:
        """Create the directory and its subdirectories, or check the existing ones: each a
        real directory of this user that no other user may write into (:class:`~hpc_elastic.files.UnsafeFile`
        otherwise: a directory someone else made may hold a planted stop file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)  # the root: a site directory, made if missing
        private_dir(self.path, JOB_DIR_MODE)
        private_dir(self.control, CONTROL_MODE)
        private_dir(self.checkpoints, PRIVATE_MODE)
        private_dir(self.logs, PRIVATE_MODE)
        return self

    def _read(self, name: str) -> str | None:
        try:
            data = read_owned(self.path, [CONTROL, name], limit=MAX_CONTROL_BYTES)
        except FileNotFoundError:
            return None
        return data.decode("utf-8", errors="replace")

    def read_stop(self) -> StopRequest | None:
        """The stop request, None when there is none; one that cannot be read or parsed (half-written, a planted
        link, too large) is still a stop, with reason ``unknown``."""
        try:
            text = self._read(STOP)
        except (OSError, UnsafeFile):
            text = ""
        return None if text is None else parse_stop_lenient(text)

    def read_ack(self) -> Ack | None:
        """The acknowledgement, None when it is missing or not (yet) valid."""
        try:
            text = self._read(ACK)
            return parse_ack(text) if text is not None else None
        except (OSError, UnsafeFile, ValueError):
            return None

    def request_stop(self, request: StopRequest) -> None:
        atomic_write_bytes(self.stop_path, request.to_json().encode())

    def acknowledge(self, ack: Ack) -> None:
        atomic_write_bytes(self.ack_path, ack.to_json().encode())

    @property
    def scale_path(self) -> Path:
        return self.control / SCALE

    def request_scale(self, request: ScaleRequest) -> None:
        """Ask the job's wrapper to scale the job (``hpc-elastic scale``, as the job's user)."""
        atomic_write_bytes(self.scale_path, request.to_json().encode(), mode=0o644)

    def take_scale(self, stamp: int) -> ScaleRequest | None:
        """The scale request, claimed (renamed ``scale.handled-<stamp>-<token>``) and then read, so that a request
        written meanwhile waits under ``scale`` for the next call instead of being set aside unread; None when there
        is none. ``ValueError`` naming why one is refused: not a plain file of this user (a link, a FIFO, another
        owner's), too large, or not a valid request."""
        claimed = f"{SCALE}{HANDLED}{stamp}-{secrets.token_hex(3)}"
        try:
            os.rename(self.control / SCALE, self.control / claimed)  # (a link is renamed, not followed)
        except FileNotFoundError:
            return None
        try:
            data = read_owned(self.path, [CONTROL, claimed], limit=MAX_CONTROL_BYTES, owner=os.getuid())
        except (OSError, UnsafeFile) as exc:
            raise ValueError(f"scale request refused: {exc}") from None
        return parse_scale(data.decode("utf-8", errors="replace"))

    def reply_scale(self, reply: ScaleReply) -> None:
        atomic_write_bytes(self.control / SCALE_REPLY, reply.to_json().encode(), mode=0o644)

    def read_scale_reply(self) -> ScaleReply | None:
        """The wrapper's last answer to a scale request, None when there is none or it is not valid."""
        try:
            text = self._read(SCALE_REPLY)
            return parse_scale_reply(text) if text is not None else None
        except (OSError, UnsafeFile, ValueError):
            return None

    def timelimit_requeues(self) -> tuple[int, ...]:
        """The incarnations (restart counts) that were requeued at their time limit; ``()`` before the first.
        ``ValueError`` for a record that cannot be read or parsed (the caller decides what that costs)."""
        try:
            text = self._read(REQUEUES)
        except (OSError, UnsafeFile) as exc:
            raise ValueError(f"cannot read {self.requeues_path}: {exc}") from None
        return () if text is None else parse_requeues(text)

    def record_timelimit_requeue(self, restart_count: int) -> tuple[int, ...]:
        """Add incarnation ``restart_count`` to the record (idempotent); return the record."""
        restarts = tuple(sorted({*self.timelimit_requeues(), _count(restart_count, "restart_count")}))
        atomic_write_bytes(self.requeues_path, (json.dumps({"restarts": list(restarts)}) + "\n").encode())
        return restarts

    def set_aside(self, stamp: int, *, keep_stop: bool = False) -> None:
        """Rename the stop request (unless ``keep_stop``), the acknowledgement and a scale request to
        ``<name>.handled-<stamp>``: kept for the record, never taken for those of a later run."""
        self._set_aside((ACK, SCALE) if keep_stop else (STOP, ACK, SCALE), stamp)

    def _set_aside(self, names: Sequence[str], stamp: int) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.control / name, self.control / f"{name}{HANDLED}{stamp}")

    def sweep_temporaries(self, now: float) -> int:
        """Remove the stale temporaries of atomic writes (:func:`hpc_elastic.files.sweep_temporaries`) that a
        process killed while writing a control file, the progress record, the result or a PS-mode status left in
        the job directory; the number removed. The checkpoint store sweeps its own directory."""
        return sum(sweep_temporaries(where, now=now) for where in (self.path, self.control, self.ps))

    def record_progress(self, progress: Progress) -> None:
        atomic_write_bytes(self.progress_path, progress.to_json().encode())

    def read_progress(self) -> Progress | None:
        """The last progress record, None when there is none or it is not valid."""
        try:
            text = self._read(PROGRESS)
            return parse_progress(text) if text is not None else None
        except (OSError, UnsafeFile, ValueError):
            return None

    def write_result(self, data: bytes) -> None:
        """The pickled outcome of a submitted function (private to the job's user)."""
        atomic_write_bytes(self.result_path, data, mode=0o600)

    def read_result(self, limit: int) -> bytes | None:
        """The pickled outcome, None while there is none; :class:`UnsafeFile` when it is not this job's plain
        file or holds more than ``limit`` bytes."""
        try:
            return read_owned(self.path, [RESULT], limit=limit, owner=os.getuid())
        except FileNotFoundError:
            return None

    def list_checkpoints(self) -> tuple[CheckpointRecord, ...]:
        """The newest :data:`MAX_LISTED` committed checkpoints whose manifest parses, newest first (bounded reads,
        no hashing: a listing, not a verification)."""
        try:
            names = os.listdir(self.checkpoints)
        except OSError:
            return ()
        steps = sorted((s for s in map(layout.step_of, names) if s is not None), reverse=True)[:MAX_LISTED]
        found = []
        for step in steps:
            name = layout.dir_name(step)
            try:
                data = read_owned(self.checkpoints, [name, layout.MANIFEST], limit=MAX_MANIFEST_BYTES)
                manifest = layout.parse_manifest(data.decode("utf-8", errors="replace"))
            except (OSError, UnsafeFile, ValueError):
                continue
            size = sum(entry.size for entry in manifest.files.values())
            found.append(CheckpointRecord(manifest.step, manifest.created_at, size, manifest.world_size))
        return tuple(found)

    def past_stops(self) -> tuple[PastStop, ...]:
        """The newest :data:`MAX_LISTED` stop requests that earlier incarnations set aside, oldest first."""
        try:
            names = os.listdir(self.control)
        except OSError:
            return ()
        stamped = []
        for name in names:
            head, sep, digits = name.partition(HANDLED)
            if head == STOP and sep and digits.isdigit() and len(digits) <= 12:
                stamped.append((int(digits), name))
        out = []
        for stamp, name in sorted(stamped)[-MAX_LISTED:]:
            try:
                text = self._read(name)
            except (OSError, UnsafeFile):
                text = ""
            if text is not None:
                out.append(PastStop(parse_stop_lenient(text), float(stamp)))
        return tuple(out)

    def standing_stop(self) -> StopRequest | None:
        """A stop for a chosen step that no checkpoint has acknowledged yet (it outlives a restart), else None."""
        request = self.read_stop()  # an unreadable one has no step: it never stands
        return request if request is not None and still_pending(request, self.read_ack()) else None

    # -- the daemon's side (another user, with more rights) -----------------------------------------------------

    def owned_by(self, uid: int) -> bool:
        """Whether the directory is a real directory (not a link) of user ``uid``."""
        try:
            info = os.lstat(self.path)
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and info.st_uid == uid

    def read_ack_as(self, uid: int) -> Ack | None:
        """The acknowledgement as the daemon reads it: only through directories and a file of user ``uid`` (the
        job's), no link followed, no FIFO waited on, at most :data:`MAX_CONTROL_BYTES`; None otherwise."""
        try:
            data = read_owned(self.path.parent, [self.path.name, CONTROL, ACK], limit=MAX_CONTROL_BYTES, owner=uid)
            return parse_ack(data.decode("utf-8", errors="replace"))
        except (OSError, UnsafeFile, ValueError):
            return None

    def scale_requested(self) -> bool:
        """Whether a scale request waits in ``control/`` (its wrapper sets it aside once read); no link followed."""
        try:
            os.lstat(self.scale_path)
        except OSError:
            return False
        return True

    def read_scale_reply_as(self, uid: int) -> ScaleReply | None:
        """The wrapper's last answer to a scale request as the daemon reads it: through directories and a file of
        user ``uid`` only, no link followed, at most :data:`MAX_CONTROL_BYTES`, validated; None otherwise."""
        try:
            parts = [self.path.name, CONTROL, SCALE_REPLY]
            data = read_owned(self.path.parent, parts, limit=MAX_CONTROL_BYTES, owner=uid)
            return parse_scale_reply(data.decode("utf-8", errors="replace"))
        except (OSError, UnsafeFile, ValueError):
            return None

    def read_progress_as(self, uid: int) -> Progress | None:
        """The progress record (with the job's telemetry) as the daemon reads it: through directories and a file of
        user ``uid`` only, no link followed, at most :data:`MAX_CONTROL_BYTES`, validated; None otherwise."""
        try:
            data = read_owned(self.path.parent, [self.path.name, CONTROL, PROGRESS], limit=MAX_CONTROL_BYTES, owner=uid)
            return parse_progress(data.decode("utf-8", errors="replace"))
        except (OSError, UnsafeFile, ValueError):
            return None


def output_path(ckpt_root: Path, name: str, job_id: int, array_task_id: int | None = None) -> Path:
    """The job's standard output and error: ``<ckpt-root>/<name>-<id>.out``, for an array task
    ``<name>-<array id>_<task id>.out`` (the batch script's ``--output``, :data:`OUTPUT_PATTERN` or
    :data:`ARRAY_OUTPUT_PATTERN`, beside the job's directory)."""
    return Path(ckpt_root) / f"{leaf_name(name, job_id, array_task_id)}.out"


def read_tail(path: Path, limit: int) -> str:
    """The last ``limit`` bytes of a regular file (decoded leniently); ``FileNotFoundError`` when it is missing."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{path} is not a regular file")
        os.lseek(fd, max(0, info.st_size - limit), os.SEEK_SET)
        chunks = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def call_path(ckpt_root: Path) -> Path:
    """A fresh private place for the pickled call of a function submitted with :func:`hpc_elastic.submit`:
    ``<ckpt-root>/calls/<random>.pkl``, its directory created 0700 (or checked: this user's, nobody else's to
    write into)."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    calls = private_dir(root / CALLS, PRIVATE_MODE)
    return calls / f"{secrets.token_hex(12)}.pkl"


def write_call(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data, mode=0o600)


def find_job_dir(
    roots: list[Path] | tuple[Path, ...], name: str, job_id: int, uid: int, array_task_id: int | None = None
) -> JobDir | None:
    """The job's directory under the first root where it exists as a real directory of the job's user ``uid``;
    None when there is none (or the job name cannot name one). An array task: the array's job id and the task's."""
    try:
        leaf = leaf_name(name, job_id, array_task_id)
    except ValueError:
        return None
    for root in roots:
        job_dir = JobDir(Path(root) / leaf)
        if job_dir.owned_by(uid):
            return job_dir
    return None
