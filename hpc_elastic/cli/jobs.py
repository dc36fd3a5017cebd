"""``hpc-elastic jobs`` and ``hpc-elastic job JOBID [--json] [--follow]``: your jobs with their elastic state.

Per job: logical workers N, worker processes M now and their GPU types, the last step and steps/s (rank 0's
progress record), checkpoints with age and size, requeues (with the reasons of the stops that caused them) and
restarts inside the allocation, and the scheduler daemon's last action on the job (its stop notice).  Read through
the Slurm adapter and the job directory (:mod:`hpc_elastic.jobs`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from hpc_elastic.jobs import default_roots, job_status, my_jobs
from hpc_elastic.jobstatus import ElasticStatus, StopView
from hpc_elastic.slurm import connect

FOLLOW_POLL_S = 2.0


@dataclass(frozen=True)
class WatchConfig:
    """What ``hpc-elastic job`` was asked for."""

    job_id: int
    roots: tuple[Path, ...]
    as_json: bool = False
    follow: bool = False
    total_steps: int | None = None
    poll_s: float = FOLLOW_POLL_S

    def __post_init__(self) -> None:
        if self.job_id < 1:
            raise ValueError(f"job id must be a positive integer, got {self.job_id}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.total_steps}")
        if not self.poll_s > 0:
            raise ValueError(f"--poll must be positive, got {self.poll_s}")


# --------------------------------------------------------------------------------------------- formatting


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    if s < 172800:
        return f"{s // 3600}h ago"
    return f"{s // 86400}d ago"


def duration(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def gpus_text(status: ElasticStatus) -> str:
    return ",".join(f"{t or 'gpu'}:{n}" for t, n in sorted(status.gpus.items())) or "-"


def stop_text(view: StopView) -> str:
    at = f" at step {view.at_step}" if view.at_step is not None else ""
    return f"{view.reason}{at} {human_age(view.age_s)}"


def rate_text(status: ElasticStatus) -> str:
    return f"{status.steps_per_s:.2f}" if status.steps_per_s is not None else "-"


def describe(status: ElasticStatus) -> list[str]:
    """``hpc-elastic job JOBID``: a few lines about one job."""
    lines = [
        f"job {status.job_id} {status.name}: {status.state.value}"
        + (f" ({status.pending_reason})" if status.pending_reason else "")
        + (f" on partition {status.partition}" if status.partition else "")
        + f", elapsed {duration(status.elapsed_s)}"
        + (f" of {duration(status.time_limit_s)}" if status.time_limit_s else ""),
    ]
    if status.workers is None:
        lines.append("  not an hpc-elastic job (no marker in its comment)")
    else:
        unit = "processes" if status.unit == "proc" or (status.unit is None and not status.gpus) else "GPUs"
        m = str(status.processes) if status.processes is not None else "-"
        where = f" on {gpus_text(status)}" if status.gpus else ""
        nodes = f" ({','.join(status.nodes)})" if status.nodes else ""
        lo_hi = f", elastic range {status.elastic_range[0]}-{status.elastic_range[1]}" if status.elastic_range else ""
        lines.append(f"  logical workers N={status.workers}, {unit} M={m}{where}{nodes}{lo_hi}")
    if status.step is not None:
        recorded = f" (recorded {human_age(status.progress_age_s)})" if status.progress_age_s is not None else ""
        lines.append(f"  step {status.step}, {rate_text(status)} steps/s{recorded}")
    if status.checkpoints:
        shown = ", ".join(
            f"step {c.step} ({human_age(c.age_s)}, {human_size(c.size_bytes)}, M={c.world_size})"
            for c in status.checkpoints[:3]
        )
        more = f" and {len(status.checkpoints) - 3} more" if len(status.checkpoints) > 3 else ""
        lines.append(f"  checkpoints: {shown}{more}")
    else:
        lines.append("  checkpoints: none")
    stops = "; stops: " + ", ".join(stop_text(s) for s in status.stops) if status.stops else ""
    lines.append(f"  requeues {status.requeues}, restarts in this allocation {status.restarts}{stops}")
    if status.stop_pending is not None:
        lines.append(f"  stopping now: {stop_text(status.stop_pending)}")
    if status.plugin_action is not None:
        lines.append(f"  scheduler's last action: {stop_text(status.plugin_action)}")
    if status.job_dir is not None:
        lines.append(f"  job directory {status.job_dir}")
    return lines


def jobs_table(statuses: list[ElasticStatus]) -> Table:
    table = Table(title="Your jobs")
    for column in (
        "job",
        "name",
        "state",
        "N",
        "M",
        "GPUs",
        "step",
        "steps/s",
        "last checkpoint",
        "requeues",
        "scheduler",
    ):
        table.add_column(column)
    for s in statuses:
        newest = s.checkpoints[0] if s.checkpoints else None
        table.add_row(
            str(s.job_id),
            s.name,
            s.state.value,
            str(s.workers) if s.workers is not None else "-",
            str(s.processes) if s.processes is not None else "-",
            gpus_text(s),
            str(s.step) if s.step is not None else "-",
            rate_text(s),
            f"{newest.step} ({human_age(newest.age_s)}, {human_size(newest.size_bytes)})" if newest else "-",
            str(s.requeues) + (f" ({s.stops[-1].reason})" if s.stops else ""),
            stop_text(s.plugin_action) if s.plugin_action else "-",
        )
    return table


# ----------------------------------------------------------------------------------------------- following


def follow_job(config: WatchConfig, read: Callable[[], ElasticStatus], echo: Callable[[str], None]) -> ElasticStatus:
    """Poll ``read`` until the job ends: a progress bar of steps on a live terminal, else a line (a JSON line with
    ``--json``) whenever something shown changes.  The last status."""
    console = Console()
    if console.is_terminal and not config.as_json:
        return _follow_bar(config, read, console)
    last = ""
    while True:
        status = read()
        line = json.dumps(status.to_dict(), sort_keys=True) if config.as_json else _line(status)
        key = line if not config.as_json else json.dumps({**status.to_dict(), "progress_age_s": None}, sort_keys=True)
        if key != last:
            echo(line)
            last = key
        if status.finished:
            return status
        time.sleep(config.poll_s)


def _line(status: ElasticStatus) -> str:
    return (
        f"job {status.job_id} {status.state.value} N={status.workers or '-'} M={status.processes or '-'} "
        f"{gpus_text(status)} step {status.step if status.step is not None else '-'} {rate_text(status)} steps/s "
        f"checkpoints {len(status.checkpoints)} requeues {status.requeues}"
    )


def _follow_bar(config: WatchConfig, read: Callable[[], ElasticStatus], console: Console) -> ElasticStatus:
    columns = [
        TextColumn("[bold]job {task.fields[job]}[/] {task.fields[state]}"),
        BarColumn(),
        MofNCompleteColumn() if config.total_steps else TextColumn("step {task.completed:.0f}"),
        TextColumn("{task.fields[rate]} steps/s  M={task.fields[m]} {task.fields[gpus]}  {task.fields[ckpt]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task: TaskID | None = None
        while True:
            status = read()
            fields: dict[str, Any] = {
                "job": status.job_id,
                "state": status.state.value,
                "rate": rate_text(status),
                "m": status.processes if status.processes is not None else "-",
                "gpus": gpus_text(status),
                "ckpt": f"checkpoint {status.checkpoints[0].step}" if status.checkpoints else "no checkpoint",
            }
            if task is None:
                task = bar.add_task("steps", total=config.total_steps, **fields)
            bar.update(task, completed=status.step or 0, **fields)
            if status.finished:
                break
            time.sleep(config.poll_s)
    for line in describe(status):
        console.print(line, highlight=False)
    return status


# ------------------------------------------------------------------------------------------------- commands

_ROOTS = click.option(
    "--ckpt-root",
    "ckpt_roots",
    multiple=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Where to look for job directories (repeatable; default: submit's default checkpoint root).",
)


@click.command("jobs")
@_ROOTS
@click.option("--json", "as_json", is_flag=True, help="One JSON list instead of a table.")
def jobs(ckpt_roots: tuple[Path, ...], as_json: bool) -> None:
    """Your jobs that Slurm knows now, with their elastic state."""
    statuses = my_jobs(connect(), default_roots(ckpt_roots))
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in statuses], indent=1, sort_keys=True))
    elif not statuses:
        click.echo("no jobs of yours in the queue")
    else:
        Console().print(jobs_table(statuses))


@click.command("job")
@click.argument("job_id", type=int)
@_ROOTS
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with --follow: one JSON line per change).")
@click.option("--follow", is_flag=True, help="Watch the job until it ends (a progress bar on a terminal).")
@click.option("--steps", "total_steps", type=int, help="With --follow: the run's total steps, for the bar.")
def job(job_id: int, ckpt_roots: tuple[Path, ...], as_json: bool, follow: bool, total_steps: int | None) -> None:
    """One job's elastic state: N, M, GPU types, step, steps/s, checkpoints, requeues, the scheduler's action."""
    config = WatchConfig(job_id, default_roots(ckpt_roots), as_json, follow, total_steps)
    slurm = connect()

    def read() -> ElasticStatus:
        return job_status(slurm, config.job_id, config.roots)

    if config.follow:
        follow_job(config, read, click.echo)
        return
    status = read()
    if config.as_json:
        click.echo(json.dumps(status.to_dict(), indent=1, sort_keys=True))
    else:
        for line in describe(status):
            click.echo(line)
