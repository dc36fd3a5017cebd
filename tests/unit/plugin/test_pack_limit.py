"""PACKLIMIT refitted by the daemon from the placements and speeds the jobs report (Tiresias §3.3.2): the reports
of a pass, what is kept, the refit and its resistance to one user's reports, the store, and the daemon's passes."""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from hpc_elastic.jobdir import JobDir, Progress
from hpc_elastic.launch.spec import JobMarker
from hpc_elastic.policy import ClusterState, JobStatus, JobView, NodeView
from hpc_elastic.slurm import GpuCounts, Job, Node
from slurm_plugin.actions import Place
from slurm_plugin.daemon import STATE_NAME, Daemon
from slurm_plugin.pack_limit import MAX_REPORTS, PlacementReport, merge, refit, reports_of
from slurm_plugin.store import DB_NAME, Store
from tests.unit.plugin.conftest import MARK, at, config, start_of
from tests.unit.plugin.test_daemon import FakeSlurm, make

ME = os.getuid()
NOW = 1_766_400_000.0


def report(job_id: int, model: str, skew: float, consolidated: bool, speed: float, **kw: object) -> PlacementReport:
    fields: dict[str, object] = {"restart_count": 0, "uid": 1000 + job_id, "at": NOW + job_id}
    fields.update(kw)
    return PlacementReport(job_id, model=model, skew=skew, consolidated=consolidated, speed=speed, **fields)  # type: ignore[arg-type]


def two_models(vgg_spread: float = 4.0) -> list[PlacementReport]:
    """vgg (skew 0.8) runs 2.5x as fast consolidated; mlp (skew 0.1) the same either way."""
    return [
        report(1, "vgg", 0.8, True, 10.0),
        report(2, "vgg", 0.8, False, vgg_spread),
        report(3, "mlp", 0.1, True, 10.0),
        report(4, "mlp", 0.1, False, 9.8),
    ]


def test_a_report_refuses_what_is_not_one() -> None:
    good = report(1, "vgg", 0.8, True, 10.0)
    for bad in (
        {"job_id": 0},
        {"restart_count": -1},
        {"uid": True},
        {"model": ""},
        {"model": "x" * 300},
        {"skew": float("nan")},
        {"skew": -0.1},
        {"speed": 0.0},
        {"speed": float("inf")},
        {"at": float("nan")},
        {"consolidated": 1},
    ):
        with pytest.raises(ValueError, match="placement report"):
            replace(good, **bad)


def test_the_refit_separates_a_sensitive_model_from_an_insensitive_one() -> None:
    assert refit(two_models(), 0.9, 1.1) == pytest.approx(0.45)  # between the two skews
    # nothing to separate: both models run as fast spread (one class), or a model seen in one placement only
    assert refit(two_models(vgg_spread=9.9), 0.9, 1.1) == 0.9
    assert refit(two_models()[:3], 0.9, 1.1) == 0.9
    assert refit((), 0.9, 1.1) == 0.9
    # the tolerance decides what counts as sensitive: 2.5x is not at 3
    assert refit(two_models(), 0.9, 3.0) == 0.9


def test_one_user_counts_once_per_model_and_placement() -> None:
    honest = two_models(vgg_spread=9.9)  # no model is placement-sensitive: PACKLIMIT stays
    for uid in (2001, 2002):  # two more honest users of mlp spread
        honest.append(report(10 + uid % 10, "mlp", 0.1, False, 9.9, uid=uid))
    # one user, many jobs, claiming mlp runs 100x slower spread
    liar = [report(100 + i, "mlp", 0.1, False, 0.1, uid=666) for i in range(50)]
    assert refit(honest + liar, 0.9, 1.1) == 0.9
    # ... who alone decides a model only they ran (the median of one user)
    alone = [r for r in honest if r.model == "vgg"] + [
        report(200, "own", 0.1, True, 10.0, uid=666),
        *(report(201 + i, "own", 0.1, False, 0.1, uid=666) for i in range(5)),
    ]
    assert refit(alone, 0.9, 1.1) != 0.9


def test_merge_keeps_the_newest_report_of_each_run_and_at_most_the_newest_reports() -> None:
    first = report(1, "vgg", 0.8, True, 10.0, at=NOW)
    again = replace(first, speed=11.0, at=NOW + 5)
    requeued = replace(first, restart_count=1, at=NOW + 6)
    assert merge([first], [again, requeued]) == (again, requeued)
    many = [report(i, "mlp", 0.1, True, 1.0, at=NOW + i) for i in range(1, MAX_REPORTS + 11)]
    kept = merge(many[:20], many[20:])
    assert len(kept) == MAX_REPORTS and kept[0].job_id == 11 and kept[-1].job_id == MAX_REPORTS + 10


def cluster() -> ClusterState:
    return ClusterState.from_nodes([NodeView(f"node{i}", 4, 0, "a100" if i < 3 else "v100") for i in (1, 2, 3, 4)])


def test_a_pass_reports_the_running_jobs_with_a_skew_a_speed_and_their_run() -> None:
    views = [
        JobView(1, 4, 0.0, JobStatus.RUNNING, skew=0.8, allocation=(("node1", 4),)),
        JobView(2, 4, 0.0, JobStatus.RUNNING, skew=0.8, allocation=(("node1", 2), ("node2", 2))),  # spread
        JobView(3, 6, 0.0, JobStatus.RUNNING, skew=0.1, allocation=(("node1", 4), ("node2", 2))),  # 2 nodes: fewest
        JobView(4, 2, 0.0, JobStatus.RUNNING, skew=0.1, allocation=(("node2", 1), ("node3", 1))),  # two types
        JobView(5, 2, 0.0, JobStatus.RUNNING, allocation=(("node1", 2),)),  # no skew
        JobView(6, 2, 0.0, JobStatus.PENDING, skew=0.1),
        JobView(7, 2, 0.0, JobStatus.RUNNING, skew=0.1, allocation=(("node1", 2),)),  # no speed
        JobView(8, 2, 0.0, JobStatus.RUNNING, skew=0.1, allocation=(("node1", 2),)),  # no run (no profile, no uid)
    ]
    runs = {i: (3, 1000 + i, "p") for i in range(1, 8)}
    speeds = {i: float(i) for i in (1, 2, 3, 4, 5, 6, 8)}
    got = reports_of(views, cluster(), runs=runs, speeds=speeds, now=NOW)
    assert [(r.job_id, r.model, r.consolidated, r.speed, r.uid, r.restart_count) for r in got] == [
        (1, "p on a100", True, 1.0, 1001, 3),
        (2, "p on a100", False, 2.0, 1002, 3),
        (3, "p on a100", True, 3.0, 1003, 3),
        (4, "p on a100+v100", False, 4.0, 1004, 3),
    ]


def test_the_store_keeps_the_reports_and_drops_a_bad_row_alone(tmp_path: Path) -> None:
    store = Store(tmp_path)
    reports = merge((), two_models())
    store.save([], placements=reports)
    store.close()
    assert Store(tmp_path).load_placements() == reports
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute("UPDATE placements SET speed = -1 WHERE job_id = 2")
    assert [r.job_id for r in Store(tmp_path).load_placements()] == [1, 3, 4]
    # a database of a daemon before the table: read-only, no reports; opened for writing, it gains the table
    older = tmp_path / "older"
    older.mkdir()
    with sqlite3.connect(older / DB_NAME) as db:
        db.execute("CREATE TABLE jobs (job_id INTEGER PRIMARY KEY, first_seen REAL, waiting_since REAL)")
    assert Store(older, read_only=True).load_placements() == ()
    assert Store(older).load_placements() == ()


# ---------------------------------------------------------------------------------------------- the daemon

PROFILES = {"vgg@a100": 0.8, "mlp@a100": 0.1, "big@v100": 0.6}


def skew_of(marker: JobMarker, gpus: int) -> float | None:
    return PROFILES.get(marker.profile or "")


def scene(busy: tuple[list[Job], list[Node]]) -> tuple[list[Job], list[Node]]:
    """The captured busy cluster with node1 and node2's 8 a100 split between four 2-GPU jobs: vgg and mlp, each
    once on one node and once spread over both; and a 4-GPU job of skew 0.6 waiting for v100 (node3, node4 idle)."""
    jobs, nodes = busy
    running = next(j for j in jobs if j.job_id == 24)
    waiting = next(j for j in jobs if j.job_id == 25)
    mark = MARK.format(n=2)
    scene_jobs = [
        replace(
            running,
            job_id=job_id,
            name=f"{profile.split('@')[0]}-{job_id}",
            user_id=ME,
            nodes=where,
            node_count=len(where),
            gpus=GpuCounts.of({"a100": 2}),
            comment=f"{mark},profile={profile}",
        )
        for job_id, profile, where in (
            (30, "vgg@a100", ("node1",)),
            (31, "vgg@a100", ("node1", "node2")),
            (32, "mlp@a100", ("node2",)),
            (33, "mlp@a100", ("node1", "node2")),
        )
    ]
    big = replace(
        waiting,
        partition="gpu-v100",
        gpus=GpuCounts.of({"v100": 4}),
        comment=MARK.format(n=4).replace("gpu_type=a100", "gpu_type=v100") + ",profile=big@v100",
    )
    others = [j for j in jobs if j.job_id not in (24, 25)]
    return [*scene_jobs, big, *others], nodes


SPEEDS = {30: 10.0, 31: 4.0, 32: 10.0, 33: 9.8}  # EST mini-batches per second per process


def progress(root: Path, jobs: list[Job]) -> None:
    for job in jobs:
        if job.job_id in SPEEDS:
            job_dir = JobDir.of(root, job.name, job.job_id).prepare()
            # 2 ESTs on 2 processes: steps per second = per-process speed
            job_dir.record_progress(Progress(40, NOW, SPEEDS[job.job_id], 2, job.restart_count, 0, ("a100",), 2))


def daemon_of(tmp_path: Path, jobs: list[Job], nodes: list[Node], *, refit_on: bool = True) -> Daemon:
    cfg = config(tmp_path, tiresias={"pack_limit": 0.9, "refit_pack_limit": refit_on})
    daemon, _ = make(cfg, FakeSlurm(jobs, nodes), at(start_of(jobs, 30), 60))
    daemon.skew_lookup = skew_of
    return daemon


def places(daemon: Daemon) -> list[Place]:
    return [a for a in daemon.run_pass().actions if isinstance(a, Place)]


def test_the_daemon_refits_packlimit_from_the_jobs_reports_and_places_with_it(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    jobs, nodes = scene(busy)
    progress(tmp_path / "jobs", jobs)
    daemon = daemon_of(tmp_path, jobs, nodes)
    assert daemon.pack_limit == 0.9
    placed = places(daemon)
    # vgg runs 2.5x as fast on one node, mlp as fast spread: PACKLIMIT lands between their skews, and the waiting
    # job of skew 0.6 (under the configured 0.9) is consolidated in the same pass
    assert daemon.pack_limit == pytest.approx(0.45)
    assert daemon.policy.options.pack_limit == pytest.approx(0.45)
    assert [(p.job_id, p.num_nodes) for p in placed] == [(25, 1)] and "PACKLIMIT 0.45" in placed[0].reason
    state = json.loads((tmp_path / STATE_NAME).read_text())
    assert state["pack_limit"] == pytest.approx(0.45) and state["placement_reports"] == 4
    # a restarted daemon starts from the reports it kept, before any pass
    daemon.store.close()
    again = daemon_of(tmp_path, jobs, nodes)
    assert again.pack_limit == pytest.approx(0.45) and again.policy.options.pack_limit == pytest.approx(0.45)


def test_without_the_refit_or_the_reports_the_configured_packlimit_stands(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    jobs, nodes = scene(busy)
    progress(tmp_path / "off" / "jobs", jobs)
    off = daemon_of(tmp_path / "off", jobs, nodes, refit_on=False)
    assert places(off) == [] and off.pack_limit == 0.9
    with sqlite3.connect(tmp_path / "off" / DB_NAME) as db:
        assert db.execute("SELECT COUNT(*) FROM placements").fetchone() == (0,)
    # the reports of another user's directory, or of an earlier run, are not the job's
    stale = tmp_path / "stale"
    progress(stale / "jobs", [replace(j, restart_count=j.restart_count + 1) for j in jobs])
    daemon = daemon_of(stale, jobs, nodes)
    assert places(daemon) == [] and daemon.pack_limit == 0.9
