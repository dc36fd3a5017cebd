"""PACKLIMIT refitted from what the running jobs measure (Tiresias §3.3.2, "Determining PACKLIMIT").

Tiresias consolidates a job whose skew exceeds PACKLIMIT and refits PACKLIMIT from history "with a simple linear
classifier ... using a job's placement and corresponding performance as features". The daemon gathers that
history from the jobs' own telemetry, the channel EasyScale's companion reads too (``progress.json``,
:func:`~slurm_plugin.apply.telemetry`):

- every pass, each running managed job with a skew (its profile's, the scale PACKLIMIT is on) that reported a
  speed from its current run gives one :class:`PlacementReport` of that incarnation: its model (that of the profile
  it names, ``<model>@<device type>``, on the GPU types it holds: speeds differ by type), its skew, whether it runs
  consolidated (on the fewest nodes that hold its GPUs, :meth:`~hpc_elastic.policy.types.ClusterState.spread`) and
  its speed per process (EST mini-batches per second per process, communication included: what a placement
  changes);
- the newest report of an incarnation replaces its older one, and the newest :data:`MAX_REPORTS` are kept in the
  state store (``placements``), so the refit is over the jobs' history and survives a daemon restart;
- :func:`refit` is :func:`~hpc_elastic.policy.placement.fit_pack_limit` over them, the configured PACKLIMIT being
  what stands until two models, one placement-sensitive and one not, were each seen consolidated and spread.

A job's report is its user's word (hostile input): a model's speed in a placement is the median over its users of
each user's mean, so one user's reports, however many, move PACKLIMIT only through the models their jobs name,
and not at all where more than half of a model's users in a placement report honestly; the skew is never theirs
(the site's profile of that name, on which PACKLIMIT is the classifier's threshold).

Pure: plain values in, reports and a number out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_elastic.policy.placement import PlacementSample, fit_pack_limit
from hpc_elastic.policy.types import ClusterState, JobStatus, JobView

#: the most placement reports the daemon keeps (the newest)
MAX_REPORTS = 1024
#: the longest model name a report may carry (a profile name and the GPU types)
MAX_MODEL_CHARS = 256


@dataclass(frozen=True, slots=True)
class PlacementReport:
    """One job incarnation's placement and its measured speed (Tiresias §3.3.2's features): job ``job_id`` run
    ``restart_count`` of user ``uid``, of ``model`` with ``skew``, ran ``consolidated`` or spread at ``speed`` EST
    mini-batches per second per process, last seen at ``at`` (epoch seconds)."""

    job_id: int
    restart_count: int
    uid: int
    model: str
    skew: float
    consolidated: bool
    speed: float
    at: float

    def __post_init__(self) -> None:
        for name in ("job_id", "restart_count", "uid"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "job_id" else 0):
                raise ValueError(
                    f"placement report {name} must be an integer >= {int(name == 'job_id')}, got {value!r}"
                )
        if not isinstance(self.model, str) or not 0 < len(self.model) <= MAX_MODEL_CHARS:
            raise ValueError(
                f"placement report model must be a name of 1-{MAX_MODEL_CHARS} characters, got {self.model!r}"
            )
        if not isinstance(self.consolidated, bool):
            raise ValueError(f"placement report consolidated must be true or false, got {self.consolidated!r}")
        for name in ("skew", "speed", "at"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"placement report {name} must be a finite number, got {value!r}")
        if self.skew < 0 or self.speed <= 0:
            raise ValueError(f"placement report needs skew >= 0 and speed > 0, got {self.skew!r} and {self.speed!r}")

    @property
    def key(self) -> tuple[int, int]:
        """The incarnation it reports on."""
        return self.job_id, self.restart_count


def reports_of(
    views: Sequence[JobView],
    cluster: ClusterState,
    *,
    runs: Mapping[int, tuple[int, int, str]],
    speeds: Mapping[int, float],
    now: float,
) -> list[PlacementReport]:
    """This pass's reports: one per running job with a skew, an allocation on known nodes, its incarnation
    (``runs``: job id -> (restart count, uid, model name)) and a speed measured in it (``speeds``)."""
    out: list[PlacementReport] = []
    for view in views:
        run, speed = runs.get(view.job_id), speeds.get(view.job_id)
        if view.status is not JobStatus.RUNNING or view.skew is None or run is None or speed is None:
            continue
        rows = tuple((cluster.index[name], count) for name, count in view.allocation if name in cluster.index)
        if not rows or len(rows) != len(view.allocation):
            continue
        restart_count, uid, name = run
        types = "+".join(sorted({cluster.pool_names[int(cluster.pool[node])] or "gpu" for node, _ in rows}))
        model = f"{name} on {types}"
        if len(model) > MAX_MODEL_CHARS:
            continue
        consolidated = not cluster.spread(rows)
        out.append(PlacementReport(view.job_id, restart_count, uid, model, view.skew, consolidated, speed, now))
    return out


def merge(kept: Iterable[PlacementReport], new: Iterable[PlacementReport]) -> tuple[PlacementReport, ...]:
    """The reports kept after a pass: a new report replaces its incarnation's older one; the newest
    :data:`MAX_REPORTS` (ordered by time, then job and run)."""
    by_key = {report.key: report for report in kept}
    for report in new:
        by_key[report.key] = report
    newest = sorted(by_key.values(), key=lambda r: (r.at, r.job_id, r.restart_count), reverse=True)
    return tuple(sorted(newest[:MAX_REPORTS], key=lambda r: (r.at, r.job_id, r.restart_count)))


def refit(reports: Iterable[PlacementReport], configured: float, tolerance: float) -> float:
    """PACKLIMIT from the reports (§3.3.2's classifier, :func:`fit_pack_limit`): a model's speed in a placement is
    the median over its users of each user's mean; ``configured`` while no two models, one of each class, were
    each seen both consolidated and spread."""
    by_user: dict[tuple[str, bool, int], list[PlacementReport]] = {}
    for report in reports:
        by_user.setdefault((report.model, report.consolidated, report.uid), []).append(report)
    users: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for (model, consolidated, _), group in sorted(by_user.items()):
        mean = (sum(r.skew for r in group) / len(group), sum(r.speed for r in group) / len(group))
        users.setdefault((model, consolidated), []).append(mean)
    samples = [
        PlacementSample(
            model,
            statistics.median(skew for skew, _ in means),
            consolidated,
            statistics.median(speed for _, speed in means),
        )
        for (model, consolidated), means in sorted(users.items())
    ]
    return fit_pack_limit(samples, tolerance=tolerance, current=configured)
