"""Realistic against reference model: which modelling difference costs 2D-LAS and 2D-Gittins how much avg JCT.

The reference model (``SimModel.REFERENCE``, the public Tiresias simulator's) differs from the realistic one in
five things; this replays one trace under the realistic model with one of them switched to the reference's at a
time (and the two models themselves):

- ``counted GPUs``: the nodes merge into one pool per GPU type (no placement: a 16-GPU job never waits for two
  free nodes, a skewed job is never spread);
- ``free preemptions``: no checkpoint + restore per preemption (bandwidth 1e30 B/s);
- ``no spread slowdown``: a skewed job spread over nodes runs at full speed;
- ``list order``: the queues ordered as the reference's lists (``QueueOrder.LIST``) instead of by first start;
- ``reference index``: 2D-Gittins with the reference's approximation of the index (``DeltaMode.REFERENCE``);

and the realistic model without the spread slowdown, with list order (and the reference index): the reference
model but for its placement and its free preemptions.

Default: the synthetic heavy-tailed trace (80,000 jobs, job sizes of ``tiresias_yarn-gput1000.csv``, Tiresias's
GPU mix, Poisson arrivals at nominal load 2) on 64x8 GPUs; 2D-Gittins uses the yarn job-size distribution (the
reference's) in every variant, so that only the model changes. Ends with one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from hpc_elastic.policy import PolicyOptions, ServiceDistribution, make_policy
from hpc_elastic.policy.policies import DeltaMode, QueueOrder
from hpc_elastic.sim.cluster import NodeSpec, parse_cluster_spec
from hpc_elastic.sim.engine import SimConfig, SimModel, Simulator, count_nodes
from hpc_elastic.sim.metrics import summarize
from hpc_elastic.sim.synth import load_sizes, synthesize
from hpc_elastic.sim.trace import TraceJob

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("tiresias-las", "tiresias-gittins")


@dataclass(frozen=True, slots=True)
class Variant:
    nodes: tuple[NodeSpec, ...]
    config: SimConfig
    options: PolicyOptions


def variants(nodes: tuple[NodeSpec, ...], history: ServiceDistribution, policy: str) -> dict[str, Variant]:
    realistic = Variant(nodes, SimConfig(history=history), PolicyOptions(min_history=0))
    out = {
        "reference": replace(realistic, config=replace(realistic.config, model=SimModel.REFERENCE)),
        "realistic": realistic,
        "realistic, counted GPUs": replace(realistic, nodes=count_nodes(nodes)),
        "realistic, free preemptions": replace(realistic, config=replace(realistic.config, bandwidth=1e30)),
        "realistic, no spread slowdown": replace(realistic, config=replace(realistic.config, spread_slowdown=1.0)),
        "realistic, list order": replace(realistic, options=replace(realistic.options, queue_order=QueueOrder.LIST)),
    }
    if policy == "tiresias-gittins":
        out["realistic, reference index"] = replace(
            realistic, options=replace(realistic.options, delta_mode=DeltaMode.REFERENCE)
        )
    # the differences that matter, together (the placement matters only through the slowdown)
    listed = replace(realistic.options, queue_order=QueueOrder.LIST)
    if policy == "tiresias-gittins":
        listed = replace(listed, delta_mode=DeltaMode.REFERENCE)
    label = "realistic, no slowdown, list" + (", ref. index" if policy == "tiresias-gittins" else "")
    out[label] = Variant(nodes, replace(realistic.config, spread_slowdown=1.0), listed)
    return out


def run(jobs: tuple[TraceJob, ...], policy: str, variant: Variant) -> dict[str, float]:
    started = time.perf_counter()
    result = Simulator(jobs, variant.nodes, make_policy(policy, variant.options), variant.config).run()
    m = summarize(result)
    keys = ("avg_jct", "p99_jct", "avg_queue_delay", "preemptions", "utilization")
    out = {k: m[k] for k in keys}
    out["preemption_cost_h"] = result.preemption_cost / 3600  # seconds of checkpoint + restore, summed over jobs
    out["wall_s"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--jobs", type=int, default=80_000)
    parser.add_argument("--cluster", default="64x8")
    parser.add_argument("--load", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--variants", default="", help="labels to run, separated by semicolons (default: all)")
    args = parser.parse_args()
    sizes_file = args.traces / "tiresias_yarn-gput1000.csv"
    if not sizes_file.is_file():
        sys.exit(f"job sizes not found: {sizes_file}")
    sizes = load_sizes(sizes_file)
    history = ServiceDistribution.from_samples(sizes)
    nodes = parse_cluster_spec(args.cluster)
    gpus = sum(n.gpus for n in nodes)
    jobs = synthesize(sizes, args.jobs, gpus, load=args.load, seed=args.seed)
    print(f"{args.jobs:,} synthetic jobs (yarn sizes) on {args.cluster}, nominal load {args.load:g}, seed {args.seed}")
    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for policy in args.policies.split(","):
        print(f"\n{policy}")
        print(
            f"  {'variant':42s} {'avg JCT s':>10s} {'/ ref':>6s} {'p99 JCT s':>10s} {'preempt':>8s} "
            f"{'ckpt h':>10s} {'util':>6s} {'wall s':>7s}"
        )
        per: dict[str, dict[str, float]] = {}
        chosen = variants(nodes, history, policy)
        if args.variants:
            wanted = {"reference", *(v.strip() for v in args.variants.split(";"))}
            chosen = {label: v for label, v in chosen.items() if label in wanted}
        for label, variant in chosen.items():
            m = per[label] = run(jobs, policy, variant)
            ratio = m["avg_jct"] / per["reference"]["avg_jct"]
            print(
                f"  {label:42s} {m['avg_jct']:10.0f} {ratio:6.2f} {m['p99_jct']:10.0f} {m['preemptions']:8.0f} "
                f"{m['preemption_cost_h']:10.0f} {m['utilization']:6.3f} {m['wall_s']:7.1f}",
                flush=True,
            )
        results[policy] = per
    summary = {
        "jobs": args.jobs,
        "cluster": args.cluster,
        "load": args.load,
        "seed": args.seed,
        "results": results,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
