"""The launcher/script contract and the CLI's input checks (no process is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import _register, cli
from hpc_elastic.env import read_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.backends import CommBackend
from hpc_elastic.est.job import RunSpec, job_from_environment
from hpc_elastic.est.launch import backend_unavailable_reason


def test_environment_fields() -> None:
    env = read_environment({"HPC_ELASTIC_EST_SPEC": "/x/spec.json", "HPC_ELASTIC_EST_RANK": "3"})
    assert env.est_spec == Path("/x/spec.json") and env.est_rank == 3
    assert read_environment({}).est_spec is None
    with pytest.raises(ValueError, match="HPC_ELASTIC_EST_RANK must be a non-negative integer, got 'x'"):
        read_environment({"HPC_ELASTIC_EST_RANK": "x"})


def test_run_spec_roundtrip_and_errors(tmp_path: Path) -> None:
    spec = RunSpec(backend=CommBackend.GLOO, num_ests=4, procs=2, steps=3, result_path="r.json", placement=[0, 1, 1, 0])
    path = spec.write(tmp_path / "s.json")
    assert RunSpec.read(path) == spec
    assert spec.resolved_placement().local_ests(0) == (0, 3)
    path.write_text('{"backend": "gloo", "num_ests": 0, "procs": 1, "steps": 1, "result_path": "r"}')
    with pytest.raises(ValueError, match="num_ests"):
        RunSpec.read(path)
    with pytest.raises(HpcElasticError, match="HPC_ELASTIC_EST_SPEC is not set"):
        job_from_environment({})
    spec.write(path)
    with pytest.raises(HpcElasticError, match="needs HPC_ELASTIC_EST_RANK"):
        job_from_environment({"HPC_ELASTIC_EST_SPEC": str(path)})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--procs", "1,8"], "--procs value 8 is outside [1, 4]"),
        (["--procs", "x"], "--procs must be a comma-separated list of integers, got 'x'"),
        (["--steps", "4", "--resize-at", "4"], "--resize-at must be in [1, 3] for --steps 4, got 4"),
        (["-o", "novalue"], "--option must look like key=value, got 'novalue'"),
        (["/nonexistent/train.py"], "training script /nonexistent/train.py does not exist"),
    ],
)
def test_verify_cli_rejects_bad_input_with_one_line(args: list[str], message: str) -> None:
    _register()
    result = CliRunner().invoke(cli, ["verify-determinism", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_horovod_backend_reports_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpc_elastic.est.launch as launch_mod

    monkeypatch.setattr(launch_mod, "horovod_available", lambda: False)
    assert "Horovod is not installed" in str(backend_unavailable_reason(CommBackend.HOROVOD))
    _register()
    result = CliRunner().invoke(cli, ["verify-determinism", "--backend", "horovod", "--procs", "1"])
    assert result.exit_code == 2
    assert "backend horovod unavailable" in result.output
