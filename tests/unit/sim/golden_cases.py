"""Small deterministic replays whose outcomes are pinned in ``golden.json`` (see test_golden.py).

Run as a module (``python -m tests.unit.sim.golden_cases``) to print the outcomes of the current code as JSON:
that is how ``golden.json`` was written, and how it is rewritten when a change of results is intended.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace

import numpy as np

from hpc_elastic.policy import POLICY_NAMES, PolicyOptions, make_policy
from hpc_elastic.policy.types import ScalingCurve
from hpc_elastic.sim.cluster import NodeSpec, parse_cluster_spec
from hpc_elastic.sim.engine import SimConfig, SimModel, SimResult, Simulator
from hpc_elastic.sim.synth import synthesize
from hpc_elastic.sim.trace import TraceJob

#: a job-size sample with a heavy tail (GPU-seconds)
SIZES = tuple(float(x) for x in np.round(np.random.default_rng(7).lognormal(7.0, 1.6, size=400), 3))
CURVES = (
    ScalingCurve((1, 2, 4, 8), (1.0, 1.9, 3.5, 6.0)),
    ScalingCurve((1, 2, 4, 8), (1.0, 1.6, 2.2, 2.6)),
)
TWO_TYPES = tuple(NodeSpec(f"a{i}", 4, "a100") for i in range(3)) + tuple(
    NodeSpec(f"v{i}", 8, "v100") for i in range(2)
)


def trace(n_jobs: int, capacity: int, load: float, seed: int) -> tuple[TraceJob, ...]:
    """Synthetic jobs; every third is elastic on [ceil(g / 2), 2g] with one of two scaling curves."""
    jobs = synthesize(SIZES, n_jobs, capacity, load=load, seed=seed)
    out: list[TraceJob] = []
    for i, job in enumerate(jobs):
        if i % 3 == 0:
            out.append(replace(job, min_gpus=math.ceil(job.gpus / 2), max_gpus=2 * job.gpus, scaling=CURVES[i % 2]))
        else:
            out.append(job)
    return tuple(out)


def typed(jobs: tuple[TraceJob, ...]) -> tuple[TraceJob, ...]:
    """Every fifth job may only use a100 GPUs, every seventh only v100."""
    out: list[TraceJob] = []
    for i, job in enumerate(jobs):
        a100 = i % 5 == 0
        types = frozenset({"a100"}) if a100 else frozenset({"v100"}) if i % 7 == 0 else None
        out.append(replace(job, gpu_types=types, gpus=min(job.gpus, 4 if a100 else 8)))
    return tuple(out)


def cases() -> dict[str, tuple[tuple[TraceJob, ...], tuple[NodeSpec, ...], PolicyOptions, SimConfig]]:
    """name -> (jobs, cluster, policy knobs, simulator settings)."""
    nodes = parse_cluster_spec("6x4")
    base = trace(300, 24, 1.6, 3)
    knobs = PolicyOptions(thresholds=(800.0, 8000.0), promote_knob=2.0, min_run_time=30.0, time_slice=300.0)
    return {
        "realistic": (base, nodes, PolicyOptions(), SimConfig()),
        "knobs": (base, nodes, knobs, SimConfig(restart_overhead=5.0)),
        "reference": (base, nodes, knobs, SimConfig(model=SimModel.REFERENCE)),
        "two-types": (typed(trace(250, 28, 1.4, 5)), TWO_TYPES, PolicyOptions(), SimConfig()),
        "interval": (base, nodes, PolicyOptions(), SimConfig(sched_interval=60.0, refit_pack_limit=True)),
    }


def outcome(result: SimResult) -> dict[str, object]:
    """What a change of the simulator's speed must not change: every job's times, counts and totals."""
    digest = hashlib.sha256()
    for column in (result.first_start, result.end, result.queue_delay):
        digest.update(np.round(column, 6).tobytes())
    digest.update(result.preemptions.tobytes())
    digest.update(result.resizes.tobytes())
    return {
        "avg_jct": float(np.nanmean(result.jct)),
        "finished": result.finished,
        "preemptions": int(result.preemptions.sum()),
        "resizes": int(result.resizes.sum()),
        "busy_gpu_seconds": round(result.busy_gpu_seconds, 3),
        "digest": digest.hexdigest(),
    }


def run_case(name: str, policy: str) -> dict[str, object]:
    jobs, nodes, options, config = cases()[name]
    return outcome(Simulator(jobs, nodes, make_policy(policy, options), config).run())


def main() -> None:
    print(json.dumps({name: {p: run_case(name, p) for p in POLICY_NAMES} for name in cases()}, indent=1))


if __name__ == "__main__":
    main()
