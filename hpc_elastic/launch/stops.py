"""Why a job stops and what the wrapper does then: pure decisions, from what the wrapper saw and what Slurm says.

How Slurm 22.05 stops a job (measured on the dev cluster; README.md, "How Slurm stops a job"):

- the scheduler daemon's preemption or resize: ``USR1`` to the batch shell (the wrapper), reason in the job's
  ``AdminComment`` (:class:`hpc_elastic.jobdir.StopNotice`);
- the time limit: ``USR1`` to the wrapper ``grace`` seconds before it (``--signal=B:USR1@grace``, Slurm checks
  once a minute or so); at the limit itself ``TERM`` to the wrapper and the workers at once, ``KILL`` after
  ``KillWait``;
- Slurm's own preemption (``PreemptMode=REQUEUE`` with ``GraceTime``): ``TERM`` to the job's steps (the workers)
  at once, the wrapper untouched; the job stays ``RUNNING`` with ``PreemptTime`` set; at the end of the grace time
  Slurm requeues it and signals the wrapper;
- ``scancel``: ``TERM`` to the wrapper and the workers at once; the job is ``COMPLETING`` (ends ``CANCELLED``);
- a node set down: Slurm requeues the job at once (``PENDING``, restart count + 1) and signals what still runs.
"""

from __future__ import annotations

import enum
from datetime import datetime

from hpc_elastic.jobdir import StopReason
from hpc_elastic.slurm.types import Job, JobState

#: Slurm sends ``--signal=B:USR1@grace`` when at most ``grace`` seconds are left, checking about once a minute: a
#: USR1 without the daemon's notice this close to the limit (beyond the grace) is the time-limit warning.
TIMELIMIT_SLACK_S = 60.0


class Action(enum.StrEnum):
    """What the wrapper does once the workers checkpointed for a stop."""

    REQUEUE = "requeue"  # scontrol requeue: the job resumes from the checkpoint
    LEAVE = "leave"  # exit: Slurm ends the job (a cancel) or has requeued it already (a node failure)
    TIMEOUT = "timeout"  # the time-limit requeue budget is spent: Slurm ends the job at its limit (TIMEOUT)


def usr1_reason(
    notice: StopReason | None, start: datetime | None, limit_s: int | None, now: datetime, grace_s: float
) -> StopReason:
    """Why a ``USR1`` came: the daemon's notice, else the time limit if it is within grace + slack, else a
    preemption (a ``scancel --signal=USR1 --batch`` by hand)."""
    if notice is not None:
        return notice
    if start is not None and limit_s is not None:
        remaining = (start.timestamp() + limit_s) - now.timestamp()
        if remaining <= grace_s + TIMELIMIT_SLACK_S:
            return StopReason.TIMELIMIT
    return StopReason.PREEMPT


def sigterm_reason(job: Job | None, restart_count: int, now: datetime) -> StopReason:
    """Why the workers got ``SIGTERM`` (and stopped at a checkpoint), from Slurm's view of the job at ``now`` (None:
    Slurm did not answer) and this incarnation's restart count.

    Requeued by Slurm already (pending, or a later incarnation): a node failure, or the end of a preemption's
    grace time.  Running with a ``PreemptTime`` of
    this run: Slurm's preemption, in its grace time.  Ending (``COMPLETING``) at or past its time limit: the time
    limit; before it: a cancel.  Anything else (no answer, a ``TERM`` sent to the steps by hand) stays ``sigterm``,
    which is requeued: a wrong guess costs a requeue from a fresh checkpoint, never the training."""
    if job is None:
        return StopReason.SIGTERM
    if job.restart_count > restart_count or job.state.is_pending:
        return StopReason.REQUEUED
    if job.state is JobState.RUNNING:
        preempted = job.preempt_time is not None and (job.start_time is None or job.preempt_time >= job.start_time)
        return StopReason.PREEMPT if preempted else StopReason.SIGTERM
    if job.state in (JobState.COMPLETING, JobState.CANCELLED, JobState.TIMEOUT):
        ran_out = (
            job.start_time is not None
            and job.time_limit_s is not None
            and (now - job.start_time).total_seconds() >= job.time_limit_s
        )
        return StopReason.TIMELIMIT if ran_out or job.state is JobState.TIMEOUT else StopReason.CANCEL
    return StopReason.SIGTERM


def after_stop(reason: StopReason, *, timelimit_requeues: int, max_requeues: int) -> Action:
    """What follows a checkpointed stop: a time limit is requeued while fewer than ``max_requeues`` time-limit
    requeues were made; a cancel or a node failure is left to Slurm; everything else is requeued."""
    if reason is StopReason.TIMELIMIT:
        return Action.REQUEUE if timelimit_requeues < max_requeues else Action.TIMEOUT
    if reason in (StopReason.CANCEL, StopReason.REQUEUED):
        return Action.LEAVE
    return Action.REQUEUE
