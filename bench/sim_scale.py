"""Simulator throughput: replay an 80,000-job trace on a 2,000-GPU cluster (250 nodes x 8), per policy.

The trace is synthetic (:func:`hpc_elastic.sim.synth.synthesize`): job sizes resampled from Tiresias's
``tiresias_yarn-gput1000.csv`` (production job sizes, heavy-tailed), GPU counts from Tiresias's testbed mix,
Poisson arrivals at a nominal load of 1.5 x the cluster (with this heavy tail that gives queueing delays of
hours without an unbounded backlog over the trace). Prints wall time, events/s and passes per policy; ends with
one JSON object on the last line.

Default: every policy (``--policies`` takes a comma-separated subset). Wall time and process CPU time are printed
side by side: on a shared machine the CPU time is the steadier figure (and both are pessimistic there). The load
average is printed before and after, and per policy the seconds spent in Python's garbage collector and the peak
resident memory of the process so far: the replays run one after the other in this process, and these show
whether an earlier replay's objects or memory weigh on a later one (in the measurements of the README they do not:
a policy takes the same CPU time alone and after the others).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

from hpc_elastic.policy import POLICY_NAMES, make_policy
from hpc_elastic.sim.cluster import parse_cluster_spec
from hpc_elastic.sim.engine import SimConfig, Simulator
from hpc_elastic.sim.metrics import summarize
from hpc_elastic.sim.synth import load_sizes, synthesize

REPO = Path(__file__).resolve().parents[1]
GOAL_PER_POLICY_S = 30


class GcTimer:
    """CPU seconds spent in the garbage collector while installed (a ``gc.callbacks`` hook)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._since = time.process_time()
        else:
            self.seconds += time.process_time() - self._since


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--jobs", type=int, default=80_000)
    parser.add_argument("--cluster", default="250x8")
    parser.add_argument("--load", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policies", default="all", help="comma-separated, or 'all'")
    args = parser.parse_args()
    sizes_file = args.traces / "tiresias_yarn-gput1000.csv"
    if not sizes_file.is_file():
        sys.exit(f"job sizes not found: {sizes_file}")
    names = list(POLICY_NAMES) if args.policies == "all" else args.policies.split(",")
    nodes = parse_cluster_spec(args.cluster)
    gpus = sum(n.gpus for n in nodes)
    t0 = time.perf_counter()
    jobs = synthesize(load_sizes(sizes_file), args.jobs, gpus, load=args.load, seed=args.seed)
    gen_s = time.perf_counter() - t0
    print(
        f"{args.jobs:,} jobs on {gpus:,} GPUs ({args.cluster}), nominal load {args.load:g}; "
        f"trace built in {gen_s:.1f} s; load average {load_average()}"
    )
    print(
        f"  {'policy':18s} {'wall s':>8s} {'cpu s':>8s} {'gc s':>6s} {'rss MB':>7s} {'events':>9s} {'events/s':>9s} "
        f"{'passes':>8s} {'shortcut':>8s} {'avg JCT s':>10s} {'preempt':>8s}"
    )
    load_before = os.getloadavg()
    out: dict[str, dict[str, float]] = {}
    total = total_cpu = 0.0
    for name in names:
        gc_timer = GcTimer()
        gc.callbacks.append(gc_timer)
        t = time.perf_counter()
        c = time.process_time()
        result = Simulator(jobs, nodes, make_policy(name), SimConfig()).run()
        wall = time.perf_counter() - t
        cpu = time.process_time() - c
        gc.callbacks.remove(gc_timer)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (kilobytes on Linux)
        total += wall
        total_cpu += cpu
        m = summarize(result)
        out[name] = {
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "gc_s": round(gc_timer.seconds, 2),
            "max_rss_mb": round(rss_mb, 1),
            "events": result.events,
            "events_per_s": round(result.events / wall, 1),
            "passes": result.passes,
            "shortcut_passes": result.shortcut_passes,
            "avg_jct": m["avg_jct"],
            "avg_queue_delay": m["avg_queue_delay"],
            "preemptions": m["preemptions"],
            "finished": m["finished"],
        }
        print(
            f"  {name:18s} {wall:8.1f} {cpu:8.1f} {gc_timer.seconds:6.2f} {rss_mb:7.0f} {result.events:9d} "
            f"{result.events / wall:9.0f} {result.passes:8d} "
            f"{result.shortcut_passes:8d} "
            f"{m['avg_jct']:10.0f} {m['preemptions']:8.0f}",
            flush=True,
        )
    slowest = max(out, key=lambda k: out[k]["wall_s"])
    print(f"  total wall {total:.1f} s, cpu {total_cpu:.1f} s for {len(names)} policies; load average {load_average()}")
    print(
        f"  slowest replay: {slowest} {out[slowest]['wall_s']:.1f} s "
        f"(goal: each policy's 80k-job replay under {GOAL_PER_POLICY_S} s)"
    )
    over = [name for name in out if out[name]["cpu_s"] > GOAL_PER_POLICY_S]
    print(f"  over the goal in CPU time: {', '.join(over) if over else 'none'}")
    print(
        json.dumps(
            {
                "jobs": args.jobs,
                "gpus": gpus,
                "load": args.load,
                "total_wall_s": round(total, 2),
                "total_cpu_s": round(total_cpu, 2),
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "goal_per_policy_s": GOAL_PER_POLICY_S,
                "slowest_policy": slowest,
                "slowest_wall_s": out[slowest]["wall_s"],
                "over_goal_cpu": over,
                "policies": out,
            }
        )
    )


if __name__ == "__main__":
    main()
