"""The daemon under tiresias-las+easyscale: each elastic job's speed model (C_i corrected by its telemetry, Role 3's
observation of the last grow) reaches the policy, and its decisions become resizes that keep the job's GPU type."""

from __future__ import annotations

import os
import sqlite3
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

import slurm_plugin.daemon as daemon_module
from hpc_elastic.jobdir import JobDir
from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.slurm import GpuCounts, Job, Node
from slurm_plugin.actions import Resize
from slurm_plugin.easyscale import ScaleOutWatch, estimated_capability, job_gpus, observe_grow, watch_grow
from slurm_plugin.store import Store
from tests.unit.plugin.conftest import at, config, marked, start_of
from tests.unit.plugin.test_daemon import FakeSlurm, make
from tests.unit.plugin.test_telemetry import record

ME = os.getuid()
ELASTIC = "hpc-elastic:v=1,workers=8,min=2,max=8,unit=gpu,backend=torch"


def test_estimated_capability_is_corrected_by_what_the_job_observed() -> None:
    assert estimated_capability(("a100", "v100"), {}) == {"a100": 1.0, "v100": 1.0}
    # the observed type takes its value, the other keeps the estimate in the observed unit
    assert estimated_capability(("a100", "v100"), {"a100": 30.0}) == pytest.approx({"a100": 30.0, "v100": 30.0})
    both = estimated_capability(("a100", "v100"), {"a100": 30.0, "v100": 10.0})
    assert both == pytest.approx({"a100": 30.0, "v100": 10.0})
    # within the companion's threshold (10 %) the estimate stays: 1.05 observed against 1.0 estimated
    near = estimated_capability(("a100", "v100"), {"a100": 1.05, "k80": 3.0})
    assert near == pytest.approx({"a100": 1.0, "v100": 1.05})
    with pytest.raises(ValueError, match="no GPU type"):
        estimated_capability((), {})


def _v100_job(jobs: list[Job], gpus: int, restart_count: int) -> Job:
    """Job 24 of the captured output as job 30, an elastic job of 8 ESTs (2..8 GPUs) on ``gpus`` v100 GPUs."""
    job = next(j for j in jobs if j.job_id == 24)
    nodes = ("node3",) if gpus <= 4 else ("node3", "node4")
    return replace(
        job,
        job_id=30,
        name="es",
        user_id=ME,
        comment=ELASTIC,
        partition="gpu-v100",
        gpus=GpuCounts.of({"v100": gpus}),
        nodes=nodes,
        restart_count=restart_count,
    )


def _nodes(nodes: list[Node], used: dict[str, int]) -> list[Node]:
    return [
        replace(node, gpus_allocated=GpuCounts.of({"v100": used[node.name]})) if node.name in used else node
        for node in nodes
    ]


def test_an_elastic_job_grows_by_its_plan_and_falls_back_when_the_grow_did_not_pay(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """Job 24 (rigid, 8 a100) is left alone; job "es" (8 ESTs on 2 v100, 6 v100 idle) grows by Role 2's proposals
    to 8 v100 and stays on v100. Once it reports from its new run a throughput below the one before (Eq. 1d with
    the observed C_i: 8 ESTs / (4 / 10) = 20 on 2 GPUs, 8 / (1 / 2) = 16 on 8), Role 3 returns it to 2 GPUs."""
    jobs, nodes = busy
    rigid = marked(next(j for j in jobs if j.job_id == 24))
    es = replace(_v100_job(jobs, 2, 0), job_id=30)
    cfg = config(
        tmp_path,
        policy="tiresias-las+easyscale",
        resize={"enabled": True},
        preemption={"min_run_time_s": 0},
    )
    root = tmp_path / "jobs"
    job_dir = JobDir.of(root, es.name, es.job_id).prepare()
    record(job_dir, 0, (("v100", 10.0),))
    fake = FakeSlurm([rigid, es], _nodes(nodes, {"node3": 2}))
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 600))
    report = daemon.run_pass()
    assert report.observation is not None and report.decision is not None
    profile = next(v.scaling for v in report.observation.jobs if v.job_id == es.job_id)
    assert isinstance(profile, EstProfile) and profile.ests == 8
    assert dict(profile.capability) == pytest.approx({"a100": 10.0, "v100": 10.0})
    assert next(v.scaling for v in report.observation.jobs if v.job_id == 24) is None  # rigid: no model
    assert [(r.job_id, r.gpus) for r in report.decision.resizes] == [(es.job_id, 8)]
    assert all(name in {"node3", "node4"} for r in report.decision.resizes for name, _ in r.allocation)
    (grow,) = [a for a in report.actions if isinstance(a, Resize)]
    assert (grow.job_id, grow.old_gpus, grow.new_gpus, grow.gpu_type) == (es.job_id, 2, 8, "v100")
    # the job checkpoints, is requeued, set to 8 tasks and runs again on 8 v100; it then reports C_v100 = 2
    later = replace(_v100_job(jobs, 8, 1), start_time=start_of(jobs, 24) + timedelta(seconds=700))
    record(job_dir, 1, (("v100", 2.0),))
    fake._jobs = [rigid, later]  # what squeue shows now
    fake._nodes = _nodes(nodes, {"node3": 4, "node4": 4})
    clock.now = at(start_of(jobs, 24), 1400)
    report = daemon.run_pass()
    assert report.decision is not None
    assert [(r.job_id, r.gpus) for r in report.decision.resizes] == [(es.job_id, 2)]
    (back,) = [a for a in report.actions if isinstance(a, Resize)]
    assert (back.old_gpus, back.new_gpus, back.gpu_type) == (8, 2, "v100")


def test_role_3_watches_a_grow_until_the_job_reports_from_its_new_run(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, _ = busy
    before = _v100_job(jobs, 2, 3)
    profile = EstProfile((1,), (1.0,), capability=(("v100", 10.0),), ests=8, base_type="v100")
    watch = watch_grow(profile, before)
    assert watch.previous == (("v100", 2),) and watch.before == pytest.approx(20.0) and watch.restart_count == 3
    assert job_gpus(before) == (("v100", 2),)
    after = _v100_job(jobs, 8, 4)
    assert (
        observe_grow(watch, profile, before, reported=True, now=10.0).scale_out is None
    )  # still the run before the grow
    assert (
        observe_grow(watch, profile, after, reported=False, now=10.0).scale_out is None
    )  # no report from the new run yet
    seen = observe_grow(watch, profile, after, reported=True, now=10.0).scale_out
    assert seen is not None and seen.after == pytest.approx(80.0) and not seen.worse
    slower = replace(profile, capability=(("v100", 2.0),))
    observed = observe_grow(watch, slower, after, reported=True, now=10.0)
    worse = observed.scale_out
    assert worse is not None and worse.worse and worse.previous_gpus == 2
    # the fallback's run (back on 2 GPUs) says nothing about the grow: the observation stays
    back = _v100_job(jobs, 2, 5)
    assert observe_grow(observed, profile, back, reported=True, now=20.0) == observed
    with pytest.raises(ValueError, match="finite"):
        replace(watch, after=float("nan"))
    with pytest.raises(ValueError, match="previous GPUs"):
        replace(watch, previous=(("v100", 0),))


def test_a_restarted_daemon_goes_on_watching_a_grow_and_falls_back(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """Role 3's record is in the state store: the daemon that grew job "es" to 8 v100 stops; a new daemon on the
    same state directory sees the grown run report a throughput below the one before and returns the job to its
    2 GPUs. The fallback's own run (2 GPUs again, the same C_i as before the grow) does not lift it."""
    jobs, nodes = busy
    rigid = marked(next(j for j in jobs if j.job_id == 24))
    es = _v100_job(jobs, 2, 0)
    cfg = config(tmp_path, policy="tiresias-las+easyscale", resize={"enabled": True}, preemption={"min_run_time_s": 0})
    job_dir = JobDir.of(tmp_path / "jobs", es.name, es.job_id).prepare()
    record(job_dir, 0, (("v100", 10.0),))
    fake = FakeSlurm([rigid, es], _nodes(nodes, {"node3": 2}))
    first, clock = make(cfg, fake, at(start_of(jobs, 24), 600))
    (grow,) = [a for a in first.run_pass().actions if isinstance(a, Resize)]
    assert (grow.old_gpus, grow.new_gpus) == (2, 8)
    first.store.close()  # the daemon stops
    assert Store(tmp_path, read_only=True).load_grows() == {
        es.job_id: ScaleOutWatch(20.0, (("v100", 2),), 0)
    }  # 8 ESTs on 2 v100 of C_i 10: 4 ESTs a GPU, 2.5 steps/s, 20 ESTs/s
    later = replace(_v100_job(jobs, 8, 1), start_time=start_of(jobs, 24) + timedelta(seconds=700))
    record(job_dir, 1, (("v100", 2.0),))
    fake._jobs = [rigid, later]
    fake._nodes = _nodes(nodes, {"node3": 4, "node4": 4})
    second, clock = make(cfg, fake, at(start_of(jobs, 24), 1400))
    report = second.run_pass()
    (back,) = [a for a in report.actions if isinstance(a, Resize)]
    assert (back.job_id, back.old_gpus, back.new_gpus, back.gpu_type) == (es.job_id, 8, 2, "v100")
    assert second.store.load_grows()[es.job_id].after == pytest.approx(16.0)
    # the job runs again on 2 v100 and reports what it did before the grow: it stays there
    again = replace(_v100_job(jobs, 2, 2), start_time=start_of(jobs, 24) + timedelta(seconds=1500))
    record(job_dir, 2, (("v100", 10.0),))
    fake._jobs = [rigid, again]
    fake._nodes = _nodes(nodes, {"node3": 2})
    clock.now = at(start_of(jobs, 24), 1600)
    report = second.run_pass()
    assert not [a for a in report.actions if isinstance(a, Resize)]
    assert report.decision is not None and not report.decision.resizes


def test_grow_records_survive_an_old_store_and_bad_rows_are_dropped(tmp_path: Path) -> None:
    """A database written before the grows table opens (the table is added); a row that does not make a record is
    left out alone."""
    db = sqlite3.connect(tmp_path / "state.sqlite3")
    with db:
        db.execute("CREATE TABLE jobs (job_id INTEGER PRIMARY KEY, first_seen REAL, waiting_since REAL)")
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.close()
    assert Store(tmp_path, read_only=True).load_grows() == {}
    store = Store(tmp_path)
    watch = ScaleOutWatch(20.0, (("a100", 2), ("v100", 1)), 3, 12.5)
    store.save([], grows={7: watch, 8: ScaleOutWatch(1.0, (), 0)})
    with store._db:
        store._db.execute(
            "INSERT INTO grows (job_id, before, previous, restart_count, after) VALUES (9, 'x', 'v100:2', 1, NULL)"
        )
        store._db.execute(
            "INSERT INTO grows (job_id, before, previous, restart_count, after) VALUES (10, 1.0, 'v100:0', 1, NULL)"
        )
        store._db.execute(
            "INSERT INTO grows (job_id, before, previous, restart_count, after) VALUES (11, 1.0, 'v100:2', -1, NULL)"
        )
    assert store.load_grows() == {7: watch, 8: ScaleOutWatch(1.0, (), 0)}
    store.save([], grows={})
    assert store.load_grows() == {}


def test_role_3_stamps_the_fallback_and_counts_failures_in_a_row(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, _ = busy
    profile = EstProfile((1,), (1.0,), capability=(("v100", 10.0),), ests=8, base_type="v100")
    slower = replace(profile, capability=(("v100", 2.0),))
    before, after = _v100_job(jobs, 2, 3), _v100_job(jobs, 8, 4)
    watch = watch_grow(profile, before)
    assert watch.earlier == 0 and watch.at is None and watch.failures == 0
    worse = observe_grow(watch, slower, after, reported=True, now=500.0)
    assert worse.at == 500.0 and worse.grown == (("v100", 8),) and worse.failures == 1
    seen = worse.scale_out
    assert seen is not None and seen.at == 500.0 and seen.limits == (("v100", 2),)
    assert observe_grow(worse, slower, after, reported=True, now=510.0).at == 500.0  # the first pass that saw it
    assert observe_grow(worse, profile, after, reported=True, now=520.0).at is None  # it pays after all
    # the next grow of the job carries the failure: a second one in a row doubles the hold
    again = watch_grow(profile, _v100_job(jobs, 2, 5), worse)
    assert again.earlier == 1 and again.scale_out is None and again.failures == 1
    twice = observe_grow(again, slower, _v100_job(jobs, 8, 6), reported=True, now=4000.0)
    assert twice.failures == 2 and twice.scale_out is not None and twice.scale_out.hold(1800.0) == 3600.0
    paid = observe_grow(again, profile, _v100_job(jobs, 8, 6), reported=True, now=4000.0)
    assert paid.failures == 0 and watch_grow(profile, before, paid).earlier == 0  # a grow that paid ends the row
    with pytest.raises(ValueError, match="fallback time"):
        replace(watch, at=float("nan"))
    with pytest.raises(ValueError, match="earlier failures"):
        replace(watch, earlier=-1)
    with pytest.raises(ValueError, match="grown GPUs"):
        replace(watch, grown=(("v100", 0),))


def test_the_store_keeps_the_fallback_across_a_reopen_and_upgrades_an_older_grows_table(tmp_path: Path) -> None:
    """The fallback time, the failures in a row and the GPUs after survive a reopen; a ``grows`` table written
    before those columns gains them when a daemon opens it (its rows keep their values, the new ones their
    defaults), and a read-only view of it reads the defaults."""
    db = sqlite3.connect(tmp_path / "state.sqlite3")
    with db:
        db.execute("CREATE TABLE jobs (job_id INTEGER PRIMARY KEY, first_seen REAL, waiting_since REAL)")
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute(
            "CREATE TABLE grows (job_id INTEGER PRIMARY KEY, before REAL NOT NULL, previous TEXT NOT NULL, "
            "restart_count INTEGER NOT NULL, after REAL)"
        )
        db.execute("INSERT INTO grows VALUES (7, 20.0, 'v100:2', 3, 16.0)")
    db.close()
    old = ScaleOutWatch(20.0, (("v100", 2),), 3, 16.0)
    assert Store(tmp_path, read_only=True).load_grows() == {7: old}
    store = Store(tmp_path)
    assert store.load_grows() == {7: old}
    columns = {row[1] for row in store._db.execute("PRAGMA table_info(grows)")}
    assert {"fallen_at", "earlier", "grown"} <= columns
    fell = ScaleOutWatch(20.0, (("v100", 2),), 3, 16.0, at=1400.0, earlier=2, grown=(("a100", 1), ("v100", 4)))
    store.save([], grows={7: fell, 8: old})
    store.close()
    reopened = Store(tmp_path)
    assert reopened.load_grows() == {7: fell, 8: old}
    with reopened._db:
        reopened._db.execute("UPDATE grows SET earlier = -3 WHERE job_id = 8")
    assert reopened.load_grows() == {7: fell}  # a bad row is left out alone


def test_a_restarted_daemon_holds_the_cap_until_it_lapses_then_grows_again(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """Job "es" grows to 8 v100 at t = 600 and reports a slower run at 1400: it falls back to 2 (the store stamps
    1400). With 6 v100 idle it stays on 2 while the hold (600 s) lasts, across a daemon restart, and grows to 8 again
    once it lapsed; the new grow carries one failure in a row."""
    jobs, nodes = busy
    rigid = marked(next(j for j in jobs if j.job_id == 24))
    cfg = config(
        tmp_path,
        policy="tiresias-las+easyscale",
        resize={"enabled": True, "fallback_hold_s": 600},
        preemption={"min_run_time_s": 0},
    )
    es = _v100_job(jobs, 2, 0)
    job_dir = JobDir.of(tmp_path / "jobs", es.name, es.job_id).prepare()
    record(job_dir, 0, (("v100", 10.0),))
    fake = FakeSlurm([rigid, es], _nodes(nodes, {"node3": 2}))
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 600))
    (grow,) = [a for a in daemon.run_pass().actions if isinstance(a, Resize)]
    assert (grow.old_gpus, grow.new_gpus) == (2, 8)
    record(job_dir, 1, (("v100", 2.0),))
    fake._jobs = [rigid, replace(_v100_job(jobs, 8, 1), start_time=start_of(jobs, 24) + timedelta(seconds=700))]
    fake._nodes = _nodes(nodes, {"node3": 4, "node4": 4})
    clock.now = at(start_of(jobs, 24), 1400)
    (back,) = [a for a in daemon.run_pass().actions if isinstance(a, Resize)]
    assert (back.old_gpus, back.new_gpus) == (8, 2)
    fell = daemon.store.load_grows()[es.job_id]
    assert fell.at == clock.now and fell.failures == 1 and fell.grown == (("v100", 8),)
    daemon.store.close()  # the daemon stops
    # back on 2 v100, reporting what it did before the grow; 6 v100 idle
    record(job_dir, 2, (("v100", 10.0),))
    fake._jobs = [rigid, replace(_v100_job(jobs, 2, 2), start_time=start_of(jobs, 24) + timedelta(seconds=1500))]
    fake._nodes = _nodes(nodes, {"node3": 2})
    second, clock = make(cfg, fake, at(start_of(jobs, 24), 1900))
    report = second.run_pass()
    assert report.decision is not None and not report.decision.resizes  # 500 s after the fallback: held
    assert second.store.load_grows()[es.job_id] == fell
    clock.now = at(start_of(jobs, 24), 2001)  # 601 s after: the cap lapsed
    report = second.run_pass()
    (regrow,) = [a for a in report.actions if isinstance(a, Resize)]
    assert (regrow.old_gpus, regrow.new_gpus, regrow.gpu_type) == (2, 8, "v100")
    watch = second.store.load_grows()[es.job_id]
    assert watch.earlier == 1 and watch.after is None and watch.restart_count == 2


def test_a_speed_model_that_fails_leaves_out_its_job_not_the_pass(
    tmp_path: Path,
    busy: tuple[list[Job], list[Node]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job whose speed model cannot be built from its figures (a ValueError or an overflow in the planner's
    arithmetic) is left without a model, logged once; the pass goes on and orders both jobs."""
    jobs, nodes = busy
    rigid = marked(next(j for j in jobs if j.job_id == 24))
    es = _v100_job(jobs, 2, 0)
    cfg = config(tmp_path, policy="tiresias-las+easyscale", resize={"enabled": True})
    fake = FakeSlurm([rigid, es], _nodes(nodes, {"node3": 2}))
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 600))

    def overflowing(*_args: object, **_kwargs: object) -> EstProfile:
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(daemon_module, "job_profile", overflowing)
    for _ in range(2):
        report = daemon.run_pass()
        assert report.observation is not None and report.decision is not None
        assert next(v.scaling for v in report.observation.jobs if v.job_id == es.job_id) is None
        assert {v.job_id for v in report.observation.jobs} == {24, es.job_id}
        clock.now += 30
    logged = [r.getMessage() for r in caplog.records if "no speed model" in r.getMessage()]
    assert len(logged) == 1 and f"job {es.job_id} left out" in logged[0] and "infinity" in logged[0]
