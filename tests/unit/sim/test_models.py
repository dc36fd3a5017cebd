"""The simulator's reference model and elastic jobs."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_elastic.policy import POLICY_NAMES, PolicyOptions, QueueOrder, make_policy
from hpc_elastic.sim.cluster import NodeSpec, parse_cluster_spec
from hpc_elastic.sim.engine import EventKind, SimConfig, SimModel, Simulator, count_nodes
from hpc_elastic.sim.trace import TraceJob

REFERENCE = SimConfig(model=SimModel.REFERENCE, record_events=True)


def test_reference_model_counts_gpus_and_costs_nothing() -> None:
    """A skewed 6-GPU job spread over three nodes (4 + 2 + 2 GPUs: two could hold it) runs slower in the realistic
    model only, and a preemption costs a checkpoint and a restore there only."""
    jobs = [
        TraceJob("wide", 0.0, 6, 100.0, skew=0.9, checkpoint_bytes=1.2e9, line=0),
        TraceJob("short", 10.0, 4, 5.0, line=1),
    ]
    nodes = (NodeSpec("a", 4), NodeSpec("b", 2), NodeSpec("c", 2))
    policy = make_policy("tiresias-las", PolicyOptions(thresholds=(50.0,), pack_limit=1.0))  # (not consolidated)
    realistic = Simulator(jobs, nodes, policy, SimConfig(spread_slowdown=2.0)).run()
    reference = Simulator(jobs, nodes, policy, REFERENCE).run()
    assert reference.preemption_cost == 0.0 < realistic.preemption_cost
    ends = dict(zip(reference.names, reference.end.tolist(), strict=True))
    assert ends == {"wide": pytest.approx(105.0), "short": pytest.approx(15.0)}
    assert realistic.end.max() > 200.0  # the spread skewed job at half speed
    assert {node for e in reference.log for node, _ in e.allocation} == {"count-gpu"}


def test_count_nodes_merges_the_nodes_of_each_gpu_type() -> None:
    nodes = (*parse_cluster_spec("3x4"), *(NodeSpec(f"v{i}", 8, "V100") for i in range(2)))
    assert [(n.gpu_type, n.gpus) for n in count_nodes(nodes)] == [("", 12), ("V100", 16)]


def test_reference_model_orders_queues_as_lists() -> None:
    jobs = [TraceJob(f"j{i}", float(i), 1 + i % 2, 30.0 + 7 * i, line=i) for i in range(12)]
    policy = make_policy("tiresias-las", PolicyOptions(thresholds=(40.0,)))
    sim = Simulator(jobs, parse_cluster_spec("1x3"), policy, REFERENCE)
    assert sim.policy.options.queue_order is QueueOrder.LIST
    listed = make_policy("tiresias-las", PolicyOptions(thresholds=(40.0,), queue_order=QueueOrder.LIST))
    count = SimConfig(bandwidth=1e30, spread_slowdown=1.0)
    np.testing.assert_array_equal(sim.run().end, Simulator(jobs, parse_cluster_spec("1x3"), listed, count).run().end)


def elastic(name: str, submit: float, gpus: int, duration: float, top: int, line: int) -> TraceJob:
    return TraceJob(name, submit, gpus, duration, checkpoint_bytes=0.6e9, line=line, min_gpus=gpus, max_gpus=top)


def test_elastic_job_lends_and_borrows_gpus() -> None:
    """A (1 GPU asked, up to 4, linear) starts on the 4 idle GPUs; B (1 GPU) arrives at 10: A shrinks to 3; B ends
    at 20: A grows back to 4 and ends at 20 + (100 - 40 - 30) / 4."""
    jobs = [elastic("a", 0.0, 1, 100.0, 4, 0), TraceJob("b", 10.0, 1, 10.0, line=1)]
    result = Simulator(jobs, parse_cluster_spec("1x4"), make_policy("tiresias-las+elastic"), REFERENCE).run()
    ends = dict(zip(result.names, result.end.tolist(), strict=True))
    assert ends == {"a": pytest.approx(27.5), "b": pytest.approx(20.0)}
    assert result.resizes.tolist() == [2, 0] and result.resize_cost == 0.0
    sizes = [(e.time, sum(c for _, c in e.allocation)) for e in result.log if e.kind is EventKind.RESIZE]
    assert sizes == [(10.0, 3), (20.0, 4)]
    # the realistic model charges a checkpoint + restart per resize (2 x 0.6 GB at 1.2 GB/s)
    costly = Simulator(jobs, parse_cluster_spec("1x4"), make_policy("tiresias-las+elastic"), SimConfig()).run()
    assert costly.resize_cost == pytest.approx(2 * 1.0)
    assert costly.end[0] > result.end[0]


def test_other_policies_run_elastic_jobs_at_their_size() -> None:
    jobs = [elastic("a", 0.0, 1, 100.0, 4, 0)]
    for name in POLICY_NAMES:
        if make_policy(name).elastic:
            continue
        result = Simulator(jobs, parse_cluster_spec("1x4"), make_policy(name), SimConfig()).run()
        assert result.end.tolist() == [100.0] and int(result.resizes.sum()) == 0


def test_elastic_policy_on_rigid_jobs_decides_as_2d_las() -> None:
    jobs = [
        TraceJob(f"j{i}", float(3 * i), 1 + i % 3, 20.0 + 11 * (i % 5), skew=0.8 * (i % 2), line=i) for i in range(40)
    ]
    options = PolicyOptions(thresholds=(60.0,))
    las = Simulator(jobs, parse_cluster_spec("2x4"), make_policy("tiresias-las", options), SimConfig()).run()
    ela = Simulator(jobs, parse_cluster_spec("2x4"), make_policy("tiresias-las+elastic", options), SimConfig()).run()
    np.testing.assert_array_equal(las.end, ela.end)
    np.testing.assert_array_equal(las.preemptions, ela.preemptions)
