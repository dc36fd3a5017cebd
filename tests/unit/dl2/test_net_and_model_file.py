"""DL²'s networks (§4.1, §4.3), their numpy forward pass, and the model file (round trip, refusals)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="the DL² networks need torch")

import torch

from hpc_elastic.dl2 import model_file
from hpc_elastic.dl2.evaluate import EvalConfig, evaluate_model, plot_model
from hpc_elastic.dl2.net import (
    NetShape,
    PolicyNet,
    TorchScorer,
    ValueNet,
    inference_network,
    load_arrays,
    masked_log_softmax,
    to_arrays,
)
from hpc_elastic.policy.dl2 import Dl2Policy, StateSpec, infer
from hpc_elastic.policy.slot_registry import make_slot_policy
from hpc_elastic.policy.slots import Servers, SlotInput, SlotJob
from hpc_elastic.sim.ps_jobs import JOB_TYPES, Arrival

SPEC = StateSpec(jobs=6, type_names=tuple(kind.name for kind in JOB_TYPES), slot_seconds=1200.0, share_scale=0.01)
SHAPE = NetShape(width_factor=0.5, hidden=32, row_hidden=16)


def nets(seed: int = 0) -> tuple[PolicyNet, ValueNet]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PolicyNet(SPEC, SHAPE), ValueNet(SPEC, SHAPE)


def random_slot(rng: np.random.Generator) -> SlotInput:
    count = int(rng.integers(1, 15))
    jobs = tuple(
        SlotJob(
            k,
            int(rng.integers(0, len(JOB_TYPES))),
            k,
            float(rng.uniform(10, 500)),
            slots_run=int(rng.integers(0, 30)),
            request_workers=int(rng.integers(1, 4)),
            request_ps=int(rng.integers(1, 4)),
            max_workers=8,
            max_ps=8,
        )
        for k in range(count)
    )
    return SlotInput(0, 1200.0, JOB_TYPES, Servers.uniform(4, 4, 16), jobs)


def test_shapes() -> None:
    policy, value = nets()
    states = torch.rand(5, SPEC.state_size)
    assert policy(states).shape == (5, SPEC.action_size)
    assert value(states).shape == (5,)
    first = policy.layers[0]
    assert isinstance(first, torch.nn.Linear)
    assert first.out_features == round(0.5 * SPEC.state_size)  # proportional to the state size (§4.1)
    plain = PolicyNet(SPEC, dataclasses.replace(SHAPE, row_hidden=0))
    assert plain.rows is None and plain(states).shape == (5, SPEC.action_size)


def test_tempering_divides_every_logit_and_keeps_the_argmax() -> None:
    states = torch.rand(20, SPEC.state_size)
    for shape in (SHAPE, dataclasses.replace(SHAPE, row_hidden=0)):
        policy = PolicyNet(SPEC, shape)
        with torch.no_grad():
            before = policy(states)
            policy.temper(8.0)
            after = policy(states)
        assert torch.allclose(after * 8.0, before, rtol=1e-5, atol=1e-5)
        assert torch.equal(after.argmax(dim=1), before.argmax(dim=1))
        for bad in (0, -1.0, float("inf"), float("nan"), True):
            with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
                policy.temper(bad)


def test_masked_log_softmax_gives_masked_actions_no_probability() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0]])
    mask = torch.tensor([[False, True, True, True]])
    probs = masked_log_softmax(logits, mask).exp()
    assert float(probs[0, 0]) == 0.0
    assert float(probs.sum()) == pytest.approx(1.0)


def test_the_c_network_and_torch_make_the_same_decisions() -> None:
    policy, _ = nets(3)
    rng = np.random.default_rng(5)
    fast, slow = inference_network(policy), TorchScorer(policy)
    for _ in range(25):
        inp = random_slot(rng)
        state = rng.random(SPEC.state_size)
        assert np.allclose(fast(state), slow(state), atol=1e-5)
        assert infer(SPEC, inp, fast)[0] == infer(SPEC, inp, slow)[0]


def test_arrays_round_trip_and_refusals() -> None:
    policy, value = nets(1)
    arrays = to_arrays(policy, value)
    other_policy, other_value = nets(2)
    load_arrays(other_policy, "policy", arrays)
    load_arrays(other_value, "value", arrays)
    for a, b in zip(policy.parameters(), other_policy.parameters(), strict=True):
        assert torch.equal(a, b)
    missing = {k: v for k, v in arrays.items() if k != "policy.layers.0.bias"}
    with pytest.raises(ValueError, match="missing policy.layers.0.bias"):
        load_arrays(other_policy, "policy", missing)
    wrong = {**arrays, "policy.layers.0.bias": np.zeros(3, dtype=np.float32)}
    with pytest.raises(ValueError, match="the network needs"):
        load_arrays(other_policy, "policy", wrong)
    with pytest.raises(ValueError, match="unexpected"):
        load_arrays(other_policy, "policy", {**arrays, "policy.extra": np.zeros(1, dtype=np.float32)})


def save(path: Path) -> tuple[PolicyNet, ValueNet]:
    policy, value = nets(4)
    meta = {"curve": [{"update": 0, "episode": 0, "avg_jct": 1.5, "episode_reward": float("nan")}]}
    model_file.save(path, SPEC, {"seed": 4}, meta, to_arrays(policy, value))
    return policy, value


def test_model_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.dl2"
    policy, value = save(path)
    loaded = model_file.load(path)
    assert loaded.spec == SPEC
    assert loaded.config == {"seed": 4}
    assert loaded.meta["curve"][0]["episode_reward"] is None  # NaN is stored as null
    for name, array in to_arrays(policy, value).items():
        assert np.array_equal(loaded.arrays[name], array)
    rng = np.random.default_rng(0)
    for _ in range(10):
        state = rng.random(SPEC.state_size)
        assert np.array_equal(loaded.network()(state), inference_network(policy)(state))
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    # the same content gives the same bytes
    again = tmp_path / "again.dl2"
    save(again)
    assert again.read_bytes() == path.read_bytes()


def test_corrupt_truncated_and_foreign_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.dl2"
    save(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad = tmp_path / "bad.dl2"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        model_file.load(bad)
    bad.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="checksum mismatch"):
        model_file.load(bad)
    policy, _ = nets()
    torch.save(policy.state_dict(), bad)
    with pytest.raises(ValueError, match="not a DL² model file"):
        model_file.load(bad)
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match="not a DL² model file"):
        model_file.load(bad)
    with pytest.raises(ValueError, match="cannot read"):
        model_file.load(tmp_path / "missing.dl2")


def test_a_well_formed_file_with_wrong_tensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.dl2"
    arrays = {
        "policy.layers.0.weight": np.zeros((4, 3), dtype=np.float32),
        "policy.layers.0.bias": np.zeros(4, dtype=np.float32),
    }
    model_file.save(path, SPEC, {}, {}, arrays)
    with pytest.raises(ValueError, match="does not fit the spec"):
        model_file.load(path).network()
    plot = tmp_path / "curve.png"
    evaluation = EvalConfig(path, 0, 5, 1.0, Arrival.POISSON, 0.0, ("drf",), plot)
    with pytest.raises(ValueError, match="does not fit the spec"):
        evaluate_model(evaluation)
    assert not plot.exists()  # refused before the plot is written


def test_a_tensor_that_is_not_a_layer_or_a_header_nested_too_deeply_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.dl2"
    for weight in (np.zeros(12, dtype=np.float32), np.zeros((), dtype=np.float32), np.zeros((4, 3, 1), np.float32)):
        model_file.save(
            path, SPEC, {}, {}, {"policy.layers.0.weight": weight, "policy.layers.0.bias": np.zeros(4, np.float32)}
        )
        with pytest.raises(ValueError, match=r"policy.layers.0 is not a linear layer \(weight"):
            model_file.load(path).network()
    head = b'{"format":"hpc-elastic-dl2","version":1,"x":' + b"[" * 10**5 + b"]" * 10**5 + b"}"
    body = model_file.MAGIC + len(head).to_bytes(8, "little") + head
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(ValueError, match="the header is not JSON: nested too deeply"):
        model_file.load(path)
    for bad in (float("nan"), float("inf")):  # a checksummed file of a network that diverged decides nothing
        diverged = np.zeros((4, 3), dtype=np.float32)
        diverged[1, 2] = bad
        tensors = {"policy.layers.0.weight": diverged, "policy.layers.0.bias": np.zeros(4, dtype=np.float32)}
        model_file.save(path, SPEC, {}, {}, tensors)
        with pytest.raises(ValueError, match="tensor 'policy.layers.0.weight' holds NaN or infinite values"):
            model_file.load(path)


def test_a_hostile_training_curve_is_refused_before_anything_is_plotted(tmp_path: Path) -> None:
    policy, value = nets(4)
    plot = tmp_path / "curve.png"
    for meta, message in (
        ({"curve": 3}, "the training curve is not a list of points"),
        ({"curve": [3]}, "the training curve is not a list of points"),
        ({"curve": [{}]}, "curve point {} lacks an integer update and episode"),
        ({"curve": [{"update": 1e300, "episode": 0}]}, "lacks an integer update and episode"),
        ({"supervised": [1]}, "the supervised losses are not a list"),
        ({"supervised": {"losses": "low"}}, "the supervised losses are not a list"),
    ):
        model_file.save(tmp_path / "m.dl2", SPEC, {}, meta, to_arrays(policy, value))
        with pytest.raises(ValueError, match=re.escape(message)):
            plot_model(plot, model_file.load(tmp_path / "m.dl2"))
        assert not plot.exists()


def test_the_model_file_gives_the_registry_a_dl2_policy(tmp_path: Path) -> None:
    path = tmp_path / "m.dl2"
    policy, _ = save(path)
    made = make_slot_policy("dl2", model_file.slot_policies(path))
    assert isinstance(made, Dl2Policy) and made.spec == SPEC
    inp = random_slot(np.random.default_rng(2))
    assert made.allocate(inp) == infer(SPEC, inp, inference_network(policy))[0]
