"""easyscale-homo / easyscale-heter: 2D-LAS at the minimum, free GPUs by Role 2's proposals, Role 3's fallback."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpc_elastic.policy import ClusterState, Decision, JobStatus, JobTable, JobView, NodeView, PassInput, make_policy
from hpc_elastic.policy.easyscale import evaluate
from hpc_elastic.policy.hetero import EstProfile, ScaleOut, est_profile
from hpc_elastic.policy.policies import PolicyOptions
from hpc_elastic.sim.cluster import NodeSpec
from hpc_elastic.sim.engine import SimConfig, Simulator
from hpc_elastic.sim.trace import TraceJob

R = JobStatus.RUNNING
CAP = {"v100": 3.0, "k80": 1.0}


def run(name: str, jobs: list[JobView], nodes: list[NodeView]) -> Decision:
    cluster = ClusterState.from_nodes(nodes)
    return make_policy(name).schedule(PassInput(100.0, JobTable.from_views(jobs, cluster), cluster))


def gpus_after(decision: Decision) -> dict[int, dict[str, int]]:
    """GPUs per node of every job the decision starts or resizes."""
    out = {s.job_id: dict(s.allocation) for s in decision.starts}
    out.update({r.job_id: dict(r.allocation) for r in decision.resizes})
    return out


def elastic(job_id: int, held: tuple[tuple[str, int], ...], ests: int, profile: EstProfile | None = None) -> JobView:
    gpus = sum(n for _, n in held)
    return JobView(
        job_id,
        gpus,
        0.0,
        R,
        attained_service=10.0,
        allocation=held,
        min_gpus=1,
        max_gpus=ests,
        scaling=profile or est_profile(CAP, ests, "v100"),
    )


def test_free_gpus_go_by_speedup_per_gpu() -> None:
    # A: 4 ESTs on 2 GPUs; a third GPU still leaves 2 ESTs on one of them (no gain), two more double it (0.5 per
    # GPU). B: 3 ESTs on 2 GPUs; one more GPU doubles it (1.0 per GPU): B gets a GPU first, then none fits A.
    nodes = [NodeView("v0", 4, 0, "v100"), NodeView("v1", 2, 2, "v100")]
    a = elastic(1, (("v0", 2),), 4)
    b = elastic(2, (("v0", 2),), 3)
    decision = run("easyscale-heter", [a, b], nodes)
    assert not decision.preemptions
    assert {r.job_id: r.gpus for r in decision.resizes} == {2: 3}
    # with 4 free GPUs both grow: B by one (1.0 per GPU), A by two (0.5 per GPU)
    nodes = [NodeView("v0", 4, 0, "v100"), NodeView("v1", 4, 4, "v100")]
    decision = run("easyscale-heter", [a, b], nodes)
    assert {r.job_id: r.gpus for r in decision.resizes} == {1: 4, 2: 3}


def test_a_gang_job_is_never_shrunk_or_moved() -> None:
    nodes = [NodeView("v0", 4, 0, "v100"), NodeView("k0", 4, 2, "k80")]
    rigid = JobView(1, 2, 0.0, R, attained_service=5.0, allocation=(("v0", 2),))
    grown = elastic(2, (("v0", 2),), 8)
    other = JobView(4, 2, 0.0, R, attained_service=5.0, allocation=(("k0", 2),))
    arrival = JobView(3, 1, 90.0, min_gpus=1, max_gpus=4, scaling=est_profile(CAP, 4, "v100"))
    for name in ("easyscale-homo", "easyscale-heter"):
        decision = run(name, [rigid, grown, arrival, other], nodes)
        assert 1 not in {r.job_id for r in decision.resizes} | {p.job_id for p in decision.preemptions}
        assert 3 in {s.job_id for s in decision.starts}


def test_homo_never_mixes_types_and_heter_does_when_it_pays() -> None:
    nodes = [NodeView("v0", 2, 0, "v100"), NodeView("k0", 4, 4, "k80")]
    job = elastic(1, (("v0", 2),), 8)
    assert not run("easyscale-homo", [job], nodes).resizes
    decision = run("easyscale-heter", [job], nodes)
    (resize,) = decision.resizes
    assert dict(resize.allocation)["v0"] == 2 and dict(resize.allocation)["k0"] >= 1
    # 8 ESTs on 2 v100 (4 each): 8 / (4 / 3) = 6 mini-batches/s; with 2 k80 of 1 EST each: 8 / 1 = 8
    assert job.scaling is not None and isinstance(job.scaling, EstProfile)
    assert job.scaling.throughput({"v100": 2, "k80": 2}) == pytest.approx(8.0)
    # a type too slow to help is not mixed in (one EST on it would be the slowest of the step)
    slow = elastic(1, (("v0", 2),), 8, est_profile({"v100": 3.0, "k80": 0.1}, 8, "v100"))
    assert not run("easyscale-heter", [slow], nodes).resizes


NEAR = {"v100": 2.0, "k80": 1.8}  # a k80 almost as fast as a v100 for this model


def test_heter_gives_free_gpus_to_plans_on_one_type_first() -> None:
    # A: 2 ESTs on 1 v100 (2 mini-batches/s); with 1 k80 more, 1 EST each: 3.6/s, +0.8 per GPU. B: 4 ESTs on 2 k80
    # (3.6/s); with the 2 free k80, 1 EST each: 7.2/s, +0.5 per GPU. Plans on one type come first: B gets both k80
    # (A's own best on one type, moving to 2 k80, is +0.4 per GPU), and nothing is left for A's mixed plan.
    nodes = [NodeView("v0", 1, 0, "v100"), NodeView("k0", 4, 2, "k80")]
    a = elastic(1, (("v0", 1),), 2, est_profile(NEAR, 2, "v100"))
    b = elastic(2, (("k0", 2),), 4, est_profile(NEAR, 4, "v100"))
    decision = run("easyscale-heter", [a, b], nodes)
    assert gpus_after(decision) == {2: {"k0": 4}}
    # with one k80 more, A's mixed plan takes what B's left
    nodes = [NodeView("v0", 1, 0, "v100"), NodeView("k0", 5, 3, "k80")]
    decision = run("easyscale-heter", [a, b], nodes)
    assert gpus_after(decision) == {1: {"v0": 1, "k0": 1}, 2: {"k0": 4}}


def test_heter_offers_the_other_types_of_a_mixed_plan_again_each_pass() -> None:
    # A runs 1 v100 + 1 k80 (3.6/s). It keeps its v100 (its type of the most capability); its k80 goes back to the
    # grants, where B's plan on one type (2 k80 more: +0.5 per GPU) comes before A's mixed plan: A shrinks to its
    # v100 (2/s), B doubles (7.2/s): 9.2 mini-batches/s in all instead of 7.2.
    nodes = [NodeView("v0", 1, 0, "v100"), NodeView("k0", 4, 1, "k80")]
    a = elastic(1, (("v0", 1), ("k0", 1)), 2, est_profile(NEAR, 2, "v100"))
    b = elastic(2, (("k0", 2),), 4, est_profile(NEAR, 4, "v100"))
    decision = run("easyscale-heter", [a, b], nodes)
    assert gpus_after(decision) == {1: {"v0": 1}, 2: {"k0": 4}}
    assert not decision.preemptions
    # where no plan on one type wants the k80, A keeps its mixed plan as it is (no resize)
    alone = run("easyscale-heter", [a], nodes)
    assert not alone.resizes and not alone.preemptions


def test_homo_grows_in_the_type_it_holds() -> None:
    nodes = [NodeView("v0", 4, 2, "v100"), NodeView("k0", 4, 4, "k80")]
    decision = run("easyscale-homo", [elastic(1, (("v0", 2),), 8)], nodes)
    assert gpus_after(decision) == {1: {"v0": 4}}


def test_fallback_after_a_scale_out_that_ran_slower() -> None:
    nodes = [NodeView("v0", 4, 0, "v100"), NodeView("v1", 4, 4, "v100")]
    profile = est_profile(CAP, 8, "v100")
    worse = profile.__class__(
        profile.gpus,
        profile.speedup,
        capability=profile.capability,
        ests=8,
        base_type="v100",
        scale_out=ScaleOut(before=2.0, after=1.5, previous=(("v100", 2),)),
    )
    decision = run("easyscale-heter", [elastic(1, (("v0", 4),), 8, worse)], nodes)
    assert {r.job_id: r.gpus for r in decision.resizes} == {1: 2}  # back to its GPUs before, not grown again
    better = ScaleOut(before=2.0, after=3.9, previous=(("v100", 2),))
    kept = profile.__class__(
        profile.gpus, profile.speedup, capability=profile.capability, ests=8, base_type="v100", scale_out=better
    )
    decision = run("easyscale-heter", [elastic(1, (("v0", 4),), 8, kept)], nodes)
    assert {r.job_id: r.gpus for r in decision.resizes} == {1: 8}  # it paid: the job grows on


def test_engine_speed_of_a_mixed_job_is_eq_1d() -> None:
    # 4 ESTs, C = 2 on v100 and 1 on k80, requested on 1 v100: 4 ESTs there take 4 / 2 = 2 s a step (2 /s).
    # heter starts it on 1 v100 + 2 k80 (+2 k80: speedup 2, 0.5 per GPU; +1 k80: 1.33): A = 2 on the v100, 1 on
    # each k80, f = max(2 / 2, 1 / 1) = 1 s, 4 mini-batches/s: twice as fast, 100 s of work end at 50 s.
    capability = {"v100": 2.0, "k80": 1.0}
    plan = evaluate({"v100": 1, "k80": 2}, {"v100": 2, "k80": 1}, capability, 4)
    assert plan.overload == 1.0 and plan.waste == 0.0 and plan.throughput == 4.0
    assert evaluate({"v100": 1}, {"v100": 4}, capability, 4).throughput == 2.0
    nodes = (NodeSpec("v0", 1, "v100"), NodeSpec("k0", 2, "k80"))
    job = TraceJob("j", 0.0, 1, 100.0, min_gpus=1, max_gpus=4, scaling=est_profile(capability, 4, "v100"))
    heter = Simulator([job], nodes, make_policy("easyscale-heter"), SimConfig(record_events=True)).run()
    assert heter.end.tolist() == [pytest.approx(50.0)]
    assert {name for e in heter.log if e.allocation for name, _ in e.allocation} == {"v0", "k0"}
    homo = Simulator([job], nodes, make_policy("easyscale-homo"), SimConfig()).run()
    assert homo.end.tolist() == [pytest.approx(100.0)]  # stays on its v100 (1 GPU of a type held, none free)
    # a rigid job on another type than it asked for runs at that type's capability: 100 s of v100 work on k80
    rigid = TraceJob("r", 0.0, 2, 100.0, scaling=est_profile(capability, 2, "v100"))
    on_k80 = Simulator([rigid], (NodeSpec("k0", 2, "k80"),), make_policy("fifo"), SimConfig()).run()
    assert on_k80.end.tolist() == [pytest.approx(200.0)]


def test_engine_records_the_scale_out_for_role_3() -> None:
    capability = {"v100": 1.0}
    nodes = (NodeSpec("v0", 4, "v100"),)
    first = TraceJob("a", 0.0, 2, 50.0)
    job = TraceJob("b", 1.0, 2, 1000.0, min_gpus=1, max_gpus=4, scaling=est_profile(capability, 4, "v100"))
    sim = Simulator([first, job], nodes, make_policy("easyscale-heter"), SimConfig())
    result = sim.run()
    assert int(result.resizes[1]) >= 1
    observed = result.scale_outs[1]
    assert result.scale_outs[0] is None and observed is not None
    assert observed.after > observed.before and not observed.worse
    # what a replay learns stays in it: the simulator's profile is as given, and a second replay is the same
    assert isinstance(sim.scaling[1], EstProfile) and sim.scaling[1].scale_out is None
    again = sim.run()
    assert again.scale_outs == result.scale_outs and again.end.tolist() == result.end.tolist()


def test_simulator_refuses_a_profile_without_the_cluster_types() -> None:
    job = TraceJob("j", 0.0, 1, 10.0, scaling=est_profile({"v100": 1.0}, 1, "v100"))
    with pytest.raises(ValueError, match="k80"):
        Simulator([job], (NodeSpec("k0", 2, "k80"),), make_policy("fifo"))


def test_the_daemons_easyscale_proposes_only_types_a_job_may_run_on() -> None:
    # 8 ESTs on 2 v100 (4 each: 8 / (4 / 1) = 2 per s); on 4 idle a100 of C = 3 (2 each): 8 / (2 / 3) = 12
    nodes = [NodeView("v0", 2, 0, "v100"), NodeView("a0", 4, 4, "a100")]
    profile = est_profile({"v100": 1.0, "a100": 3.0}, 8, "v100")
    anywhere = elastic(1, (("v0", 2),), 8, profile)
    assert gpus_after(run("easyscale-homo", [anywhere], nodes)) == {1: {"a0": 4}}  # the simulator's: it moves
    assert gpus_after(run("tiresias-las+easyscale", [anywhere], nodes)) == {1: {"a0": 4}}
    pinned = JobView(
        1,
        2,
        0.0,
        R,
        attained_service=10.0,
        allocation=(("v0", 2),),
        min_gpus=1,
        max_gpus=8,
        gpu_types=frozenset({"v100"}),
        scaling=profile,
    )
    assert not run("tiresias-las+easyscale", [pinned], nodes).resizes  # the daemon's: only v100, none idle
    assert gpus_after(run("easyscale-homo", [pinned], nodes)) == {1: {"a0": 4}}  # the simulator's ignores it


@pytest.mark.parametrize("name", ["easyscale-homo", "easyscale-heter", "tiresias-las+easyscale"])
def test_a_job_within_its_minimum_run_time_is_not_granted_a_proposal(name: str) -> None:
    # A ran 10 s of a 300 s minimum run time: it keeps its 2 v100 as they are. Its proposal (to move to, or mix
    # in, the 4 a100 where it runs 6x faster) is not granted, so the a100 it would have taken or the v100 it
    # would have released are not handed to B on paper while A still holds them: B, past its minimum, grows on
    # the a100 instead.
    nodes = [NodeView("v0", 4, 0, "v100"), NodeView("a0", 4, 4, "a100")]
    profile = est_profile({"v100": 1.0, "a100": 6.0}, 8, "v100")
    types = frozenset({"v100", "a100"})
    young = JobView(1, 2, 0.0, R, 10.0, allocation=(("v0", 2),), min_gpus=1, max_gpus=8, scaling=profile)
    old = JobView(2, 2, 0.0, R, 900.0, allocation=(("v0", 2),), min_gpus=1, max_gpus=8, scaling=profile)
    young, old = (replace(j, run_time=j.attained_service, gpu_types=types) for j in (young, old))
    cluster = ClusterState.from_nodes(nodes)
    policy = make_policy(name, PolicyOptions(min_run_time=300.0))
    decision = policy.schedule(PassInput(1000.0, JobTable.from_views([young, old], cluster), cluster))
    after = gpus_after(decision)
    assert 1 not in after and not decision.preemptions
    assert after[2].get("a0", 0) >= 1
    used = {"v0": 2, "a0": 0}  # A's, kept
    for alloc in after.values():
        for node, count in alloc.items():
            used[node] += count
    assert used["v0"] <= 4 and used["a0"] <= 4
