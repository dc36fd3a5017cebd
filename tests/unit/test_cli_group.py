"""The project's click command and group: lazy subcommands; usage, library and system errors as one line with exit 2."""

from __future__ import annotations

import errno

import click
from click.testing import CliRunner

from hpc_elastic.cli.group import USAGE_EXIT_CODE, Command, Group
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


def test_usage_errors_are_one_line_that_names_the_help_with_exit_2() -> None:
    @click.group(cls=Group, lazy={"queue": "hpc_elastic.cli.queue:queue"})
    def top() -> None:
        pass

    @top.command()
    @click.option("--steps", type=int, required=True)
    @click.argument("script")
    def run(steps: int, script: str) -> None:
        click.echo(f"{steps} {script}")

    @top.group()  # a plain click group inside the project's
    def sub() -> None:
        pass

    @sub.command()
    def leaf() -> None:
        pass

    cases = {
        (
            "run",
            "--steps",
            "x",
            "a.py",
        ): "Invalid value for '--steps': 'x' is not a valid integer. (see 'top run --help')",
        ("run", "--steps", "1"): "Missing argument 'SCRIPT'. (see 'top run --help')",
        ("run", "--step", "1", "a.py"): (
            "No such option '--step'. (Did you mean one of: '--help', '--steps'?) (see 'top run --help')"
        ),
        ("nosuch",): "No such command 'nosuch'. (see 'top --help')",
        ("--bogus", "run"): "No such option '--bogus'. (see 'top --help')",
        ("sub", "nosuch"): "No such command 'nosuch'. (see 'top sub --help')",
        ("queue", "--nosuch"): "No such option '--nosuch'. (see 'top queue --help')",
    }
    for argv, message in cases.items():
        result = CliRunner().invoke(top, list(argv), prog_name="top")
        assert result.exit_code == USAGE_EXIT_CODE, (argv, result.output)
        assert result.stderr == f"hpc-elastic: error: {message}\n" and result.stdout == "", (argv, result.stderr)
    assert CliRunner().invoke(top, ["run", "--steps", "3", "a.py"]).stdout == "3 a.py\n"
    bare = CliRunner().invoke(top, ["sub"], prog_name="top")  # a group without a subcommand shows its help
    assert "Usage: top sub [OPTIONS] COMMAND" in bare.output and "leaf" in bare.output


def test_a_command_names_its_own_program_in_the_line() -> None:
    @click.command(cls=Command, prog="hpc-elastic-sched")
    @click.option("--config", required=True)
    def sched(config: str) -> None:
        pass

    result = CliRunner().invoke(sched, [], prog_name="hpc-elastic-sched")
    assert result.exit_code == USAGE_EXIT_CODE
    assert result.stderr == "hpc-elastic-sched: error: Missing option '--config'. (see 'hpc-elastic-sched --help')\n"
