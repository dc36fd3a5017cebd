"""Cost of one scheduling pass (priorities + preemption plan + placement) at 1k / 10k / 100k active jobs.

The cluster has 2,000 GPUs (250 nodes x 8). Jobs are drawn at random: GPU counts from Tiresias's testbed mix,
attained service log-uniform over 1 GPU-s .. 1e6 GPU-s, half of them started at some point; enough jobs run to
fill 90% of the cluster and, for the MLFQ policies, fresh jobs in Q1 outrank demoted running ones, so passes preempt and
place. Each policy's :meth:`schedule` is timed on a prebuilt :class:`JobTable` (median of repeats); the cost of
building that table from :class:`JobView` objects (what a daemon does) is timed separately.

Goal: <= 100 ms at 10k, growth no worse than n log n (ratio 13.3 from 1k to 10k, 12.5 from 10k to 100k).
Ends with one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable

import numpy as np

from hpc_elastic.policy import (
    POLICY_NAMES,
    ClusterState,
    JobStatus,
    JobTable,
    JobView,
    NodeView,
    PassInput,
    Policy,
    make_policy,
)
from hpc_elastic.sim.synth import GPU_MIX

NODES, PER_NODE = 250, 8
FREE_SHARE = 0.1  # GPUs left free by the running jobs, so that non-preemptive policies place jobs too


def build(n: int, seed: int) -> tuple[PassInput, list[JobView], list[NodeView]]:
    rng = np.random.default_rng(seed)
    values = np.array([g for g, _ in GPU_MIX])
    weights = np.array([w for _, w in GPU_MIX], dtype=np.float64)
    gpus = rng.choice(values, size=n, p=weights / weights.sum())
    attained = np.exp(rng.uniform(0.0, math.log(1e6), size=n))
    started = rng.random(n) < 0.5
    free = [PER_NODE] * NODES
    node = 0
    jobs: list[JobView] = []
    for i in range(n):
        g = int(gpus[i])
        alloc: list[tuple[str, int]] = []
        if started[i] and node < NODES and sum(free[node:]) - FREE_SHARE * NODES * PER_NODE >= g:
            need = g
            while need:
                take = min(free[node], need)
                if take:
                    alloc.append((f"n{node}", take))
                    free[node] -= take
                    need -= take
                if free[node] == 0:
                    node += 1
        running = bool(alloc)
        a = float(attained[i]) if started[i] else 0.0
        jobs.append(
            JobView(
                job_id=i,
                gpus=g,
                submit_time=float(i),
                status=JobStatus.RUNNING if running else JobStatus.PENDING,
                attained_service=a,
                executed_time=a / g,
                waiting_time=0.0 if running else float(rng.uniform(0, 1e4)),
                run_time=float(rng.uniform(0, 3600)) if running else 0.0,
                first_start_time=float(i) + 1.0 if started[i] else None,
                queue=int(a >= 3200.0),
                skew=float(rng.random()),
                allocation=tuple(alloc),
                remaining_time=float(rng.uniform(10, 1e5)),
                time_limit=float(rng.uniform(100, 2e5)),
            )
        )
    nodes = [NodeView(f"n{k}", PER_NODE, free[k]) for k in range(NODES)]
    cluster = ClusterState.from_nodes(nodes)
    return PassInput(float(n) + 10.0, JobTable.from_views(jobs, cluster), cluster), jobs, nodes


def timed(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--repeats", type=int, default=0, help="repeats per size (default: scaled to size)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    history = np.exp(np.random.default_rng(1).uniform(math.log(100), math.log(1e6), size=1000)).tolist()
    policies: dict[str, Policy] = {}
    for name in args.policies.split(","):
        policy = make_policy(name)
        policies[name] = policy.with_history(history) if policy.uses_history else policy
    ms: dict[str, dict[int, float]] = {name: {} for name in policies}
    convert_ms: dict[int, float] = {}
    starts: dict[str, dict[int, int]] = {name: {} for name in policies}
    preempts: dict[str, dict[int, int]] = {name: {} for name in policies}
    for n in sizes:
        inp, jobs, nodes = build(n, seed=n)
        repeats = args.repeats or max(3, min(30, 30_000 // n))
        cluster = ClusterState.from_nodes(nodes)
        convert_ms[n] = timed(functools.partial(JobTable.from_views, jobs, cluster), max(1, repeats // 3))
        for name, policy in policies.items():
            decision = policy.schedule(inp)
            starts[name][n] = len(decision.starts)
            preempts[name][n] = len(decision.preemptions)
            ms[name][n] = timed(functools.partial(policy.schedule, inp), repeats)
    print("one pass, 2,000 GPUs; median ms (starts/preemptions in the pass)")
    print(f"  {'policy':18s}" + "".join(f"{n:>22,d}" for n in sizes) + "   growth per x10")
    ratios: dict[str, list[float]] = {}
    for name in policies:
        cells = "".join(f"{ms[name][n]:>10.2f} ({starts[name][n]:>4d}/{preempts[name][n]:>4d})" for n in sizes)
        ratios[name] = [ms[name][b] / ms[name][a] for a, b in itertools.pairwise(sizes)]
        print(f"  {name:18s}{cells}   " + " ".join(f"{r:5.1f}" for r in ratios[name]))
    nlogn = [(b * math.log(b)) / (a * math.log(a)) for a, b in itertools.pairwise(sizes)]
    print(f"  {'n log n':18s}" + " " * (22 * len(sizes)) + "   " + " ".join(f"{r:5.1f}" for r in nlogn))
    print(f"  {'JobTable.from_views':18s}" + "".join(f"{convert_ms[n]:>22.2f}" for n in sizes))
    out = {
        "cluster_gpus": NODES * PER_NODE,
        "sizes": sizes,
        "pass_ms": {name: {str(n): round(v, 3) for n, v in d.items()} for name, d in ms.items()},
        "growth_per_x10": {name: [round(r, 2) for r in rs] for name, rs in ratios.items()},
        "nlogn_growth": [round(r, 2) for r in nlogn],
        "from_views_ms": {str(n): round(v, 3) for n, v in convert_ms.items()},
        "goal_10k_ms": 100,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
