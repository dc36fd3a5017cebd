"""Elastic resize: which size (divisors of the logical workers), when (others wait / GPUs idle), and how
(checkpoint with stop reason ``resize`` -> requeue -> NumTasks/NumCPUs on the pending job)."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np

from hpc_elastic.collective import Backend
from hpc_elastic.jobdir import StopNotice, StopReason
from hpc_elastic.launch.spec import JobMarker, MarkerUnit
from hpc_elastic.policy import Decision, JobStatus, JobView, NodeView
from hpc_elastic.slurm import GpuCounts, Job, JobState, Node
from slurm_plugin.actions import Resize, SetSize, elastic_sizes, followup_actions, plan, resize_actions
from slurm_plugin.observe import FORGET_AFTER_S, Observation, Selection, observe
from slurm_plugin.store import JobRecord, Store
from tests.unit.plugin.conftest import at, config, marked, start_of
from tests.unit.plugin.test_daemon import FakeSlurm, make

ELASTIC = {
    "resize": {"enabled": True},
    "preemption": {"enabled": False, "min_run_time_s": 30},
    "tiresias": {"thresholds": [100.0]},
}


def test_sizes_are_every_count_up_to_the_logical_workers() -> None:
    view = JobView(1, 4, 0.0, min_gpus=2, max_gpus=6)
    assert elastic_sizes(view) == [2, 3, 4, 5, 6]  # 4 and 5 do not divide N = 6: the ESTs run anyway
    assert elastic_sizes(JobView(1, 4, 0.0)) == []  # not elastic


def test_elastic_job_shrinks_for_a_waiting_job(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    jobs = [marked(j, elastic_min=2) if j.job_id == 24 else j for j in jobs]  # 8 logical workers, 2..8 GPUs
    cfg = config(tmp_path, **ELASTIC)
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)
    fake = FakeSlurm(jobs, nodes)
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    report = daemon.run_pass()
    resizes = [a for a in report.actions if isinstance(a, Resize)]
    # preemption is off, so job 25 (Q1, 1 GPU) can only start if job 24 (Q2) gives up GPUs: 8 -> 7, as few as
    # will do (7 does not divide its 8 logical workers: its ESTs run on any number of processes)
    assert [(r.job_id, r.old_gpus, r.new_gpus) for r in resizes] == [(24, 8, 7)]
    assert "job(s) 25 wait" in resizes[0].reason
    assert fake.calls[-1] == ("cancel", ([24], "USR1", True))
    notice = StopNotice.decode(fake.job(24).admin_comment)  # the reason, in a field only Slurm admins may set
    assert notice is not None and notice.reason is StopReason.RESIZE
    assert not list((tmp_path / "jobs" / "fill|a100-24" / "control").iterdir())  # the daemon wrote nothing there
    record = Store(tmp_path).load()[24]
    assert (record.stop_kind, record.resize_to, record.resize_set) == ("resize", 7, 0)

    clock.now += 2
    assert not [a for a in daemon.run_pass().actions if isinstance(a, Resize)]  # no second resize in flight
    # the wrapper checkpointed and requeued the job: it waits for its BeginTime with the old size
    fake._jobs = [
        replace(j, state=JobState.PENDING, restart_count=1, start_time=None, nodes=(), pending_reason="BeginTime")
        if j.job_id == 24
        else j
        for j in fake._jobs
    ]
    clock.now += 2
    report = daemon.run_pass()
    sizes = [a for a in report.actions if isinstance(a, SetSize)]
    assert [(s.job_id, s.tasks, s.cpus) for s in sizes] == [(24, 7, 7)]  # 2 CPUs for 8 tasks -> 1 per task
    # the GPU request follows the tasks (Slurm keeps the submission's otherwise), of the job's type
    fields = {"NumTasks": 7, "NumCPUs": 7, "NumNodes": "1-7", "TresPerJob": "gres:gpu:a100:7"}
    assert ("update", (24, fields)) in fake.calls
    record = Store(tmp_path).load()[24]
    assert (record.stop_kind, record.resize_to, record.resize_set) == ("", 7, 7)
    clock.now += 2
    assert not [a for a in daemon.run_pass().actions if isinstance(a, SetSize)]  # set once
    # it runs again with 7 GPUs: the resize is over
    fake._jobs = [
        replace(
            j,
            state=JobState.RUNNING,
            start_time=j.submit_time,
            gpus=GpuCounts.of({"a100": 7}),
            nodes=("node1", "node2"),
            pending_reason="",
        )
        if j.job_id == 24
        else j
        for j in fake._jobs
    ]
    fake._nodes = [
        replace(n, gpus_allocated=GpuCounts.of({"a100": 4 if n.name == "node1" else 3}))
        if n.name in ("node1", "node2")
        else n
        for n in nodes
    ]
    clock.now += 2
    daemon.run_pass()
    record = Store(tmp_path).load()[24]
    assert (record.resize_to, record.resize_set) == (0, 0) and record.attained_service > 8 * 60


def _one_node_obs(pending_gpus: int | None) -> tuple[Observation, Decision]:
    job = Job(
        job_id=7,
        name="el",
        user="u",
        state=JobState.RUNNING,
        gpus=GpuCounts.of({"a100": 2}),
        cpus=2,
        comment="hpc-elastic:v=1,workers=4,min=2,max=4,unit=gpu,backend=torch",
    )
    views = [
        JobView(7, 2, 0.0, status=JobStatus.RUNNING, run_time=600.0, allocation=(("node1", 2),), min_gpus=2, max_gpus=4)
    ]
    slurm_jobs = {7: job}
    records = {7: JobRecord(7, 0.0, 0.0)}
    if pending_gpus is not None:
        views.append(JobView(8, pending_gpus, 1.0))
        slurm_jobs[8] = replace(job, job_id=8, state=JobState.PENDING, comment="")
        records[8] = JobRecord(8, 1.0, 1.0)
    marker = JobMarker(workers=4, min=2, max=4, unit=MarkerUnit.GPU, backend=Backend.TORCH)
    obs = Observation(
        700.0, tuple(views), (NodeView("node1", 4, 2, "a100"),), slurm_jobs, {7: marker, 8: None}, records, ()
    )
    order = np.arange(len(views), dtype=np.int64)
    return obs, Decision((), (), (), order, None)


def test_elastic_job_grows_into_idle_gpus_only_when_nothing_waits(tmp_path: Path) -> None:
    cfg = config(tmp_path, resize={"enabled": True})
    obs, decision = _one_node_obs(None)
    grow = resize_actions(obs, decision, cfg)
    assert [(r.job_id, r.old_gpus, r.new_gpus) for r in grow] == [(7, 2, 4)] and "2 a100 GPU(s) idle" in grow[0].reason
    obs, decision = _one_node_obs(3)  # a 3-GPU job waits: no growth (and 7 cannot shrink below its minimum)
    assert resize_actions(obs, decision, cfg) == []
    assert resize_actions(*_one_node_obs(None), config(tmp_path)) == []  # resize disabled (the default)
    busy_obs = replace(obs, records={**obs.records, 7: replace(obs.records[7], stop_kind="preempt")})
    assert not [a for a in plan(busy_obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit) if isinstance(a, Resize)]


def test_requeue_follows_ack_or_grace(tmp_path: Path) -> None:
    cfg = config(tmp_path, preemption={"grace_s": 30, "requeue_wait_s": 5})
    obs, _ = _one_node_obs(None)
    obs = replace(
        obs, managed={7: obs.slurm_jobs[7]}, records={7: replace(obs.records[7], stop_kind="preempt", stop_at=690.0)}
    )
    assert followup_actions(obs, {}, cfg) == []  # 10 s after the request, no ack: wait
    assert followup_actions(obs, {7: 697.0}, cfg) == []  # acknowledged 3 s ago: the wrapper requeues itself
    (late,) = followup_actions(obs, {7: 694.0}, cfg)
    assert late.job_id == 7 and "did not requeue itself" in late.reason
    (grace,) = followup_actions(replace(obs, now=721.0), {}, cfg)
    assert "no checkpoint acknowledgement within 30s" in grace.reason


def test_store_reads_a_database_of_an_older_daemon(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "state.sqlite3")
    db.execute(
        "CREATE TABLE jobs (job_id INTEGER PRIMARY KEY, first_seen REAL, waiting_since REAL, "
        "banked_service REAL, banked_exec REAL, run_start REAL, run_gpus INTEGER NOT NULL, run_exec REAL, "
        "first_start REAL, queue INTEGER NOT NULL, preemptions INTEGER NOT NULL, last_preempt REAL, "
        "placement TEXT NOT NULL)"
    )
    db.execute("INSERT INTO jobs VALUES (5, 1.0, 1.0, 120.0, 60.0, NULL, 0, 0.0, 2.0, 1, 1, 50.0, '')")
    db.commit()
    db.close()
    old = Store(tmp_path, read_only=True).load()[5]
    assert old.attained_service == 120.0 and old.stop_kind == "" and old.resize_to == 0
    store = Store(tmp_path)
    record = store.load()[5]
    store.save([replace(record, stop_kind="resize", resize_to=2)])
    again = Store(tmp_path).load()[5]
    assert (again.attained_service, again.queue, again.stop_kind, again.resize_to) == (120.0, 1, "resize", 2)


def test_a_job_missing_from_one_answer_is_not_forgotten(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    now = at(start_of(jobs, 24), 60)
    first = observe(jobs, nodes, {}, Selection(), now=now)
    records = {24: replace(first.records[24], queue=1)}
    empty = observe([], nodes, records, Selection(), now=now + 5)  # e.g. a restarting controller
    assert empty.forget == () and empty.records[24].queue == 1 and empty.records[24].missing_since == now + 5
    back = observe(jobs, nodes, empty.records, Selection(), now=now + 10)
    assert back.records[24].queue == 1 and back.records[24].missing_since is None
    gone = observe([], nodes, empty.records, Selection(), now=now + 5 + FORGET_AFTER_S)
    assert gone.forget == (24,)


def test_a_second_resize_keeps_the_cpus_per_task(tmp_path: Path) -> None:
    """Grown to 4 tasks of 1 CPU, then requeued to shrink: squeue shows the pending job with the submission's
    2 GPUs but 4 tasks and 4 CPUs (what we set). The shrink to 2 tasks asks for 2 CPUs, not 4."""
    cfg = config(tmp_path, resize={"enabled": True})
    obs, _ = _one_node_obs(None)
    pending = replace(
        obs.slurm_jobs[7], state=JobState.PENDING, gpus=GpuCounts.of({"a100": 2}), tasks=4, cpus=4, nodes=()
    )
    obs = replace(
        obs,
        slurm_jobs={**obs.slurm_jobs, 7: pending},
        managed={7: pending},
        records={7: replace(obs.records[7], resize_to=2, resize_set=0)},
    )
    (size,) = [a for a in followup_actions(obs, {}, cfg) if isinstance(a, SetSize)]
    assert (size.job_id, size.tasks, size.cpus) == (7, 2, 2)
