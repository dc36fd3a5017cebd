"""Summary metrics of a simulation (Tiresias §5.1 "Metric": JCT = completion - submission)."""

from __future__ import annotations

import math

import numpy as np

from hpc_elastic.sim.engine import SimResult

METRIC_KEYS: tuple[str, ...] = (
    "jobs",
    "finished",
    "avg_jct",
    "median_jct",
    "p95_jct",
    "p99_jct",
    "avg_queue_delay",
    "max_queue_delay",
    "makespan",
    "preemptions",
    "preemption_cost",
    "resizes",
    "utilization",
)


def summarize(result: SimResult) -> dict[str, float]:
    """avg / median / p95 / p99 JCT, average and longest queueing delay (time spent waiting, all waits of a job
    summed; the longest shows starvation), makespan (last completion - first submission), preemptions and their
    total cost (seconds of checkpoint + restore + restart), resizes of elastic jobs, GPU utilisation (GPU-seconds
    held by jobs / (GPUs x makespan)).
    Seconds, counts, fraction. Only finished jobs enter the JCT statistics; ``finished`` < ``jobs`` flags a run
    that ended early.
    """
    done = ~np.isnan(result.end)
    jct = result.jct[done]
    out: dict[str, float] = {"jobs": float(len(result.job_ids)), "finished": float(np.count_nonzero(done))}
    if jct.size:
        out.update(
            avg_jct=float(jct.mean()),
            median_jct=float(np.median(jct)),
            p95_jct=float(np.percentile(jct, 95)),
            p99_jct=float(np.percentile(jct, 99)),
            avg_queue_delay=float(result.queue_delay[done].mean()),
            max_queue_delay=float(result.queue_delay[done].max()),
        )
        makespan = float(result.end[done].max() - result.submit.min())
    else:
        out.update(avg_jct=math.nan, median_jct=math.nan, p95_jct=math.nan, p99_jct=math.nan)
        out["avg_queue_delay"] = out["max_queue_delay"] = math.nan
        makespan = math.nan
    out["makespan"] = makespan
    out["preemptions"] = float(result.preemptions.sum())
    out["preemption_cost"] = float(result.preemption_cost)
    out["resizes"] = float(result.resizes.sum())
    capacity = result.capacity_gpus * makespan
    out["utilization"] = float(result.busy_gpu_seconds / capacity) if capacity > 0 else math.nan
    return out
