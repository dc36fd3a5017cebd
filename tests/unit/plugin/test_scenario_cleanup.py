"""What a scenario or a test leaves behind: :func:`slurm_plugin.scenario.cancel_active` over a fake client."""

from __future__ import annotations

import time
from collections.abc import Iterable

import pytest

from hpc_elastic.slurm import Job, JobNotFound, JobRef, JobState, SlurmUnavailable
from slurm_plugin.scenario import cancel_active


class Queue:
    """squeue and scancel as 22.05 behave: a job forgotten after MinJobAge is not listed, and a cancel naming one
    is refused whole (nothing cancelled); a cancelled job ends at the next look."""

    def __init__(self, jobs: dict[int, JobState], *, fail_first: int = 0) -> None:
        self.states = jobs
        self.fail_first = fail_first
        self.cancels: list[list[int]] = []

    def jobs(self, job_ids: Iterable[int] | None = None, *, site_factors: bool = False) -> list[Job]:
        if self.fail_first:
            self.fail_first -= 1
            raise SlurmUnavailable("slurm_load_jobs error: Socket timed out on send/recv operation")
        wanted = set(job_ids or self.states)
        return [Job(job_id=i, name=f"j{i}", user="alice", state=s) for i, s in self.states.items() if i in wanted]

    def cancel(self, job_ids: Iterable[int | JobRef], signal: str | None = None, **_: object) -> None:
        ids = [int(str(i)) for i in job_ids]
        if any(i not in self.states for i in ids):
            raise JobNotFound(["scancel"], 0, "Invalid job id specified")
        self.cancels.append(ids)
        for i in ids:
            self.states[i] = JobState.CANCELLED


@pytest.fixture(autouse=True)
def no_naps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda _s: None)  # the retries' naps


def test_only_the_active_jobs_are_cancelled_and_a_forgotten_one_does_not_stop_them() -> None:
    queue = Queue({2: JobState.RUNNING, 3: JobState.COMPLETED, 4: JobState.PENDING})  # job 1 forgotten already
    assert cancel_active(queue, [1, 2, 3, 4, 2]) == []  # type: ignore[arg-type]
    assert queue.cancels == [[2, 4]]
    assert queue.states == {2: JobState.CANCELLED, 3: JobState.COMPLETED, 4: JobState.CANCELLED}


def test_a_controller_that_does_not_answer_is_asked_again() -> None:
    queue = Queue({7: JobState.RUNNING}, fail_first=2)
    assert cancel_active(queue, [7]) == [] and queue.cancels == [[7]]  # type: ignore[arg-type]


def test_the_jobs_still_active_at_the_timeout_are_returned() -> None:
    class Stuck(Queue):
        def cancel(self, job_ids: Iterable[int | JobRef], signal: str | None = None, **_: object) -> None:
            self.cancels.append([int(str(i)) for i in job_ids])  # a job stuck COMPLETING on a node that hangs

    queue = Stuck({5: JobState.COMPLETING, 6: JobState.COMPLETED})
    assert cancel_active(queue, [5, 6], timeout_s=0.0) == [5]  # type: ignore[arg-type]
    assert not cancel_active(Queue({}), [])  # type: ignore[arg-type]
