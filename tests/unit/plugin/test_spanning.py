"""One elastic job across GPU types (EasyScale §3.4 plans, §3.3's D2 guard) in the daemon, on output captured on
the dev cluster: job 12 ran on 2 a100 (node1) + 3 v100 (node3) as one untyped job (`--gpus-per-task=1`, node
lists chosen so that Slurm's block fill gives those counts), fillers 8-11 holding the other GPUs."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest

from hpc_elastic.jobdir import JobDir
from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.slurm import GpuCounts, Job, JobState, Node, commands
from hpc_elastic.slurm.parse import parse_sinfo_json, parse_squeue_json
from slurm_plugin.actions import SPAN_WAIT_S, Resize, SetSize
from slurm_plugin.daemon import Daemon
from slurm_plugin.easyscale import parse_split, span_nodes, split_text
from tests.unit.plugin.conftest import at, config
from tests.unit.plugin.test_daemon import Clock, FakeSlurm, make
from tests.unit.plugin.test_telemetry import record

ME = os.getuid()
D2 = "hpc-elastic:v=1,workers=8,min=2,max=8,unit=gpu,backend=torch,level=d2"
D1 = D2.replace(",level=d2", "")
STORY = {"node1": 2, "node2": 0, "node3": 3, "node4": 0}  # the captured fillers' free GPUs


def _free(free: dict[str, int]) -> list[tuple[str, str, int]]:
    return [(name, "a100" if name in {"node1", "node2"} else "v100", count) for name, count in free.items()]


def test_span_nodes_gives_the_plans_counts_per_type_as_whole_nodes_and_one_last_partial() -> None:
    # the captured allocation: node1's 2 free a100 and node3's 3 free v100, the others excluded
    assert span_nodes({"a100": 2, "v100": 3}, _free(STORY)) == (("node1", "node3"), ("node2", "node4"))
    # the last node in Slurm's order may give part of its free GPUs: 2 of node3's 3
    assert span_nodes({"a100": 2, "v100": 2}, _free(STORY)) == (("node1", "node3"), ("node2", "node4"))
    # node1 comes first and gives all its 2 free a100: 1 a100 cannot be had with v100 after it
    assert span_nodes({"a100": 1, "v100": 3}, _free(STORY)) is None
    # but alone it is the last node: 1 of its 2
    assert span_nodes({"a100": 1}, _free(STORY)) == (("node1",), ("node2", "node3", "node4"))
    # fewest nodes first, then Slurm's order (node10 after node2)
    free = [("node2", "v100", 2), ("node10", "v100", 4), ("node3", "v100", 2)]
    assert span_nodes({"v100": 4}, free) == (("node10",), ("node2", "node3"))
    assert span_nodes({"v100": 3}, free) == (("node10",), ("node2", "node3"))  # 3 of node10's 4
    assert span_nodes({"v100": 5}, free) == (("node2", "node10"), ("node3",))  # node2's 2, then 3 of node10's
    assert span_nodes({"v100": 9}, free) is None
    with pytest.raises(ValueError, match="positive GPU counts"):
        span_nodes({}, free)
    with pytest.raises(ValueError, match="twice"):
        span_nodes({"v100": 1}, [*free, ("node2", "v100", 1)])


def test_a_split_is_stored_as_text_and_read_back_strictly() -> None:
    assert split_text({"v100": 3, "a100": 2, "k80": 0}) == "a100:2,v100:3"
    assert parse_split("a100:2,v100:3") == {"a100": 2, "v100": 3} and parse_split("") == {}
    for bad in ("a100:0", "a100:2,a100:3", "a100", "a100:2;v100:3", "a 100:2", "a100:-1"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_span_fields_set_the_node_lists_then_the_untyped_size() -> None:
    first, second = commands.span_fields(5, 5, ("node1", "node3"), ("node2", "node4"))
    assert commands.scontrol_update(12, first) == [
        "scontrol",
        "update",
        "JobId=12",
        "ReqNodeList=node1,node3",
        "ExcNodeList=node2,node4",
    ]
    assert commands.scontrol_update(12, second) == [
        "scontrol",
        "update",
        "JobId=12",
        "NumTasks=5",
        "NumCPUs=5",
        "NumNodes=2",
        "TresPerJob=gres:gpu:5",
    ]
    with pytest.raises(ValueError, match="nodes"):
        commands.span_fields(1, 1, ("node1", "node3"), ())
    # no nodes: the earlier lists cleared, any nodes
    assert commands.span_fields(3, 3, (), ()) == [
        {"ReqNodeList": "", "ExcNodeList": ""},
        {"NumTasks": 3, "NumCPUs": 3, "NumNodes": "1-3", "TresPerJob": "gres:gpu:3"},
    ]
    with pytest.raises(ValueError, match="both required and excluded"):
        commands.span_fields(2, 2, ("node1",), ("node1",))


def _captured(slurm_data: Path) -> tuple[list[Job], list[Node]]:
    jobs = parse_squeue_json((slurm_data / "squeue_spanning_running.json").read_text())
    nodes = parse_sinfo_json((slurm_data / "sinfo_spanning.json").read_text())
    return jobs, nodes


def _elastic_on_node1(jobs: list[Job], comment: str) -> Job:
    """The captured job 12 as the user's elastic job ``es`` on node1's 2 a100, its marker ``comment``."""
    return replace(
        next(j for j in jobs if j.job_id == 12),
        name="es",
        user_id=ME,
        comment=comment,
        gpus=GpuCounts.of({"a100": 2}),
        nodes=("node1",),
        tasks=2,
        cpus=2,
    )


def _story(jobs: list[Job], nodes: list[Node], comment: str) -> tuple[Job, list[Job], list[Node]]:
    """Job 12 as an elastic job of 8 ESTs on node1's 2 a100; filler 10 holds 2 of node3's v100 (2 idle)."""
    job = _elastic_on_node1(jobs, comment)
    fillers = [j for j in jobs if j.job_id in {8, 9, 11}]
    filler = replace(next(j for j in jobs if j.job_id == 10), gpus=GpuCounts.of({"v100": 2}))
    used = {"node1": {"a100": 4}, "node2": {"a100": 4}, "node3": {"v100": 2}, "node4": {"v100": 4}}
    seen = [replace(n, gpus_allocated=GpuCounts.of(used[n.name])) if n.name in used else n for n in nodes]
    return job, [job, *fillers, filler], seen


@dataclass
class Pass:
    """The first pass of the story: its resize (None: none), and what the next passes need."""

    grow: Resize | None
    fake: FakeSlurm
    daemon: Daemon
    clock: Clock
    job: Job
    squeue: list[Job]


def _pass(tmp_path: Path, slurm_data: Path, comment: str, d2: bool) -> Pass:
    jobs, nodes = _captured(slurm_data)
    job, squeue, sinfo = _story(jobs, nodes, comment)
    cfg = config(tmp_path, policy="tiresias-las+easyscale", resize={"enabled": True}, preemption={"min_run_time_s": 0})
    job_dir = JobDir.of(tmp_path / "jobs", job.name, job.job_id).prepare()
    record(job_dir, job.restart_count, (("a100", 10.0),), d2=d2)
    fake = FakeSlurm(squeue, sinfo)
    assert job.start_time is not None
    daemon, clock = make(cfg, fake, (job.start_time + timedelta(seconds=600)).timestamp())
    report = daemon.run_pass()
    assert report.observation is not None
    profile = next(v.scaling for v in report.observation.jobs if v.job_id == 12)
    assert isinstance(profile, EstProfile) and profile.mixed is (d2 and "level=d2" in comment)
    resizes = [a for a in report.actions if isinstance(a, Resize)]
    return Pass(resizes[0] if resizes else None, fake, daemon, clock, job, squeue)


def test_a_d2_covered_job_grows_across_types_and_its_requeued_job_gets_the_nodes_of_its_plan(
    tmp_path: Path, slurm_data: Path
) -> None:
    """8 ESTs on 2 a100, 2 v100 idle: Role 2's proposal of 2 v100 (Eq. 1d: 8 / 2 = 4 against 8 / 4 = 2 on 2 GPUs,
    C_v100 estimated as C_a100) is granted as a plan on both types; once the job is requeued the daemon gives it
    node1 (its own 2 a100) and node3 (2 free v100) with untyped GPUs."""
    story = _pass(tmp_path, slurm_data, D2, d2=True)
    grow, fake, daemon, clock, job, squeue = story.grow, story.fake, story.daemon, story.clock, story.job, story.squeue
    assert grow is not None
    assert (grow.old_gpus, grow.new_gpus, grow.split, grow.gpu_type) == (2, 4, (("a100", 2), ("v100", 2)), None)
    assert grow.reason.endswith("(2 a100 + 2 v100)")
    # the plan's nodes are held for the job before its stop frees anything: node3's idle v100 included
    assert grow.keep == ("node1", "node3")
    kinds = [kind for kind, _ in fake.calls]
    assert kinds.index("reserve") < kinds.index("cancel")
    (reserve,) = [args for kind, args in fake.calls if kind == "reserve"]
    assert isinstance(reserve, tuple) and reserve[:3] == ("hpc-elastic-keep-12-2", ("node1", "node3"), job.user)
    assert daemon.store.load()[12].resize_keep == "hpc-elastic-keep-12-2:node1,node3"
    # the job checkpointed and requeued itself: pending, its GPUs free again
    fake._jobs = [replace(job, state=JobState.PENDING, restart_count=1, nodes=()), *squeue[1:]]
    fake._nodes = [
        replace(n, gpus_allocated=GpuCounts.of({"a100": 2})) if n.name == "node1" else n for n in fake._nodes
    ]
    fake.calls.clear()
    clock.now += 30
    report = daemon.run_pass()
    (size,) = [a for a in report.actions if isinstance(a, SetSize)]
    assert size.span is not None and (size.tasks, size.span.nodes, size.span.why) == (4, ("node1", "node3"), "")
    updates: list[object] = []
    for kind, args in fake.calls:
        if kind == "update" and isinstance(args, tuple) and args[0] == 12:
            updates.append(args[1])
    assert updates[-1] == {"SiteFactor": 11000}  # the pending job's place in the order
    assert updates[:-1] == [
        {"ReqNodeList": "node1,node3", "ExcNodeList": "node2,node4", "Reservation": "hpc-elastic-keep-12-2"},
        {"NumTasks": 4, "NumCPUs": 4, "NumNodes": 2, "TresPerJob": "gres:gpu:4"},
    ]
    assert daemon.store.load()[12].resize_split == "a100:2,v100:2"


@pytest.mark.parametrize(("comment", "d2"), [(D1, True), (D2, False), (D1, False)])
def test_without_the_d2_guard_a_job_stays_on_its_type(tmp_path: Path, slurm_data: Path, comment: str, d2: bool) -> None:
    """Submitted below D2, or a run that does not report D2 (the model scanner refused its model): the v100 GPUs
    are not proposed to it, and no a100 is free: no resize."""
    assert _pass(tmp_path, slurm_data, comment, d2).grow is None


def test_a_split_that_no_nodes_give_falls_back_to_its_largest_type(tmp_path: Path, slurm_data: Path) -> None:
    """A job requeued for 2 a100 + 2 v100 while node3's v100 went to another job: 2 a100 on node1, said so."""
    story = _pass(tmp_path, slurm_data, D2, d2=True)
    fake, daemon, clock, job, squeue = story.fake, story.daemon, story.clock, story.job, story.squeue
    fake._jobs = [replace(job, state=JobState.PENDING, restart_count=1, nodes=()), *squeue[1:]]
    fake._nodes = [
        replace(n, gpus_allocated=GpuCounts.of({"a100": 2}))
        if n.name == "node1"
        else replace(n, gpus_allocated=GpuCounts.of({"v100": 4}))
        if n.name == "node3"
        else n
        for n in fake._nodes
    ]
    clock.now += 30
    report = daemon.run_pass()  # Slurm may still show its old GPUs in use: it waits for the plan's nodes
    assert not [a for a in report.actions if isinstance(a, SetSize)]
    clock.now += SPAN_WAIT_S
    report = daemon.run_pass()
    (size,) = [a for a in report.actions if isinstance(a, SetSize)]
    assert size.span is not None and size.tasks == 2 and size.span.split == (("a100", 2),)
    assert size.span.nodes == ("node1",) and "no nodes give 2 a100 + 2 v100" in size.span.why
    assert daemon.store.load()[12].resize_to == 2
    # had nothing of its plan been free: any nodes (the earlier node lists cleared), its planned count, untyped
    fake._nodes = [replace(n, gpus_allocated=n.gpus) for n in fake._nodes]
    fake.calls.clear()
    daemon.store.save([replace(daemon.store.load()[12], resize_to=4, resize_set=0, resize_split="a100:2,v100:2")])
    clock.now += 2
    report = daemon.run_pass()
    (size,) = [a for a in report.actions if isinstance(a, SetSize)]
    assert size.span is not None and (size.tasks, size.span.nodes) == (4, ())
    # (still in the reservation of its plan's nodes: created FLEX, it may start outside them)
    cleared = {"ReqNodeList": "", "ExcNodeList": "", "Reservation": "hpc-elastic-keep-12-2"}
    assert ("update", (12, cleared)) in fake.calls


def test_a_pass_sees_a_job_running_on_two_types(tmp_path: Path, slurm_data: Path) -> None:
    """The captured job 12 on 2 a100 + 3 v100 (all 16 GPUs in use): the pass reads it (it was a partial read
    before, which stopped every pass while such a job ran) and plans nothing for it."""
    jobs, nodes = _captured(slurm_data)
    spanning = replace(next(j for j in jobs if j.job_id == 12), name="es", user_id=ME, comment=D2)
    assert spanning.gpus.by_type == (("a100", 2), ("v100", 3)) and spanning.nodes == ("node1", "node3")
    cfg = config(tmp_path, policy="tiresias-las+easyscale", resize={"enabled": True}, preemption={"min_run_time_s": 0})
    record(JobDir.of(tmp_path / "jobs", "es", 12).prepare(), spanning.restart_count, (("a100", 3.0),), d2=True)
    squeue = [spanning if j.job_id == 12 else j for j in jobs]
    assert spanning.start_time is not None
    daemon, _ = make(cfg, FakeSlurm(squeue, nodes), at(spanning.start_time, 600))
    report = daemon.run_pass()
    assert not report.skipped and report.observation is not None
    (view,) = [v for v in report.observation.jobs if v.job_id == 12]
    assert view.allocation == (("node1", 2), ("node3", 3)) and view.gpu_types == frozenset({"a100", "v100"})
    assert not [a for a in report.actions if isinstance(a, Resize)]
