"""CheckpointStore in one process and on threaded ranks: layout, manifest, keep-K, corruption fallback, async."""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.serialization import config

from hpc_elastic.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    CorruptCheckpoint,
    UnreadableCheckpoint,
    layout,
    open_checkpoint,
)
from hpc_elastic.collective import LocalCollective
from hpc_elastic.files import HashingWriter
from tests.unit.checkpoint.threaded import ThreadCollective, run_ranks


def shard_for(step: int, rank: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(64, 8, generator=g), "step": step, "rank": rank, "tags": ["a", (1, 2.5)], "none": None}


def assert_shard_equal(got: Any, want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    assert torch.equal(got["w"], want["w"])
    assert {k: v for k, v in got.items() if k != "w"} == {k: v for k, v in want.items() if k != "w"}


def test_save_writes_shard_and_manifest_with_sha256(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    pending = store.save(7, shard_for(7), meta={"note": "x"})
    assert pending.path == tmp_path / "ckpt-000000000007"
    assert sorted(os.listdir(pending.path)) == ["MANIFEST.json", "shard-00000.pt"]
    doc = json.loads((pending.path / "MANIFEST.json").read_text())
    assert doc["format"] == layout.FORMAT and doc["step"] == 7 and doc["world_size"] == 1
    assert doc["meta"] == {"note": "x"}
    data = (pending.path / "shard-00000.pt").read_bytes()
    assert doc["files"] == {"shard-00000.pt": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000000007"]  # no temporary left behind
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 7
    assert_shard_equal(ckpt.load_shard(0), shard_for(7))


def test_not_weights_only_loadable_shard_is_refused_before_writing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match=r"shard\['arr'\] is a ndarray"):
        store.save(1, {"arr": np.zeros(3)})
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [0, -1, True, "3"])
def test_keep_must_be_positive_int(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="keep must be a positive integer"):
        CheckpointStore(tmp_path, keep=bad)


def test_bad_step_and_mode_are_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="step must be an integer"):
        store.save(-1, {})
    with pytest.raises(ValueError, match="mode must be sync or async, got 'later'"):
        store.save(1, {}, mode="later")


def test_keep_last_k(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    for step in (1, 2, 3, 4, 5):
        store.save(step, shard_for(step))
    assert store.steps() == [5, 4, 3]
    store1 = CheckpointStore(tmp_path, keep=1)
    store1.save(6, shard_for(6))
    assert store1.steps() == [6]


def corrupt_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        "flip-byte",
        "truncate",
        "delete-shard",
        "delete-manifest",
        "garbage-manifest",
        "manifest-wrong-step",
        "manifest-meta-bit",
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, shard_for(1), meta={"seed": 3})
    newest = store.save(2, shard_for(2), meta={"seed": 3}).path
    shard = newest / "shard-00000.pt"
    manifest = newest / "MANIFEST.json"
    if damage == "flip-byte":
        corrupt_byte(shard)
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "delete-shard":
        shard.unlink()
    elif damage == "delete-manifest":
        manifest.unlink()
    elif damage == "garbage-manifest":
        manifest.write_text("{not json")
    elif damage == "manifest-meta-bit":  # 0x33 -> 0x37: still valid JSON, another seed (a restart would refuse it)
        manifest.write_text(manifest.read_text().replace('"seed": 3', '"seed": 7'))
    else:
        manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 3'))
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
    found = store.load_latest(lambda c: c.load_shard(0))
    assert found is not None
    assert found[0].step == 1
    assert_shard_equal(found[1], shard_for(1))


def test_flipped_byte_is_caught_by_hash_not_size(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(1, shard_for(1)).path
    corrupt_byte(path / "shard-00000.pt")
    ckpt = open_checkpoint(path)  # sizes still match: the manifest opens
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        ckpt.load_shard(0)
    with pytest.raises(CorruptCheckpoint, match="does not match"):
        ckpt.verify()
    assert store.latest() is None
    assert store.load_latest(lambda c: c.load_shard(0)) is None


def test_shards_skip_torch_zip_crc_yet_a_flipped_tensor_byte_is_caught(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    want = {"w": torch.arange(4096, dtype=torch.float32)}
    path = store.save(1, want).path
    assert config.save.compute_crc32 is True  # the process-wide setting is restored after the save
    assert torch.equal(open_checkpoint(path).load_shard(0)["w"], want["w"])  # torch.load(weights_only=True)
    # The zip CRC of the tensor record is not computed: the manifest's sha256 is what catches damage there.
    shard = path / "shard-00000.pt"
    data = bytearray(shard.read_bytes())
    at = bytes(data).index(want["w"][1000:1004].numpy().tobytes())
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        open_checkpoint(path).load_shard(0)
    assert store.latest() is None


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "missing")
    assert store.latest() is None
    assert store.steps() == []
    assert store.load_latest(lambda c: c.load_shard(0)) is None


def test_leftover_temporaries_are_ignored_and_cleaned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, shard_for(1))
    stale = tmp_path / layout.tmp_dir_name(2, "dead")
    stale.mkdir()
    (stale / "shard-00000.pt").write_bytes(b"partial")
    half_named = tmp_path / "ckpt-000000000003"  # a directory with the final name but no manifest
    half_named.mkdir()
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
    store.save(4, shard_for(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000001", "ckpt-000000000004"]


def test_resuming_from_an_older_checkpoint_sets_the_abandoned_newer_one_aside(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.save(5, shard_for(5))
    corrupt_byte(store.save(10, shard_for(10)).path / "shard-00000.pt")
    found = store.load_latest(lambda c: c.load_shard(0))
    assert found is not None and found[0].step == 5
    for step in (7, 8, 9):  # the new timeline: step 10 is from the old one; keep=2 prunes only the new timeline
        store.save(step, shard_for(step))
    assert store.steps() == [9, 8]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{layout.ABANDONED_PREFIX}ckpt-000000000010-")]
    assert len(aside) == 1 and (aside[0] / "shard-00000.pt").exists()  # kept whole, for the user to look at


def test_an_unreadable_checkpoint_is_an_error_not_an_absence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transient read error (EIO on the shared filesystem) must not make the job restart from step 0 and then
    commit over its newer checkpoints."""
    store = CheckpointStore(tmp_path)
    store.save(5, shard_for(5))
    newest = store.save(10, shard_for(10)).path
    read_bytes = Path.read_bytes

    def failing(self: Path) -> bytes:
        if self.parent == newest:
            raise OSError(errno.EIO, "Input/output error")
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", failing)
    with pytest.raises(UnreadableCheckpoint, match="cannot be read"):
        store.load_latest(lambda c: c.load_shard(0))
    monkeypatch.undo()
    found = store.load_latest(lambda c: c.load_shard(0))
    assert found is not None and found[0].step == 10  # the error passed: nothing was lost


def test_prune_keeps_a_checkpoint_whose_manifest_cannot_be_read_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CheckpointStore(tmp_path, keep=2)
    shaky = writer.save(1, shard_for(1)).path
    writer.save(2, shard_for(2))
    read_text = Path.read_text

    def failing(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.parent == shaky:
            raise OSError(errno.ESTALE, "Stale file handle")
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", failing)
    assert CheckpointStore(tmp_path, keep=1).prune() == []  # neither valid nor invalid: not touched
    assert shaky.is_dir()


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(3, shard_for(3))
    store.save(3, shard_for(4))
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 3
    assert_shard_equal(ckpt.load_shard(0), shard_for(4))
    assert store.steps() == [3]


def test_async_save_snapshots_tensors_before_returning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    shard = shard_for(1)
    original = shard["w"].clone()
    pending = store.save(1, shard, mode="async")
    shard["w"].add_(1.0)  # training goes on and changes the parameters in place
    shard["tags"].append("later")
    assert store.wait() == pending.path
    ckpt = store.latest()
    assert ckpt is not None
    got = ckpt.load_shard(0)
    assert torch.equal(got["w"], original)
    assert got["tags"] == ["a", (1, 2.5)]
    assert store.wait() is None  # nothing in flight any more


def test_next_save_waits_for_the_async_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    store.save(1, shard_for(1), mode="async")
    store.save(2, shard_for(2), mode="async")
    store.save(3, shard_for(3))
    assert store.pending is None
    assert store.steps() == [3, 2, 1]
    for step in (1, 2, 3):
        assert_shard_equal(open_checkpoint(tmp_path / layout.dir_name(step)).load_shard(0), shard_for(step))


def test_async_failure_is_raised_by_wait(tmp_path: Path) -> None:
    def explode(phase: str) -> None:
        if phase.startswith("file:"):
            raise OSError("disk on fire")

    store = CheckpointStore(tmp_path, on_phase=explode)
    store.save(1, shard_for(1), mode="async")
    with pytest.raises(CheckpointError, match="disk on fire"):
        store.wait()
    assert store.latest() is None


def test_sync_failure_raises_and_leaves_no_checkpoint(tmp_path: Path) -> None:
    def explode(phase: str) -> None:
        if phase.startswith("partial:"):
            raise OSError("quota exceeded")

    CheckpointStore(tmp_path).save(1, shard_for(1))
    store = CheckpointStore(tmp_path, on_phase=explode)
    with pytest.raises(CheckpointError, match="quota exceeded"):
        store.save(2, shard_for(2))
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_four_ranks_write_one_checkpoint(tmp_path: Path, mode: str) -> None:
    def rank_body(coll: ThreadCollective) -> Path | None:
        store = CheckpointStore(tmp_path, coll, keep=2)
        store.save(1, shard_for(1, coll.rank), mode=mode)
        pending = store.save(2, None if coll.rank == 2 else shard_for(2, coll.rank), meta={"m": 1}, mode=mode)
        waited = store.wait()
        return waited if mode == "async" else pending.path

    paths = run_ranks(4, rank_body)
    assert paths == [tmp_path / "ckpt-000000000002"] * 4
    ckpt = open_checkpoint(tmp_path / "ckpt-000000000002")
    assert ckpt.world_size == 4 and ckpt.meta == {"m": 1}
    assert ckpt.manifest.ranks == [0, 1, 3]  # rank 2 saved nothing
    for r in (0, 1, 3):
        assert_shard_equal(ckpt.load_shard(r), shard_for(2, r))
    assert CheckpointStore(tmp_path).steps() == [2, 1]
    assert sorted(os.listdir(ckpt.path)) == ["MANIFEST.json", "shard-00000.pt", "shard-00001.pt", "shard-00003.pt"]


def test_one_rank_with_a_bad_shard_makes_every_rank_raise(tmp_path: Path) -> None:
    outcomes: dict[int, str] = {}

    def rank_body(coll: ThreadCollective) -> None:
        store = CheckpointStore(tmp_path, coll)
        shard: dict[str, Any] = shard_for(1, coll.rank)
        if coll.rank == 1:
            shard["bad"] = object()
        try:
            store.save(1, shard)
        except ValueError as exc:
            outcomes[coll.rank] = str(exc)

    run_ranks(3, rank_body)
    assert sorted(outcomes) == [0, 1, 2]
    assert all("rank 1: shard['bad'] is a object" in m for m in outcomes.values())
    assert CheckpointStore(tmp_path).steps() == []


def test_ranks_agree_to_skip_a_checkpoint_one_rank_finds_corrupt(tmp_path: Path) -> None:
    def write(coll: ThreadCollective) -> None:
        store = CheckpointStore(tmp_path, coll)
        store.save(1, shard_for(1, coll.rank))
        store.save(2, shard_for(2, coll.rank))

    run_ranks(2, write)
    corrupt_byte(tmp_path / "ckpt-000000000002" / "shard-00001.pt")  # only rank 1 reads this file

    def read(coll: ThreadCollective) -> tuple[int, Any]:
        found = CheckpointStore(tmp_path, coll).load_latest(lambda c: c.load_shard(coll.rank))
        assert found is not None
        return found[0].step, found[1]

    results = run_ranks(2, read)
    assert [s for s, _ in results] == [1, 1]
    for r, (_, shard) in enumerate(results):
        assert_shard_equal(shard, shard_for(1, r))


def test_an_error_in_load_that_is_not_corruption_is_raised_everywhere(tmp_path: Path) -> None:
    CheckpointStore(tmp_path).save(1, shard_for(1))
    raised: dict[int, str] = {}

    def read(coll: ThreadCollective) -> None:
        def load(c: Checkpoint) -> Any:
            if coll.rank == 0:
                raise KeyError("model")
            return c.load_shard(0)

        try:
            CheckpointStore(tmp_path, coll).load_latest(load)
        except (KeyError, CheckpointError) as exc:
            raised[coll.rank] = type(exc).__name__

    run_ranks(2, read)
    assert raised == {0: "KeyError", 1: "CheckpointError"}


def test_local_collective_semantics() -> None:
    c = LocalCollective()
    assert (c.rank, c.world_size) == (0, 1)
    assert c.broadcast_object({"a": 1}) == {"a": 1}
    assert c.gather_object(3) == [3]
    assert c.allgather_object("x") == ["x"]
    assert c.allreduce_max_int(-5) == -5
    t = torch.arange(6).reshape(2, 3)
    out = c.allgather_tensor(t)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    with pytest.raises(ValueError, match="root must be in"):
        c.broadcast_object(1, root=1)
    with pytest.raises(ValueError, match="needs an int"):
        c.allreduce_max_int(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("cuts", [[], [100], [3, 40 << 20]])
def test_pipelined_hashing_writes_and_hashes_every_byte_in_order(cuts: list[int]) -> None:
    data = os.urandom(50 << 20)  # several pieces of HashingWriter.PIECE: hashed on the helper thread
    bounds = [0, *cuts, len(data)]
    sink = io.BytesIO()
    with HashingWriter(sink) as writer:
        for lo, hi in itertools.pairwise(bounds):
            assert writer.write(data[lo:hi]) == hi - lo
    assert sink.getvalue() == data
    assert (writer.hexdigest(), writer.size) == (hashlib.sha256(data).hexdigest(), len(data))


def test_a_manifest_written_before_its_checksum_existed_still_opens(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(1, shard_for(1)).path
    doc = json.loads((path / "MANIFEST.json").read_text())
    del doc["body_sha256"]
    (path / "MANIFEST.json").write_text(json.dumps(doc))
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
