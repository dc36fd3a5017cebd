"""The Slurm adapter of DL²'s supervised phase (``--teacher sacct``): Slurm's decisions, read from its accounting,
as the samples the policy network imitates (DL² §4.2 bootstraps from whatever scheduler the cluster runs).

The only module of :mod:`hpc_elastic.dl2` that talks to Slurm: :func:`read_history` runs the reads
(:mod:`hpc_elastic.slurm`: ``sacct`` for the jobs and their steps, ``sinfo`` for the partition's nodes) and hands
them to the pure :mod:`hpc_elastic.dl2.history`, which turns them into DL²'s slots; :func:`train_on_history`
trains on them (:func:`hpc_elastic.dl2.train.train`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from hpc_elastic.dl2.history import HistorySamples, collect, history_slots, partition_servers, ps_partitions
from hpc_elastic.dl2.train import Teacher, TrainConfig, TrainResult, base_spec, train
from hpc_elastic.env import read_environment
from hpc_elastic.slurm import connect


def parse_moment(option: str, raw: str) -> datetime:
    """An ISO 8601 date or time (UTC when it names no zone); ``ValueError`` naming the option."""
    try:
        moment = datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{option} {raw!r} is not an ISO 8601 date or time") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class SacctTeacher:
    """``--teacher sacct``: the window of history and the CPU partition whose PS-mode jobs teach."""

    since: datetime
    until: datetime
    partition: str | None

    def __post_init__(self) -> None:
        if self.since >= self.until:
            raise ValueError(f"--since {self.since.isoformat()} is not before {self.until.isoformat()}")

    @classmethod
    def parse(cls, since: str | None, until: str | None, partition: str | None) -> SacctTeacher:
        """The window from ``--since`` (required, not in the future) and ``--until`` (default: now)."""
        if since is None:
            raise ValueError("--teacher sacct needs --since (an ISO date)")
        now = datetime.now(UTC)
        start = parse_moment("--since", since)
        if start > now:
            raise ValueError(f"--since {since} is in the future")
        return cls(start, parse_moment("--until", until) if until else now, partition)


def read_history(teacher: SacctTeacher, config: TrainConfig) -> tuple[HistorySamples, dict[str, object]]:
    """Slurm's history of the window as DL²'s slots (one ``sacct`` for the jobs, one for their steps, one
    ``sinfo`` for the partition's nodes); ``ValueError`` when it gives no sample."""
    slurm = connect(read_environment())
    jobs = slurm.history(teacher.since, teacher.until)
    steps = slurm.step_history(teacher.since, teacher.until)
    partition = teacher.partition
    if partition is None:
        found = sorted(ps_partitions(jobs, steps))
        if len(found) != 1:
            where = f"in partitions {', '.join(found)}" if found else "in no partition"
            raise ValueError(f"PS-mode jobs since {teacher.since.isoformat()} are {where}: name one with --partition")
        partition = found[0]
    collected = collect(jobs, steps, partition)
    servers = partition_servers(slurm.nodes(), partition)
    history = history_slots(
        base_spec(config), config.types, servers, collected.records, start=teacher.since, end=teacher.until
    )
    summary: dict[str, object] = {
        "teacher": Teacher.SACCT.value,
        "since": teacher.since.isoformat(),
        "until": teacher.until.isoformat(),
        "partition": partition,
        **history.summary(),
        "not_ps_jobs": collected.not_ps,
        "bad_markers": collected.bad_marker,
        "other_partition_jobs": collected.other_partition,
        "ps_jobs_by_steps": collected.by_steps,
    }
    if history.samples == 0:
        unknown = ", ".join(f"{name} ({count})" for name, count in history.unknown_types) or "none"
        raise ValueError(
            f"no usable samples in sacct history of partition {partition} since {teacher.since.isoformat()}: "
            f"{history.jobs} PS-mode jobs of a DL² type (unknown types: {unknown}), {len(history.slots)} slots with "
            f"jobs, {history.inexpressible} not expressible in DL²'s actions"
        )
    return history, summary


def train_on_history(
    teacher: SacctTeacher, config: TrainConfig, progress: Callable[[str], None] | None = None
) -> TrainResult:
    """:func:`~hpc_elastic.dl2.train.train` with the samples of Slurm's history of ``teacher``'s window; what was
    read (:func:`read_history`'s summary) goes to ``progress`` first, and into the model file's meta."""
    history, described = read_history(teacher, config)
    if progress is not None:
        progress(f"sacct: {json.dumps(described)}")
    return train(config, progress=progress, history=history.slots, teacher=described)
