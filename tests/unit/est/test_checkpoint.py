from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.checkpoint import SHARED, CheckpointStore, atomic_write_bytes, est_file, load_file


def _write_step(store: CheckpointStore, step: int, n: int = 2) -> dict[str, str]:
    files = {SHARED: store.write(step, SHARED, {"step": step, "t": torch.arange(3)})}
    for v in range(n):
        files[est_file(v)] = store.write(step, est_file(v), {"vrank": v})
    return files


def test_atomic_write_leaves_no_temporaries(tmp_path: Path) -> None:
    sha = atomic_write_bytes(tmp_path / "a" / "f.bin", b"hello")
    assert (tmp_path / "a" / "f.bin").read_bytes() == b"hello"
    assert len(sha) == 64
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["f.bin"]


def test_commit_latest_load_and_prune(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    assert store.latest() is None
    for step in (1, 2, 3):
        m = store.commit(step, 2, _write_step(store, step), {"placement": [0, 1]})
    latest = store.latest()
    assert latest is not None and latest.step == 3 and latest == m
    assert torch.equal(load_file(latest, SHARED)["t"], torch.arange(3))
    assert store.at(2).step == 2
    assert not store.step_dir(1).exists()  # pruned
    with pytest.raises(HpcElasticError, match="not a complete checkpoint"):
        store.at(1)
    _write_step(store, 4)  # a run killed before committing step 4 ...
    assert store.latest() == latest  # ... is invisible
    store.commit(5, 2, _write_step(store, 5), {})
    assert not store.step_dir(4).exists()  # and its leftovers go at the next commit


def test_corruption_and_incomplete_commits_are_reported(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    files = _write_step(store, 1)
    with pytest.raises(HpcElasticError, match="lacks est-00001.pt"):
        store.commit(1, 2, {k: v for k, v in files.items() if k != est_file(1)}, {})
    m = store.commit(1, 2, files, {})
    (m.directory / est_file(0)).write_bytes(b"garbage")
    with pytest.raises(HpcElasticError, match="is corrupt"):
        load_file(m, est_file(0))
    (m.directory / "MANIFEST.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(HpcElasticError, match="format 99"):
        store.latest()
    with pytest.raises(ValueError, match="keep must be a positive integer, got 0"):
        CheckpointStore(tmp_path, keep=0)
