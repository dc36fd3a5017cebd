"""The PS message format, the gRPC transport and a parameter server's partition and Adagrad updates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpc_elastic.jobdir import JobDir
from hpc_elastic.ps import checkpoint, rpc, wire
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.data import NUM_SPARSE, CriteoLike, CriteoSpec, label_entropy, owner
from hpc_elastic.ps.master import Master
from hpc_elastic.ps.model import ModelSpec, dense_owner, dense_shapes, init_dense, init_rows, log_loss
from hpc_elastic.ps.server import ParameterServer
from hpc_elastic.ps.shards import ShardConfig, ShardManager
from hpc_elastic.ps.worker import forward


def test_messages_round_trip_header_and_arrays() -> None:
    arrays: wire.Arrays = {
        "ids": np.array([3, 1, 2], dtype=np.int64),
        "rows": np.arange(12, dtype=np.float32).reshape(3, 4),
    }
    header, out = wire.decode(wire.encode({"op": "push", "n": [1, 2]}, arrays))
    assert header == {"op": "push", "n": [1, 2]}
    assert set(out) == {"ids", "rows"}
    for k, v in arrays.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"XXXX\x00\x00\x00\x00",
        wire.encode({"a": 1}, {"x": np.zeros(4, np.float32)})[:-1],
        b"HPS1\x02\x00\x00\x00{]",
    ],
)
def test_broken_messages_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        wire.decode(data)


def test_only_plain_dtypes_travel() -> None:
    with pytest.raises(ValueError, match="object"):
        wire.encode({}, {"x": np.array([object()])})


def test_arrays_travel_in_this_machines_byte_order_and_any_layout() -> None:
    swapped = np.arange(4, dtype=np.int64).astype(np.dtype(np.int64).newbyteorder())
    with pytest.raises(ValueError, match="array 'x' has dtype"):  # its bytes would be read back as other numbers
        wire.encode({}, {"x": swapped})
    strided = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]
    empty = np.zeros((0, 5), dtype=np.int64)
    _, out = wire.decode(wire.encode({}, {"s": strided, "e": empty}))
    assert np.array_equal(out["s"], strided) and out["e"].shape == (0, 5) and out["e"].dtype == np.int64


def test_the_transport_calls_handlers_and_returns_refusals() -> None:
    def double(header: dict[str, object], arrays: wire.Arrays) -> rpc.Reply:
        if header.get("bad"):
            raise ValueError("bad request")
        return {"k": header["k"]}, {"y": arrays["x"] * 2}

    server, port = rpc.serve({"double": double})
    client = rpc.Client(f"127.0.0.1:{port}", timeout=10)
    try:
        reply, out = client.call("double", {"k": 5}, {"x": np.arange(3, dtype=np.float64)})
        assert reply == {"k": 5} and out["y"].tolist() == [0.0, 2.0, 4.0]
        with pytest.raises(rpc.RemoteError, match="bad request"):
            client.call("double", {"bad": True, "k": 0})
        with pytest.raises(rpc.RemoteError, match="unknown operation"):
            client.call("nothing")
        with pytest.raises(rpc.RemoteError, match="malformed double request: KeyError"):
            client.call("double", {"k": 1})
    finally:
        client.close()
        server.stop(grace=0)


def test_the_ps_partition_covers_every_row_and_array_once() -> None:
    config = PsJobConfig(num_ps=3, vocab=50)
    servers = [ParameterServer(config, p, 3) for p in range(3)]
    ids = np.concatenate([s.ids for s in servers])
    assert np.array_equal(np.sort(ids), np.arange(NUM_SPARSE * 50))
    names = [n for s in servers for n in s.dense]
    assert sorted(names) == sorted(dense_shapes(ModelSpec()))
    assert all(dense_owner(n, 3) == p for p, s in enumerate(servers) for n in s.dense)
    assert np.array_equal(owner(ids, 3), owner(ids.copy(), 3))  # stable


def test_a_push_applies_adagrad_to_the_rows_and_arrays_it_names() -> None:
    config = PsJobConfig(num_ps=2, vocab=20, lr=0.1)
    ps = ParameterServer(config, 1, 2)
    ids = ps.ids[:3]
    _, before = ps.pull({"names": list(ps.dense)}, {"ids": ids})
    assert np.array_equal(before["rows"], init_rows(config.model(), ids))
    grads = np.ones((3, config.model().row_width), dtype=np.float32)
    dense = {f"d:{n}": np.ones_like(v) for n, v in ps.dense.items()}
    ps.push({}, {"ids": ids, "rows": grads, **dense})
    _, after = ps.pull({"names": list(ps.dense)}, {"ids": ids})
    step = 0.1 / np.sqrt(0.1 + 1.0)
    assert np.allclose(after["rows"], before["rows"] - step)
    for n in ps.dense:
        assert np.allclose(after[f"d:{n}"], before[f"d:{n}"] - step)
    untouched = ps.ids[3:6]
    assert np.array_equal(ps.pull({}, {"ids": untouched})[1]["rows"], init_rows(config.model(), untouched))


def test_a_ps_refuses_rows_it_does_not_hold_and_unsorted_pushes() -> None:
    config = PsJobConfig(num_ps=2, vocab=20)
    ps = ParameterServer(config, 0, 2)
    other = np.setdiff1d(np.arange(NUM_SPARSE * 20), ps.ids)[:2]
    with pytest.raises(ValueError, match="not held by PS 0"):
        ps.pull({}, {"ids": other})
    rows = np.zeros((2, config.model().row_width), dtype=np.float32)
    with pytest.raises(ValueError, match="sorted and unique"):
        ps.push({}, {"ids": ps.ids[[1, 0]], "rows": rows})


def test_the_synthetic_data_is_seeded_and_learnable() -> None:
    data = CriteoLike(CriteoSpec(num_samples=5000, vocab=100, seed=4))
    a, b = data.records(100, 300), CriteoLike(CriteoSpec(num_samples=5000, vocab=100, seed=4)).records(100, 300)
    assert np.array_equal(a.dense, b.dense) and np.array_equal(a.ids, b.ids) and np.array_equal(a.label, b.label)
    assert a.dense.shape == (200, 13) and a.ids.shape == (200, 26)
    assert np.all((a.ids >= 0) & (a.ids < 26 * 100))
    assert np.all(a.ids // 100 == np.arange(26))
    assert not np.array_equal(a.label, CriteoLike(CriteoSpec(5000, 100, seed=5)).records(100, 300).label)
    full = data.records(0, 5000)
    # the true logits explain the labels far better than the base rate: the signal is learnable
    p = 1.0 / (1.0 + np.exp(-data.true_logits(np.arange(5000))))
    best = float(-np.mean(full.label * np.log(p) + (1 - full.label) * np.log(1 - p)))
    assert 0.2 < full.label.mean() < 0.8
    assert best < label_entropy(full) - 0.1
    with pytest.raises(ValueError, match="outside"):
        data.batch(np.array([5000]))


def test_a_checkpoint_restores_onto_another_number_of_ps(tmp_path: Path) -> None:
    two = PsJobConfig(num_ps=2, vocab=30)
    servers = [ParameterServer(two, p, 2) for p in range(2)]
    for ps in servers:  # move the parameters away from their initial values
        ids = ps.ids[::3]
        ps.push({}, {"ids": ids, "rows": np.full((ids.size, two.model().row_width), 0.5, dtype=np.float32)})
        ps.push(
            {},
            {
                "ids": ps.ids[:0],
                "rows": np.zeros((0, 9), np.float32),
                **{f"d:{n}": np.ones_like(v) for n, v in ps.dense.items()},
            },
        )
    assert checkpoint.latest(tmp_path) is None
    state = ShardManager(ShardConfig(num_samples=10, shard_size=5)).checkpoint()
    where = checkpoint.write(tmp_path, 1, state, [ps.snapshot() for ps in servers])
    assert checkpoint.latest(tmp_path) == where and checkpoint.read_queues(where) == (1, state)
    three = PsJobConfig(num_ps=3, vocab=30)
    restored = [ParameterServer(three, p, 3) for p in range(3)]
    for ps in restored:
        ps.load(checkpoint.read_partitions(where))
    all_ids = np.arange(NUM_SPARSE * 30, dtype=np.int64)

    def rows(group: list[ParameterServer], num_ps: int) -> np.ndarray:
        out = np.zeros((all_ids.size, 9), np.float32)
        for p, ps in enumerate(group):
            mine = all_ids[owner(all_ids, num_ps) == p]
            out[mine] = ps.pull({}, {"ids": mine})[1]["rows"]
        return out

    assert np.array_equal(rows(servers, 2), rows(restored, 3))
    before = {n: v for ps in servers for n, v in ps.dense.items()}
    after = {n: v for ps in restored for n, v in ps.dense.items()}
    assert before.keys() == after.keys() and all(np.array_equal(before[n], after[n]) for n in before)
    for seq in (2, 3):
        checkpoint.write(tmp_path, seq, state, [ps.snapshot() for ps in servers])
    assert sorted(d.name for d in tmp_path.glob("ckpt-*")) == ["ckpt-000000000002", "ckpt-000000000003"]


def test_a_frozen_or_reconfigured_ps_refuses_requests_as_moved_and_loses_no_update() -> None:
    config = PsJobConfig(num_ps=1, vocab=20, lr=0.1)
    ps = ParameterServer(config, 0, 1)
    ids = ps.ids[:4]
    width = config.model().row_width
    ps.push({}, {"ids": ids, "rows": np.ones((4, width), np.float32)})
    frozen = ps.freeze()
    with pytest.raises(rpc.Moved):
        ps.push({}, {"ids": ids, "rows": np.ones((4, width), np.float32)})
    with pytest.raises(rpc.Moved):
        ps.pull({}, {"ids": ids})
    fresh = ParameterServer(config, 1, 2)
    ps.reconfigure(0, 2, 1, [frozen])
    fresh.reconfigure(1, 2, 1, [frozen])
    with pytest.raises(rpc.Moved, match="generation 1"):
        ps.pull({"generation": 0}, {"ids": ps.ids[:1]})
    got = np.zeros((4, width), np.float32)
    for p, server in enumerate((ps, fresh)):
        sel = owner(ids, 2) == p
        got[sel] = server.pull({"generation": 1}, {"ids": ids[sel]})[1]["rows"]
    assert np.array_equal(got, frozen.rows[:4])  # the one push before the freeze, and only it
    assert ps.updates == fresh.updates == 1


def test_a_restored_master_keeps_the_loss_curve_of_the_shards_its_ledger_counts(tmp_path: Path) -> None:
    config = PsJobConfig(num_ps=1, num_samples=10, shard_size=5)
    state = ShardManager(config.shards()).checkpoint()
    snapshot = ParameterServer(config, 0, 1).snapshot()
    checkpoint.write(tmp_path, 1, state, [snapshot], losses=[0.9, 0.7])
    assert checkpoint.read_losses(checkpoint.latest(tmp_path) or tmp_path) == [0.9, 0.7]
    master = Master(config, ["127.0.0.1:1"], checkpoint_root=tmp_path, restore=True)
    # the loss at the start of training is the first run's, not that of the run after a requeue
    assert master.restored_from == 1 and master.losses == [0.9, 0.7]
    assert master.summary()["loss_first"] == 0.9


def test_the_held_out_loss_is_the_workers_forward_pass_in_numpy() -> None:
    spec = ModelSpec()
    data = CriteoLike(CriteoSpec(num_samples=300))
    batch = data.records(0, 300)
    rng = np.random.default_rng(3)
    ids = rng.permutation(data.spec.num_ids).astype(np.int64)  # rows in any order, as merged partitions hold them
    rows = init_rows(spec, ids) + rng.normal(0, 0.3, (ids.size, spec.row_width)).astype(np.float32)
    dense = {n: v + rng.normal(0, 0.1, v.shape).astype(np.float32) for n, v in init_dense(spec).items()}
    by_id = rows[np.argsort(ids)]
    z = forward(spec, {n: torch.from_numpy(v) for n, v in dense.items()}, torch.from_numpy(by_id[batch.ids]),
                torch.from_numpy(batch.dense))  # fmt: skip
    expected = float(F.binary_cross_entropy_with_logits(z.double(), torch.from_numpy(batch.label).double()))
    assert log_loss(spec, dense, ids, rows, batch) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("damage", ["queues", "partition", "truncated", "manifest"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    """Every file has its sha256 in the manifest: altered queues (still valid JSON), a flipped partition byte, a
    truncated file or a broken manifest make the restore take the previous checkpoint, which KEEP kept."""
    config = PsJobConfig(num_ps=1, num_samples=10, shard_size=5)
    state = ShardManager(config.shards()).checkpoint()
    snapshot = ParameterServer(config, 0, 1).snapshot()
    first = checkpoint.write(tmp_path, 1, state, [snapshot], losses=[2.0])
    second = checkpoint.write(tmp_path, 2, state, [snapshot], losses=[2.0, 1.5])
    assert checkpoint.latest(tmp_path) == second and checkpoint.verified(second)
    if damage == "queues":
        queues = second / "queues.json"
        queues.write_text(queues.read_text().replace("[2.0, 1.5]", "[7.0, 1.5]"))
    elif damage == "partition":
        data = bytearray((second / "ps0.npz").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (second / "ps0.npz").write_bytes(bytes(data))
    elif damage == "truncated":
        (second / "ps0.npz").write_bytes((second / "ps0.npz").read_bytes()[:50])
    else:
        (second / "MANIFEST.json").write_text("{")
    assert checkpoint.latest(tmp_path) == first
    assert checkpoint.read_losses(first) == [2.0]


def test_a_checkpoint_of_the_version_without_manifests_still_restores(tmp_path: Path) -> None:
    config = PsJobConfig(num_ps=1, num_samples=10, shard_size=5)
    state = ShardManager(config.shards()).checkpoint()
    where = checkpoint.write(tmp_path, 3, state, [ParameterServer(config, 0, 1).snapshot()])
    (where / "MANIFEST.json").unlink()
    assert checkpoint.latest(tmp_path) == where and checkpoint.read_queues(where) == (3, state)


def test_hpc_elastic_job_lists_a_ps_jobs_checkpoints(tmp_path: Path) -> None:
    """One layout for both modes: the job directory's listing reads a PS checkpoint's manifest too."""
    job_dir = JobDir(tmp_path / "ps-7").prepare()
    config = PsJobConfig(num_ps=2, num_samples=10, shard_size=5)
    state = ShardManager(config.shards()).checkpoint()
    servers = [ParameterServer(config, p, 2).snapshot() for p in range(2)]
    for seq in (4, 5):
        checkpoint.write(job_dir.checkpoints, seq, state, servers)
    assert [(r.step, r.world_size) for r in job_dir.list_checkpoints()] == [(5, 2), (4, 2)]
