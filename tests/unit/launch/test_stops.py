"""Why a job stops and what follows: the wrapper's pure decisions, on Slurm's answers captured on the dev cluster."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from hpc_elastic.jobdir import StopReason
from hpc_elastic.launch.stops import Action, after_stop, sigterm_reason, usr1_reason
from hpc_elastic.slurm.parse import parse_squeue_json
from hpc_elastic.slurm.types import Job, JobState
from tests.conftest import DATA

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def captured(name: str) -> Job:
    """The job as ``squeue --json`` showed it the moment its workers got SIGTERM (Slurm 22.05, dev cluster)."""
    (job,) = parse_squeue_json((DATA / "slurm-22.05" / name).read_text())
    return job


def test_the_daemons_notice_wins() -> None:
    assert usr1_reason(StopReason.RESIZE, NOW, 60, NOW, 120) is StopReason.RESIZE


def test_usr1_near_the_time_limit_is_a_timelimit() -> None:
    start = NOW - timedelta(minutes=58)  # a 1-hour job, 2 minutes left, grace 120 s
    assert usr1_reason(None, start, 3600, NOW, 120) is StopReason.TIMELIMIT


def test_usr1_far_from_the_time_limit_or_without_one_is_a_preemption() -> None:
    assert usr1_reason(None, NOW - timedelta(minutes=10), 3600, NOW, 120) is StopReason.PREEMPT
    assert usr1_reason(None, NOW, None, NOW, 120) is StopReason.PREEMPT
    assert usr1_reason(None, None, 3600, NOW, 120) is StopReason.PREEMPT


def test_slurms_preemption_in_its_grace_time_is_running_with_a_preempt_time() -> None:
    job = captured("squeue_preempt_grace.json")
    assert job.state is JobState.RUNNING and job.preempt_time is not None and job.start_time is not None
    assert job.preempt_time >= job.start_time
    assert sigterm_reason(job, 0, NOW) is StopReason.PREEMPT


def test_a_cancel_is_completing_before_its_time_limit() -> None:
    job = captured("squeue_cancel.json")
    assert job.state is JobState.COMPLETING and job.preempt_time is None and job.time_limit_s is None
    assert sigterm_reason(job, 0, NOW) is StopReason.CANCEL
    limited = replace(job, time_limit_s=3600)
    assert job.start_time is not None
    assert sigterm_reason(limited, 0, job.start_time + timedelta(seconds=10)) is StopReason.CANCEL


def test_the_time_limit_is_completing_at_its_limit() -> None:
    job = captured("squeue_timelimit.json")
    assert job.state is JobState.COMPLETING and job.time_limit_s == 60 and job.start_time is not None
    # Slurm checks the limits about every 30 s: the TERM came 63 s after the start of this 1-minute job
    assert sigterm_reason(job, 0, job.start_time + timedelta(seconds=63)) is StopReason.TIMELIMIT


def test_a_node_failure_is_requeued_by_slurm_before_the_signal() -> None:
    job = captured("squeue_node_failed.json")
    assert job.state is JobState.PENDING and job.restart_count == 1
    assert sigterm_reason(job, 0, NOW) is StopReason.REQUEUED


def test_an_unexplained_sigterm_stays_one() -> None:
    assert sigterm_reason(None, 0, NOW) is StopReason.SIGTERM  # Slurm did not answer
    running = replace(captured("squeue_preempt_grace.json"), preempt_time=None)  # TERM to the steps by hand
    assert sigterm_reason(running, 0, NOW) is StopReason.SIGTERM
    assert running.start_time is not None
    stale = replace(running, preempt_time=running.start_time - timedelta(seconds=5))
    assert sigterm_reason(stale, 0, NOW) is StopReason.SIGTERM  # a preemption of an earlier run


@pytest.mark.parametrize(
    ("reason", "used", "limit", "action"),
    [
        (StopReason.PREEMPT, 0, 0, Action.REQUEUE),
        (StopReason.RESIZE, 5, 0, Action.REQUEUE),
        (StopReason.SIGTERM, 0, 0, Action.REQUEUE),
        (StopReason.UNKNOWN, 0, 0, Action.REQUEUE),
        (StopReason.TIMELIMIT, 0, 0, Action.TIMEOUT),
        (StopReason.TIMELIMIT, 1, 2, Action.REQUEUE),
        (StopReason.TIMELIMIT, 2, 2, Action.TIMEOUT),
        (StopReason.CANCEL, 0, 3, Action.LEAVE),
        (StopReason.REQUEUED, 0, 3, Action.LEAVE),
    ],
)
def test_what_follows_a_stop(reason: StopReason, used: int, limit: int, action: Action) -> None:
    assert after_stop(reason, timelimit_requeues=used, max_requeues=limit) is action
