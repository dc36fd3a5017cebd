"""tiresias-las+elastic: 2D-LAS decides who runs at the jobs' efficient sizes, spare GPUs grow elastic jobs."""

from __future__ import annotations

import math

import pytest

from hpc_elastic.policy import (
    ClusterState,
    Decision,
    JobStatus,
    JobTable,
    JobView,
    NodeView,
    PassInput,
    ScalingCurve,
    make_policy,
)
from hpc_elastic.policy.elastic import efficient_size

R = JobStatus.RUNNING


def run(jobs: list[JobView], nodes: list[NodeView], now: float = 100.0) -> Decision:
    cluster = ClusterState.from_nodes(nodes)
    return make_policy("tiresias-las+elastic").schedule(PassInput(now, JobTable.from_views(jobs, cluster), cluster))


def sizes(decision: Decision) -> dict[int, int]:
    """GPUs of every job the decision starts or resizes."""
    out = {s.job_id: sum(c for _, c in s.allocation) for s in decision.starts}
    out.update({r.job_id: r.gpus for r in decision.resizes})
    return out


def test_a_lone_elastic_job_grows_into_the_idle_gpus() -> None:
    nodes = [NodeView("n0", 8, 6)]
    job = JobView(1, 2, 0.0, R, attained_service=100.0, allocation=(("n0", 2),), min_gpus=2, max_gpus=8)
    decision = run([job], nodes)
    assert sizes(decision) == {1: 8} and decision.resizes[0].allocation == (("n0", 8),)
    assert decision.idle_below > 8  # at its maximum: no GPU freed later changes the next pass
    wider = JobView(1, 2, 0.0, R, attained_service=100.0, allocation=(("n0", 2),), min_gpus=2, max_gpus=16)
    decision = run([wider], nodes)
    assert sizes(decision) == {1: 8} and decision.idle_below == 0  # it would grow with any GPU freed


def test_a_borrower_shrinks_for_a_new_job_and_grows_back_into_what_is_left() -> None:
    nodes = [NodeView("n0", 8, 0)]
    grown = JobView(1, 8, 0.0, R, attained_service=5000.0, allocation=(("n0", 8),), min_gpus=2, max_gpus=8)
    new = JobView(2, 4, 90.0)
    decision = run([grown, new], nodes)
    assert decision.preemptions == ()
    assert sizes(decision) == {2: 4, 1: 4}  # the new job gets its 4, the borrower keeps the other 4


def test_gpus_no_waiting_job_fits_are_lent() -> None:
    """A waiting 8-GPU job cannot start while the running job needs its minimum; the 6 GPUs left are lent."""
    nodes = [NodeView("n0", 8, 6)]
    small = JobView(1, 2, 0.0, R, attained_service=100.0, allocation=(("n0", 2),), min_gpus=2, max_gpus=8)
    big = JobView(2, 8, 50.0)
    decision = run([small, big], nodes)
    assert decision.starts == () and sizes(decision) == {1: 8}
    assert decision.next_wakeup is not None  # the waiting job still waits for the demotion of the runner


def test_spare_gpus_go_where_they_add_the_most_throughput() -> None:
    """One GPU at a time, to the job whose speed grows the most from it (relatively); ties: least attained."""
    old = JobView(1, 2, 0.0, R, attained_service=900.0, allocation=(("n0", 2),), min_gpus=2, max_gpus=8)
    young = JobView(2, 2, 10.0, R, attained_service=10.0, allocation=(("n0", 2),), min_gpus=2, max_gpus=8)
    assert sizes(run([old, young], [NodeView("n0", 5, 1)])) == {2: 3}  # one spare GPU: the younger job
    assert sizes(run([old, young], [NodeView("n0", 8, 4)])) == {1: 4, 2: 4}  # linear: they share it evenly
    poor = ScalingCurve((1, 2, 4), (1.0, 1.1, 1.15))  # 2 -> 3 GPUs: +2 % only
    flat = JobView(1, 2, 0.0, R, attained_service=10.0, allocation=(("n0", 2),), min_gpus=2, max_gpus=8, scaling=poor)
    assert sizes(run([flat, young], [NodeView("n0", 8, 4)])) == {2: 6}


def test_growth_stops_where_the_speedup_does() -> None:
    nodes = [NodeView("n0", 8, 7)]
    flat = ScalingCurve((1, 2, 4, 8), (1.0, 1.9, 2.0, 2.0))  # nothing to gain past 4 GPUs
    job = JobView(1, 1, 0.0, R, allocation=(("n0", 1),), min_gpus=1, max_gpus=8, scaling=flat)
    assert sizes(run([job], nodes)) == {1: 4}


def test_growth_looks_past_a_flat_stretch_of_the_curve() -> None:
    """8 ESTs run no faster on 5-7 GPUs than on 4: with 4 spare GPUs the job jumps from 4 to 8, and with 3 it
    stays on 4 (one GPU at a time would stop at 4 either way)."""
    ests = ScalingCurve(tuple(range(1, 9)), (1.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0, 8.0))
    job = JobView(1, 4, 0.0, R, allocation=(("n0", 4),), min_gpus=2, max_gpus=8, scaling=ests)
    assert sizes(run([job], [NodeView("n0", 8, 4)])) == {1: 8}
    assert sizes(run([job], [NodeView("n0", 7, 3)])) == {}
    # the 3 GPUs go to a job they speed up instead
    other = JobView(2, 1, 5.0, R, attained_service=10.0, allocation=(("n0", 1),), min_gpus=1, max_gpus=4)
    assert sizes(run([job, other], [NodeView("n0", 8, 3)])) == {2: 4}


def test_a_waiting_elastic_job_starts_on_its_minimum() -> None:
    nodes = [NodeView("n0", 4, 2)]
    runner = JobView(1, 2, 0.0, R, attained_service=100.0, allocation=(("n0", 2),))
    elastic = JobView(2, 4, 50.0, min_gpus=2, max_gpus=4)
    assert sizes(run([runner, elastic], nodes)) == {2: 2}


#: Throughput per GPU 0.575 on 4 GPUs, less on 5-7 and 0.81 on 8 (Gavel's median curve for 16 ESTs is alike).
BUMP = ScalingCurve(tuple(range(1, 9)), (1.0, 1.8, 2.1, 2.3, 2.5, 2.7, 2.9, 6.5))


def test_efficient_size_is_the_fewest_gpus_doing_the_most_work_each() -> None:
    concave = ScalingCurve((1, 2, 4, 8), (1.0, 1.9, 3.5, 6.0))
    assert efficient_size(concave, 2, 8) == 2
    assert efficient_size(ScalingCurve(), 3, 12) == 3  # linear: every size ties, the fewest GPUs
    assert efficient_size(BUMP, 4, 8) == 8
    assert efficient_size(BUMP, 4, 6) == 4  # 5 and 6 GPUs do less per GPU than 4
    assert efficient_size(BUMP, 1, 8) == 1
    with pytest.raises(ValueError, match=r"\[4, 2\]"):
        efficient_size(BUMP, 4, 2)


def test_the_walk_counts_an_elastic_job_at_its_efficient_size() -> None:
    """Halving the first job to start the second would run it at 2.3 / 6.5 of its speed on 4 of its 8 GPUs."""
    first = JobView(1, 8, 50.0, min_gpus=4, max_gpus=8, scaling=BUMP)
    second = JobView(2, 4, 60.0)
    decision = run([first, second], [NodeView("n0", 8, 8)])
    assert sizes(decision) == {1: 8}


def test_a_job_left_out_at_its_efficient_size_starts_at_its_minimum_on_what_is_left() -> None:
    runner = JobView(1, 4, 0.0, R, attained_service=100.0, allocation=(("n0", 4),))
    waiting = JobView(2, 8, 50.0, min_gpus=4, max_gpus=8, scaling=BUMP)
    decision = run([runner, waiting], [NodeView("n0", 8, 4)])
    assert sizes(decision) == {2: 4} and decision.preemptions == ()


def test_a_job_too_big_even_at_its_minimum_waits_and_the_pass_says_how_many_gpus_would_start_it() -> None:
    runner = JobView(1, 6, 0.0, R, attained_service=100.0, allocation=(("n0", 6),))
    waiting = JobView(2, 8, 50.0, min_gpus=4, max_gpus=8, scaling=BUMP)
    decision = run([runner, waiting], [NodeView("n0", 8, 2)])
    assert decision.starts == () and decision.resizes == ()
    assert decision.idle_below == 2  # on 4 GPUs (its minimum) it could start, not only on 8


def test_a_running_job_left_out_at_its_efficient_size_shrinks_to_its_minimum_instead_of_stopping() -> None:
    low = JobView(
        1,
        8,
        0.0,
        R,
        attained_service=9e5,
        allocation=(("n0", 8),),
        queue=1,
        first_start_time=0.0,
        min_gpus=4,
        max_gpus=8,
        scaling=BUMP,
    )
    new = JobView(2, 4, 90.0)
    decision = run([low, new], [NodeView("n0", 8, 0)])
    assert decision.preemptions == ()
    assert sizes(decision) == {2: 4, 1: 4}


def test_rigid_jobs_are_scheduled_as_by_2d_las() -> None:
    nodes = [NodeView("n0", 4, 0)]
    old = JobView(1, 4, 0.0, R, attained_service=4000.0, allocation=(("n0", 4),), queue=1, first_start_time=0.0)
    new = JobView(2, 2, 90.0)
    cluster = ClusterState.from_nodes(nodes)
    inp = PassInput(100.0, JobTable.from_views([old, new], cluster), cluster)
    las, elastic = make_policy("tiresias-las").schedule(inp), make_policy("tiresias-las+elastic").schedule(inp)
    assert [s.allocation for s in elastic.starts] == [s.allocation for s in las.starts]
    assert elastic.preemptions == las.preemptions and elastic.resizes == ()
    assert elastic.idle_below == las.idle_below


@pytest.mark.parametrize(("counts", "speedups"), [((2, 4), (2.0, 4.0)), ((1, 4), (1.0, 3.0, 4.0)), ((1,), ())])
def test_scaling_curve_validated(counts: tuple[int, ...], speedups: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="scaling curve"):
        ScalingCurve(counts, speedups)


def test_scaling_curve_interpolates_caps_and_extrapolates() -> None:
    curve = ScalingCurve((1, 2, 4, 8), (1.0, 2.5, 3.0, 4.0))
    assert curve.at(2) == 2.0  # never above linear
    w = math.log2(3) - 1.0  # speedup interpolated in log2(n) between 2 (2.5, measured) and 4 GPUs (3.0)
    assert curve.at(3) == pytest.approx(2.5 + w * (3.0 - 2.5))
    assert curve.at(8) == pytest.approx(4.0)
    # past 8 GPUs: Amdahl with σ from 8 GPUs at speedup 4 (σ = 1/7)
    assert curve.at(16) == pytest.approx(16 / (1 + 15 / 7))
    assert [curve.at(n) for n in range(1, 20)] == sorted(curve.at(n) for n in range(1, 20))
