"""Where a PS job's steps go inside its allocation (pure): the allocation's nodes from Slurm's environment, a step
placed on the node that fits it best, a set of new steps refused with the reason when one fits no node, the changes
a Brain plan makes to a running job, and Brain's partition in a submitted job (C_max a node's share beside the job
master, not the task size)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpc_elastic.env import per_node_counts, read_job_environment
from hpc_elastic.policy.brain import Group, JobLimits, Range, ResourcePlan, Stage
from hpc_elastic.ps.allocation import parse_args
from hpc_elastic.ps.brain_agent import BrainAgent, Changes, changes
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.job import PsJob, PsLauncher, _Proc
from hpc_elastic.ps.placement import Nodes
from hpc_elastic.slurm import commands

TWO = Nodes.of(["node5", "node6"], [8, 4])


def test_the_allocations_cpus_per_node_come_from_slurms_environment() -> None:
    assert per_node_counts("8(x2),4") == (8, 8, 4)
    assert per_node_counts("5") == (5,)
    assert per_node_counts("") == () and per_node_counts("8(x") == ()
    env = read_job_environment(
        {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "node[5-6]", "SLURM_JOB_CPUS_PER_NODE": "3(x2)"}
    )
    assert env.cpus_per_node == (3, 3) and env.node_list == "node[5-6]"


def test_nodes_are_checked() -> None:
    with pytest.raises(ValueError, match="2 nodes"):
        Nodes.of(["node5", "node6"], [8])
    with pytest.raises(ValueError, match="named twice"):
        Nodes.of(["node5", "node5"], [8, 8])
    with pytest.raises(ValueError, match="bad node"):
        Nodes.of(["node5"], [0])
    with pytest.raises(ValueError, match="not in the allocation"):
        TWO.free({"node1": 1})
    with pytest.raises(ValueError, match="holds 5 cores of its 4"):
        TWO.free({"node6": 5})


def test_a_step_goes_to_the_node_that_fits_it_best() -> None:
    assert TWO.total == 12 and TWO.largest_free({}) == 8
    assert TWO.place(4, {}) == "node6"  # the smaller share that fits: node5's 8 stay whole
    assert TWO.place(5, {}) == "node5"
    held = {"node5": 5}
    assert TWO.free(held) == {"node5": 3, "node6": 4} and TWO.largest_free(held) == 4
    assert TWO.place(3, held) == "node5" and TWO.place(4, held) == "node6" and TWO.place(5, held) is None
    assert Nodes.of(["a", "b"], [4, 4]).place(2, {}) == "a"  # among equals, node-list order
    with pytest.raises(ValueError, match="at least one core"):
        TWO.place(0, {})


def test_new_steps_that_fit_no_node_are_refused_with_the_reason() -> None:
    held = {"node5": 5}
    assert TWO.refusal([3, 4], held) is None  # 4 on node6, 3 on node5
    reason = TWO.refusal([4, 4], held)
    assert reason is not None and "a step of 4 cores fits no node" in reason and "node5 3, node6 0" in reason
    assert TWO.refusal([9], {}) is not None  # more than any node: never left pending


def test_srun_places_a_step_on_a_node_and_bounds_its_wait() -> None:
    argv = commands.srun_single(["python"], name="ps1", cpus=2, mem_mb=2048, node="node5", immediate_s=30)
    assert {"--nodelist=node5", "--immediate=30", "--cpus-per-task=2", "--exact", "--mem=2048M"} <= set(argv)
    assert not any(a.startswith(("--nodelist", "--immediate")) for a in commands.srun_single(["python"], name="w0"))
    with pytest.raises(ValueError, match="--immediate"):
        commands.srun_single(["python"], name="w0", immediate_s=0)


def _plan(workers: int, worker_cores: int, ps: tuple[int, ...]) -> ResourcePlan:
    return ResourcePlan(Group(workers, worker_cores, 1024), ps, 1024, Stage.ADJUST)


def test_the_changes_of_a_plan_to_a_running_job() -> None:
    running = {"w0": 1, "w1": 1, "w2": 1}
    # a hot single PS replaced by a larger one: the old one stays until the new one holds the parameters
    assert changes(_plan(3, 1, (2,)), running, (1,)) == Changes((), (0,), (2,), 0, kept_ps=0)
    # of two PS, the hot one goes first
    assert changes(_plan(3, 1, (1, 3)), running, (1, 1)) == Changes((), (1,), (3,), 0, None)
    # fewer workers: the newest stop; workers of another size all stop and come back at the plan's size
    assert changes(_plan(1, 1, (1,)), running, (1,)) == Changes(("w1", "w2"), (), (), 0, None)
    assert changes(_plan(2, 2, (1,)), running, (1,)) == Changes(("w0", "w1", "w2"), (), (), 2, None)


def test_in_a_submitted_job_brain_may_use_a_nodes_share_beside_the_master() -> None:
    config = parse_args(["--mode=ps", "--ckpt-root=/g", "--workers-range=1:2", "--ps-range=1:1"])
    local = config.brain()  # local processes: the budget, processes of the task size
    assert local is not None and (local.cores, local.cores_per_node) == (3, 1)
    exclusive = config.brain(Nodes.of(["node5"], [8]))  # a whole node: room beyond the budget of 3 tasks
    assert exclusive is not None and (exclusive.cores, exclusive.cores_per_node) == (7, 7)
    assert exclusive.limits.c_total == 3
    first = exclusive.initial_plan()
    assert first.total_cores <= 3 and first.workers.cores == 2  # C_max 7, shrunk to the budget with a PS of 1
    split = config.brain(Nodes.of(["node5", "node6"], [2, 2]))  # the master on node5: C_max is node6's 2
    assert split is not None and (split.cores, split.cores_per_node) == (3, 2)


def test_the_hot_threshold_is_a_setting_of_the_job() -> None:
    assert PsJobConfig().hot_threshold == 0.8
    assert PsJobConfig.from_json({"hot_threshold": 0.05}).hot_threshold == 0.05
    for bad in (0, 1.5, "x", True):
        with pytest.raises(ValueError, match="hot_threshold must be a number in"):
            PsJobConfig.from_json({"hot_threshold": bad})


def _placed_job(tmp_path: Path, nodes: Nodes, procs: dict[str, tuple[int, str]]) -> PsJob:
    """A PS job under the srun launcher whose steps (name -> cores, node) are on the books, without processes."""
    job = PsJob(PsJobConfig(num_ps=1, num_workers=0), tmp_path, launcher=PsLauncher.SRUN, nodes=nodes)
    for name, (cpus, node) in procs.items():
        popen = subprocess.Popen(["true"])
        popen.wait()
        proc = _Proc(name, popen, (tmp_path / f"{name}.log").open("ab"), cpus, 1024 * cpus, node)
        job._held[popen.pid] = (node, cpus)
        if name == "master":
            job.master_proc = proc
        elif name.startswith("ps"):
            job.ps.append(proc)
        else:
            job.workers[name] = proc
    return job


def test_brain_checks_a_plan_against_the_nodes_in_the_order_it_applies_it(tmp_path: Path) -> None:
    # the sample (1 worker of 4 cores, 2 PS of 1) on a node of 7 with the master: optimize's 4 workers of 1 core and
    # 1 PS of 2 fit, since one old PS stays only while the new one takes the parameters, before the workers come
    job = _placed_job(tmp_path, Nodes.of(["node5"], [7]), {"master": (1, "node5"), "ps0": (1, "node5"),
                                                            "ps1": (1, "node5"), "w0": (4, "node5")})  # fmt: skip
    agent = BrainAgent(JobLimits(6, Range(1, 4), Range(1, 2)), cores=6, cores_per_node=6, mem_per_node_mb=6144)
    assert agent.refusal(job, _plan(4, 1, (2,))) is None
    _close(job)
    # a whole node of 8: a hot single PS of 2 cores beside 2 workers and the master may become one of 3 (1 + 2 + 2 + 3),
    # not one of 4: refused with the reason
    job = _placed_job(tmp_path, Nodes.of(["node5"], [8]), {"master": (1, "node5"), "ps2": (2, "node5"),
                                                            "w0": (1, "node5"), "w1": (1, "node5")})  # fmt: skip
    assert agent.refusal(job, _plan(2, 1, (3,))) is None
    reason = agent.refusal(job, _plan(2, 1, (4,)))
    assert reason is not None and "a step of 4 cores fits no node" in reason and "node5 3" in reason
    _close(job)


def _close(job: PsJob) -> None:
    for proc in [*job.ps, *job.workers.values(), *([job.master_proc] if job.master_proc else [])]:
        proc.log.close()
