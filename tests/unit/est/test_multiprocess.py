"""N = 4 ESTs of the bundled example (BatchNorm, dropout, an augmenting loader) on real processes: bitwise-identical
final states on M = 1, 2, 3, 4 over gloo, MPI and Horovod, also across resizes (a stop at step k on M processes,
then M') and a kill -9; plain DDP on 4 processes agrees to rounding."""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.cli.main import cli
from hpc_elastic.collective import Backend
from hpc_elastic.est.checkpoint import Fingerprint, fingerprint
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers
from tests.conftest import REPO
from tests.unit.session.launch import HVD_REASON, MPI_REASON, base_env

N = 4
STEPS = 4  # 96 samples / 4 ESTs / batch 8 = 3 steps per epoch: the runs cross an epoch boundary
RESIZE_AT = 2
EXAMPLE = REPO / "hpc_elastic" / "est" / "example.py"
SCRIPT_ARGS = ["--loader-workers", "1"]  # a shuffling DataLoader with a worker process
SHA = re.compile(r"step (\d+)\s+([0-9a-f]{64})\s+(reference|match|MISMATCH)")


def verify(work: Path, *args: str) -> list[tuple[int, str, str]]:
    """``hpc-elastic verify-determinism`` itself; its (step, sha256, verdict) lines."""
    argv = ["verify-determinism", "--workers", str(N), "--steps", str(STEPS), "--workdir", str(work), *args]
    result = CliRunner().invoke(cli, [*argv, "--", *SCRIPT_ARGS])
    print(result.output)
    assert result.exit_code == 0, result.output
    return [(int(m[1]), m[2], m[3]) for m in SHA.finditer(result.output)]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Fingerprint]:
    """Fixed M = 4, 3, 1 and resizes 4 -> 3, 3 -> 1 at step 2 over gloo; the reference's workdir and fingerprint."""
    work = tmp_path_factory.mktemp("verify")
    lines = verify(work, "--procs", "4,3,1", "--resize-at", str(RESIZE_AT))
    assert [v for _, _, v in lines] == ["reference"] + ["match"] * 4
    found = fingerprint(CheckpointStore(work / "fixed-m4" / "checkpoints").latest() or pytest.fail("no checkpoint"))
    assert found.step == STEPS and {sha for _, sha, _ in lines} == {found.params_sha256}
    return work, found


def test_gloo_m1_m3_m4_and_resizes_give_identical_states(gloo_runs: tuple[Path, Fingerprint]) -> None:
    work, ref = gloo_runs
    for name in ("fixed-m1", "fixed-m3", "resize-m4-m3", "resize-m3-m1"):
        ckpt = CheckpointStore(work / name / "checkpoints").latest()
        assert ckpt is not None
        assert fingerprint(ckpt) == Fingerprint(STEPS, ref.params_sha256, ref.state_sha256, N, ckpt.world_size)
    # the resized runs stopped at step 2 on M processes (acknowledged) and ended on the next M
    assert (work / "resize-m4-m3" / "control" / "ack.json.handled-0").exists()
    assert CheckpointStore(work / "resize-m3-m1" / "checkpoints").latest().world_size == 1  # type: ignore[union-attr]


@pytest.mark.skipif(MPI_REASON is not None, reason=f"MPI unavailable: {MPI_REASON}")
def test_mpi_m1_m3_and_a_resize_match_gloo(gloo_runs: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    lines = verify(tmp_path, "--procs", "1,3", "--backend", "mpi", "--resize-at", str(RESIZE_AT))
    assert [v for _, _, v in lines] == ["reference", "match", "match"]
    assert lines[0][1] == gloo_runs[1].params_sha256


@pytest.mark.skipif(HVD_REASON is not None, reason=str(HVD_REASON))
def test_horovod_matches_gloo(gloo_runs: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    lines = verify(tmp_path, "--procs", "2", "--backend", "horovod")
    assert lines == [(STEPS, gloo_runs[1].params_sha256, "reference")]


def test_kill_9_then_resume_on_fewer_processes(gloo_runs: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    job = tmp_path / "job"
    step = WorkerStep(
        command=(sys.executable, str(EXAMPLE), f"--steps={STEPS}", "--ckpt-every=1", "--step-delay=1", *SCRIPT_ARGS),
        ntasks=4,
        num_ests=N,
        job_dir=job,
        launcher=Launcher.LOCAL,
    )
    victim = start_workers(step, environ=base_env(), logs=tmp_path / "victim")
    store = CheckpointStore(job / "checkpoints")
    deadline = time.monotonic() + 180
    latest = None
    while time.monotonic() < deadline and victim.poll() is None:
        latest = store.latest()
        if latest is not None and latest.step >= 1:
            break
        time.sleep(0.1)
    assert latest is not None and latest.step < STEPS, "the victim finished (or never checkpointed) before the kill"
    victim.signal(signal.SIGKILL)
    assert victim.wait(30) == -9
    killed_at = store.latest()
    assert killed_at is not None and killed_at.step < STEPS
    without_delay = step.command[:3] + step.command[5:]
    again = WorkerStep(command=without_delay, ntasks=2, num_ests=N, job_dir=job, launcher=Launcher.LOCAL)
    resumed = start_workers(again, environ=base_env(), logs=tmp_path / "resumed")
    assert resumed.wait(180) == 0
    final = store.latest()
    assert final is not None and (final.step, final.world_size) == (STEPS, 2)
    assert fingerprint(final).state_sha256 == gloo_runs[1].state_sha256
    print(f"killed after the checkpoint of step {killed_at.step}, resumed on 2 processes")


def test_plain_ddp_on_n_processes_agrees_to_rounding(
    gloo_runs: tuple[Path, Fingerprint], tmp_path: Path, record_property: object
) -> None:
    out = tmp_path / "ddp.pt"
    worker = REPO / "tests" / "data" / "workers" / "ddp_blobs.py"
    ddp = WorkerStep(
        command=(sys.executable, str(worker), str(out), str(STEPS), "1"),
        ntasks=N,
        num_ests=N,
        job_dir=tmp_path / "job",
        backend=Backend.TORCH,
        launcher=Launcher.LOCAL,
    )
    assert start_workers(ddp, environ=base_env(), logs=tmp_path).wait(240) == 0
    base = torch.load(out, weights_only=True)
    ckpt = CheckpointStore(gloo_runs[0] / "fixed-m1" / "checkpoints").latest()
    assert ckpt is not None
    shared = ckpt.load_shard(0)["shared"]
    names = ckpt.meta["est"]["param_names"]
    est = dict(zip(names, shared["params"], strict=True))
    assert est.keys() == base.keys()
    max_abs = max(float((value - base[k]).abs().max()) for k, value in est.items())
    record_property("max_abs_diff_vs_ddp", max_abs)  # type: ignore[operator]
    print(f"EST (D1, any M) vs plain DDP on {N} processes: max abs difference of parameters {max_abs:.3e}")
    for k, value in est.items():
        torch.testing.assert_close(value, base[k], rtol=1e-5, atol=1e-6)
