"""SIGKILL a real process in the middle of writing a checkpoint: the previous checkpoint stays loadable.

The child (a real process, forked from a fresh forkserver that preloaded torch: forking the test process itself
could deadlock in OpenMP) commits step 1, then saves step 2 with a fault-injection hook that, at the chosen
phase, writes a marker file and sleeps; the parent waits for the marker and kills the child with SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_elastic.checkpoint import CheckpointStore

BIG = 1 << 20  # 4 MiB of float32: torch.save writes it in several chunks


def payload(step: int) -> dict[str, Any]:
    return {"w": torch.full((BIG,), float(step)), "step": step}


def child(root: str, phase: str, marker: str, mode: str) -> None:
    CheckpointStore(root).save(1, payload(1))

    def hook(name: str) -> None:
        if name == phase:
            Path(marker).write_text(name)
            time.sleep(120)

    store = CheckpointStore(root, on_phase=hook)
    store.save(2, payload(2), mode=mode)
    store.wait()
    os._exit(0)  # reached only when the phase never happened: the parent fails on the missing marker


def kill_at(tmp_path: Path, phase: str, mode: str) -> None:
    marker = tmp_path / "marker"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hpc_elastic.checkpoint", __name__])
    proc = ctx.Process(target=child, args=(str(tmp_path / "ckpt"), phase, str(marker), mode))
    proc.start()
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), f"the child never reached phase {phase!r} (exit code {proc.exitcode})"
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


PHASES_BEFORE_COMMIT = ["tmpdir", "partial:shard-00000.pt", "file:shard-00000.pt", "manifest"]


ASYNC_PHASES = ["partial:shard-00000.pt", "part"]


@pytest.mark.parametrize(
    ("phase", "mode"), [(p, "sync") for p in PHASES_BEFORE_COMMIT] + [(p, "async") for p in ASYNC_PHASES]
)
def test_kill_before_the_rename_leaves_the_previous_checkpoint(tmp_path: Path, phase: str, mode: str) -> None:
    kill_at(tmp_path, phase, mode)
    root = tmp_path / "ckpt"
    if phase.startswith("partial:"):  # killed in the middle of a file: part of it is on disk
        (torn,) = root.glob(".tmp-ckpt-000000000002-*/shard-00000.pt")
        full = (root / "ckpt-000000000001" / "shard-00000.pt").stat().st_size
        assert 0 < torn.stat().st_size < full
    store = CheckpointStore(root)
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
    got = ckpt.load_shard(0)
    assert got["step"] == 1 and torch.equal(got["w"], payload(1)["w"])
    # the interrupted save left a temporary directory behind; the next save removes it
    assert any(p.name.startswith(".tmp-ckpt-000000000002-") for p in root.iterdir())
    store.save(3, payload(3))
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000000001", "ckpt-000000000003"]


def test_kill_after_the_rename_leaves_the_new_checkpoint(tmp_path: Path) -> None:
    kill_at(tmp_path, "renamed", "sync")
    ckpt = CheckpointStore(tmp_path / "ckpt").latest()
    assert ckpt is not None and ckpt.step == 2
    assert torch.equal(ckpt.load_shard(0)["w"], payload(2)["w"])
