"""EasyScale on heterogeneous GPUs: the intra-job planner's cost (§3.4, Eq. 1a-1d) on Gavel's measured speeds.

For every model of Gavel's throughput table (``gavel_simulation_throughputs.json``: iterations per second of each
model alone on k80, p100 and v100; a fourth type is a v100 at 1.6x for an a100-like part), the job's ``C_i`` are
those speeds; maxP = 64 ESTs and 16 free GPUs of each of the 4 types. Times the plan database (Role 1's top-K),
the top-1 plan, and one job's scale-out proposals (Role 2) from 4 v100. Goal: the planner <= 10 ms.
Prints the timings and ends with one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpc_elastic.policy.easyscale import best_plan, plan_frontier, propose

REPO = Path(__file__).resolve().parents[1]
GOAL_MS = 10.0


def gavel_capabilities(path: Path) -> dict[str, dict[str, float]]:
    """Model -> GPU type -> iterations per second alone on one GPU (Gavel's ``null`` entry)."""
    table = json.loads(path.read_text())
    models: dict[str, dict[str, float]] = {}
    for gpu_type in ("k80", "p100", "v100"):
        for key, row in table[gpu_type].items():
            name, scale = ast.literal_eval(key)
            if scale == 1 and isinstance(row.get("null"), int | float) and row["null"] > 0:
                models.setdefault(name, {})[gpu_type] = float(row["null"])
    return {m: {**c, "a100": 1.6 * c["v100"]} for m, c in models.items() if len(c) == 3}


def timed_ms(call: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--max-p", type=int, default=64)
    parser.add_argument("--free", type=int, default=16, help="free GPUs of each type")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    path = args.traces / "gavel_simulation_throughputs.json"
    if not path.is_file():
        sys.exit(f"Gavel throughputs not found: {path}")
    models = gavel_capabilities(path)
    free = dict.fromkeys(("a100", "v100", "p100", "k80"), args.free)
    rows = []
    print(f"{len(models)} models, maxP = {args.max_p}, {args.free} free GPUs of each of {len(free)} types")
    print(f"  {'model':34s} {'database ms':>11s} {'top-1 ms':>9s} {'proposals ms':>12s} {'plans':>6s} {'top-1 plan'}")
    for name, cap in sorted(models.items()):
        front = plan_frontier(free, cap, args.max_p)
        db = timed_ms(lambda cap=cap: plan_frontier(free, cap, args.max_p), args.repeat)
        top = timed_ms(lambda cap=cap: best_plan(free, cap, args.max_p), args.repeat)
        prop = timed_ms(lambda cap=cap: propose(0, {"v100": 4}, free, cap, args.max_p), args.repeat)
        best = front[0]
        shape = " ".join(f"{n}x{t}:{a}" for (t, n), (_, a) in zip(best.gpus, best.ests, strict=True))
        print(f"  {name:34s} {db:11.2f} {top:9.3f} {prop:12.2f} {len(front):6d} {shape}")
        rows.append({"model": name, "database_ms": db, "top1_ms": top, "proposals_ms": prop, "plans": len(front)})
    worst = max(r["database_ms"] for r in rows)
    print(f"planner (plan database) worst {worst:.2f} ms against the {GOAL_MS:.0f} ms goal")
    summary = {
        "max_p": args.max_p,
        "types": len(free),
        "planner_ms_worst": round(worst, 3),
        "planner_ms_median": round(statistics.median(r["database_ms"] for r in rows), 3),
        "top1_ms_worst": round(max(r["top1_ms"] for r in rows), 3),
        "proposals_ms_worst": round(max(r["proposals_ms"] for r in rows), 3),
        "goal_ms": GOAL_MS,
        "met": worst <= GOAL_MS,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
