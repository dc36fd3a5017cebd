"""2D-Gittins against 2D-LAS, and how much job-size history 2D-Gittins needs (Tiresias §3.2.2-3.2.3).

Per trace and load, side by side in one run (realistic model, default knobs): 2D-LAS; 2D-Gittins with the
distribution of ``tiresias_yarn-gput1000.csv`` (the production job sizes the public Tiresias simulator's index
uses); 2D-Gittins learning the distribution online from the jobs completed so far (what the daemon does from
sacct); and 2D-Gittins with a history of only the first N jobs the cluster finished (the sizes a 2D-LAS replay
completes first: a young cluster's sacct, biased to short jobs), N = 10 ... 1000, used whatever its size.
Plus the reference model (the public simulator's) on the synthetic trace: its 2D-Gittins gain over 2D-LAS.

Traces (``../shared/traces`` or ``--traces``): a synthetic 20k-job trace with the yarn job sizes (heavy tail) on
64x8 GPUs at nominal loads 2 and 3, the Alibaba openb pods on 4x8 at load scales 1 and 2, the Pollux workloads
1-8 on 16x4 at 1 and 2 (mean). Ends with one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hpc_elastic.policy import PolicyOptions, ServiceDistribution, make_policy
from hpc_elastic.sim.cluster import NodeSpec, parse_cluster_spec
from hpc_elastic.sim.engine import SimConfig, SimModel, Simulator
from hpc_elastic.sim.synth import load_sizes, synthesize
from hpc_elastic.sim.trace import TraceJob, load_trace

REPO = Path(__file__).resolve().parents[1]
FIRST = (10, 30, 100, 300, 1000)


def avg_jct(
    jobs: tuple[TraceJob, ...],
    nodes: tuple[NodeSpec, ...],
    name: str,
    history: ServiceDistribution | None = None,
    model: SimModel = SimModel.REALISTIC,
) -> tuple[float, list[float]]:
    """Average JCT, and the sizes (GPU-seconds) of the jobs in the order they completed."""
    options = PolicyOptions(min_history=0)  # a given history is used whatever its size
    sim = Simulator(jobs, nodes, make_policy(name, options), SimConfig(model=model, history=history))
    result = sim.run()
    sizes = np.array([job.service for job in sim.jobs])
    done = ~np.isnan(result.end)
    order = np.argsort(result.end[done], kind="stable")
    return float(np.nanmean(result.jct)), sizes[done][order].tolist()


def variants(
    jobs: tuple[TraceJob, ...], nodes: tuple[NodeSpec, ...], yarn: ServiceDistribution, first: tuple[int, ...]
) -> dict[str, float]:
    las, completed = avg_jct(jobs, nodes, "tiresias-las")
    out = {"las": las, "gittins-yarn": avg_jct(jobs, nodes, "tiresias-gittins", yarn)[0]}
    out["gittins-online"] = avg_jct(jobs, nodes, "tiresias-gittins")[0]
    for n in first:
        if n <= len(completed):
            history = ServiceDistribution.from_samples(completed[:n])
            out[f"gittins-first{n}"] = avg_jct(jobs, nodes, "tiresias-gittins", history)[0]
    return out


def report(title: str, result: dict[str, float]) -> None:
    las = result["las"]
    print(f"\n{title}")
    for key, value in result.items():
        print(f"  {key:18s} {value:12.0f}   LAS / this = {las / value:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs of the synthetic trace")
    parser.add_argument("--skip-openb", action="store_true")
    args = parser.parse_args()
    sizes_file = args.traces / "tiresias_yarn-gput1000.csv"
    if not sizes_file.is_file():
        sys.exit(f"shared traces not found in {args.traces}")
    started = time.perf_counter()
    sizes = load_sizes(sizes_file)
    yarn = ServiceDistribution.from_samples(sizes)
    results: dict[str, object] = {}

    syn_nodes = parse_cluster_spec("64x8")
    for load in (2.0, 3.0):
        jobs = synthesize(sizes, args.jobs, 512, load=load, seed=3)
        res = variants(jobs, syn_nodes, yarn, FIRST)
        report(f"synthetic {args.jobs} jobs (yarn sizes), 64x8, nominal load {load:g}", res)
        results[f"synthetic@{load:g}"] = res
    jobs = synthesize(sizes, args.jobs, 512, load=3.0, seed=3)
    ref = {
        "las": avg_jct(jobs, syn_nodes, "tiresias-las", model=SimModel.REFERENCE)[0],
        "gittins-yarn": avg_jct(jobs, syn_nodes, "tiresias-gittins", yarn, SimModel.REFERENCE)[0],
    }
    report(f"synthetic {args.jobs} jobs, 64x8, nominal load 3, reference model", ref)
    results["synthetic@3-reference"] = ref

    if not args.skip_openb:
        nodes = parse_cluster_spec("4x8")
        trace = load_trace(args.traces / "alibaba_openb" / "openb_pod_list_default.csv", "openb")
        for scale in (1.0, 2.0):
            res = variants(trace.scaled(scale).jobs, nodes, yarn, FIRST)
            report(f"Alibaba openb pods, 4x8, load scale {scale:g}", res)
            results[f"openb@{scale:g}"] = res

    nodes = parse_cluster_spec("16x4")
    for scale in (1.0, 2.0):
        per = [
            variants(
                load_trace(args.traces / "pollux_workloads" / f"workload-{w}.csv", "pollux").scaled(scale).jobs,
                nodes,
                yarn,
                (),
            )
            for w in range(1, 9)
        ]
        mean = {key: statistics.fmean(p[key] for p in per) for key in per[0]}
        report(f"Pollux workloads 1-8 (mean), 16x4, load scale {scale:g}", mean)
        results[f"pollux@{scale:g}"] = mean
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
