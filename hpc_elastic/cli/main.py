"""Entry point of the ``hpc-elastic`` command."""

from __future__ import annotations

import logging
from typing import Any

import click

from hpc_elastic import __version__
from hpc_elastic.errors import HpcElasticError

USAGE_EXIT_CODE = 2


class UserError(click.ClickException):
    """One clear line on stderr and exit code 2 (bad input, Slurm unreachable, ...)."""

    exit_code = USAGE_EXIT_CODE

    def show(self, file: Any = None) -> None:
        click.echo(f"hpc-elastic: error: {self.format_message()}", err=True)


class Group(click.Group):
    """A click group that maps library errors to :class:`UserError`."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (HpcElasticError, ValueError) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise UserError(message) from exc


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-elastic")
@click.option("-v", "--verbose", count=True, help="More log output (-v: info, -vv: debug).")
def cli(verbose: int) -> None:
    """hpc-elastic: elastic, preemptible, reproducible training on Slurm."""
    # Without -v only errors are logged: a one-shot command reports failures as one line and exit code 2.
    level = {0: logging.ERROR, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register() -> None:
    from hpc_elastic.cli.cluster import cluster
    from hpc_elastic.cli.profile import profile
    from hpc_elastic.cli.queue import queue
    from hpc_elastic.cli.simulate import simulate
    from hpc_elastic.cli.submit import submit
    from hpc_elastic.cli.verify import verify_determinism

    for command in (cluster, profile, queue, simulate, submit, verify_determinism):
        cli.add_command(command)


def main() -> None:
    _register()
    cli()
