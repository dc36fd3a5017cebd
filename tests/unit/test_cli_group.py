"""The project's click group: lazy subcommands; library and system errors as one line with exit 2."""

from __future__ import annotations

import errno

import click
from click.testing import CliRunner

from hpc_elastic.cli.group import USAGE_EXIT_CODE, Group
from hpc_elastic.errors import HpcElasticError


def _group(error: BaseException) -> click.Group:
    @click.group(cls=Group, lazy={"queue": "hpc_elastic.cli.queue:queue"})
    def top() -> None:
        pass

    @top.command()
    def fail() -> None:
        raise error

    return top


def test_errors_of_the_user_and_the_system_are_one_line_with_exit_2() -> None:
    cases = {
        HpcElasticError("job 7: not found"): "hpc-elastic: error: job 7: not found\n",
        ValueError("--steps must be >= 1, got 0"): "hpc-elastic: error: --steps must be >= 1, got 0\n",
        PermissionError(errno.EACCES, "Permission denied", "/ro/out.png"): (
            "hpc-elastic: error: /ro/out.png: Permission denied\n"
        ),
        OSError(errno.ENOSPC, "No space left on device"): "hpc-elastic: error: No space left on device\n",
    }
    for error, line in cases.items():
        result = CliRunner().invoke(_group(error), ["fail"])
        assert result.exit_code == USAGE_EXIT_CODE and result.output == line, (error, result.output)
    crash = CliRunner().invoke(_group(KeyError("bug")), ["fail"])
    assert crash.exit_code == 1 and isinstance(crash.exception, KeyError)  # a bug is not the user's mistake


def test_a_lazy_subcommand_is_listed_and_loads_when_used() -> None:
    top = _group(ValueError())
    listed = CliRunner().invoke(top, ["--help"])
    assert "fail" in listed.output and "queue" in listed.output
    assert "--json" in CliRunner().invoke(top, ["queue", "--help"]).output
