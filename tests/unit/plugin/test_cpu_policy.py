"""The daemon's plan for ps-mode jobs on CPU partitions: 2D-LAS on CPU-core-time, preemption only of jobs that
attained more and only when it makes the waiting job fit, never more cores than the partition frees."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.jobdir import JobDir, StopNotice, StopReason
from hpc_elastic.slurm import Job, Node
from hpc_elastic.slurm.parse import parse_sinfo_json, parse_squeue_json
from slurm_plugin.actions import ps_plan, ps_preempt_actions
from slurm_plugin.cpu_policy import PsJobView, plan_ps_jobs
from slurm_plugin.daemon import STATE_NAME
from slurm_plugin.observe import Selection, observe
from tests.unit.plugin.conftest import at, config, marked, start_of
from tests.unit.plugin.test_daemon import FakeSlurm, make


def view(job_id: int, running: bool, cores: int, core_s: float, part: str = "cpu", **kw: object) -> PsJobView:
    return PsJobView(job_id, part, running, cores, core_s, submitted=float(job_id), **kw)  # type: ignore[arg-type]


def test_a_waiting_job_that_fits_takes_free_cores_and_preempts_nothing() -> None:
    out = plan_ps_jobs([view(1, True, 8, 9000.0), view(2, False, 4, 0.0)], {"cpu": 8}, max_preempt=4)
    assert out.preempt == () and out.fits == (2,)


def test_the_most_attained_running_job_makes_room_for_a_less_attained_one() -> None:
    jobs = [view(1, True, 8, 500.0), view(2, True, 6, 9000.0), view(3, False, 6, 100.0)]
    out = plan_ps_jobs(jobs, {"cpu": 2}, max_preempt=4)
    assert out.preempt == (2,) and out.fits == (3,)
    assert out.reasons[2] == "9000 core-s attained on partition cpu; its 6 cores go to ps job 3 (100 core-s, 6 cores)"


def test_no_preemption_that_would_not_make_the_job_fit_nor_of_a_job_that_attained_less() -> None:
    # 2 free + job 2's 4 cores < 10: preempting job 2 would not start job 3; job 1 attained less than job 3
    jobs = [view(1, True, 8, 10.0), view(2, True, 4, 9000.0), view(3, False, 10, 100.0)]
    assert plan_ps_jobs(jobs, {"cpu": 2}, max_preempt=4).preempt == ()
    # a job that may not be preempted yet (it ran less than min_run_time_s) is left alone
    jobs = [view(2, True, 6, 9000.0, may_preempt=False), view(3, False, 6, 100.0)]
    assert plan_ps_jobs(jobs, {"cpu": 2}, max_preempt=4).preempt == ()
    # another partition's cores are not this one's
    jobs = [view(2, True, 6, 9000.0, part="cpu2"), view(3, False, 6, 100.0)]
    assert plan_ps_jobs(jobs, {"cpu": 2, "cpu2": 0}, max_preempt=4).preempt == ()
    assert plan_ps_jobs([view(2, True, 6, 9000.0), view(3, False, 6, 1.0)], {"cpu": 2}, max_preempt=0).preempt == ()


jobs_strategy = st.lists(
    st.builds(
        lambda running, cores, core_s, part, ok: (running, cores, core_s, part, ok),
        st.booleans(),
        st.integers(1, 16),
        st.floats(0, 1e6),
        st.sampled_from(["cpu", "cpu2"]),
        st.booleans(),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(jobs_strategy, st.integers(0, 32), st.integers(0, 32), st.integers(0, 6))
def test_a_plan_never_hands_out_more_cores_than_a_partition_frees(
    specs: list[tuple[bool, int, float, str, bool]], free_cpu: int, free_cpu2: int, max_preempt: int
) -> None:
    jobs = [view(i + 1, r, c, s, part=p, may_preempt=ok) for i, (r, c, s, p, ok) in enumerate(specs)]
    by_id = {j.job_id: j for j in jobs}
    free = {"cpu": free_cpu, "cpu2": free_cpu2}
    out = plan_ps_jobs(jobs, free, max_preempt=max_preempt)
    assert len(out.preempt) <= max_preempt and len(set(out.preempt)) == len(out.preempt)
    for part, cores in free.items():
        started = sum(by_id[j].cores for j in out.fits if by_id[j].partition == part)
        freed = sum(by_id[j].cores for j in out.preempt if by_id[j].partition == part)
        assert started <= cores + freed
    for victim in out.preempt:
        assert by_id[victim].running and by_id[victim].may_preempt
        # only for a job ahead of it in 2D-LAS order
        assert any(by_id[j].priority < by_id[victim].priority for j in out.fits)
    assert all(not by_id[j].running for j in out.fits)


# ------------------------------------------------------------------ observed from captured squeue/sinfo output

PS_MARK = "hpc-elastic:v=1,workers=7,min=7,max=7,unit=proc,backend=torch,ps_workers=1-4,ps_servers=1-2,cpw=1"


def cpu_jobs(slurm_data: Path) -> tuple[list[Job], list[Node]]:
    """Jobs 26 and 28 run on the cpu partition (one core each), 27 waits; node5 has 2 of 8 cores allocated: 14
    cores free. The three marked as ps-mode jobs; 27 asks for 16 cores (more than are free) and waits for them."""
    jobs = parse_squeue_json((slurm_data / "squeue_pending.json").read_text())
    nodes = parse_sinfo_json((slurm_data / "sinfo_busy.json").read_text())
    ps_sizes = {26: {}, 28: {}, 27: {"cpus": 16, "pending_reason": "Resources"}}  # 27 waits for cores, not time

    def mark(job: Job) -> Job:
        if job.job_id in ps_sizes:
            return replace(job, comment=PS_MARK, **ps_sizes[job.job_id])  # type: ignore[arg-type]
        return marked(job) if job.job_id in (24, 25) else job

    out = [mark(job) for job in jobs]
    return out, nodes


def test_the_daemon_observes_ps_jobs_on_cpu_partitions_and_preempts_for_a_waiting_one(
    slurm_data: Path, tmp_path: Path
) -> None:
    jobs, nodes = cpu_jobs(slurm_data)
    now = at(start_of(jobs, 28), 1000.0)
    obs = observe(jobs, nodes, {}, Selection(), now=now)
    seen = sorted((v.job_id, v.running, v.cores) for v in obs.ps_jobs)
    assert seen == [(26, True, 1), (27, False, 16), (28, True, 1)]
    assert obs.cpu_free == {"cpu": 14}
    assert {v.job_id for v in obs.jobs} == {24, 25}  # the GPU jobs, as before
    ran = {v.job_id: v.core_seconds for v in obs.ps_jobs}
    assert ran[27] == 0.0 and ran[28] >= 1000.0  # CPU-core-time: one core for the seconds it ran
    decision = ps_plan(obs, config(tmp_path))
    assert sorted(decision.preempt) == [26, 28] and decision.fits == (27,)
    actions = ps_preempt_actions(obs, decision)
    assert sorted(a.job_id for a in actions) == [26, 28] and all(a.checkpointed for a in actions)
    assert "cores go to ps job 27" in actions[0].reason
    # preemption off, or jobs that ran less than min_run_time_s: nothing
    assert ps_plan(obs, config(tmp_path, preemption={"enabled": False})).preempt == ()
    assert ps_plan(obs, config(tmp_path, preemption={"min_run_time_s": 5000})).preempt == ()


def test_a_daemon_pass_preempts_the_ps_jobs_its_plan_names(slurm_data: Path, tmp_path: Path) -> None:
    jobs, nodes = cpu_jobs(slurm_data)
    jobs = [j for j in jobs if j.job_id in (26, 27, 28)]  # the ps jobs alone
    for job in jobs:  # 26 and 28 are tasks of an array: their directories are named by the array's id
        JobDir.of(tmp_path / "jobs", job.name, job.ref.job_id, job.ref.array_task_id).control.mkdir(parents=True)
    cfg = config(tmp_path, preemption={"min_run_time_s": 30, "grace_s": 20})
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    kinds = [kind for kind, _ in fake.calls]
    assert kinds == ["update", "cancel", "update", "cancel"]  # a notice, then the checkpoint signal, per job
    notices = [StopNotice.decode(cast(tuple[int, dict[str, str]], args)[1]["AdminComment"]) for kind, args in
               fake.calls if kind == "update"]  # fmt: skip
    assert [n.reason for n in notices if n is not None] == [StopReason.PREEMPT, StopReason.PREEMPT]
    state = json.loads((tmp_path / STATE_NAME).read_text())
    done = sorted((a["kind"], a["job_id"], a["ok"]) for a in state["recent_actions"])
    assert done == [("preempt", 26, True), ("preempt", 28, True)]
    assert all("cores go to ps job 27" in a["reason"] for a in state["recent_actions"])
