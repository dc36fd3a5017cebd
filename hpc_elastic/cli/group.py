"""The project's click group: subcommands that load when invoked, and library errors as one line with exit 2."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click

from hpc_elastic.errors import HpcElasticError

USAGE_EXIT_CODE = 2


class UserError(click.ClickException):
    """One clear line on stderr and exit code 2 (bad input, Slurm unreachable, ...)."""

    exit_code = USAGE_EXIT_CODE

    def show(self, file: Any = None) -> None:
        click.echo(f"hpc-elastic: error: {self.format_message()}", err=True)


class Group(click.Group):
    """A click group whose subcommands named in ``lazy`` (name -> ``"module:attribute"``) are imported only when
    used (a command that trains needs torch, ``hpc-elastic queue`` does not), and that maps library errors
    (:class:`~hpc_elastic.errors.HpcElasticError`, ``ValueError``) and the system's (``OSError``: a path that cannot
    be written) to :class:`UserError`."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.lazy.get(cmd_name)
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
        except OSError as exc:  # a path the user gave that cannot be written or read (permissions, a full disk)
            where = f"{exc.filename}: " if exc.filename else ""
            raise UserError(f"{where}{exc.strerror or exc}") from exc
