"""``python -m hpc_elastic.ps ROLE``: the processes of a PS-mode job (``ps``, ``master``, ``worker``) and ``local``.
Each command's module is imported only when it runs: the parameter servers and the master do not load torch."""

from __future__ import annotations

import importlib

import click

from hpc_elastic.cli.main import Group

COMMANDS = {
    "ps": "hpc_elastic.ps.roles:ps_command",
    "master": "hpc_elastic.ps.roles:master_command",
    "local": "hpc_elastic.ps.roles:local_command",
    "worker": "hpc_elastic.ps.worker:worker_command",
}


class PsGroup(Group):
    """The project's group (library errors → one line, exit 2) with the PS-mode commands."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        command: click.Command = getattr(importlib.import_module(module), attr)
        return command


@click.group(cls=PsGroup)
def main() -> None:
    """PS-mode processes (parameter servers, job master, workers) and a local job."""


if __name__ == "__main__":
    main()
