"""``hpc-elastic simulate-ps``: PS jobs in time slots (DL²'s model) under the slot policies.

A thin layer: options -> :class:`~hpc_elastic.sim.slots.PsExperiment` ->
:func:`~hpc_elastic.sim.slots.run_ps_experiment`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from hpc_elastic.policy.slot_registry import SLOT_POLICY_NAMES
from hpc_elastic.sim.ps_jobs import DEFAULT_SERVERS, Arrival, parse_servers
from hpc_elastic.sim.slots import PsExperiment, run_ps_experiment
from hpc_elastic.sim.trace import TraceFormat

_DEFAULT_SERVERS = f"{len(DEFAULT_SERVERS.gpus)}x{DEFAULT_SERVERS.gpus[0]}x{DEFAULT_SERVERS.cpus[0]}"


@click.command("simulate-ps")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help=f"Slot policy; repeat to compare several (default: all of {', '.join(SLOT_POLICY_NAMES)}).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated trace (or type draws).")
@click.option("--jobs", type=click.IntRange(min=1), help="Jobs to generate (default 200), or the trace's first N.")
@click.option("--servers", default=_DEFAULT_SERVERS, show_default=True, help="NxGxC: servers x GPUs x cores.")
@click.option("--load", type=float, default=3.0, show_default=True, help="Offered load of a generated trace.")
@click.option(
    "--arrival", type=click.Choice([a.value for a in Arrival]), default=Arrival.DIURNAL.value, show_default=True
)
@click.option("--variation", type=float, default=0.0, show_default=True, help="Speed variation (DL² §6.4), 0-1.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path, dir_okay=False), help="A GPU trace to convert.")
@click.option("--format", "trace_format", type=click.Choice([f.value for f in TraceFormat]), help="Its format.")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="Stretch the trace's times by this.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {policy: {metric: value}}.")
def simulate_ps(  # noqa: PLR0917 - click passes every option as an argument
    policies: tuple[str, ...],
    seed: int,
    jobs: int | None,
    servers: str,
    load: float,
    arrival: str,
    variation: float,
    trace_path: Path | None,
    trace_format: str | None,
    time_scale: float,
    as_json: bool,
) -> None:
    """Simulate PS jobs in 20-minute slots (DL² §6.2) and print each policy's average JCT and utilisation."""
    experiment = PsExperiment(
        policies=policies or SLOT_POLICY_NAMES,
        seed=seed,
        jobs=jobs,
        servers=parse_servers(servers),
        load=load,
        arrival=Arrival(arrival),
        variation=variation,
        trace=trace_path,
        trace_format=TraceFormat(trace_format) if trace_format else None,
        time_scale=time_scale,
    )
    results = run_ps_experiment(experiment)
    summaries = {result.policy: result.summary() for result in results}
    if as_json:
        click.echo(json.dumps(summaries, sort_keys=True))
        return
    click.echo(f"{'policy':<22} {'avg JCT (slots)':>15} {'makespan (slots)':>16} {'GPU util':>8} {'CPU util':>8}")
    for name, s in summaries.items():
        click.echo(
            f"{name:<22} {s['avg_jct_slots']:>15.2f} {s['makespan_s'] / experiment.slot_seconds:>16.1f} "
            f"{s['gpu_util']:>8.2f} {s['cpu_util']:>8.2f}"
            + (f"  ({s['unfinished']} unfinished)" if s["unfinished"] else "")
        )
