"""``python -m hpc_elastic.ps ROLE``: the processes of a PS-mode job (``ps``, ``master``, ``worker``) and ``local``.
Each command's module is imported only when it runs: the parameter servers and the master do not load torch."""

from __future__ import annotations

import click

from hpc_elastic.cli.group import Group

COMMANDS = {
    "ps": "hpc_elastic.ps.roles:ps_command",
    "master": "hpc_elastic.ps.roles:master_command",
    "local": "hpc_elastic.ps.roles:local_command",
    "worker": "hpc_elastic.ps.worker:worker_command",
}


@click.group(cls=Group, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """PS-mode processes (parameter servers, job master, workers) and a local job."""


if __name__ == "__main__":
    main()
