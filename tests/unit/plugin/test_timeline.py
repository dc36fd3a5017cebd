"""The GPUs-over-time timeline of make demo's second act, from samples of Slurm's job records."""

from __future__ import annotations

import json

import pytest

from hpc_elastic.slurm import JobState
from hpc_elastic.slurm.parse import parse_squeue_json
from slurm_plugin.grow_story import read_loss_log
from slurm_plugin.timeline import (
    Holding,
    LossRecord,
    Sample,
    gpu_types,
    holdings,
    loss_by_step,
    parse_loss_line,
    resize_actions,
    restarts,
)
from tests.conftest import DATA

SLURM_DATA = DATA / "slurm-22.05"
DEMO_DATA = DATA / "demo"

R, P, C, D = JobState.RUNNING, JobState.PENDING, JobState.COMPLETING, JobState.COMPLETED


def s(t: float, job: int, state: JobState, restarts_: int, **gpus: int) -> Sample:
    return Sample(t, job, state, restarts_, tuple(sorted(gpus.items())))


def test_a_job_holds_its_allocation_only_while_running_and_each_change_starts_a_holding() -> None:
    samples = [
        s(0, 7, P, 0, v100=2),
        s(1, 7, R, 0, v100=2),
        s(2, 7, R, 0, v100=2),
        s(3, 7, C, 0, v100=2),  # requeued: still completing on its old GPUs
        s(4, 7, P, 1, v100=4),  # pending at its new size
        s(5, 7, R, 1, v100=4),
        s(6, 7, R, 1, a100=2, v100=3),
        s(7, 7, D, 1, a100=2, v100=3),
    ]
    series = holdings(reversed(samples))  # any order: sorted by time
    assert series == {
        7: [
            Holding(0, ()),
            Holding(1, (("v100", 2),)),
            Holding(3, ()),
            Holding(5, (("v100", 4),)),
            Holding(6, (("a100", 2), ("v100", 3))),
            Holding(7, ()),
        ]
    }
    assert [h.count("v100") for h in series[7]] == [0, 2, 0, 4, 3, 0]
    assert [h.count("a100") for h in series[7]] == [0, 0, 0, 0, 2, 0]
    assert gpu_types(series) == ["a100", "v100"]
    assert restarts(samples) == {7: [(4, 1)]}


def test_restarts_are_counted_per_job_from_its_first_sample() -> None:
    samples = [s(0, 1, R, 3), s(0, 2, R, 0), s(1, 1, R, 3), s(2, 2, P, 1), s(3, 2, P, 1), s(4, 2, R, 2)]
    assert restarts(samples) == {2: [(2, 1), (4, 2)]}


def test_samples_round_trip_through_the_report_and_bad_ones_are_refused() -> None:
    sample = s(1.5, 9, R, 2, v100=4)
    assert Sample.from_dict(sample.to_dict()) == sample
    with pytest.raises(ValueError, match="gpus"):
        Sample.from_dict({**sample.to_dict(), "gpus": {"v100": -1}})
    with pytest.raises(ValueError):
        Sample.from_dict({**sample.to_dict(), "state": "NOT_A_STATE"})


def test_samples_of_jobs_parsed_from_squeue_keep_their_gpus_by_type() -> None:
    # squeue --json on the dev cluster: a job spanning node1 (2 a100) and node3 (3 v100), requeued twice, and a
    # 1-GPU v100 job
    jobs = {j.job_id: j for j in parse_squeue_json((SLURM_DATA / "squeue_cross_type_running.json").read_text())}
    samples = [Sample.of(10.0, jobs[12]), Sample.of(10.0, jobs[10])]
    assert (samples[0].state, samples[0].restart_count) == (JobState.RUNNING, 2)
    assert holdings(samples) == {
        12: [Holding(10.0, (("a100", 2), ("v100", 3)))],
        10: [Holding(10.0, (("v100", 1),))],
    }
    assert gpu_types(holdings(samples)) == ["a100", "v100"]


def test_resize_actions_are_the_daemons_resizes_of_the_given_jobs_in_time_order() -> None:
    actions = [
        {"kind": "order", "job_id": 5, "time": 1.0, "ok": True, "detail": "", "reason": ""},
        {"kind": "resize", "job_id": 5, "time": 9.0, "ok": True, "detail": "4 -> 2", "reason": "shrink: x"},
        {"kind": "resize", "job_id": 5, "time": 3.0, "ok": True, "detail": "2 -> 4", "reason": "grow into: y"},
        {"kind": "resize", "job_id": 6, "time": 4.0, "ok": False, "detail": "", "reason": "grow"},
        {"kind": "resize", "job_id": 5, "ok": True},  # no time: skipped
    ]
    got = resize_actions(actions, [5])
    assert [(a.t, a.detail, a.reason) for a in got] == [(3.0, "2 -> 4", "grow into: y"), (9.0, "4 -> 2", "shrink: x")]
    assert [a.job_id for a in resize_actions(actions)] == [5, 6, 5]


def rec(restart: int, rank: int, step: int, loss_sum: float, ests: int) -> LossRecord:
    return LossRecord(restart, rank, step, loss_sum, ests, 0)


def test_the_loss_of_a_step_is_the_mean_over_the_n_ests_of_the_newest_whole_incarnation() -> None:
    records = [
        # incarnation 0 on 2 processes (4 ESTs each): steps 1-3; it stopped after step 3 for a resize
        *(rec(0, r, step, loss, 4) for step, loss in ((1, 8.0), (2, 6.0), (3, 4.0)) for r in (0, 1)),
        # incarnation 1 on 4 processes (2 ESTs each) from step 4; rank 3 had not logged step 5 when it stopped
        *(rec(1, r, 4, 1.0, 2) for r in range(4)),
        *(rec(1, r, 5, 1.0, 2) for r in range(3)),
        # incarnation 2 redid step 5 (a restart from the step-4 checkpoint) on 1 process with all 8 ESTs
        rec(2, 0, 5, 2.0, 8),
        rec(2, 0, 5, 1.6, 8),  # its own redo of the same step: the last line wins
    ]
    assert loss_by_step(records, workers=8) == [(1, 2.0), (2, 1.5), (3, 1.0), (4, 0.5), (5, 0.2)]
    assert loss_by_step(records[:7], workers=8) == [(1, 2.0), (2, 1.5), (3, 1.0)]  # step 4 not whole yet


def test_a_loss_line_is_parsed_or_refused_with_what_is_wrong() -> None:
    line = '{"step": 3, "loss_sum": 2.5, "ests": 4, "world_size": 2}'
    assert parse_loss_line(1, 0, line) == LossRecord(1, 0, 3, 2.5, 4, 2)
    with pytest.raises(ValueError, match="loss record needs"):
        parse_loss_line(0, 0, '{"step": 3}')
    with pytest.raises(ValueError, match="must be an object"):
        parse_loss_line(0, 0, "[1, 2]")


def test_the_timeline_of_a_captured_run_of_make_demos_second_act() -> None:
    # demo-grow-report.json and the elastic job's --loss-log of one run on the dev cluster: the job grew 2 -> 4
    # v100, shrank to 2 for a short gang job, which ended before the job restarted, and the daemon grew it again
    doc = json.loads((DEMO_DATA / "grow-report.json").read_text())
    samples = [Sample.from_dict(d) for d in doc["samples"]]
    elastic, gang = doc["elastic_id"], doc["gang_id"]
    series = holdings(samples)
    assert gpu_types(series) == ["v100"]
    assert [h.count("v100") for h in series[elastic]] == [0, 2, 0, 4, 0, 2, 0, 4, 0]
    assert [h.count("v100") for h in series[gang]] == [0, 2, 0]
    requeues = restarts(samples)[elastic]
    assert [n for _, n in requeues] == [1, 2, 3]
    decided = resize_actions(doc["daemon_actions"], [elastic])
    assert [a.reason.split(":")[0] for a in decided] == [
        "grow into GPUs no waiting job can use",
        "shrink",
        "grow into GPUs no waiting job can use",
    ]
    # each decision comes before the requeue it caused, and that requeue before the next decision
    moments = sorted([(a.t, "decided") for a in decided] + [(t, "requeued") for t, _ in requeues])
    assert [what for _, what in moments] == ["decided", "requeued"] * 3
    # the gang job held its GPUs between the shrink's requeue and the second grow
    gang_start = next(h.t for h in series[gang] if h.gpus)
    assert requeues[1][0] <= gang_start <= decided[2].t
    loss = loss_by_step(read_loss_log(DEMO_DATA / "loss"), workers=8)
    assert [step for step, _ in loss] == list(range(1, 81))
    assert loss[-1][1] < loss[0][1] / 10
