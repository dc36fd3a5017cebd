"""The pass loop over a fake client that serves parsed captured Slurm output and records what is changed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import cast

import pytest

from hpc_elastic.jobdir import Ack, JobDir, StopNotice, StopReason, StopRequest, find_job_dir
from hpc_elastic.slurm import Job, JobRef, JobState, Node, Partition, PermissionDenied, SlurmUnavailable, commands
from hpc_elastic.slurm.commands import JobAction
from slurm_plugin.config import PluginConfig
from slurm_plugin.daemon import STATE_NAME, Daemon, DaemonLocked, state_lock
from slurm_plugin.store import Store
from tests.unit.plugin.conftest import at, config, start_of


class FakeSlurm:
    """The :class:`hpc_elastic.slurm.SlurmClient` a daemon pass talks to, over jobs and nodes parsed from the real
    cluster's output; what a pass must not call fails the test."""

    def __init__(self, jobs: list[Job], nodes: list[Node], *, ack_root: Path | None = None) -> None:
        self._jobs, self._nodes, self.ack_root = jobs, nodes, ack_root
        self.calls: list[tuple[str, object]] = []
        self.fail_reads = 0

    def jobs(self, job_ids: Iterable[int] | None = None, *, site_factors: bool = False) -> list[Job]:
        if self.fail_reads:
            self.fail_reads -= 1
            raise SlurmUnavailable("slurm_load_jobs error: Unable to contact slurm controller")
        wanted = None if job_ids is None else set(job_ids)
        return [j for j in self._jobs if wanted is None or j.job_id in wanted]

    def nodes(self) -> list[Node]:
        return self._nodes

    def history(
        self,
        start: datetime,
        end: datetime | None = None,
        job_ids: Iterable[int] | None = None,
        *,
        user_text: bool = True,
    ) -> list[Job]:
        self.calls.append(("history", user_text))
        return []

    def version(self) -> str:
        return "22.05.8"

    def ping(self) -> None:
        return None

    def job(self, job_id: int) -> Job:
        (found,) = self.jobs([job_id])
        return found

    def partitions(self) -> list[Partition]:
        raise AssertionError("a pass reads no partitions")

    def accounts(self) -> frozenset[str]:
        raise AssertionError("a pass reads no accounts")

    def submit(
        self, script_path: str | None = None, options: Sequence[str] = (), *, script_text: str | None = None
    ) -> int:
        raise AssertionError("a pass submits nothing")

    def act(self, action: JobAction, job_ids: Iterable[int | JobRef]) -> None:
        self.calls.append((action.value, list(job_ids)))

    def update_job(self, job_id: int | JobRef, fields: Mapping[str, str | int]) -> None:
        commands.scontrol_update(job_id, fields)  # what CliSlurm would run: a field or value it refuses fails here
        self.calls.append(("update", (job_id, dict(fields))))
        if "SiteFactor" in fields:  # what sprio then reports
            self._jobs = [
                replace(j, site_factor=int(fields["SiteFactor"])) if job_id in (j.job_id, j.ref) else j
                for j in self._jobs
            ]
        if "AdminComment" in fields:  # what squeue then shows the job's wrapper
            comment = str(fields["AdminComment"])
            self._jobs = [replace(j, admin_comment=comment) if job_id in (j.job_id, j.ref) else j for j in self._jobs]

    def requeue(self, job_ids: Iterable[int | JobRef]) -> None:
        self.calls.append(("requeue", list(job_ids)))

    def create_reservation(self, name: str, nodes: Sequence[str], user: str, duration_s: float) -> None:
        self.calls.append(("reserve", (name, tuple(nodes), user, duration_s)))

    def end_reservation(self, name: str) -> None:
        self.calls.append(("end-reservation", name))

    def cancel(
        self, job_ids: Iterable[int | JobRef], signal: str | None = None, *, batch: bool = False, full: bool = False
    ) -> None:
        ids = list(job_ids)
        self.calls.append(("cancel", (ids, signal, batch)))
        if self.ack_root is not None:  # the job's wrapper and workers: checkpoint and acknowledge
            for job in self._jobs:
                if job.job_id in ids:
                    notice = StopNotice.decode(job.admin_comment)
                    assert notice is not None, "the daemon signals after its notice"
                    job_dir = JobDir(self.ack_root / f"{job.name}-{job.job_id}")
                    job_dir.request_stop(StopRequest(notice.reason, notice.requested_at))
                    at = notice.requested_at + 1
                    job_dir.acknowledge(Ack(job.job_id, job.restart_count, 42, Path("/x"), at))


class RefusesAdminComment(FakeSlurm):
    """A daemon whose account may not set a job's AdminComment (not a Slurm operator)."""

    def update_job(self, job_id: int | JobRef, fields: Mapping[str, str | int]) -> None:
        if "AdminComment" in fields:
            raise PermissionDenied(["scontrol"], 1, "Access/permission denied")
        super().update_job(job_id, fields)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def make(cfg: PluginConfig, fake: FakeSlurm, now: float, *, dry_run: bool = False) -> tuple[Daemon, Clock]:
    clock = Clock(now)
    store = Store(cfg.state_dir, read_only=dry_run)
    return Daemon(cfg, fake, store, clock=clock, sleep=clock.sleep, dry_run=dry_run), clock


def test_the_gittins_history_is_read_without_what_users_write(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """sacct's text prints a job name as it is, newlines and ``|`` included: the job sizes are read without names
    and comments, so no name can forge a record of the 2D-Gittins distribution."""
    fake = FakeSlurm(*busy)
    daemon, _ = make(config(tmp_path, policy="tiresias-gittins"), fake, at(start_of(busy[0], 24), 60))
    daemon.run_pass()
    assert ("history", False) in fake.calls and ("history", True) not in fake.calls


PREEMPTING: dict[str, object] = {
    "tiresias": {"thresholds": [100.0]},
    "preemption": {"min_run_time_s": 30, "grace_s": 20, "requeue_wait_s": 2},
}


def test_pass_preempts_with_checkpoint_and_orders(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, **PREEMPTING)
    job_dir = tmp_path / "jobs" / "fill|a100-24"
    (job_dir / "control").mkdir(parents=True)
    fake = FakeSlurm(jobs, nodes, ack_root=tmp_path / "jobs")
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60))
    assert daemon.run(once=True) == 0
    kinds = [c[0] for c in fake.calls]
    # order, then signal in the first pass (the waiting job's SiteFactor is set before GPUs are freed); the fake
    # job stays RUNNING, so a follow-up pass of --once requeues it
    assert kinds == ["update", "update", "cancel", "requeue"]
    assert fake.calls[0][1] == (25, {"SiteFactor": 11_000})
    assert fake.calls[1][0] == "update"
    notice_job, fields = cast(tuple[int, dict[str, str]], fake.calls[1][1])
    assert notice_job == 24 and StopNotice.decode(fields["AdminComment"]) == StopNotice(
        StopReason.PREEMPT, at(start_of(jobs, 24), 60), 0
    )
    assert fake.calls[2][1] == ([24], "USR1", True)
    state = json.loads((tmp_path / STATE_NAME).read_text())
    done = [(a["kind"], a["job_id"], a["ok"]) for a in state["recent_actions"]]
    assert done == [("order", 25, True), ("preempt", 24, True), ("requeue", 24, True)]
    assert "acknowledged" in state["recent_actions"][2]["reason"]
    record = Store(tmp_path).load()[24]
    # follow-up passes every stop_poll_s (1 s): ack at +1 s, requeue_wait_s = 2 -> requeued 3 s after the signal
    assert record.preemptions == 1 and record.queue == 1 and record.attained_service == pytest.approx(8 * 63)
    assert record.stop_kind == "" and daemon.metrics.preemptions._value.get() == 1


def test_a_preemption_in_flight_does_not_block_the_pass(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, **PREEMPTING)
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)
    fake = FakeSlurm(jobs, nodes)  # nobody acknowledges
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    report = daemon.run_pass()
    assert [c[0] for c in fake.calls] == ["update", "update", "cancel"] and clock.slept == []  # returned at once
    assert Store(tmp_path).load()[24].stop_kind == "preempt"
    assert daemon._sleep_time(report) == cfg.stop_poll_s  # look again soon
    clock.now += 5
    daemon.run_pass()  # in flight, within the grace: no second signal, no requeue
    assert [c[0] for c in fake.calls] == ["update", "update", "cancel"]
    clock.now += 20  # grace_s = 20 without acknowledgement: requeue anyway
    report = daemon.run_pass()
    assert fake.calls[-1] == ("requeue", [24])
    assert report.result is not None and "no checkpoint acknowledgement" in report.result.outcomes[0].action.reason


def test_the_wrappers_own_requeue_ends_the_stop(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, **PREEMPTING)
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)
    fake = FakeSlurm(jobs, nodes, ack_root=tmp_path / "jobs")
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    daemon.run_pass()
    # the wrapper checkpointed and requeued: pending again, restart count + 1
    fake._jobs = [
        replace(j, state=JobState.PENDING, restart_count=1, start_time=None, nodes=(), pending_reason="BeginTime")
        if j.job_id == 24
        else j
        for j in jobs
    ]
    clock.now += 3
    daemon.run_pass()
    assert [c[0] for c in fake.calls].count("requeue") == 0
    record = Store(tmp_path).load()[24]
    assert record.stop_kind == "" and not record.running and record.attained_service == pytest.approx(8 * 60)


def test_jobs_arriving_start_the_next_pass_early(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, interval_s=60, event_poll_s=2)
    fake = FakeSlurm(jobs, nodes)
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    daemon.run_pass()
    start = clock.now
    daemon._wait(60)
    assert clock.now - start == pytest.approx(60)  # nothing changed: the whole interval
    assert daemon.metrics.early_passes._value.get() == 0
    newcomer = replace(next(j for j in jobs if j.job_id == 25), job_id=99)
    fake._jobs = [*jobs, newcomer]
    start = clock.now
    daemon._wait(60)
    assert clock.now - start == pytest.approx(2)  # the first poll sees the arrival
    assert daemon.metrics.early_passes._value.get() == 1
    unmanaged = replace(newcomer, job_id=100, comment="")
    fake._jobs = [*jobs, unmanaged]
    daemon.run_pass()
    fake._jobs = [*jobs, unmanaged, replace(unmanaged, job_id=101)]
    start = clock.now
    daemon._wait(10)
    assert clock.now - start == pytest.approx(10)  # jobs the daemon does not manage do not count


def test_dry_run_changes_nothing(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, **PREEMPTING)
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60), dry_run=True)
    report = daemon.run_pass()
    assert {a.kind.value for a in report.actions} == {"preempt", "order"}
    assert fake.calls == []
    assert not (tmp_path / STATE_NAME).exists() and not (tmp_path / "state.sqlite3").exists()


def test_restart_keeps_attained_service(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path)
    first, _ = make(cfg, FakeSlurm(jobs, nodes), at(start_of(jobs, 24), 60))
    first.run_pass()
    first.store.close()
    second, _ = make(cfg, FakeSlurm(jobs, nodes), at(start_of(jobs, 24), 90))
    report = second.run_pass()
    assert report.observation is not None
    view = next(v for v in report.observation.jobs if v.job_id == 24)
    assert view.attained_service == pytest.approx(8 * 90) and view.first_start_time == start_of(jobs, 24).timestamp()


def test_unreachable_slurm_means_no_action_and_a_bounded_restart_budget(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, max_consecutive_errors=3, interval_s=5)
    fake = FakeSlurm(jobs, nodes)
    fake.fail_reads = 10
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    assert daemon.run() == 1
    assert fake.calls == [] and clock.slept == [10, 20]
    assert daemon.metrics.errors.labels("read")._value.get() == 3
    fake.fail_reads = 1
    assert daemon.run(once=True) == 1 and fake.calls == []


def test_a_pass_that_fails_on_anything_is_retried_with_backoff_not_the_end_of_the_daemon(
    tmp_path: Path, busy: tuple[list[Job], list[Node]], caplog: pytest.LogCaptureFixture
) -> None:
    """An error no code path foresaw (here in a pass's read) counts like an unreachable Slurm: logged with its
    traceback, retried with back-off, and the daemon exits 1 after ``max_consecutive_errors`` in a row."""
    jobs, nodes = busy
    cfg = config(tmp_path, max_consecutive_errors=2, interval_s=5)
    fake = FakeSlurm(jobs, nodes)

    def broken() -> list[Node]:
        raise RecursionError("maximum recursion depth exceeded")

    fake.nodes = broken  # type: ignore[method-assign]
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    assert daemon.run() == 1 and clock.slept == [10] and fake.calls == []
    assert sum("pass failed" in r.getMessage() and r.exc_info is not None for r in caplog.records) == 2
    assert daemon.run(once=True) == 1


def test_partial_read_skips_the_pass(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, _ = busy
    cfg = config(tmp_path)
    fake = FakeSlurm(jobs, [])
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60))
    assert daemon.run(once=True) == 3
    assert fake.calls == []


def test_one_daemon_at_a_time(tmp_path: Path) -> None:
    with state_lock(tmp_path), pytest.raises(DaemonLocked, match="another hpc-elastic-sched"), state_lock(tmp_path):
        pass
    with state_lock(tmp_path):  # released when the first one ends
        pass


def test_job_names_never_leave_the_checkpoint_roots(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    (root / "ok-5").mkdir(parents=True)
    (tmp_path / "x-5").mkdir()
    me = os.getuid()
    assert find_job_dir([root], "ok", 5, me) == JobDir(root / "ok-5")
    assert find_job_dir([root], "ok", 5, me + 1) is None  # another user's directory is not this job's
    for name in ("../x", "..", "a/b", "", "x\n", "$(touch /tmp/pwned)", ".hidden"):
        assert find_job_dir([root], name, 5, me) is None


def test_waits_run_on_the_monotonic_clock_when_the_wall_clock_steps_back(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """An NTP step of the wall clock an hour back must not stall the daemon for an hour."""
    jobs, nodes = busy
    cfg = config(tmp_path, interval_s=30, event_poll_s=5)
    fake = FakeSlurm(jobs, nodes)
    wall = Clock(at(start_of(jobs, 24), 60))
    ticks = Clock(1000.0)

    def sleep(seconds: float) -> None:
        ticks.sleep(seconds)
        wall.sleep(seconds)
        if len(ticks.slept) == 1:
            wall.now -= 3600.0  # the step happens during the first nap

    daemon = Daemon(cfg, fake, Store(cfg.state_dir), clock=wall, sleep=sleep, monotonic=ticks)
    daemon._wait(30.0)
    assert sum(ticks.slept) == pytest.approx(30.0)


def test_max_per_pass_zero_preempts_nothing(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, tiresias={"thresholds": [100.0]}, preemption={"min_run_time_s": 30, "max_per_pass": 0})
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60))
    assert daemon.run(once=True) == 0
    assert [c for c in fake.calls if c[0] in ("cancel", "requeue")] == []
    assert [c[0] for c in fake.calls] == ["update"]  # the waiting job is still ordered


def test_a_refused_notice_still_signals_the_job(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    """A stop the daemon could not annotate (its account lacks the right) is still sent: the old daemon sent no
    signal at all when its stop file could not be written, and preemption silently did nothing."""
    jobs, nodes = busy
    cfg = config(tmp_path, **PREEMPTING)
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)

    fake = RefusesAdminComment(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60))
    daemon.run_pass()
    assert ("cancel", ([24], "USR1", True)) in fake.calls


def test_an_array_task_is_stopped_and_requeued_as_array_underscore_task(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """A task of a job array is named ``<array>_<task>`` in every call: one task's own job id is the array's,
    and Slurm applies a signal, an update or a requeue of that id to every task of the array."""
    jobs, nodes = busy
    task = JobRef(24, 3)  # the task whose own id (24) is the array's id
    jobs = [replace(j, array_job_id=24, array_task_id=3) if j.job_id == 24 else j for j in jobs]
    cfg = config(tmp_path, **PREEMPTING)
    (tmp_path / "jobs" / "fill|a100-24_3" / "control").mkdir(parents=True)
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60))
    daemon.run_pass()
    assert ("cancel", ([task], "USR1", True)) in fake.calls
    notices = [args for kind, args in fake.calls if kind == "update" and "AdminComment" in str(args)]
    assert notices and all(isinstance(args, tuple) and args[0] == task for args in notices)
    # no directory of the job's user for another array task: it is requeued at once, by its own name too
    other = [replace(j, array_job_id=20, array_task_id=1) if j.job_id == 24 else j for j in busy[0]]
    fake = FakeSlurm(other, nodes)
    (tmp_path / "b").mkdir()
    daemon, _ = make(config(tmp_path / "b", **PREEMPTING), fake, at(start_of(other, 24), 60))
    daemon.run_pass()
    assert ("requeue", [JobRef(20, 1)]) in fake.calls
    assert not any(kind == "requeue" and isinstance(ids, list) and 24 in ids for kind, ids in fake.calls)


def test_a_stop_asked_mid_pass_lets_the_pass_store_what_it_did(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """SIGTERM while a pass acts: the pass ends and stores its stop in flight, then the daemon exits 0 without
    another pass. Killed there instead, the next daemon would not know that the job was signalled."""
    jobs, nodes = busy
    cfg = config(tmp_path, **PREEMPTING)
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)

    class StoppedWhileSignalling(FakeSlurm):
        def cancel(
            self, job_ids: Iterable[int | JobRef], signal: str | None = None, *, batch: bool = False, full: bool = False
        ) -> None:
            daemon.request_stop()  # what the CLI's SIGTERM handler calls
            super().cancel(job_ids, signal, batch=batch, full=full)

    fake = StoppedWhileSignalling(jobs, nodes)
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 60))
    assert daemon.run() == 0
    assert [c[0] for c in fake.calls] == ["update", "update", "cancel"] and clock.slept == []
    assert Store(tmp_path).load()[24].stop_kind == "preempt"
    assert json.loads((tmp_path / STATE_NAME).read_text())["recent_actions"][1]["kind"] == "preempt"


def test_a_stop_asked_between_passes_ends_the_wait(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, interval_s=30, event_poll_s=0)
    fake = FakeSlurm(jobs, nodes)
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        daemon.request_stop()  # the signal comes while the daemon sleeps: the handler's exception ends the nap

    daemon = Daemon(cfg, fake, Store(cfg.state_dir), clock=Clock(at(start_of(jobs, 24), 60)), sleep=sleep)
    assert daemon.run() == 0
    assert naps == [30.0] and [c[0] for c in fake.calls] == ["update"]  # one pass, then no other
