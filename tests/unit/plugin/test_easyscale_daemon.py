"""The daemon under tiresias-las+easyscale: each elastic job's speed model (C_i corrected by its telemetry, Role 3's
observation of the last grow) reaches the policy, and its decisions become resizes that keep the job's GPU type."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from hpc_elastic.jobdir import JobDir
from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.slurm import GpuCounts, Job, Node
from slurm_plugin.actions import Resize
from slurm_plugin.easyscale import estimated_capability, job_gpus, observed_scale_out, watch_grow
from tests.unit.plugin.conftest import at, config, marked, start_of
from tests.unit.plugin.test_daemon import FakeSlurm, make
from tests.unit.plugin.test_telemetry import record

ME = os.getuid()
ELASTIC = "hpc-elastic:v=1,workers=8,min=2,max=8,unit=gpu,backend=torch"


def test_estimated_capability_is_corrected_by_what_the_job_observed() -> None:
    assert estimated_capability(("a100", "v100"), {}) == {"a100": 1.0, "v100": 1.0}
    # the observed type takes its value, the other keeps the estimate in the observed unit
    assert estimated_capability(("a100", "v100"), {"a100": 30.0}) == pytest.approx({"a100": 30.0, "v100": 30.0})
    both = estimated_capability(("a100", "v100"), {"a100": 30.0, "v100": 10.0})
    assert both == pytest.approx({"a100": 30.0, "v100": 10.0})
    # within the companion's threshold (10 %) the estimate stays: 1.05 observed against 1.0 estimated
    near = estimated_capability(("a100", "v100"), {"a100": 1.05, "k80": 3.0})
    assert near == pytest.approx({"a100": 1.0, "v100": 1.05})
    with pytest.raises(ValueError, match="no GPU type"):
        estimated_capability((), {})


def _v100_job(jobs: list[Job], gpus: int, restart_count: int) -> Job:
    """Job 24 of the captured output as job 30, an elastic job of 8 ESTs (2..8 GPUs) on ``gpus`` v100 GPUs."""
    job = next(j for j in jobs if j.job_id == 24)
    nodes = ("node3",) if gpus <= 4 else ("node3", "node4")
    return replace(
        job,
        job_id=30,
        name="es",
        user_id=ME,
        comment=ELASTIC,
        partition="gpu-v100",
        gpus=GpuCounts.of({"v100": gpus}),
        nodes=nodes,
        restart_count=restart_count,
    )


def _nodes(nodes: list[Node], used: dict[str, int]) -> list[Node]:
    return [
        replace(node, gpus_allocated=GpuCounts.of({"v100": used[node.name]})) if node.name in used else node
        for node in nodes
    ]


def test_an_elastic_job_grows_by_its_plan_and_falls_back_when_the_grow_did_not_pay(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """Job 24 (rigid, 8 a100) is left alone; job "es" (8 ESTs on 2 v100, 6 v100 idle) grows by Role 2's proposals
    to 8 v100 and stays on v100. Once it reports from its new run a throughput below the one before (Eq. 1d with
    the observed C_i: 8 ESTs / (4 / 10) = 20 on 2 GPUs, 8 / (1 / 2) = 16 on 8), Role 3 returns it to 2 GPUs."""
    jobs, nodes = busy
    rigid = marked(next(j for j in jobs if j.job_id == 24))
    es = replace(_v100_job(jobs, 2, 0), job_id=30)
    cfg = config(
        tmp_path,
        policy="tiresias-las+easyscale",
        resize={"enabled": True},
        preemption={"min_run_time_s": 0},
    )
    root = tmp_path / "jobs"
    job_dir = JobDir.of(root, es.name, es.job_id).prepare()
    record(job_dir, 0, (("v100", 10.0),))
    fake = FakeSlurm([rigid, es], _nodes(nodes, {"node3": 2}))
    daemon, clock = make(cfg, fake, at(start_of(jobs, 24), 600))
    report = daemon.run_pass()
    assert report.observation is not None and report.decision is not None
    profile = next(v.scaling for v in report.observation.jobs if v.job_id == es.job_id)
    assert isinstance(profile, EstProfile) and profile.ests == 8
    assert dict(profile.capability) == pytest.approx({"a100": 10.0, "v100": 10.0})
    assert next(v.scaling for v in report.observation.jobs if v.job_id == 24) is None  # rigid: no model
    assert [(r.job_id, r.gpus) for r in report.decision.resizes] == [(es.job_id, 8)]
    assert all(name in {"node3", "node4"} for r in report.decision.resizes for name, _ in r.allocation)
    (grow,) = [a for a in report.actions if isinstance(a, Resize)]
    assert (grow.job_id, grow.old_gpus, grow.new_gpus, grow.gpu_type) == (es.job_id, 2, 8, "v100")
    # the job checkpoints, is requeued, set to 8 tasks and runs again on 8 v100; it then reports C_v100 = 2
    later = replace(_v100_job(jobs, 8, 1), start_time=start_of(jobs, 24) + timedelta(seconds=700))
    record(job_dir, 1, (("v100", 2.0),))
    fake._jobs = [rigid, later]  # what squeue shows now
    fake._nodes = _nodes(nodes, {"node3": 4, "node4": 4})
    clock.now = at(start_of(jobs, 24), 1400)
    report = daemon.run_pass()
    assert report.decision is not None
    assert [(r.job_id, r.gpus) for r in report.decision.resizes] == [(es.job_id, 2)]
    (back,) = [a for a in report.actions if isinstance(a, Resize)]
    assert (back.old_gpus, back.new_gpus, back.gpu_type) == (8, 2, "v100")


def test_role_3_watches_a_grow_until_the_job_reports_from_its_new_run(busy: tuple[list[Job], list[Node]]) -> None:
    jobs, _ = busy
    before = _v100_job(jobs, 2, 3)
    profile = EstProfile((1,), (1.0,), capability=(("v100", 10.0),), ests=8, base_type="v100")
    watch = watch_grow(profile, before)
    assert watch.previous == (("v100", 2),) and watch.before == pytest.approx(20.0) and watch.restart_count == 3
    assert job_gpus(before) == (("v100", 2),)
    after = _v100_job(jobs, 8, 4)
    assert observed_scale_out(watch, profile, before, reported=True) is None  # still the run before the grow
    assert observed_scale_out(watch, profile, after, reported=False) is None  # no report from the new run yet
    seen = observed_scale_out(watch, profile, after, reported=True)
    assert seen is not None and seen.after == pytest.approx(80.0) and not seen.worse
    slower = replace(profile, capability=(("v100", 2.0),))
    worse = observed_scale_out(watch, slower, after, reported=True)
    assert worse is not None and worse.worse and worse.previous_gpus == 2
