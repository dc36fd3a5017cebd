"""The managed jobs as of the daemon's last pass (``state.json`` in the state directory), for people.

Used by ``hpc-elastic queue``. Reads one file; renders with rich.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hpc_elastic.files import loads_json, read_input
from slurm_plugin.daemon import STATE_NAME

COLUMNS = (
    "rank",
    "job",
    "name",
    "state",
    "GPUs",
    "queue",
    "attained GPU-s",
    "site factor",
    "nodes",
    "planned / in flight",
)


#: what every job entry of the state must hold (the table reads them)
_REQUIRED = ("job_id", "name", "state", "gpus", "queue", "attained_gpu_s")


class NoState(ValueError):
    """The daemon has not written its state yet (or it is unreadable)."""


def load_state(state_dir: Path) -> dict[str, Any]:
    path = state_dir / STATE_NAME
    try:
        doc = loads_json(read_input(path), f"daemon state {path}")
    except OSError as exc:
        raise NoState(f"no daemon state in {path} ({exc.strerror or exc}); has hpc-elastic-sched run?") from None
    except ValueError as exc:
        raise NoState(str(exc)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise NoState(f"daemon state {path} has no job list")
    for job in doc["jobs"]:
        missing = [key for key in _REQUIRED if not isinstance(job, dict) or key not in job]
        if missing:
            raise NoState(f"daemon state {path}: a job entry lacks {', '.join(missing)}: {str(job)[:80]}")
    return doc


def _rank_key(job: dict[str, Any]) -> tuple[int, int]:
    rank = job.get("rank")
    return (rank if isinstance(rank, int) else 1 << 30, int(job.get("job_id", 0)))


def _printable(text: str) -> str:
    """``text`` with control characters (escape sequences, newlines) shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of strings per managed job, highest priority first (jobs the policy does not rank last)."""
    out: list[tuple[str, ...]] = []
    for job in sorted(doc["jobs"], key=_rank_key):
        planned = " ".join(p for p in (job.get("planned") or "", job.get("in_flight") or "") if p)
        if job.get("resize_to"):
            planned = f"{planned} -> {job['resize_to']} GPUs".strip()
        factor = job.get("site_factor")
        out.append(
            (
                str(job["rank"]) if job.get("rank") is not None else "-",
                str(job["job_id"]),
                str(job["name"]),
                str(job["state"]),
                str(job["gpus"]),
                str(job["queue"]),
                f"{float(job['attained_gpu_s']):.0f}",
                str(factor) if factor is not None else "-",
                ",".join(job.get("nodes") or []) or "-",
                planned or "-",
            )
        )
    return out


def render(doc: dict[str, Any]) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc.get("time", 0))))
    table = Table(title=f"hpc-elastic managed jobs (daemon pass at {when})")
    for column in COLUMNS:
        table.add_column(column)
    for row in rows(doc):  # users' words (job names): plain text, never rich markup
        table.add_row(*(Text(_printable(cell)) for cell in row))
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not cut columns at 80 characters
        console = Console(width=200)
    console.print(table)
    if isinstance(doc.get("pack_limit"), int | float):
        console.print(f"PACKLIMIT {doc['pack_limit']:.3g} ({doc.get('placement_reports', 0)} placement reports)")
    if doc.get("skipped"):
        console.print(Text(_printable(f"last pass skipped: {doc['skipped']}")))
