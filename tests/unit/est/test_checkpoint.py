"""EST checkpoints on the library's store: shard contents, reading ESTs saved by other processes, falling back
past a damaged checkpoint, refusing a checkpoint of another job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_elastic.checkpoint import CheckpointStore, CorruptCheckpoint
from hpc_elastic.est.checkpoint import EST_FORMAT, checkpoint_at, est_meta, fingerprint, read_state, save_state
from tests.unit.checkpoint.threaded import ThreadCollective, run_ranks
from tests.unit.est.test_state_local import make, train


def test_each_est_is_read_from_the_shard_of_the_process_that_ran_it(tmp_path: Path) -> None:
    placement = [1, 0, 0, 1]  # EST -> process of the saving run (non-contiguous)

    def save(member: ThreadCollective) -> None:
        store = CheckpointStore(tmp_path, member)
        mine = {v: {"vrank": v, "saved_by": member.rank} for v, p in enumerate(placement) if p == member.rank}
        shared = {"step": 7, "params": [torch.arange(3.0)]} if member.rank == 0 else None
        save_state(store, 7, mine, shared, {"num_ests": 4, "placement": placement})

    run_ranks(2, save)
    ckpt = checkpoint_at(tmp_path, 7)
    assert ckpt.world_size == 2 and sorted(ckpt.manifest.files) == ["shard-00000.pt", "shard-00001.pt"]
    meta = est_meta(ckpt)
    assert meta["format"] == EST_FORMAT and meta["placement"] == placement
    state = read_state(ckpt, [0, 1, 2, 3], num_ests=4)  # a restart with M = 1 wants all four
    assert {v: c["saved_by"] for v, c in state.contexts.items()} == {0: 1, 1: 0, 2: 0, 3: 1}
    assert state.step == 7 and torch.equal(state.shared["params"][0], torch.arange(3.0))
    assert set(read_state(ckpt, [3]).contexts) == {3}
    with pytest.raises(ValueError, match="written for 4 logical workers"):
        read_state(ckpt, [0], num_ests=2)
    with pytest.raises(ValueError, match="has ESTs 0..3, not 4"):
        read_state(ckpt, [4])
    (ckpt.path / "shard-00001.pt").write_bytes(b"x" * ckpt.manifest.files["shard-00001.pt"].size)
    with pytest.raises(CorruptCheckpoint, match="is corrupt"):
        read_state(ckpt, [0])


def test_runtime_checkpoint_is_a_library_checkpoint_with_every_context(tmp_path: Path) -> None:
    state, model = make(job_dir=tmp_path)
    train(state, model, 2, commit_every=2)
    ckpt = CheckpointStore(tmp_path / "checkpoints").latest()
    assert ckpt is not None and ckpt.step == 2 and ckpt.path.name == "ckpt-000000000002"
    shard = ckpt.load_shard(0)
    assert sorted(shard["ests"]) == [0, 1, 2, 3]
    assert [c["cursor"] for c in shard["ests"].values()] == [2, 2, 2, 2]
    assert set(shard["ests"][0]["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    # the BatchNorm statistics are per EST: each saw its own data
    assert not torch.equal(shard["ests"][0]["buffers"]["1.running_mean"], shard["ests"][1]["buffers"]["1.running_mean"])
    assert shard["shared"]["step"] == 2 and len(shard["shared"]["params"]) == len(state.params)
    # the fingerprint of the checkpoint is the live state's
    found = fingerprint(ckpt)
    assert (found.step, found.params_sha256, found.state_sha256) == (2, state.params_sha256(), state.state_sha256())
    train(state, model, 3)
    assert fingerprint(ckpt).state_sha256 != state.state_sha256()


def test_restore_skips_a_damaged_newest_checkpoint(tmp_path: Path) -> None:
    straight, model = make(job_dir=tmp_path)
    train(straight, model, 4, commit_every=2)
    newest = checkpoint_at(tmp_path / "checkpoints", 4)
    path = newest.path / "shard-00000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    resumed, model2 = make(job_dir=tmp_path)
    assert resumed.restore() is not None and resumed.step == 2  # step 4 is damaged: step 2 it is
    train(resumed, model2, 4)
    assert resumed.state_sha256() == straight.state_sha256()


def test_restore_refuses_another_jobs_checkpoint(tmp_path: Path) -> None:
    state, model = make(job_dir=tmp_path)
    train(state, model, 1, commit_every=1)
    other, _ = make(job_dir=tmp_path, seed=9)
    with pytest.raises(ValueError, match="was written with seed=3, now 9"):
        other.restore()
    empty, _ = make(job_dir=tmp_path / "none")
    assert empty.restore() is None
    plain = CheckpointStore(tmp_path / "plain" / "checkpoints")
    plain.save(1, {"x": torch.zeros(1)})
    with pytest.raises(CorruptCheckpoint, match="is not a checkpoint of this runtime"):
        fingerprint(checkpoint_at(tmp_path / "plain" / "checkpoints", 1))
