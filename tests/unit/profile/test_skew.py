"""Skew from tensor sizes (Tiresias §3.3): exact values on hand-built models."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from hpc_elastic.models import mlp, resnet_like, transformer_small, vgg_like
from hpc_elastic.profile.model import model_info, tensor_infos
from hpc_elastic.profile.skew import largest_tensor_share, round_robin_shards, shard_skew, shard_skews

from .helpers import TwoLinear


def test_round_robin_assignment_in_model_order() -> None:
    assert round_robin_shards([12, 3, 6, 2], 2) == [18, 5]
    assert round_robin_shards([12, 3, 6, 2], 3) == [14, 3, 6]
    assert round_robin_shards([5], 3) == [5, 0, 0]


def test_exact_skew_of_a_hand_built_model() -> None:
    info = model_info("x:y", "y", TwoLinear(), (1, 2, 4, 8))
    # Linear(3, 4): weight 12, bias 4; Linear(4, 2): weight 8, bias 2 -- float32, so 4 bytes each.
    assert [t.bytes for t in info.tensors] == [48, 16, 32, 8]
    assert [t.shape for t in info.tensors] == [[4, 3], [4], [2, 4], [2]]
    assert info.num_parameters == 26
    assert info.parameter_bytes == 104
    assert info.largest_tensor_share == pytest.approx(12 / 26, rel=1e-12)
    skews = {entry.shards: entry.skew for entry in info.shard_skew}
    # K=2: shards [12+8, 4+2] elements -> max 20, mean 13. K=4: max 12, mean 6.5. K=8: max 12, mean 3.25.
    assert skews[1] == 1.0
    assert skews[2] == pytest.approx(20 / 13, rel=1e-12)
    assert skews[4] == pytest.approx(12 / 6.5, rel=1e-12)
    assert skews[8] == pytest.approx(12 / 3.25, rel=1e-12)


def test_skew_weights_tensors_by_bytes_and_skips_frozen_ones() -> None:
    module = nn.Module()
    module.register_parameter("wide", nn.Parameter(torch.zeros(10, dtype=torch.float64)))  # 80 bytes
    module.register_parameter("narrow", nn.Parameter(torch.zeros(20, dtype=torch.float16)))  # 40 bytes
    module.register_parameter("frozen", nn.Parameter(torch.zeros(1000), requires_grad=False))
    infos = tensor_infos(module)
    assert [(t.name, t.bytes) for t in infos] == [("wide", 80), ("narrow", 40)]
    info = model_info("x:y", "y", module, (2,))
    assert info.largest_tensor_share == pytest.approx(80 / 120)
    assert info.shard_skew[0].skew == pytest.approx(80 / 60)


def test_vgg_like_is_dominated_by_its_fc_tensor() -> None:
    module = vgg_like()[0]
    conv = 3 * 16 * 9 + 16 + 16 * 32 * 9 + 32 + 32 * 64 * 9 + 64
    fc = 1024 * 2048 + 2048 + 2048 * 256 + 256 + 256 * 10 + 10
    info = model_info("hpc_elastic.models:vgg_like", "vgg_like", module, (4,))
    assert info.num_parameters == conv + fc == 2_649_898
    assert info.largest_tensor_share == pytest.approx(1024 * 2048 / (conv + fc), rel=1e-12)


def test_reference_models_have_different_shapes() -> None:
    shares = {
        factory.__name__: model_info("m:f", "f", factory()[0], (4,)).largest_tensor_share
        for factory in (vgg_like, resnet_like, transformer_small, mlp)
    }
    assert shares["vgg_like"] > 0.75
    assert shares["resnet_like"] < 0.25
    assert shares["mlp"] == pytest.approx(65536 / (4 * (65536 + 256)))
    assert shares["vgg_like"] > shares["transformer_small"] > shares["mlp"] > shares["resnet_like"]


@pytest.mark.parametrize(
    ("sizes", "shards"),
    [([], 2), ([0, 0], 2), ([1, -1], 2), ([1.5], 2), ([True], 2), ([3], 0), ([3], True)],
)
def test_bad_inputs_name_the_bad_value(sizes: list[object], shards: object) -> None:
    with pytest.raises(ValueError, match=r"got"):
        shard_skew(sizes, shards)  # type: ignore[arg-type]


def test_shard_skews_needs_a_count() -> None:
    with pytest.raises(ValueError, match="at least one"):
        shard_skews([1, 2], ())


@given(
    st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=60).filter(lambda s: sum(s) > 0),
    st.integers(min_value=1, max_value=16),
)
def test_skew_properties(sizes: list[int], shards: int) -> None:
    loads = round_robin_shards(sizes, shards)
    assert sum(loads) == sum(sizes)
    skew = Fraction(max(loads) * shards, sum(sizes))
    assert 1 <= skew <= shards
    assert shard_skew(sizes, shards) == pytest.approx(float(skew), rel=1e-12)
    share = largest_tensor_share(sizes)
    assert Fraction(1, len(sizes)) <= Fraction(max(sizes), sum(sizes)) == pytest.approx(share, rel=1e-12)
    if shards >= len(sizes):
        assert shard_skew(sizes, shards) == pytest.approx(share * shards, rel=1e-12)
