"""EasyScale Role 3's cap after a fallback (§3.4): on the configuration that did not pay only, and for a hold that
doubles with each fallback in a row; the simulator falls back when it observes the slower run, and retries later."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpc_elastic.policy import ClusterState, Decision, JobStatus, JobTable, JobView, NodeView, PassInput, make_policy
from hpc_elastic.policy.easyscale import DEFAULT_FALLBACK_HOLD
from hpc_elastic.policy.hetero import EstProfile, ScaleOut, est_profile
from hpc_elastic.policy.policies import PolicyOptions
from hpc_elastic.sim.cluster import NodeSpec
from hpc_elastic.sim.engine import EventKind, SimConfig, Simulator
from hpc_elastic.sim.trace import TraceJob

CAP = {"v100": 3.0, "k80": 1.0}
#: 8 ESTs on 2 v100 grew to 8 v100 at t = 90 and ran slower there: back on its 2 v100 since
FELL = ScaleOut(before=2.0, after=1.5, previous=(("v100", 2),), at=90.0, grown=(("v100", 8),))


def job(scale_out: ScaleOut | None) -> JobView:
    profile = replace(est_profile(CAP, 8, "v100"), scale_out=scale_out)
    return JobView(
        1, 2, 0.0, JobStatus.RUNNING, attained_service=10.0, allocation=(("v0", 2),), min_gpus=1, max_gpus=8,
        scaling=profile,
    )  # fmt: skip


def run(name: str, now: float, scale_out: ScaleOut | None, *, k80: bool = False, hold: float = 0.0) -> Decision:
    nodes = [NodeView("v0", 4, 2, "v100"), NodeView("v1", 4, 4, "v100")]
    if k80:
        nodes.append(NodeView("k0", 4, 4, "k80"))
    cluster = ClusterState.from_nodes(nodes)
    policy = make_policy(name, PolicyOptions(fallback_hold=hold or DEFAULT_FALLBACK_HOLD))
    return policy.schedule(PassInput(now, JobTable.from_views([job(scale_out)], cluster), cluster))


def grown(decision: Decision) -> dict[str, int]:
    """The job's GPUs per node after the pass ({} when it is not resized)."""
    return {name: n for r in decision.resizes for name, n in r.allocation}


@pytest.mark.parametrize("name", ["easyscale-homo", "easyscale-heter"])
def test_a_fallen_back_job_is_not_regrown_on_the_same_type_during_the_hold(name: str) -> None:
    assert sum(grown(run(name, 100.0, None)).values()) == 8  # with no record it grows to its 8 ESTs
    decision = run(name, 100.0, FELL)
    assert not decision.resizes  # 6 v100 idle, but the v100 grow did not pay 10 s ago
    assert decision.next_wakeup == pytest.approx(90.0 + DEFAULT_FALLBACK_HOLD)  # the pass when the cap lapses
    assert not run(name, 90.0 + DEFAULT_FALLBACK_HOLD - 1.0, FELL).resizes


@pytest.mark.parametrize("name", ["easyscale-homo", "easyscale-heter"])
def test_the_cap_lapses_after_the_hold(name: str) -> None:
    decision = run(name, 90.0 + DEFAULT_FALLBACK_HOLD, FELL)
    assert sum(grown(decision).values()) == 8 and decision.next_wakeup is None
    assert sum(grown(run(name, 150.0, FELL, hold=60.0)).values()) == 8  # a shorter hold, as configured


def test_repeated_failures_back_off_longer() -> None:
    assert [replace(FELL, earlier=k).hold(100.0) for k in range(4)] == [100.0, 200.0, 400.0, 800.0]
    assert replace(FELL, after=2.0).hold(100.0) == 0.0 and not replace(FELL, after=2.0).capped(95.0, 100.0)
    second = replace(FELL, earlier=1)  # the second fallback in a row: twice the hold
    assert second.failures == 2
    assert not run("easyscale-heter", 90.0 + DEFAULT_FALLBACK_HOLD, second).resizes
    decision = run("easyscale-heter", 100.0, second)
    assert decision.next_wakeup == pytest.approx(90.0 + 2 * DEFAULT_FALLBACK_HOLD)
    assert sum(grown(run("easyscale-heter", 90.0 + 2 * DEFAULT_FALLBACK_HOLD, second)).values()) == 8
    assert replace(FELL, earlier=10_000).hold(1.0) == 2.0**40  # (bounded: no overflow)


def test_the_cap_refuses_only_the_types_the_failed_grow_added() -> None:
    assert FELL.limits == (("v100", 2),)
    assert FELL.refuses({"v100": 3}) and not FELL.refuses({"v100": 2, "k80": 2})
    unknown = replace(FELL, grown=())  # the configuration is not known: nothing beyond the GPUs before
    assert unknown.refuses({"v100": 2, "k80": 1}) and not unknown.refuses({"v100": 2})
    # heter: idle k80 may be mixed in during the hold (8 ESTs: 2 v100 + 2 k80 run 8 /s against 6 /s), no v100
    after = grown(run("easyscale-heter", 100.0, FELL, k80=True))
    assert after["v0"] == 2 and "v1" not in after and after["k0"] >= 1
    # with the type unknown the cap is the GPUs before, as a whole
    assert not run("easyscale-heter", 100.0, unknown, k80=True).resizes


def test_scale_out_and_option_values_are_checked() -> None:
    with pytest.raises(ValueError, match="fallback time"):
        replace(FELL, at=float("inf"))
    with pytest.raises(ValueError, match="earlier failures"):
        replace(FELL, earlier=-1)
    with pytest.raises(ValueError, match="fallback_hold"):
        PolicyOptions(fallback_hold=-1.0)


def test_the_simulator_falls_back_when_it_observes_and_retries_after_a_doubling_hold() -> None:
    """Job e (4 ESTs on 2 v100 of v1) grows to 4 when b2 leaves v0 at t = 100: 2 GPUs on each node, spread, and it
    is skew-sensitive (3x slower spread), so its speed drops from 1 to 2/3. It falls back as soon as its new run is
    observed (after its restore), tries again when the hold (50 s) lapses, and each failure doubles the hold."""
    nodes = (NodeSpec("v0", 4, "v100"), NodeSpec("v1", 4, "v100"))
    profile = est_profile({"v100": 1.0}, 4, "v100")
    jobs = [
        TraceJob("b1", 0.0, 2, 2000.0),
        TraceJob("b2", 0.0, 2, 100.0),
        TraceJob("b3", 0.0, 2, 2000.0),
        TraceJob("e", 1.0, 2, 1000.0, min_gpus=1, max_gpus=4, skew=0.7, scaling=profile),
    ]
    policy = make_policy("easyscale-heter", PolicyOptions(pack_limit=0.9, fallback_hold=50.0))
    result = Simulator(jobs, nodes, policy, SimConfig(record_events=True, spread_slowdown=3.0)).run()
    resizes = [(e.time, sum(n for _, n in e.allocation)) for e in result.log if e.kind is EventKind.RESIZE]
    assert resizes[0] == (100.0, 4)
    sizes = [n for _, n in resizes]
    assert sizes == [4, 2] * (len(sizes) // 2) and len(sizes) >= 6  # grow, fall back, again after the hold
    cost = resizes[1][0] - resizes[0][0]  # the restore before the grown run is observed
    assert cost > 0
    fallbacks = [t for t, n in resizes if n == 2]
    regrows = [t for t, n in resizes if n == 4][1:]
    waits = [g - f for f, g in zip(fallbacks, regrows, strict=False)]
    assert waits == pytest.approx([50.0 * 2**k for k in range(len(waits))])
    last = result.scale_outs[3]
    assert last is not None and last.worse and last.grown == (("v100", 4),)
    assert last.earlier == len(regrows) and last.at == pytest.approx(resizes[-1][0])
    assert isinstance(jobs[3].scaling, EstProfile) and jobs[3].scaling.scale_out is None  # the trace is untouched
