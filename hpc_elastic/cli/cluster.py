"""``hpc-elastic cluster ...``: what the cluster looks like now."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from hpc_elastic.cluster import ClusterSummary, summarize
from hpc_elastic.env import read_environment
from hpc_elastic.slurm import connect


@click.group()
def cluster() -> None:
    """Look at the Slurm cluster."""


@cluster.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def status(as_json: bool) -> None:
    """Nodes per partition with state, GPUs by type free/total, jobs running and pending."""
    client = connect(read_environment())
    summary = summarize(client.partitions(), client.nodes(), client.jobs())
    if as_json:
        click.echo(json.dumps(summary.to_json(), indent=2, sort_keys=True))
    else:
        _print_tables(summary)


def _print_tables(summary: ClusterSummary) -> None:
    console = Console()
    parts = Table(title="Partitions")
    for column in ("partition", "state", "nodes", "GPUs free/total", "running", "pending"):
        parts.add_column(column)
    for p in summary.partitions:
        states = ", ".join(f"{count} {state.lower()}" for state, count in p.node_states)
        types = sorted({t for t, _ in p.gpus_total.by_type})
        gpus = ", ".join(f"{t or 'gpu'} {p.gpus_free.get(t)}/{p.gpus_total.get(t)}" for t in types) or "-"
        name = p.name + ("*" if p.default else "")
        parts.add_row(name, p.state.lower(), states, gpus, str(p.jobs_running), str(p.jobs_pending))
    console.print(parts)
    nodes = Table(title="Nodes")
    for column in ("node", "state", "CPUs alloc/total", "GPUs free/total", "partitions"):
        nodes.add_column(column)
    seen: dict[str, list[str]] = {}
    rows = {}
    for p in summary.partitions:
        for n in p.nodes:
            seen.setdefault(n.name, []).append(p.name)
            rows[n.name] = n
    for name, n in rows.items():
        gpus = ", ".join(f"{t or 'gpu'} {n.gpus_free.get(t)}/{c}" for t, c in n.gpus.by_type) or "-"
        nodes.add_row(name, n.state.lower(), f"{n.cpus_allocated}/{n.cpus}", gpus, ",".join(seen[name]))
    console.print(nodes)
    total = ", ".join(f"{t or 'gpu'} {summary.gpus_free.get(t)}/{c}" for t, c in summary.gpus_total.by_type)
    console.print(
        f"{summary.nodes} nodes, GPUs free/total: {total or 'none'}; "
        f"jobs: {summary.jobs_running} running, {summary.jobs_pending} pending"
    )
