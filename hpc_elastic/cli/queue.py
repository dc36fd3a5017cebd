"""``hpc-elastic queue [--json]``: the jobs hpc-elastic-sched manages, as of its last pass.

Per job: priority rank, MLFQ queue, attained service (GPU-seconds), SiteFactor, nodes, and the action the daemon
planned (or has in flight). The daemon's state directory comes from its configuration file.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from hpc_elastic.errors import HpcElasticError
from slurm_plugin.config import ConfigError, load_config
from slurm_plugin.queue_view import NoState, load_state, render

SYSTEM_CONFIG = Path("/etc/hpc-elastic/hpc-elastic.toml")
SOURCE_CONFIG = Path(__file__).resolve().parents[2] / "site-config" / "hpc-elastic.toml"


def default_config() -> Path:
    """The installed configuration, else the one of this source checkout."""
    return SYSTEM_CONFIG if SYSTEM_CONFIG.exists() or not SOURCE_CONFIG.exists() else SOURCE_CONFIG


@click.command("queue")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help=f"hpc-elastic-sched configuration (default {SYSTEM_CONFIG}, else site-config/ of the checkout)",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON document: the managed jobs and the pass time")
def queue(config_path: Path | None, as_json: bool) -> None:
    """Managed jobs with queue, attained service, priority, placement and planned action."""
    path = config_path or default_config()
    try:
        config = load_config(path)
    except ConfigError as exc:
        raise HpcElasticError(str(exc)) from None
    try:
        doc = load_state(config.state_dir)
    except NoState as exc:
        raise HpcElasticError(str(exc)) from None
    if as_json:
        click.echo(
            json.dumps(
                {"time": doc.get("time"), "skipped": doc.get("skipped", ""), "jobs": doc["jobs"]},
                indent=1,
                sort_keys=True,
            )
        )
        return
    render(doc)
