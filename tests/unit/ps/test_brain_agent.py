"""Brain in the loop: readings of the job master turned into Brain's usage (pure), and the agent driving a job of
real local processes through sample, optimize and adjust within its cores, the ledger exact at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.policy.brain import Group, JobLimits, Range, ResourcePlan, Stage
from hpc_elastic.ps.brain_agent import BrainAgent, Reading, usage_between
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.job import PsJob

PLAN = ResourcePlan(Group(2, 1, 1024), (2, 1), 1024, Stage.OPTIMIZE)


def test_cpu_seconds_per_second_are_the_cores_in_use() -> None:
    before = Reading(10.0, 100, {"w0": (5.0, 80.0, 9.0), "w1": (1.0, 70.0, 9.5)}, ((2.0, 50.0), (1.0, 40.0)))
    after = Reading(14.0, 500, {"w0": (8.0, 90.0, 13.0), "w1": (2.0, 75.0, 13.5)}, ((4.0, 55.0), (1.4, 41.0)))
    usage, rate = usage_between(before, after, PLAN)
    assert usage.worker_cpu == (0.75, 0.25) and usage.worker_rss_mb == (90.0, 75.0)
    assert usage.ps_cpu == pytest.approx((0.5, 0.1)) and rate == 100.0


def test_a_worker_without_two_readings_counts_as_the_mean() -> None:
    before = Reading(0.0, 0, {"w0": (0.0, 80.0, 0.0)}, ((0.0, 1.0), (0.0, 1.0)))
    after = Reading(2.0, 10, {"w0": (1.0, 80.0, 2.0), "w1": (0.3, 60.0, 1.9)}, ((1.0, 1.0), (0.0, 1.0)))
    usage, _ = usage_between(before, after, PLAN)
    assert usage.worker_cpu == (0.5, 0.5)


def test_readings_of_another_set_of_ps_are_refused() -> None:
    before = Reading(0.0, 0, {}, ((0.0, 1.0),))
    after = Reading(1.0, 0, {}, ((0.0, 1.0), (0.0, 1.0)))
    with pytest.raises(ValueError, match="1 then 2 PS read for a plan of 2"):
        usage_between(before, after, PLAN)
    with pytest.raises(ValueError, match="apart"):
        usage_between(after, after, PLAN)


def test_the_agent_samples_optimizes_and_adjusts_a_running_job_within_its_cores(tmp_path: Path) -> None:
    limits = JobLimits(c_total=5, workers=Range(1, 3), ps=Range(1, 2), total_steps=400)
    agent = BrainAgent(limits, cores=5, cores_per_node=4, mem_per_node_mb=8192, window_s=0.5, max_adjust=2)
    first = agent.initial_plan()
    assert first.workers.count == 1 and first.total_cores <= 5
    config = PsJobConfig(num_ps=first.num_ps, num_workers=0, num_samples=16000, shard_size=32, batch_size=32, epochs=2)
    with PsJob(config, tmp_path, ps_cpus=first.ps_cores[0]) as job:
        steps = agent.run(job)
        assert [s.stage for s in steps[:2]] == [Stage.SAMPLE, Stage.OPTIMIZE]
        assert steps[0].estimates is not None and steps[0].samples_s > 0
        for step in steps:
            assert step.plan.total_cores <= 5 and 1 <= step.plan.workers.count <= 3
        final = steps[-1].plan
        assert sorted(job.ps_cores) == sorted(final.ps_cores)
        if not any(code == 0 for code in job.exited.values()):  # (a worker out of shards at the end leaves cleanly:
            assert len(job.workers) == final.workers.count  # on a loaded machine the job can end before this line)
        status = job.wait()
    assert status["finished"] and all(e["exactly_once"] for e in status["epochs"])
