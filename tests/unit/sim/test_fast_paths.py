"""The simulator's shortcuts for speed change no outcome: the same replay with and without them."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_elastic.policy import make_policy
from hpc_elastic.sim import engine
from hpc_elastic.sim.cluster import parse_cluster_spec
from hpc_elastic.sim.engine import SimConfig, SimResult, Simulator

from .golden_cases import trace


def same_replay(a: SimResult, b: SimResult) -> None:
    """Every job's times, every count and the timeline, to the bit."""
    for column in ("first_start", "end", "queue_delay", "preemptions", "resizes"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column), err_msg=column)
    assert (a.events, a.busy_gpu_seconds, a.preemption_cost) == (b.events, b.busy_gpu_seconds, b.preemption_cost)
    for column in ("time", "waiting", "busy_gpus"):
        np.testing.assert_array_equal(getattr(a.timeline, column), getattr(b.timeline, column), err_msg=column)


@pytest.mark.parametrize("policy", ["gandiva", "srtf", "tiresias-las+elastic"])
def test_stale_completions_leaving_the_heap_change_nothing(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = trace(300, 24, 1.6, 3)
    nodes = parse_cluster_spec("6x4")
    kept = Simulator(jobs, nodes, make_policy(policy), SimConfig()).run()
    assert int(kept.preemptions.sum()) + int(kept.resizes.sum()) > 20  # (stale completions to purge)
    monkeypatch.setattr(engine, "_PURGE_AT", 1)  # purge as soon as stale events outnumber the live ones
    purged = Simulator(jobs, nodes, make_policy(policy), SimConfig()).run()
    same_replay(kept, purged)
