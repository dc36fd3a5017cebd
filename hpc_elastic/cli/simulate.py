"""``hpc-elastic simulate``: replay a job trace under one or more scheduling policies.

A thin layer over :mod:`hpc_elastic.sim` (trace loaders, discrete-event simulator, metrics) and
:mod:`hpc_elastic.policy` (Tiresias 2D-LAS / 2D-Gittins, the elastic variant and baselines).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from hpc_elastic.plotting import image_path, pyplot, save
from hpc_elastic.policy import DEFAULT_MIN_HISTORY, POLICY_NAMES, PolicyOptions, ServiceDistribution, make_policy
from hpc_elastic.policy.easyscale import DEFAULT_FALLBACK_HOLD
from hpc_elastic.policy.mlfq import DEFAULT_THRESHOLDS
from hpc_elastic.policy.placement import DEFAULT_PACK_LIMIT
from hpc_elastic.policy.policies import DEFAULT_TIME_SLICE
from hpc_elastic.sim.cluster import NodeSpec, load_cluster_file, parse_cluster_spec
from hpc_elastic.sim.engine import DEFAULT_BANDWIDTH, SimConfig, SimModel, SimResult, Simulator
from hpc_elastic.sim.metrics import summarize
from hpc_elastic.sim.scaling import (
    GAVEL_GPU_TYPES,
    load_gavel_capabilities,
    load_gavel_curves,
    make_elastic,
    make_heterogeneous,
)
from hpc_elastic.sim.synth import load_sizes
from hpc_elastic.sim.trace import TraceFormat, load_trace

#: Show a progress bar (on a terminal) from this many jobs x policies on.
PROGRESS_FROM = 2000
DROPPED_SHOWN = 10  # the names of the first jobs left out for their size

_TABLE_COLUMNS = (
    ("avg_jct", "avg JCT s"),
    ("median_jct", "median s"),
    ("p95_jct", "p95 s"),
    ("p99_jct", "p99 s"),
    ("avg_queue_delay", "avg queue s"),
    ("max_queue_delay", "max queue s"),
    ("makespan", "makespan s"),
    ("preemptions", "preempt"),
    ("preemption_cost", "preempt cost s"),
    ("resizes", "resizes"),
    ("utilization", "GPU util"),
)


def _parse_queues(raw: str) -> tuple[float, ...]:
    if not raw.strip():
        return ()
    values: list[float] = []
    for part in raw.split(","):
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"--queues takes GPU-second thresholds separated by commas, got {part!r}") from None
    return tuple(values)


def _cluster(spec: str | None, path: Path | None) -> tuple[NodeSpec, ...]:
    if spec is not None and path is None:
        return parse_cluster_spec(spec)
    if path is not None and spec is None:
        return load_cluster_file(path)
    raise click.UsageError("give exactly one of --cluster NxG and --cluster-file FILE")


def _clean(value: float) -> float | None:
    """A metric for JSON: NaN (no job finished) and ±∞ are null (JSON has no such numbers)."""
    return value if math.isfinite(value) else None


def _plot(results: dict[str, SimResult], path: Path) -> None:
    """Three panels: the JCT CDF, and over time the jobs waiting and the GPUs in use (fraction of the cluster)."""
    plt = pyplot()
    fig, (cdf, waiting, util) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, result in results.items():
        jct = np.sort(result.jct[~np.isnan(result.end)])
        if jct.size:
            cdf.plot(jct, np.arange(1, jct.size + 1) / jct.size, label=name, drawstyle="steps-post")
        line = result.timeline
        hours = line.time / 3600.0
        waiting.plot(hours, line.waiting, label=name, drawstyle="steps-post", linewidth=0.8)
        util.plot(hours, line.busy_gpus / max(result.capacity_gpus, 1), label=name, drawstyle="steps-post", lw=0.8)
    cdf.set_xscale("log")
    cdf.set_xlabel("job completion time (s)")
    cdf.set_ylabel("fraction of jobs")
    cdf.set_title("JCT CDF")
    waiting.set_xlabel("time (h)")
    waiting.set_ylabel("jobs waiting")
    waiting.set_title("queue length")
    util.set_xlabel("time (h)")
    util.set_ylabel("GPUs in use / GPUs")
    util.set_ylim(0.0, 1.05)
    util.set_title("GPU utilisation")
    for ax in (cdf, waiting, util):
        ax.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize="small")
    fig.tight_layout()
    save(fig, path, dpi=120)


@click.command("simulate")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), required=True, help="Trace file.")
@click.option(
    "--format", "trace_format", type=click.Choice([f.value for f in TraceFormat]), required=True, help="Trace format."
)
@click.option("--cluster", "cluster_spec", metavar="NxG", help="N nodes of G GPUs, e.g. 15x4.")
@click.option("--cluster-file", type=click.Path(path_type=Path), help="CSV node file: name,gpus[,gpu_type][,switch].")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(POLICY_NAMES),
    help="Policy to simulate; repeat to compare several (default: all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {policy: {metric: value}}.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write a PNG: JCT CDF, queue length and GPU utilisation over time, per policy.",
)
@click.option("--load-scale", type=float, default=1.0, show_default=True, help="Divide inter-arrival times by this.")
@click.option("--skip-bad-rows", is_flag=True, help="Skip (and count) malformed trace rows instead of failing.")
@click.option(
    "--queues",
    default=",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS),
    show_default=True,
    help="MLFQ thresholds in GPU-seconds, comma-separated (K = count + 1 queues).",
)
@click.option("--promote-knob", type=float, default=math.inf, show_default=True, help="PROMOTEKNOB (inf: off).")
@click.option(
    "--starve-limit",
    type=float,
    default=math.inf,
    show_default=True,
    help="STARVELIMIT, s: a job waiting this long goes ahead of all others (MLFQ policies; inf: off).",
)
@click.option("--pack-limit", type=float, default=DEFAULT_PACK_LIMIT, show_default=True, help="PACKLIMIT (skew).")
@click.option(
    "--refit-pack-limit", is_flag=True, help="Refit PACKLIMIT from observed (placement, speed) pairs while replaying."
)
@click.option(
    "--min-run-time",
    type=float,
    default=0.0,
    show_default=True,
    help="Seconds a (re)started job runs before it may be preempted (unless a job it overtook starves).",
)
@click.option("--time-slice", type=float, default=DEFAULT_TIME_SLICE, show_default=True, help="gandiva slice, s.")
@click.option("--history", "history_path", type=click.Path(path_type=Path), help="Job sizes (GPU-s) for Gittins.")
@click.option("--bandwidth", type=float, default=DEFAULT_BANDWIDTH / 1e9, show_default=True, help="Checkpoint GB/s.")
@click.option("--restart-overhead", type=float, default=0.0, show_default=True, help="Seconds per resume.")
@click.option("--spread-slowdown", type=float, default=1.5, show_default=True, help="Skewed job over >1 node.")
@click.option("--sched-interval", type=float, default=0.0, show_default=True, help="Periodic passes (0: events).")
@click.option(
    "--model",
    "sim_model",
    type=click.Choice([m.value for m in SimModel]),
    default=SimModel.REALISTIC.value,
    show_default=True,
    help="reference: the public Tiresias simulator's model (GPUs counted, free preemptions, its queue lists).",
)
@click.option(
    "--elastic",
    "elastic_factor",
    type=float,
    help="Make jobs elastic on [ceil(GPUs / F), ceil(GPUs x F)] (those whose scaling is known with --throughputs).",
)
@click.option(
    "--throughputs", type=click.Path(path_type=Path), help="Gavel's throughputs JSON: speedups of elastic jobs."
)
@click.option(
    "--requested-type",
    metavar="TYPE",
    help="Heterogeneous cluster: jobs ask for their GPUs of TYPE and run at Gavel's speed per GPU type (with "
    "--elastic and --throughputs; --cluster-file types among k80, p100, v100).",
)
@click.option(
    "--min-history",
    type=int,
    default=DEFAULT_MIN_HISTORY,
    show_default=True,
    help="2D-Gittins runs as 2D-LAS until it has this many job sizes.",
)
@click.option(
    "--fallback-hold",
    type=float,
    default=DEFAULT_FALLBACK_HOLD,
    show_default=True,
    help="EasyScale Role 3: seconds a job that fell back adds no GPUs of the types that did not pay, doubled for "
    "each fallback in a row.",
)
def simulate(  # noqa: PLR0917 - click passes every option as an argument
    trace_path: Path,
    trace_format: str,
    cluster_spec: str | None,
    cluster_file: Path | None,
    policies: tuple[str, ...],
    as_json: bool,
    plot_path: Path | None,
    load_scale: float,
    skip_bad_rows: bool,
    queues: str,
    promote_knob: float,
    starve_limit: float,
    pack_limit: float,
    refit_pack_limit: bool,
    min_run_time: float,
    time_slice: float,
    history_path: Path | None,
    bandwidth: float,
    restart_overhead: float,
    spread_slowdown: float,
    sched_interval: float,
    sim_model: str,
    elastic_factor: float | None,
    throughputs: Path | None,
    requested_type: str | None,
    min_history: int,
    fallback_hold: float,
) -> None:
    """Replay a job trace on a simulated GPU cluster and compare scheduling policies."""
    if plot_path is not None:
        image_path(plot_path, "--plot")
    nodes = _cluster(cluster_spec, cluster_file)
    trace = load_trace(trace_path, trace_format, skip_bad_rows=skip_bad_rows).scaled(load_scale)
    jobs = trace.jobs
    if throughputs is not None and elastic_factor is None:
        raise ValueError("--throughputs gives the speedups of elastic jobs: it needs --elastic")
    if requested_type is not None and (throughputs is None or elastic_factor is None):
        raise ValueError(
            "--requested-type runs jobs at Gavel's speeds per GPU type: it needs --elastic and --throughputs"
        )
    if requested_type is not None and requested_type not in GAVEL_GPU_TYPES:
        raise ValueError(f"--requested-type must be one of {', '.join(GAVEL_GPU_TYPES)}, got {requested_type!r}")
    if elastic_factor is not None and requested_type is not None and throughputs is not None:
        capabilities = load_gavel_capabilities(throughputs)
        jobs = make_heterogeneous(jobs, elastic_factor, load_gavel_curves(throughputs), capabilities, requested_type)
    elif elastic_factor is not None:
        curves = load_gavel_curves(throughputs) if throughputs is not None else None
        jobs = make_elastic(jobs, elastic_factor, curves)
    history = ServiceDistribution.from_samples(load_sizes(history_path)) if history_path else None
    options = PolicyOptions(
        thresholds=_parse_queues(queues),
        promote_knob=promote_knob,
        starve_limit=starve_limit,
        pack_limit=pack_limit,
        min_run_time=min_run_time,
        time_slice=time_slice,
        min_history=min_history,
        fallback_hold=fallback_hold,
    )
    config = SimConfig(
        model=SimModel(sim_model),
        bandwidth=bandwidth * 1e9,
        restart_overhead=restart_overhead,
        spread_slowdown=spread_slowdown,
        sched_interval=sched_interval,
        history=history,
        refit_pack_limit=refit_pack_limit,
    )
    names = policies or POLICY_NAMES
    names = tuple(dict.fromkeys(names))
    err = Console(stderr=True)
    if trace.skipped or trace.ignored:
        err.print(f"trace: {trace.skipped} malformed row(s) skipped, {trace.ignored} non-GPU row(s) ignored")
    results: dict[str, SimResult] = {}
    show = err.is_terminal and len(trace.jobs) * len(names) >= PROGRESS_FROM
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not show,
    ) as bar:
        for name in names:
            sim = Simulator(jobs, nodes, make_policy(name, options), config)
            if not sim.jobs:  # (the same jobs are left out under every policy)
                raise ValueError(
                    f"every job of {trace_path.name} needs more GPUs than any pool of a GPU type it may use has"
                )
            task = bar.add_task(name, total=len(sim.jobs))

            def report(done: int, total: int, task: TaskID = task) -> None:
                bar.update(task, completed=done, total=total)

            results[name] = sim.run(report)
    if refit_pack_limit:
        for name, result in results.items():
            err.print(f"{name}: PACKLIMIT {pack_limit:g} -> {result.pack_limit:.3g} (refitted from placements)")
    dropped = next(iter(results.values())).dropped
    if dropped:
        shown = ", ".join(dropped[:DROPPED_SHOWN]) + (
            f" and {len(dropped) - DROPPED_SHOWN} more" if len(dropped) > DROPPED_SHOWN else ""
        )
        err.print(
            f"{len(dropped)} job(s) need more GPUs than any pool of a GPU type they may use has, and were left "
            f"out: {shown}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    metrics = {name: summarize(result) for name, result in results.items()}
    if plot_path is not None:
        _plot(results, plot_path)
    if as_json:
        payload = {name: {key: _clean(value) for key, value in m.items()} for name, m in metrics.items()}
        click.echo(json.dumps(payload, sort_keys=False))
        return
    table = Table(title=f"{trace_path.name}: {len(trace.jobs)} jobs, {sum(n.gpus for n in nodes)} GPUs")
    table.add_column("policy")
    for _, label in _TABLE_COLUMNS:
        table.add_column(label, justify="right")
    for name, m in metrics.items():
        cells = [
            f"{m[key]:.3f}" if key == "utilization" else f"{m[key]:.0f}" if not math.isnan(m[key]) else "-"
            for key, _ in _TABLE_COLUMNS
        ]
        table.add_row(name, *cells)
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    out.print(table)
