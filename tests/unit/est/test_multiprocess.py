"""N = 4 ESTs on M = 1, 2, 4 real processes over gloo and MPI: bitwise-identical final parameters, also
across a resize (checkpoint at step k on M = 4, resume on M = 2) and a kill -9; plain DDP on 4 processes
agrees to rounding."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.cli.main import _register, cli
from hpc_elastic.est.backends import CommBackend
from hpc_elastic.est.job import RunSpec
from hpc_elastic.est.launch import free_port, launch, mpi_unavailable_reason, start
from tests.conftest import require_horovod

N = 4
STEPS = 4  # 96 samples / 4 ESTs / batch 8 = 3 steps per epoch: the runs cross an epoch boundary
RESIZE_AT = 2
OPTIONS: dict[str, Any] = {"loader_workers": 1}  # a shuffling DataLoader with a worker process


def spec(tmp: Path, name: str, procs: int, backend: CommBackend = CommBackend.GLOO, **kw: Any) -> RunSpec:
    return RunSpec(
        backend=backend,
        num_ests=N,
        procs=procs,
        steps=STEPS,
        result_path=str(tmp / f"{name}.result.json"),
        init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout_s=240,
        options={**OPTIONS, **kw.pop("options", {})},
        **kw,
    )


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``hpc-elastic verify-determinism`` itself: fixed M = 4, 2, 1 and resumes 4->2, 2->1 at step 2."""
    work = tmp_path_factory.mktemp("verify")
    _register()
    args = ["verify-determinism", "--workers", str(N), "--procs", "4,2,1", "--steps", str(STEPS)]
    args += ["--resize-at", str(RESIZE_AT), "--workdir", str(work), "-o", "loader_workers=1"]
    result = CliRunner().invoke(cli, args)
    print(result.output)
    assert result.exit_code == 0, result.output
    assert result.output.count("match") == 4 and "reference" in result.output
    runs = {p.name.removesuffix(".result.json"): json.loads(p.read_text()) for p in work.glob("*.result.json")}
    runs["_workdir"] = {"path": str(work)}
    return runs


def test_gloo_m1_m2_m4_give_identical_parameters_and_state(gloo_runs: dict[str, dict[str, Any]]) -> None:
    fixed = [gloo_runs[f"fixed-m{m}"] for m in (1, 2, 4)]
    assert [r["procs"] for r in fixed] == [1, 2, 4]
    assert len({r["param_sha256"] for r in fixed}) == 1
    assert len({r["state_sha256"] for r in fixed}) == 1
    assert all(r["step"] == STEPS for r in fixed)


def test_gloo_resize_mid_run_m4_to_m2(gloo_runs: dict[str, dict[str, Any]]) -> None:
    ref = gloo_runs["fixed-m4"]
    for name in ("resize-m4-m2", "resize-m2-m1"):
        r = gloo_runs[name]
        assert (r["param_sha256"], r["state_sha256"], r["step"]) == (ref["param_sha256"], ref["state_sha256"], STEPS)
    assert gloo_runs["resize-m4-m2"]["procs"] == 2


@pytest.mark.skipif(mpi_unavailable_reason() is not None, reason=f"MPI unavailable: {mpi_unavailable_reason()}")
def test_mpi_m1_m2_m4_match_gloo(gloo_runs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    ref = gloo_runs["fixed-m1"]
    # M = 2 with an explicit, non-contiguous EST-to-process map
    for m, placement in ((1, None), (2, [1, 0, 0, 1]), (4, None)):
        r = launch(spec(tmp_path, f"mpi-m{m}", m, CommBackend.MPI, placement=placement), tmp_path, name=f"mpi-m{m}")
        assert r.result is not None and r.result["backend"] == "mpi" and r.result["procs"] == m
        assert (r.result["param_sha256"], r.result["state_sha256"]) == (ref["param_sha256"], ref["state_sha256"])


def test_verify_determinism_over_horovod_matches_gloo(gloo_runs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """``hpc-elastic verify-determinism --backend horovod`` for real (mpirun with this venv's Horovod)."""
    require_horovod()
    ref = gloo_runs["fixed-m1"]
    args = ["verify-determinism", "--workers", str(N), "--procs", "2", "--steps", str(STEPS), "--backend", "horovod"]
    result = CliRunner().invoke(cli, [*args, "--workdir", str(tmp_path), "-o", "loader_workers=1"])
    print(result.output)
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "fixed-m2.result.json").read_text())
    assert r["backend"] == "horovod" and r["procs"] == 2
    assert (r["param_sha256"], r["state_sha256"]) == (ref["param_sha256"], ref["state_sha256"])
    assert ref["param_sha256"] in result.output


def test_kill_9_then_resume_on_fewer_processes(gloo_runs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    victim = spec(tmp_path, "victim", 4, checkpoint_dir=str(ckpt), checkpoint_every=1, options={"sleep_per_step": 1.0})
    running = start(victim, tmp_path, name="victim")
    store = CheckpointStore(ckpt)
    deadline = time.monotonic() + 180
    latest = None
    while time.monotonic() < deadline and not running.poll():
        latest = store.latest()
        if latest is not None and latest.step >= 1:
            break
        time.sleep(0.1)
    assert latest is not None and latest.step < STEPS, "the victim finished (or never checkpointed) before the kill"
    running.kill()
    assert all(p.returncode == -9 for p in running.procs)
    killed_at = store.latest()
    assert killed_at is not None and killed_at.step < STEPS
    resumed = launch(spec(tmp_path, "resumed", 2, checkpoint_dir=str(ckpt), resume=True), tmp_path, name="resumed")
    ref = gloo_runs["fixed-m4"]
    assert resumed.result is not None
    assert (resumed.result["param_sha256"], resumed.result["state_sha256"]) == (
        ref["param_sha256"],
        ref["state_sha256"],
    )
    print(f"killed after checkpoint of step {killed_at.step}, resumed on 2 processes")


def test_plain_ddp_on_n_processes_agrees_to_rounding(
    gloo_runs: dict[str, dict[str, Any]], tmp_path: Path, record_property: Any
) -> None:
    ddp = launch(
        spec(tmp_path, "ddp", N, params_path=str(tmp_path / "ddp.pt"), options={"mode": "ddp"}), tmp_path, name="ddp"
    )
    assert ddp.result is not None
    est = torch.load(Path(gloo_runs["_workdir"]["path"]) / "fixed-m1.params.pt", weights_only=True)
    base = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert est.keys() == base.keys()
    max_abs = max(float((est[k] - base[k]).abs().max()) for k in est)
    record_property("max_abs_diff_vs_ddp", max_abs)
    print(f"EST (D1, any M) vs plain DDP on {N} processes: max abs difference of parameters {max_abs:.3e}")
    for k in est:
        torch.testing.assert_close(est[k], base[k], rtol=1e-5, atol=1e-6)
