"""GPUs held over time, per job and GPU type, from samples of Slurm's job records (pure: no commands, no clock).

The grow-and-shrink story (:mod:`slurm_plugin.grow_story`) polls ``squeue`` while it runs and keeps one
:class:`Sample` per job and poll; :func:`holdings` turns them into step series (the GPUs of each type a job held
from one change to the next), :func:`restarts` into the moments Slurm requeued a job (a resize: checkpoint,
requeue, new size, restart; EasyScale §3.4's scale-out and scale-in as the daemon carries them out on Slurm), and
:func:`resize_actions` picks the daemon's resize decisions out of its recorded actions, and :func:`loss_by_step` adds
up the training loss the job's processes logged. A job holds GPUs while
Slurm shows it RUNNING: a requeued job passes through COMPLETING with its old allocation, and pending it holds none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpc_elastic.slurm import Job, JobState
from slurm_plugin.actions import ActionKind


@dataclass(frozen=True)
class Sample:
    """One job as one poll of Slurm saw it: at ``t`` (seconds, any epoch), its state, requeues and GPUs by type."""

    t: float
    job_id: int
    state: JobState
    restart_count: int
    gpus: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, t: float, job: Job) -> Sample:
        return cls(t, job.job_id, job.state, job.restart_count, job.gpus.by_type)

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "job_id": self.job_id,
            "state": self.state.value,
            "restart_count": self.restart_count,
            "gpus": dict(self.gpus),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Sample:
        gpus = doc.get("gpus")
        if not isinstance(gpus, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in gpus.items()
        ):
            raise ValueError(f"sample gpus must map GPU types to counts, got {gpus!r}")
        return cls(
            t=float(doc["t"]),
            job_id=int(doc["job_id"]),
            state=JobState(str(doc["state"])),
            restart_count=int(doc["restart_count"]),
            gpus=tuple(sorted(gpus.items())),
        )


@dataclass(frozen=True)
class Holding:
    """From ``t`` on (until the next holding of the same job), the job held ``gpus`` (type -> count; empty: none)."""

    t: float
    gpus: tuple[tuple[str, int], ...]

    def count(self, gpu_type: str) -> int:
        return sum(n for name, n in self.gpus if name == gpu_type)


def held(sample: Sample) -> tuple[tuple[str, int], ...]:
    """The GPUs the job holds in this sample: its allocation while RUNNING, none otherwise."""
    return sample.gpus if sample.state is JobState.RUNNING else ()


def holdings(samples: Iterable[Sample]) -> dict[int, list[Holding]]:
    """Per job, its holdings in time order: one entry at its first sample and one at each change."""
    out: dict[int, list[Holding]] = {}
    for sample in sorted(samples, key=lambda s: (s.t, s.job_id)):
        series = out.setdefault(sample.job_id, [])
        gpus = held(sample)
        if not series or series[-1].gpus != gpus:
            series.append(Holding(sample.t, gpus))
    return out


def gpu_types(series: Mapping[int, Sequence[Holding]]) -> list[str]:
    """The GPU types any job held, sorted (a GPU of no declared type is ``""``)."""
    return sorted({name for hs in series.values() for h in hs for name, _ in h.gpus})


def restarts(samples: Iterable[Sample]) -> dict[int, list[tuple[float, int]]]:
    """Per job, ``(t, restart_count)`` at the first sample that showed each new requeue count."""
    out: dict[int, list[tuple[float, int]]] = {}
    seen: dict[int, int] = {}
    for sample in sorted(samples, key=lambda s: (s.t, s.job_id)):
        if sample.restart_count > seen.setdefault(sample.job_id, sample.restart_count):
            out.setdefault(sample.job_id, []).append((sample.t, sample.restart_count))
        seen[sample.job_id] = max(seen[sample.job_id], sample.restart_count)
    return out


@dataclass(frozen=True)
class ResizeAction:
    """A resize the daemon decided and carried out (or tried): when, which job, how, and its stated reason."""

    t: float
    job_id: int
    ok: bool
    detail: str
    reason: str


def resize_actions(actions: Iterable[Mapping[str, Any]], job_ids: Iterable[int] | None = None) -> list[ResizeAction]:
    """The ``resize`` entries of the daemon's recorded actions (``recent_actions`` of its state file), in time
    order, of ``job_ids`` when given; entries without a time or job id are skipped."""
    wanted = None if job_ids is None else set(job_ids)
    out = []
    for a in actions:
        if (
            a.get("kind") != ActionKind.RESIZE
            or not isinstance(a.get("time"), int | float)
            or not isinstance(a.get("job_id"), int)
        ):
            continue
        if wanted is not None and a["job_id"] not in wanted:
            continue
        out.append(
            ResizeAction(
                float(a["time"]),
                int(a["job_id"]),
                bool(a.get("ok")),
                str(a.get("detail", "")),
                str(a.get("reason", "")),
            )
        )
    return sorted(out, key=lambda r: (r.t, r.job_id))


@dataclass(frozen=True)
class LossRecord:
    """One process's line of the example's ``--loss-log``: after ``step``, the sum of its ESTs' losses and how
    many ESTs it ran, in incarnation ``restart`` (Slurm's requeue count), as rank ``rank`` of ``world_size``."""

    restart: int
    rank: int
    step: int
    loss_sum: float
    ests: int
    world_size: int


def parse_loss_line(restart: int, rank: int, line: str) -> LossRecord:
    """A ``--loss-log`` line; ``ValueError`` naming what is wrong."""
    doc = json.loads(line)
    if not isinstance(doc, dict):
        raise ValueError(f"loss record must be an object, got {line!r}")
    try:
        return LossRecord(
            restart, rank, int(doc["step"]), float(doc["loss_sum"]), int(doc["ests"]), int(doc["world_size"])
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"loss record needs step, loss_sum, ests and world_size, got {line!r}") from None


def loss_by_step(records: Iterable[LossRecord], workers: int) -> list[tuple[int, float]]:
    """The training loss after each step: the mean over the N = ``workers`` ESTs, from the records of the newest
    incarnation that has every process's record of that step (a step redone after a restart counts once; the
    last record of a process for a step wins). Steps no incarnation covers whole are left out."""
    by_step: dict[int, dict[int, dict[int, LossRecord]]] = {}
    for r in records:
        by_step.setdefault(r.step, {}).setdefault(r.restart, {})[r.rank] = r
    out = []
    for step in sorted(by_step):
        for restart in sorted(by_step[step], reverse=True):
            ranks = by_step[step][restart]
            if sum(r.ests for r in ranks.values()) == workers:
                out.append((step, sum(ranks[k].loss_sum for k in sorted(ranks)) / workers))
                break
    return out
