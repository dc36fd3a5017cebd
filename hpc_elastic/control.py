"""The control files between the wrapper and the workers of a job (pure: formats only, no I/O).

In ``$HPC_ELASTIC_JOB_DIR/control/``:

``stop``
    Created by the wrapper (``wrappers/hpc-elastic-run``) when the job must checkpoint and exit::

        {"reason": "preempt" | "timelimit" | "resize", "requested_at": <epoch seconds, float>[, "at_step": <int>]}

    Its existence is the request; workers see it at the next mini-batch boundary (with ``at_step``, at the first
    boundary where the training step is ``at_step`` or later: a stop at a chosen step, as ``hpc-elastic
    verify-determinism`` uses for its resizes).  A file that is empty or not
    (yet) valid JSON still means "stop", with reason ``unknown``.

``ack.json``
    Written atomically by rank 0 once the checkpoint of the stop is committed::

        {"job_id": <int or null>, "restart_count": <int>, "step": <int>, "checkpoint": "<absolute path>",
         "written_at": <epoch seconds, float>}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

CONTROL_DIR = "control"
STOP_FILE = "stop"
ACK_FILE = "ack.json"


class StopReason(StrEnum):
    PREEMPT = "preempt"
    TIMELIMIT = "timelimit"
    RESIZE = "resize"
    UNKNOWN = "unknown"  # a stop file that cannot be parsed (still a stop)


@dataclass(frozen=True)
class StopRequest:
    reason: StopReason
    requested_at: float | None
    at_step: int | None = None

    def __post_init__(self) -> None:
        if self.at_step is not None and (
            isinstance(self.at_step, bool) or not isinstance(self.at_step, int) or self.at_step < 0
        ):
            raise ValueError(f"stop at_step must be a non-negative integer, got {self.at_step!r}")

    def to_json(self) -> str:
        doc: dict[str, Any] = {"reason": self.reason.value, "requested_at": self.requested_at}
        if self.at_step is not None:
            doc["at_step"] = self.at_step
        return json.dumps(doc, sort_keys=True)


def parse_stop(text: str) -> StopRequest:
    """Parse the content of a ``stop`` file; raise ``ValueError`` naming what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError(f"stop file is not JSON: {text[:80]!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"stop file must hold a JSON object, got {doc!r}")
    raw_reason = doc.get("reason")
    try:
        if not isinstance(raw_reason, str):
            raise ValueError(raw_reason)
        reason = StopReason(raw_reason)
    except ValueError:
        raise ValueError(f"stop reason must be one of preempt, timelimit, resize, got {raw_reason!r}") from None
    if reason is StopReason.UNKNOWN:
        raise ValueError(f"stop reason must be one of preempt, timelimit, resize, got {raw_reason!r}")
    at = doc.get("requested_at")
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise ValueError(f"stop requested_at must be epoch seconds, got {at!r}")
    return StopRequest(reason, float(at), doc.get("at_step"))


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

    def __post_init__(self) -> None:
        if self.job_id is not None and (isinstance(self.job_id, bool) or not isinstance(self.job_id, int)):
            raise ValueError(f"job_id must be an integer or None, got {self.job_id!r}")
        for name in ("restart_count", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            "step": self.step,
            "checkpoint": str(self.checkpoint),
            "written_at": self.written_at,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True) + "\n"


def still_pending(request: StopRequest, ack: Ack | None) -> bool:
    """Whether a stop request outlives a restart of the job: one for a chosen step (``at_step``) stands until a
    checkpoint at or after that step is acknowledged; any other request belongs to the incarnation it stopped."""
    return request.at_step is not None and (ack is None or ack.step < request.at_step)


def parse_ack(text: str) -> Ack:
    """Parse ``ack.json`` (the wrapper's side of the contract); raise ``ValueError`` naming what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError(f"ack file is not JSON: {text[:80]!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"ack file must hold a JSON object, got {doc!r}")
    missing = [k for k in ("job_id", "restart_count", "step", "checkpoint", "written_at") if k not in doc]
    if missing:
        raise ValueError(f"ack file lacks {missing[0]!r}")
    if not isinstance(doc["checkpoint"], str) or not doc["checkpoint"]:
        raise ValueError(f"ack checkpoint must be a path, got {doc['checkpoint']!r}")
    at = doc["written_at"]
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise ValueError(f"ack written_at must be epoch seconds, got {at!r}")
    return Ack(doc["job_id"], doc["restart_count"], doc["step"], Path(doc["checkpoint"]), float(at))
