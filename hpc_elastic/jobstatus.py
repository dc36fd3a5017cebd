"""The elastic state of one job, as ``hpc-elastic jobs`` / ``hpc-elastic job`` and ``Job.status()`` show it.

Pure: :func:`elastic_status` assembles it from Slurm's record of the job, what its job directory holds
(:class:`JobReadings`, read by :mod:`hpc_elastic.jobs` through :class:`hpc_elastic.jobdir.JobDir`) and the time now.
No Slurm command, no file, no clock here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_elastic.jobdir import CheckpointRecord, PastStop, Progress, StopNotice, StopRequest
from hpc_elastic.launch.spec import MarkerError, decode_marker
from hpc_elastic.slurm.types import Job, JobState


@dataclass(frozen=True)
class JobReadings:
    """What a job's directory holds now (everything optional: a pending job has no directory yet)."""

    path: Path | None = None
    progress: Progress | None = None
    checkpoints: tuple[CheckpointRecord, ...] = ()
    past_stops: tuple[PastStop, ...] = ()
    stop: StopRequest | None = None


@dataclass(frozen=True)
class CheckpointView:
    step: int
    age_s: float
    size_bytes: int
    world_size: int


@dataclass(frozen=True)
class StopView:
    """A stop request: why, and how long ago it was asked for (None when unknown)."""

    reason: str
    age_s: float | None
    at_step: int | None = None


@dataclass(frozen=True)
class ElasticStatus:
    """One job's elastic state.  ``workers`` is N (logical workers, from the job's marker), ``processes`` M (its
    worker processes now: tasks of the allocation while it runs, else those of its last recorded run), ``gpus`` its
    GPUs now by type.  ``requeues`` counts Slurm's requeues, ``restarts`` the restarts of the worker step inside the
    last allocation; ``stops`` are the stop requests earlier incarnations handled (oldest first), ``stop_pending``
    one the job is acting on now, ``plugin_action`` the scheduler daemon's last stop notice."""

    job_id: int
    name: str
    state: JobState
    partition: str
    workers: int | None
    elastic_range: tuple[int, int] | None
    unit: str | None
    processes: int | None
    gpus: Mapping[str, int]
    nodes: tuple[str, ...]
    elapsed_s: int | None
    time_limit_s: int | None
    step: int | None
    steps_per_s: float | None
    progress_age_s: float | None
    checkpoints: tuple[CheckpointView, ...]
    requeues: int
    restarts: int
    stops: tuple[StopView, ...]
    stop_pending: StopView | None
    plugin_action: StopView | None
    job_dir: Path | None
    pending_reason: str = ""

    @property
    def finished(self) -> bool:
        return not self.state.is_active

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted(t for t in self.gpus if t))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``hpc-elastic job --json``)."""

        def stop(view: StopView | None) -> dict[str, Any] | None:
            if view is None:
                return None
            return {"reason": view.reason, "age_s": _round(view.age_s), "at_step": view.at_step}

        return {
            "job_id": self.job_id,
            "name": self.name,
            "state": self.state.value,
            "partition": self.partition,
            "workers": self.workers,
            "elastic_range": list(self.elastic_range) if self.elastic_range else None,
            "unit": self.unit,
            "processes": self.processes,
            "gpus": dict(self.gpus),
            "gpu_types": list(self.gpu_types),
            "nodes": list(self.nodes),
            "elapsed_s": self.elapsed_s,
            "time_limit_s": self.time_limit_s,
            "step": self.step,
            "steps_per_s": _round(self.steps_per_s),
            "progress_age_s": _round(self.progress_age_s),
            "checkpoints": [
                {"step": c.step, "age_s": _round(c.age_s), "size_bytes": c.size_bytes, "world_size": c.world_size}
                for c in self.checkpoints
            ],
            "requeues": self.requeues,
            "restarts": self.restarts,
            "stops": [stop(s) for s in self.stops],
            "stop_pending": stop(self.stop_pending),
            "plugin_action": stop(self.plugin_action),
            "job_dir": str(self.job_dir) if self.job_dir else None,
            "pending_reason": self.pending_reason,
            "finished": self.finished,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else max(0.0, now - then)


def _stop_view(request: StopRequest, now: float) -> StopView:
    return StopView(request.reason.value, _age(now, request.requested_at), request.at_step)


def _elapsed(job: Job, now: float) -> int | None:
    if job.elapsed_s is not None:
        return job.elapsed_s
    if job.state.is_running and job.start_time is not None:
        return max(0, int(now - job.start_time.timestamp()))
    if job.start_time is not None and job.end_time is not None:
        return max(0, int((job.end_time - job.start_time).total_seconds()))
    return None


def elastic_status(job: Job, readings: JobReadings, now: float) -> ElasticStatus:
    """The elastic state of ``job`` (Slurm's record: ``squeue`` while it is known there, else its last ``sacct``
    record) with what its directory holds, at epoch seconds ``now``."""
    try:
        marker = decode_marker(job.comment)
    except MarkerError:
        marker = None
    progress = readings.progress
    running = job.state.is_running
    if running and job.tasks:
        processes: int | None = job.tasks
    elif running and job.gpu_count:
        processes = job.gpu_count
    else:
        processes = progress.world_size if progress is not None else None
    current = progress is not None and progress.restart_count == job.restart_count
    notice = StopNotice.decode(job.admin_comment) if job.admin_comment else None
    # rank 0 records its step every few seconds: a checkpoint may be newer
    steps = [c.step for c in readings.checkpoints[:1]] + ([progress.step] if progress is not None else [])
    pending = readings.stop  # while the job runs, a stop it acts on; else the stop that ended its last run
    return ElasticStatus(
        job_id=job.job_id,
        name=job.name,
        state=job.state,
        partition=job.partition,
        workers=marker.workers if marker is not None else (progress.workers if progress is not None else None),
        elastic_range=(marker.min, marker.max) if marker is not None else None,
        unit=marker.unit.value if marker is not None else None,
        processes=processes,
        gpus=job.gpus.as_dict() if running else {},
        nodes=job.nodes if running else (),
        elapsed_s=_elapsed(job, now),
        time_limit_s=job.time_limit_s,
        step=max(steps) if steps else None,
        steps_per_s=progress.steps_per_s if progress is not None and current else None,
        progress_age_s=_age(now, progress.written_at) if progress is not None else None,
        checkpoints=tuple(
            CheckpointView(c.step, _age(now, c.created_at) or 0.0, c.size_bytes, c.world_size)
            for c in readings.checkpoints
        ),
        requeues=job.restart_count,
        restarts=progress.attempt if current and progress is not None else 0,
        stops=tuple(
            StopView(s.request.reason.value, _age(now, s.request.requested_at or s.set_aside_at), s.request.at_step)
            for s in readings.past_stops
        )
        + (() if pending is None or running else (_stop_view(pending, now),)),
        stop_pending=_stop_view(pending, now) if pending is not None and running else None,
        plugin_action=(StopView(notice.reason.value, _age(now, notice.requested_at)) if notice is not None else None),
        job_dir=readings.path,
        pending_reason=job.pending_reason if job.state.is_pending else "",
    )
