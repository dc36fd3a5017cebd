"""The project's click command and group: subcommands that load when invoked; usage, library and system errors as one
line with exit 2."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click

from hpc_elastic.errors import HpcElasticError

USAGE_EXIT_CODE = 2
#: the name an error line starts with
PROG = "hpc-elastic"


class UserError(click.ClickException):
    """One clear line on stderr and exit code 2 (bad input, Slurm unreachable, ...), ``PROG: error: message``."""

    exit_code = USAGE_EXIT_CODE

    def __init__(self, message: str, prog: str = PROG) -> None:
        super().__init__(message)
        self.prog = prog

    def show(self, file: Any = None) -> None:
        click.echo(f"{self.prog}: error: {self.format_message()}", err=True)


def usage_error(exc: click.UsageError, prog: str) -> UserError:
    """click's usage error (the usage, a hint and the error on four lines) as one line that names the help."""
    message = " ".join(exc.format_message().split())
    if exc.ctx is not None:
        message = f"{message} (see '{exc.ctx.command_path} --help')"
    return UserError(message, prog)


class Command(click.Command):
    """A click command whose usage errors (an unknown option, a value that is not a number, a missing argument)
    are one line with exit 2; ``prog`` starts the line. A group with no arguments still shows its help."""

    def __init__(self, *args: Any, prog: str = PROG, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prog = prog

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise usage_error(exc, self.prog) from exc


class Group(Command, click.Group):
    """A click group whose subcommands named in ``lazy`` (name -> ``"module:attribute"``) are imported only when
    used (a command that trains needs torch, ``hpc-elastic queue`` does not), and that maps library errors
    (:class:`~hpc_elastic.errors.HpcElasticError`, ``ValueError``), the system's (``OSError``: a path that cannot
    be written) and the usage errors of its subcommands, whatever their class, to :class:`UserError`."""

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
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:  # a subcommand's own parse, or no such subcommand
            raise usage_error(exc, self.prog) from exc
        except (HpcElasticError, ValueError) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise UserError(message, self.prog) from exc
        except OSError as exc:  # a path the user gave that cannot be written or read (permissions, a full disk)
            where = f"{exc.filename}: " if exc.filename else ""
            raise UserError(f"{where}{exc.strerror or exc}", self.prog) from exc
