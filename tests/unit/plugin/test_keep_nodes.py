"""The shrink of a job across GPU types ends on the type its plan keeps (EasyScale §3.4 Role 1's plan, carried out
by the daemon), on output captured on the dev cluster: job 12 ran on node1's 2 a100 + node3's v100 as one untyped
job; fillers 8-11 hold the other GPUs; job 14 (captured pending, untyped) is the rigid gang job that arrives.

What Slurm 22.05 does (measured on the dev cluster): the requeue frees the job's GPUs at once and Slurm starts a
waiting job of any type on the first of them in its order (node1's a100 here) in the same instant, while the
requeued job may start only once its credential has expired. So the daemon holds the plan's nodes for the job (a
reservation of its user's, created before the stop, ended once it runs again), and the gang job gets the others.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import GpuCounts, Job, JobState, Node, PermissionDenied, SlurmCommandError, commands
from slurm_plugin.actions import ReleaseNodes, Resize, SetSize, keep_reservation
from slurm_plugin.daemon import Daemon, release_held_nodes
from tests.unit.plugin.conftest import config
from tests.unit.plugin.test_daemon import Clock, FakeSlurm, make
from tests.unit.plugin.test_spanning import D2, ME, _captured
from tests.unit.plugin.test_telemetry import record

GANG = "hpc-elastic:v=1,workers=2,min=2,max=2,unit=gpu,backend=torch"
KEEP = keep_reservation(12, 2)  # job 12 was captured after 2 requeues


def _used(nodes: list[Node], used: dict[str, dict[str, int]]) -> list[Node]:
    return [replace(n, gpus_allocated=GpuCounts.of(used[n.name])) if n.name in used else n for n in nodes]


def _spanning(jobs: list[Job]) -> Job:
    """Job 12 as the user's elastic D2 job ``es`` of 8 ESTs on node1's 2 a100 + node3's 2 v100."""
    return replace(
        next(j for j in jobs if j.job_id == 12),
        name="es",
        user_id=ME,
        comment=D2,
        gpus=GpuCounts.of({"a100": 2, "v100": 2}),
        tasks=4,
        cpus=4,
    )


def _gang(jobs: list[Job]) -> Job:
    """The captured pending job 14 as a rigid 2-GPU job of any type in partition ``gpu``."""
    job = next(j for j in jobs if j.job_id == 14)
    assert job.state is JobState.PENDING and job.gpus.by_type == (("", 4),)
    return replace(job, name="gang", partition="gpu", comment=GANG, gpus=GpuCounts.of({"": 2}), tasks=2, cpus=2)


class Story:
    """The shrink's first pass over the captured cluster, and what the next passes need."""

    def __init__(self, tmp_path: Path, slurm_data: Path, fake_type: type[FakeSlurm] = FakeSlurm) -> None:
        jobs, nodes = _captured(slurm_data)
        self.job, self.gang = _spanning(jobs), _gang(jobs)
        fillers = [j for j in jobs if j.job_id in {8, 9, 11}]
        self.fillers = [*fillers, replace(next(j for j in jobs if j.job_id == 10), gpus=GpuCounts.of({"v100": 2}))]
        busy = {"node1": {"a100": 4}, "node2": {"a100": 4}, "node3": {"v100": 4}, "node4": {"v100": 4}}
        self.nodes = _used(nodes, busy)  # every GPU in use, job 14 waits
        cfg = config(
            tmp_path, policy="tiresias-las+easyscale", resize={"enabled": True}, preemption={"min_run_time_s": 0}
        )
        job_dir = JobDir.of(tmp_path / "jobs", self.job.name, self.job.job_id).prepare()
        # its run observed an a100 twice as fast as a v100: a plan of 2 GPUs keeps the a100 (Eq. 1d)
        record(job_dir, self.job.restart_count, (("a100", 10.0), ("v100", 5.0)), d2=True)
        self.fake = fake_type([self.job, *self.fillers, self.gang], self.nodes)
        assert self.job.start_time is not None
        self.daemon, self.clock = make(cfg, self.fake, (self.job.start_time + timedelta(seconds=600)).timestamp())
        report = self.daemon.run_pass()
        (self.shrink,) = [a for a in report.actions if isinstance(a, Resize)]

    @property
    def daemon_and_clock(self) -> tuple[Daemon, Clock]:
        return self.daemon, self.clock

    def requeued(self) -> None:
        """The job checkpointed and requeued itself; Slurm started the gang job on the GPUs not held: node3's v100."""
        restarts = self.job.restart_count + 1
        pending = replace(self.job, state=JobState.PENDING, restart_count=restarts, nodes=())
        gang = replace(self.gang, state=JobState.RUNNING, nodes=("node3",), gpus=GpuCounts.of({"v100": 2}))
        self.fake._jobs = [pending, *self.fillers, gang]
        self.fake._nodes = _used(self.nodes, {"node1": {"a100": 2}})  # node1's 2 a100 free (held for job 12)
        self.fake.calls.clear()
        self.clock.now += 10

    def updates(self, job_id: int) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for kind, args in self.fake.calls:
            if kind == "update" and isinstance(args, tuple) and args[0] == job_id:
                out.append(args[1])
        return out


def test_the_shrink_holds_the_kept_a100_node_so_the_gang_job_gets_the_v100(tmp_path: Path, slurm_data: Path) -> None:
    story = Story(tmp_path, slurm_data)
    daemon, clock = story.daemon_and_clock
    shrink, fake = story.shrink, story.fake
    assert (shrink.job_id, shrink.old_gpus, shrink.new_gpus, shrink.split) == (12, 4, 2, (("a100", 2),))
    assert shrink.reason == "shrink: the policy's elastic share is 2 GPUs (2 a100)"
    # the plan keeps node1's a100: a reservation of the job's user holds node1 before the stop frees anything
    assert shrink.keep == ("node1",)
    kinds = [kind for kind, _ in fake.calls]
    assert kinds.index("reserve") < kinds.index("cancel")
    (reserve,) = [args for kind, args in fake.calls if kind == "reserve"]
    assert isinstance(reserve, tuple) and reserve[:3] == (KEEP, ("node1",), story.job.user)
    assert daemon.store.load()[12].resize_keep == f"{KEEP}:node1"
    # the gang job is never changed but for its place in the order of pending jobs
    assert all(set(fields) == {"SiteFactor"} for fields in story.updates(14))
    story.requeued()
    report = daemon.run_pass()
    (size,) = [a for a in report.actions if isinstance(a, SetSize)]
    assert size.span is not None and (size.tasks, size.span.nodes, size.span.why) == (2, ("node1",), "")
    assert story.updates(12)[:2] == [
        {"ReqNodeList": "node1", "ExcNodeList": "node2,node3,node4", "Reservation": KEEP},
        {"NumTasks": 2, "NumCPUs": 2, "NumNodes": 1, "TresPerJob": "gres:gpu:2"},
    ]
    assert not story.updates(14) and not [k for k, _ in fake.calls if k == "end-reservation"]
    # it runs again on node1's 2 a100: the reservation ends, and only once
    again = replace(story.job, restart_count=story.job.restart_count + 1, nodes=("node1",))
    fake._jobs = [replace(again, gpus=GpuCounts.of({"a100": 2}), tasks=2, cpus=2), *fake._jobs[1:]]
    fake._nodes = story.nodes
    clock.now += 15
    report = daemon.run_pass()
    (release,) = [a for a in report.actions if isinstance(a, ReleaseNodes)]
    assert (release.job_id, release.reservation) == (12, KEEP) and "runs again" in release.reason
    assert ("end-reservation", KEEP) in fake.calls and daemon.store.load()[12].resize_keep == ""
    # the running job loses the reservation's name before the reservation ends: requeued by its next resize with
    # the name of an ended reservation, Slurm would hold it for good (RESV_DEL_HOLD, seen in a demo run)
    assert story.updates(12)[-1] == {"Reservation": ""}
    cleared = next(
        i for i, (kind, args) in enumerate(fake.calls) if kind == "update" and args == (12, {"Reservation": ""})
    )
    assert cleared < fake.calls.index(("end-reservation", KEEP))
    clock.now += 2
    assert not [a for a in daemon.run_pass().actions if isinstance(a, ReleaseNodes)]


def test_nodes_held_for_a_job_that_is_gone_are_released(tmp_path: Path, slurm_data: Path) -> None:
    story = Story(tmp_path, slurm_data)
    story.requeued()
    story.fake._jobs = [j for j in story.fake._jobs if j.job_id != 12]  # cancelled while it waited
    story.clock.now += 5
    report = story.daemon.run_pass()
    (release,) = [a for a in report.actions if isinstance(a, ReleaseNodes)]
    assert release.reservation == KEEP and "no longer waits" in release.reason


def test_nodes_a_stopped_daemon_still_holds_are_released_from_its_store(tmp_path: Path, slurm_data: Path) -> None:
    story = Story(tmp_path, slurm_data)  # the shrink's pass holds node1 for job 12; the daemon stops there
    assert story.daemon.store.load()[12].resize_keep == f"{KEEP}:node1"
    story.daemon.store.close()
    fake = FakeSlurm([], [])
    assert release_held_nodes(fake, story.daemon.config.state_dir) == [KEEP]
    assert fake.calls == [("end-reservation", KEEP)]


class Gone(FakeSlurm):
    def end_reservation(self, name: str) -> None:
        raise SlurmCommandError(["scontrol", "update", f"ReservationName={name}"], 1, "Reservation name not found")


def test_a_reservation_slurm_no_longer_has_is_skipped(tmp_path: Path, slurm_data: Path) -> None:
    story = Story(tmp_path, slurm_data)
    story.daemon.store.close()
    assert release_held_nodes(Gone([], []), story.daemon.config.state_dir) == []


class NoOperator(FakeSlurm):
    """A daemon that is no Slurm operator: reservations refused, as ``scontrol`` says it."""

    def create_reservation(self, name: str, nodes: object, user: str, duration_s: float) -> None:
        argv = ["scontrol", "create", "reservation"]
        raise PermissionDenied(argv, 1, "Error creating the reservation: Access/permission denied")


def test_without_the_right_to_reserve_the_shrink_goes_on_unheld(tmp_path: Path, slurm_data: Path) -> None:
    story = Story(tmp_path, slurm_data, NoOperator)
    assert story.shrink.keep == ("node1",)
    assert "cancel" in [kind for kind, _ in story.fake.calls]  # the stop went on
    assert story.daemon.store.load()[12].resize_keep == ""
    story.requeued()
    story.daemon.run_pass()
    assert story.updates(12)[0] == {"ReqNodeList": "node1", "ExcNodeList": "node2,node3,node4"}
    assert "end-reservation" not in [kind for kind, _ in story.fake.calls]


def test_reservation_commands() -> None:
    assert commands.scontrol_create_reservation(KEEP, ("node1", "node3"), "alice", 305.2) == [
        "scontrol",
        "create",
        "reservation",
        "ReservationName=hpc-elastic-keep-12-2",
        "Users=alice",
        "Nodes=node1,node3",
        "StartTime=now",
        "Duration=0:05:06",
        "Flags=IGNORE_JOBS,FLEX",
    ]
    assert commands.scontrol_end_reservation(KEEP) == [
        "scontrol",
        "update",
        "ReservationName=hpc-elastic-keep-12-2",
        "EndTime=now",
    ]
    bad: list[tuple[str, tuple[str, ...], str, float]] = [
        ("a b", ("node1",), "alice", 60),
        (KEEP, (), "alice", 60),
        (KEEP, ("node[1-2]",), "alice", 60),
        (KEEP, ("node1",), "alice;x", 60),
        (KEEP, ("node1",), "alice", 0),
        (KEEP, ("node1",), "alice", float("nan")),
    ]
    for name, nodes, user, duration in bad:
        with pytest.raises(ValueError, match="reservation"):
            commands.scontrol_create_reservation(name, nodes, user, duration)
    with pytest.raises(ValueError, match="reservation name"):
        commands.scontrol_end_reservation("x=y")
