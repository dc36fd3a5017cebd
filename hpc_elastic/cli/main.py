"""Entry point of the ``hpc-elastic`` command."""

from __future__ import annotations

import importlib
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


class Group(click.Group):
    """A click group whose subcommands load when used, and that maps library errors to :class:`UserError`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module, attr = target.split(":")
        command: click.Command = getattr(importlib.import_module(module), attr)
        return command

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


def main() -> None:
    cli()
