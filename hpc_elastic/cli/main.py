"""Entry point of the ``hpc-elastic`` command."""

from __future__ import annotations

import logging

import click

from hpc_elastic import __version__
from hpc_elastic.cli.group import Group

#: the subcommands, each imported only when it is invoked (its module imports what it needs at its top: a command
#: that trains needs torch, ``hpc-elastic queue`` does not)
COMMANDS = {
    "cluster": "hpc_elastic.cli.cluster:cluster",
    "dl2": "hpc_elastic.cli.dl2:dl2",
    "job": "hpc_elastic.cli.jobs:job",
    "jobs": "hpc_elastic.cli.jobs:jobs",
    "profile": "hpc_elastic.cli.profile:profile",
    "queue": "hpc_elastic.cli.queue:queue",
    "scale": "hpc_elastic.cli.scale:scale",
    "simulate": "hpc_elastic.cli.simulate:simulate",
    "simulate-ps": "hpc_elastic.cli.simulate_ps:simulate_ps",
    "submit": "hpc_elastic.cli.submit:submit",
    "verify-determinism": "hpc_elastic.cli.verify:verify_determinism",
}


@click.group(cls=Group, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-elastic")
@click.option("-v", "--verbose", count=True, help="More log output (-v: info, -vv: debug).")
def cli(verbose: int) -> None:
    """hpc-elastic: elastic, preemptible, reproducible training on Slurm."""
    # Without -v only errors are logged: a one-shot command reports failures as one line and exit code 2.
    level = {0: logging.ERROR, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    cli()
