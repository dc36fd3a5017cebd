"""Lower bounds on the average JCT: hand-computed cases, and no simulated policy below them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.policy import make_policy
from hpc_elastic.policy.hetero import est_profile
from hpc_elastic.policy.types import ScalingCurve
from hpc_elastic.sim.bounds import (
    gpus_by_type,
    isolated_jct,
    jct_bound,
    least_capacity_seconds,
    srpt_mean_flow,
)
from hpc_elastic.sim.cluster import NodeSpec
from hpc_elastic.sim.engine import SimConfig, Simulator
from hpc_elastic.sim.trace import TraceJob

CAP = {"v100": 2.0, "k80": 1.0}


def est_job(duration: float = 100.0, gpus: int = 2, ests: int = 4, submit: float = 0.0) -> TraceJob:
    profile = est_profile(CAP, ests, "v100")
    return TraceJob("j", submit, gpus, duration, min_gpus=1, max_gpus=ests, scaling=profile)


def test_srpt_by_hand() -> None:
    # job 1 runs 0-1 (2 s left); job 2 (1 s) is shorter: 1-2; job 1 ends at 4. Flows 4 and 1.
    assert srpt_mean_flow([(0.0, 3.0), (1.0, 1.0)]) == pytest.approx(2.5)
    # an idle gap: flows 2 and 1
    assert srpt_mean_flow([(5.0, 1.0), (0.0, 2.0)]) == pytest.approx(1.5)
    # all at once: shortest first, completions 1, 3, 6
    assert srpt_mean_flow([(0.0, 3.0), (0.0, 1.0), (0.0, 2.0)]) == pytest.approx(10.0 / 3.0)


@pytest.mark.parametrize("jobs", [[], [(0.0, -1.0)], [(math.nan, 1.0)], [(0.0, math.inf)]])
def test_srpt_refuses_bad_input(jobs: list[tuple[float, float]]) -> None:
    with pytest.raises(ValueError, match="job"):
        srpt_mean_flow(jobs)


def test_isolated_jct_of_a_profile_is_eq_1d_on_the_whole_cluster() -> None:
    job = est_job()  # 4 ESTs, asked on 2 v100: 2 ESTs each, f = 2 / 2 = 1 s, 4 mini-batches/s
    assert isolated_jct(job, {"v100": 4}) == pytest.approx(50.0)  # 4 v100, 1 EST each: f = 0.5 s
    assert isolated_jct(job, {"v100": 2, "k80": 2}) == pytest.approx(100.0)  # 1 EST each: the k80 take 1 s
    assert isolated_jct(job, {"k80": 4}) == pytest.approx(100.0)
    assert isolated_jct(job, {"k80": 2}) == pytest.approx(200.0)  # 2 ESTs on a k80: 2 s a step
    # on one type: 2 v100 (2 ESTs each, 1 s) or 2 k80 (2 s): no faster than asked
    assert isolated_jct(job, {"v100": 2, "k80": 2}, one_type=True) == pytest.approx(100.0)
    assert isolated_jct(job, {"v100": 1, "k80": 3}) == pytest.approx(100.0)  # 1 EST each: 1 s a step
    assert isolated_jct(job, {"v100": 1, "k80": 3}, one_type=True) == pytest.approx(200.0)  # 1 v100 or 3 k80: 2 s
    assert isolated_jct(job, {"p100": 8}) == math.inf  # no capability there


def test_isolated_jct_of_a_curve_is_its_best_count() -> None:
    rigid = TraceJob("r", 0.0, 2, 100.0)
    assert isolated_jct(rigid, {"": 8}) == pytest.approx(100.0)
    elastic = TraceJob("e", 0.0, 2, 100.0, min_gpus=2, max_gpus=8)  # linear
    assert isolated_jct(elastic, {"": 4}) == pytest.approx(50.0)  # at most the cluster's 4
    curve = ScalingCurve((1, 2, 4), (1.0, 1.8, 2.0))
    bent = TraceJob("b", 0.0, 1, 100.0, min_gpus=1, max_gpus=4, scaling=curve)
    assert isolated_jct(bent, {"": 4}) == pytest.approx(50.0)
    # its most efficient count is 1 GPU: 100 GPU-seconds (2 GPUs take 2 x 100 / 1.8)
    assert least_capacity_seconds(bent, {"": 4}, {"": 1.0}) == pytest.approx(100.0)


def test_least_capacity_of_a_profile() -> None:
    job = est_job()  # 400 mini-batches in all (100 s at 4 per second)
    # one unit per GPU-second: a v100 does 2 a second, so 200 GPU-seconds
    assert least_capacity_seconds(job, {"v100": 2, "k80": 2}, {"v100": 1.0, "k80": 1.0}) == pytest.approx(200.0)
    # weighted by its own capability: one mini-batch per unit on either type
    assert least_capacity_seconds(job, {"v100": 2, "k80": 2}, CAP) == pytest.approx(400.0)
    with pytest.raises(ValueError, match="weight of GPU type 'k80'"):
        least_capacity_seconds(job, {"v100": 2, "k80": 2}, {"v100": 1.0})


def test_jct_bound_takes_the_larger_relaxation() -> None:
    nodes = (NodeSpec("v0", 2, "v100"), NodeSpec("k0", 2, "k80"))
    assert gpus_by_type(nodes) == {"v100": 2, "k80": 2}
    # ten jobs at once: alone, each takes 100 s; the capacity (2 x 2 + 2 x 1 = 6 mini-batches/s for this profile)
    # serves 400 mini-batches in 66.7 s, so SRPT's completions are 66.7 k s for k = 1..10, mean 366.7 s
    bound = jct_bound([est_job() for _ in range(10)], nodes)
    assert bound.isolated == pytest.approx(100.0)
    assert bound.fluid == pytest.approx(400.0 / 6.0 * 5.5)
    assert bound.value == bound.fluid
    assert bound.isolated_one_type == pytest.approx(100.0)  # on its 2 v100 as asked
    assert bound.one_type_value == bound.fluid
    with pytest.raises(ValueError, match="no jobs"):
        jct_bound([], nodes)


NODES = (NodeSpec("v0", 4, "v100"), NodeSpec("v1", 4, "v100"), NodeSpec("p0", 4, "p100"), NodeSpec("k0", 4, "k80"))
CAPS = (
    {"v100": 3.0, "p100": 1.5, "k80": 1.0},
    {"v100": 2.0, "p100": 1.8, "k80": 0.5},
    {"v100": 1.0, "p100": 2.0, "k80": 1.2},  # a model faster off v100 (as Gavel's Recommendation)
)


@st.composite
def traces(draw: st.DrawFn) -> list[TraceJob]:
    jobs = []
    for i in range(draw(st.integers(1, 24))):
        gpus = draw(st.sampled_from((1, 1, 2, 4)))
        submit = draw(st.floats(0.0, 300.0, allow_nan=False))
        duration = draw(st.floats(10.0, 2000.0, allow_nan=False))
        if draw(st.booleans()):
            ests = 2 * gpus
            profile = est_profile(CAPS[draw(st.integers(0, len(CAPS) - 1))], ests, "v100")
            job = TraceJob(f"j{i}", submit, gpus, duration, min_gpus=max(1, gpus // 2), max_gpus=ests, scaling=profile)
        else:
            job = TraceJob(f"j{i}", submit, gpus, duration)
        jobs.append(job)
    return jobs


@pytest.mark.parametrize("policy", ["fifo", "tiresias-las", "easyscale-homo", "easyscale-heter"])
@settings(max_examples=25, deadline=None)
@given(jobs=traces())
def test_no_simulated_policy_beats_the_bounds(policy: str, jobs: list[TraceJob]) -> None:
    sim = Simulator(jobs, NODES, make_policy(policy), SimConfig())
    result = sim.run()
    assert result.finished == len(sim.jobs)
    cluster = gpus_by_type(NODES)
    floor = np.array([isolated_jct(job, cluster) for job in sim.jobs])
    assert np.all(result.jct >= floor * (1 - 1e-9))
    bound = jct_bound(sim.jobs, NODES)
    assert float(result.jct.mean()) >= bound.value * (1 - 1e-9)
    if policy != "easyscale-heter":  # each job's plan on one type at a time
        floor = np.array([isolated_jct(job, cluster, one_type=True) for job in sim.jobs])
        assert np.all(result.jct >= floor * (1 - 1e-9))
        assert float(result.jct.mean()) >= bound.one_type_value * (1 - 1e-9)


def test_heter_alone_beats_what_plans_on_one_type_can_reach() -> None:
    nodes = (NodeSpec("v0", 1, "v100"), NodeSpec("k0", 3, "k80"))
    job = est_job(gpus=1)  # 4 ESTs asked on 1 v100: 2 s a step
    cluster = gpus_by_type(nodes)
    heter = Simulator([job], nodes, make_policy("easyscale-heter"), SimConfig()).run()
    homo = Simulator([job], nodes, make_policy("easyscale-homo"), SimConfig()).run()
    assert isolated_jct(job, cluster) == pytest.approx(50.0)  # 1 v100 + 3 k80, 1 EST each: 1 s a step
    assert isolated_jct(job, cluster, one_type=True) == pytest.approx(100.0)
    assert 50.0 <= float(heter.jct[0]) < 100.0 <= float(homo.jct[0])
