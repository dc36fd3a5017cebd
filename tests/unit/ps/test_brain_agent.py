"""Brain in the loop: readings of the job master turned into Brain's usage (pure), and the agent driving a job of
real local processes through sample, optimize and adjust within its cores, the ledger exact at the end; back to the
best observed plan when a plan measures slower (the processes real, the samples/s given by the test)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.policy.brain import Group, JobLimits, Range, ResourcePlan, Stage, Usage
from hpc_elastic.ps import brain_agent
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


class GivenRates(BrainAgent):
    """The agent with its real readings of the job but the samples/s of each plan given by ``rate``: how a plan
    that measures slower is made so whatever the machine's load."""

    def __init__(self, rate: Callable[[ResourcePlan], float], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rate = rate

    def measure(self, job: PsJob, plan: ResourcePlan) -> tuple[Usage, float]:
        usage, _ = super().measure(job, plan)
        return usage, self.rate(plan)


LIMITS = JobLimits(c_total=5, workers=Range(1, 3), ps=Range(1, 2), total_steps=400)


def run_agent(agent: BrainAgent, tmp_path: Path, samples: int = 16_000) -> list[Any]:
    first = agent.initial_plan()
    config = PsJobConfig(
        num_ps=first.num_ps, num_workers=0, num_samples=samples, shard_size=32, batch_size=32, epochs=2
    )
    with PsJob(config, tmp_path, ps_cpus=first.ps_cores[0]) as job:
        steps = agent.run(job)
        assert sorted(job.ps_cores) == sorted(steps[-1].plan.ps_cores)  # the job runs the last step's plan
        status = job.wait()
    assert status["finished"] and all(e["exactly_once"] for e in status["epochs"])
    return steps


def test_a_plan_measured_slower_falls_back_to_the_best_and_is_never_applied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 cores, a budget of 5: the sample takes the budget, adjust may grow past it (as the paper lets it); every
    # adjust proposes one more worker whatever the readings, so after its fallback it proposes a rejected plan
    agent = GivenRates(lambda p: 0.0, LIMITS, cores=8, cores_per_node=4, mem_per_node_mb=8192, window_s=0.5,
                       max_adjust=3)  # fmt: skip
    sample = agent.initial_plan()
    grown = ResourcePlan(replace(sample.workers, count=2), sample.ps_cores, sample.ps_mem_mb, Stage.ADJUST, ("grow",))
    monkeypatch.setattr(brain_agent, "adjust", lambda *args, **kwargs: grown)
    agent.rate = lambda plan: 7_092.0 if plan.shape == sample.shape else 1_555.0  # every other plan slower
    steps = run_agent(agent, tmp_path, samples=60_000)  # work left through the five windows, whatever the load
    assert all(s.full_window for s in steps)
    stages = [s.stage for s in steps]
    assert stages == [Stage.SAMPLE, Stage.OPTIMIZE, Stage.FALLBACK, Stage.ADJUST, Stage.FALLBACK]
    assert steps[1].plan.shape != sample.shape and steps[3].plan.shape == grown.shape
    assert all(s.plan.shape == sample.shape and s.samples_s == 7_092.0 for s in steps if s.stage is Stage.FALLBACK)
    assert set(agent.record.rejected) == {steps[1].plan.shape, grown.shape}
    (refusal,) = agent.refused  # the third adjust proposed the rejected plan again: not applied, the adjusts end
    assert refusal.plan.shape == grown.shape and "measured slower" in refusal.reason
    report = agent.report()
    assert [(f["from"]["samples_s"], f["to"]["samples_s"], f["after_samples_s"]) for f in report["fallbacks"]] == [
        (1_555.0, 7_092.0, 7_092.0)
    ] * 2
    assert report["fallbacks"][1]["from"]["workers"] == 2 and report["fallbacks"][1]["to"]["workers"] == 1
    assert report["adjust_steps"] == 1
    for step in steps:
        assert step.plan.total_cores <= 8 and 1 <= step.plan.workers.count <= 3 and 1 <= step.plan.num_ps <= 2


def test_a_plan_measured_faster_is_kept(tmp_path: Path) -> None:
    agent = GivenRates(lambda p: 0.0, LIMITS, cores=5, cores_per_node=4, mem_per_node_mb=8192, window_s=0.5,
                       max_adjust=0)  # fmt: skip
    sample = agent.initial_plan()
    agent.rate = lambda plan: 1_000.0 if plan.shape == sample.shape else 1_500.0
    steps = run_agent(agent, tmp_path)
    assert [s.stage for s in steps] == [Stage.SAMPLE, Stage.OPTIMIZE]
    assert agent.report()["fallbacks"] == [] and agent.record.rejected == ()


def test_a_window_at_the_jobs_end_is_not_a_measurement_of_the_plan(tmp_path: Path) -> None:
    # the optimize window ends with no shard left (as a short job's does): its samples/s are the tail's, so no
    # fallback from it; Brain stops there
    agent = GivenRates(lambda p: 0.0, LIMITS, cores=5, cores_per_node=4, mem_per_node_mb=8192, window_s=0.5,
                       max_adjust=2)  # fmt: skip
    sample = agent.initial_plan()
    agent.rate = lambda plan: 7_092.0 if plan.shape == sample.shape else 0.0
    answers = iter([True, False])
    agent.work_left = lambda job: next(answers)  # type: ignore[method-assign]
    steps = run_agent(agent, tmp_path)
    assert [(s.stage, s.full_window) for s in steps] == [(Stage.SAMPLE, True), (Stage.OPTIMIZE, False)]
    assert agent.fallbacks == [] and agent.record.latest(steps[1].plan) is None
    assert agent.report()["steps"][1]["full_window"] is False
