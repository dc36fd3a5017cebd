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
from collections.abc import Callable
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


def kill_at(tmp_path: Path, phase: str, mode: str, target: Callable[[str, str, str, str], None] = child) -> None:
    marker = tmp_path / "marker"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hpc_elastic.checkpoint", __name__])
    proc = ctx.Process(target=target, args=(str(tmp_path / "ckpt"), phase, str(marker), mode))
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


def resave_child(root: str, phase: str, marker: str, mode: str) -> None:
    """Commits steps 1 and 2, then saves step 2 again (a retried save) with other values, stopped at ``phase``."""
    CheckpointStore(root).save(1, payload(1))
    CheckpointStore(root).save(2, payload(2))

    def hook(name: str) -> None:
        if name == phase:
            Path(marker).write_text(name)
            time.sleep(120)

    store = CheckpointStore(root, on_phase=hook)
    store.save(2, {**payload(2), "w": torch.full((BIG,), 22.0)}, mode=mode)
    store.wait()
    os._exit(0)


@pytest.mark.parametrize("phase", ["manifest", "replaced"])
def test_a_retried_save_of_a_step_keeps_the_step_loadable_at_every_kill(tmp_path: Path, phase: str) -> None:
    """Killed after the old copy of step 2 lost its name and before the new one has it ("replaced"), the old copy
    is still step 2's checkpoint; the next save of step 2 publishes and deletes it."""
    kill_at(tmp_path, phase, "sync", target=resave_child)
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 2 and torch.equal(ckpt.load_shard(0)["w"], payload(2)["w"])
    loaded = store.load_latest(lambda c: c.load_shard(0))
    assert loaded is not None and loaded[0].step == 2
    store.save(2, {**payload(2), "w": torch.full((BIG,), 23.0)})
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000000001", "ckpt-000000000002"]
    again = store.latest()
    assert again is not None and float(again.load_shard(0)["w"][0]) == 23.0


def test_a_killed_saves_partial_copy_is_gone_before_the_next_save_writes(tmp_path: Path) -> None:
    """Not only after the next commit: a full filesystem could refuse every later save, and nothing be freed."""
    kill_at(tmp_path, "file:shard-00000.pt", "sync")
    root = tmp_path / "ckpt"
    assert any(p.name.startswith(".tmp-ckpt-000000000002-") for p in root.iterdir())
    seen: list[list[str]] = []
    store = CheckpointStore(root, on_phase=lambda name: seen.append(sorted(p.name for p in root.iterdir())))
    store.save(3, payload(3))
    listing = seen[0]  # at "tmpdir": this save's own directory made, nothing written yet
    assert not any(name.startswith(".tmp-ckpt-000000000002-") for name in listing)
    assert "ckpt-000000000001" in listing and any(name.startswith(".tmp-ckpt-000000000003-") for name in listing)
