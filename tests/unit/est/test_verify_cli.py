"""``hpc-elastic verify-determinism``'s input checks and the launcher's availability checks (no process starts)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import hpc_elastic.launch.workers as workers_mod
from hpc_elastic.cli.main import cli
from hpc_elastic.collective import Backend
from hpc_elastic.launch.workers import unavailable_reason


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--procs", "1,8"], "--procs value 8 is outside [1, 4]"),
        (["--procs", "x"], "--procs must be a comma-separated list of integers, got 'x'"),
        (["--steps", "4", "--resize-at", "4"], "--resize-at must be in [1, 3] for --steps 4, got 4"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["/nonexistent/train.py"], "training script /nonexistent/train.py does not exist"),
    ],
)
def test_verify_cli_rejects_bad_input_with_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["verify-determinism", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_horovod_backend_reports_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "horovod_available", lambda: False)
    assert "Horovod is not installed" in str(unavailable_reason(Backend.HOROVOD))
    assert unavailable_reason(Backend.TORCH) is None
    result = CliRunner().invoke(cli, ["verify-determinism", "--backend", "horovod", "--procs", "1"])
    assert result.exit_code == 2
    assert "backend horovod cannot run here: Horovod is not installed" in result.output
