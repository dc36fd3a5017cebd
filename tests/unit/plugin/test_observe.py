from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from hpc_elastic.policy import Decision, JobStatus, QueueChange, QueueChangeKind
from hpc_elastic.slurm import GpuCounts, Job, JobState, Node
from hpc_elastic.slurm.parse import parse_sacct_text, parse_sinfo_json, parse_squeue_json
from slurm_plugin.observe import (
    FORGET_AFTER_S,
    PartialRead,
    Selection,
    advance,
    apply_queue_changes,
    observe,
    service_samples,
)
from tests.unit.plugin.conftest import at, marked, start_of


def test_views_of_managed_running_and_pending_jobs(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    now = at(start_of(jobs, 24), 100)
    obs = observe(jobs, nodes, {}, Selection(), now=now)
    views = {v.job_id: v for v in obs.jobs}
    assert set(views) == {24, 25}  # unmarked jobs are not managed
    run, wait = views[24], views[25]
    assert run.status is JobStatus.RUNNING and run.allocation == (("node1", 4), ("node2", 4))
    assert run.attained_service == pytest.approx(8 * 100) and run.run_time == pytest.approx(100)
    assert wait.status is JobStatus.PENDING and wait.gpus == 1 and wait.gpu_types == frozenset({"a100"})
    assert wait.waiting_time == 0.0  # δ_J counts from the job's first run
    assert [(n.name, n.free_gpus) for n in obs.nodes] == [("node1", 0), ("node2", 0), ("node3", 4), ("node4", 4)]
    assert {v.job_id for v in observe(jobs, nodes, {}, Selection(manage_all=True), now=now).jobs} == {24, 25}
    named = observe(jobs, nodes, {}, Selection(name_pattern="^wait"), now=now)
    assert [v.job_id for v in named.jobs] == [25]


def test_attained_service_accumulates_across_a_requeue(slurm_data: Path) -> None:
    before = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue.json").read_text())}
    after = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue_after_requeue.json").read_text())}
    start = before[1].start_time
    assert start is not None and after[1].state.is_pending and after[1].restart_count == 1
    rec = advance(None, before[1], at(start, 10))
    assert rec.attained_service == pytest.approx(2 * 10)
    rec = advance(rec, after[1], at(start, 14))  # requeued: the seen run is banked, waiting starts
    assert rec.run_start is None and rec.attained_service == pytest.approx(20) and rec.waiting_since == at(start, 14)
    second = replace(before[1], start_time=start + timedelta(seconds=30))
    rec = advance(rec, second, at(start, 40))  # second run: 10 s so far
    assert rec.attained_service == pytest.approx(20 + 2 * 10) and rec.executed_time == pytest.approx(20)
    assert rec.first_start == start.timestamp()


def test_waiting_time_adds_up_over_requeues_until_a_promotion(slurm_data: Path) -> None:
    """δ_J sums the waiting spells since the job first ran; only a promotion resets it (Tiresias §3.2.3)."""
    before = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue.json").read_text())}
    after = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue_after_requeue.json").read_text())}
    start = before[1].start_time
    assert start is not None
    waiting = replace(after[1], eligible_time=None, pending_reason="Priority")
    nodes = parse_sinfo_json((slurm_data / "sinfo_idle.json").read_text())
    assert observe([waiting], nodes, {}, Selection(), now=at(start, 5)).jobs[0].waiting_time == 0.0  # never ran
    rec = advance(None, before[1], at(start, 10))
    rec = advance(rec, after[1], at(start, 14))  # requeued: waits from 14
    rec = advance(rec, replace(before[1], start_time=start + timedelta(seconds=30)), at(start, 40))  # ran again
    rec = advance(rec, after[1], at(start, 44))  # requeued again: waits from 44
    view = observe([waiting], nodes, {1: rec}, Selection(), now=at(start, 60)).jobs[0]
    assert view.waiting_time == pytest.approx((30 - 14) + (60 - 44))
    promote = QueueChange(0, 1, 1, 0, QueueChangeKind.PROMOTE, reset=True)
    decision = Decision((), (), (promote,), np.zeros(1, dtype=np.int64), None)
    promoted = apply_queue_changes({1: rec}, decision, at(start, 60))[1]
    assert promoted.waiting_time(at(start, 90)) == 0.0 and promoted.queue == 0


def test_sinfo_lagging_behind_squeue_is_a_partial_read(slurm_data: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, _ = busy
    idle = parse_sinfo_json((slurm_data / "sinfo_idle.json").read_text())  # no GPU in use yet
    with pytest.raises(PartialRead, match="job 24"):
        observe(jobs, idle, {}, Selection(), now=at(start_of(jobs, 24), 5))
    with pytest.raises(PartialRead, match="no GPU node"):
        observe(jobs, [], {}, Selection(), now=0.0)


def test_job_sizes_from_sacct_history(slurm_data: Path) -> None:
    history = parse_sacct_text((slurm_data / "sacct_parsable2.txt").read_text())
    # job 1 ran 14 s, was requeued, then ran 60 s on 2 GPUs: both records count; jobs 3 and 4: 8 GPUs x 30 s;
    # cancelled after running: job 10 (2 GPUs x 1 s), job 21 (2 GPUs x 1 s, resized to 1 x 1 s); job 16 was
    # cancelled before it ran (0 s): no size (job 6's row has a '|' in its name and parses as UNKNOWN)
    assert sorted(service_samples(history)) == [2 * 1, 2 * 1 + 1 * 1, 2 * (14 + 60), 8 * 30, 8 * 30]


def test_job_sizes_count_every_way_a_job_ends_after_running() -> None:
    """Time-outs, failures and cancellations after running are job sizes too; a requeued job that has not ended
    yet is not (its last record is REQUEUED, or pending / running again)."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def rec(job_id: int, state: JobState, start_s: float, elapsed: int, gpus: int = 2) -> Job:
        return Job(
            job_id,
            f"j{job_id}",
            "u",
            state,
            start_time=t0 + timedelta(seconds=start_s),
            gpus=GpuCounts.of({"a100": gpus}),
            elapsed_s=elapsed,
        )

    history = [
        rec(1, JobState.COMPLETED, 0, 10),
        rec(2, JobState.TIMEOUT, 0, 20),
        rec(3, JobState.FAILED, 0, 30),
        rec(4, JobState.CANCELLED, 0, 40),
        rec(5, JobState.CANCELLED, 0, 0),  # cancelled while pending
        rec(6, JobState.REQUEUED, 0, 50),  # requeued, not ended
        rec(7, JobState.REQUEUED, 0, 5),
        rec(7, JobState.RUNNING, 100, 7),  # running again
        rec(8, JobState.REQUEUED, 0, 5),
        rec(8, JobState.OUT_OF_MEMORY, 100, 7),
    ]
    assert sorted(service_samples(history)) == sorted([2 * 10, 2 * 20, 2 * 30, 2 * 40, 2 * (5 + 7)])


def test_requeued_job_before_its_begin_time_is_not_scheduled(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    now = at(start_of(jobs, 24), 100)
    later = [
        replace(j, eligible_time=start_of(jobs, 24) + timedelta(seconds=120)) if j.job_id == 25 else j for j in jobs
    ]
    obs = observe(later, nodes, {}, Selection(), now=now)
    assert [v.job_id for v in obs.jobs] == [24] and 25 in obs.records  # still accounted, not scheduled


def test_submit_time_of_a_requeued_job_is_its_first_submission(slurm_data: Path) -> None:
    before = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue.json").read_text())}
    after = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue_after_requeue.json").read_text())}
    first, requeued = before[1].submit_time, after[1].submit_time
    assert first is not None and requeued is not None and requeued > first  # what Slurm 22.05 reports
    start = before[1].start_time
    assert start is not None
    record = advance(advance(None, before[1], at(start, 10)), after[1], at(start, 14))
    # pending again after the requeue, eligible now: the policy sees it with its first submission time
    again = replace(after[1], eligible_time=None, pending_reason="Priority")
    nodes = parse_sinfo_json((slurm_data / "sinfo_idle.json").read_text())
    views = observe([again], nodes, {1: record}, Selection(), now=at(start, 40)).jobs
    assert [v.submit_time for v in views] == [first.timestamp()]


def test_a_forged_marker_leaves_out_its_job_not_the_pass(busy: tuple[list[Job], list[Node]]) -> None:
    """``--comment='hpc-elastic:...,min=0'`` once made every pass a partial read: no action cluster-wide."""
    jobs, nodes = busy
    forged = "hpc-elastic:v=1,workers=1,min=0,max=1,unit=gpu,backend=torch"
    jobs = [replace(j, comment=forged) if j.job_id == 25 else j for j in jobs]
    obs = observe(jobs, nodes, {}, Selection(manage_all=True), now=at(start_of(jobs, 24), 100))
    assert [v.job_id for v in obs.jobs] == [24]
    assert 25 not in obs.managed and "not a count" in obs.rejected[25]


def test_a_job_field_the_policy_refuses_leaves_out_that_job_only(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    jobs = [replace(j, submit_time=None) if j.job_id == 25 else j for j in jobs]
    now = at(start_of(jobs, 24), 100)
    records = {25: replace(advance(None, next(j for j in jobs if j.job_id == 25), now), submitted=float("nan"))}
    obs = observe(jobs, nodes, records, Selection(), now=now)
    assert [v.job_id for v in obs.jobs] == [24] and "submit_time" in obs.rejected[25]


def test_removing_the_marker_for_a_while_does_not_reset_attained_service(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    now = at(start_of(jobs, 24), 100)
    first = observe(jobs, nodes, {}, Selection(), now=now)
    served = first.records[24].attained_service
    assert served > 0
    hidden = [replace(j, comment="nothing to see") if j.job_id == 24 else j for j in jobs]
    later = now + FORGET_AFTER_S * 3
    away = observe(hidden, nodes, first.records, Selection(), now=later)
    assert 24 not in away.managed and away.forget == () and away.records[24] == first.records[24]
    back = observe(jobs, nodes, away.records, Selection(), now=later + 1)
    assert back.records[24].attained_service >= served  # its run went on: more service, never a fresh start


def test_a_stop_in_flight_is_followed_up_after_the_marker_is_removed(busy: tuple[list[Job], list[Node]]) -> None:
    """Dropping the marker after a preemption must not keep the job's GPUs: the daemon still requeues it."""
    jobs, nodes = busy
    now = at(start_of(jobs, 24), 100)
    first = observe(jobs, nodes, {}, Selection(), now=now)
    stopping = {**first.records, 24: replace(first.records[24], stop_kind="preempt", stop_at=now)}
    hidden = [replace(j, comment="") if j.job_id == 24 else j for j in jobs]
    obs = observe(hidden, nodes, stopping, Selection(), now=now + 10)
    assert 24 in obs.managed and obs.records[24].stop_kind == "preempt"
    assert 24 not in {v.job_id for v in obs.jobs}  # not scheduled, only finished


def test_a_resize_in_flight_outlives_the_old_allocation_completing_after_the_requeue(slurm_data: Path) -> None:
    """After ``scontrol requeue`` squeue shows the job COMPLETING, with its old allocation and the new restart
    count: the checkpoint + requeue happened, the new size is still to be set (seen on the dev cluster: the record
    was forgotten there, and another job was resized while this one waited)."""
    before = {j.job_id: marked(j) for j in parse_squeue_json((slurm_data / "squeue.json").read_text())}
    start = before[1].start_time
    assert start is not None
    rec = advance(None, before[1], at(start, 10))
    rec = replace(rec, stop_kind="resize", stop_restarts=0, resize_to=2, resize_split="a100:1,v100:1")
    completing = replace(before[1], state=JobState.COMPLETING, restart_count=1)
    rec = advance(rec, completing, at(start, 12))
    assert (rec.stop_kind, rec.resize_to, rec.resize_split) == ("", 2, "a100:1,v100:1")
    again = replace(before[1], restart_count=1, start_time=start + timedelta(seconds=30))
    rec = advance(rec, again, at(start, 40))  # runs again: nothing in flight
    assert (rec.resize_to, rec.resize_set, rec.resize_split) == (0, 0, "")


def test_a_job_beginning_past_year_9999_waits_and_the_rest_of_the_queue_is_scheduled(slurm_data: Path) -> None:
    """A user's ``sbatch --begin=now+3000000days`` (captured) in a busy queue: the pass sees every other job, and
    the far job is not eligible."""
    busy = json.loads((slurm_data / "squeue.json").read_text())
    far = json.loads((slurm_data / "squeue_begin_far_future.json").read_text())["jobs"][0]
    far = {**far, "job_id": 99_999, "gres_detail": [], "tres_req_str": "cpu=1,mem=2000M,node=1,billing=1,gres/gpu=1"}
    jobs = parse_squeue_json(json.dumps({**busy, "jobs": [*busy["jobs"], far]}))
    (late,) = [j for j in jobs if j.job_id == 99_999]
    assert late.eligible_time is not None and late.eligible_time.year == 9999 and late.gpu_count == 1
    nodes = parse_sinfo_json((slurm_data / "sinfo_busy.json").read_text())
    now = datetime.now(UTC).timestamp()
    obs = observe(jobs, nodes, {}, Selection(manage_all=True), now=now)
    alone = observe([j for j in jobs if j.job_id != 99_999], nodes, {}, Selection(manage_all=True), now=now)
    assert 99_999 in obs.records and 99_999 not in {v.job_id for v in obs.jobs}
    assert obs.jobs == alone.jobs and len(obs.jobs) >= 2
