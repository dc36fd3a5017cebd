from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from hpc_elastic.est.context import ESTContext, RNGState, est_seed, mix_seed
from hpc_elastic.est.data import DataPlan, ESTLoader
from hpc_elastic.est.example import AugmentedBlobs
from hpc_elastic.est.levels import DeterminismLevel


def test_levels_parse() -> None:
    assert DeterminismLevel.parse("D1") is DeterminismLevel.D1
    assert not DeterminismLevel.D0.exact_allreduce and DeterminismLevel.D2.exact_allreduce
    with pytest.raises(ValueError, match="got 'd3'"):
        DeterminismLevel.parse("d3")


def test_mix_seed_is_a_pure_function() -> None:
    assert mix_seed(1, 2) == mix_seed(1, 2)
    assert len({mix_seed(1, 2), mix_seed(2, 1), mix_seed(1, 3), est_seed(1, 2)}) == 4
    assert 0 <= mix_seed(-5, 2**70) < 2**63
    with pytest.raises(ValueError, match="seed parts must be integers"):
        mix_seed(1.5)  # type: ignore[arg-type]


def test_rng_state_roundtrip_through_a_weights_only_checkpoint(tmp_path: object) -> None:
    state = RNGState.seeded(11)
    before = RNGState.capture()
    state.restore()
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    buf = io.BytesIO()
    torch.save(ESTContext(3, state, cursor=5, buffers={"b": torch.ones(2)}).to_state(), buf)
    buf.seek(0)
    ctx = ESTContext.from_state(torch.load(buf, weights_only=True))
    assert (ctx.vrank, ctx.cursor) == (3, 5)
    ctx.rng.restore()
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    before.restore()
    with pytest.raises(ValueError, match="malformed EST context"):
        ESTContext.from_state({"vrank": 1})


def test_seeded_state_leaves_the_current_generators_alone() -> None:
    torch.manual_seed(0)
    a = torch.rand(1)
    torch.manual_seed(0)
    RNGState.seeded(99)
    assert torch.equal(torch.rand(1), a)


def test_data_plan_partitions_every_epoch() -> None:
    plan = DataPlan(dataset_len=50, num_ests=4, batch_size=3, seed=5)
    assert plan.steps_per_epoch == 4  # 12 samples per EST, 4 batches of 3
    for epoch in range(2):
        seen = [i for v in range(4) for c in range(epoch * 4, epoch * 4 + 4) for i in plan.request(v, c).indices]
        assert len(seen) == len(set(seen)) == 48
    assert plan.request(0, 0).indices != plan.request(0, 4).indices  # reshuffled
    assert plan.request(1, 2).seed != plan.request(2, 1).seed
    with pytest.raises(ValueError, match="too small for 4 ESTs"):
        DataPlan(dataset_len=10, num_ests=4, batch_size=3)
    with pytest.raises(ValueError, match="vrank must be in"):
        plan.request(4, 0)


def test_shared_loader_batches_do_not_depend_on_workers_or_order() -> None:
    ds = AugmentedBlobs(64)
    plan = DataPlan(len(ds), 4, 4, seed=1)
    inproc = ESTLoader(ds, plan, [1, 3], num_workers=0)
    pooled = ESTLoader(ds, plan, [1, 3], num_workers=1)
    torch.manual_seed(123)
    marker = torch.get_rng_state()
    a = [inproc.get(v, c) for c in range(3) for v in (1, 3)]
    assert torch.equal(torch.get_rng_state(), marker), "in-process loading must not consume the caller's RNG"
    b = [pooled.get(v, c) for c in range(3) for v in (1, 3)]
    single = ESTLoader(ds, plan, [3], num_workers=0)
    c = [single.get(3, cur) for cur in range(3)]
    pooled.close()
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for (xa, _), (xc, _) in zip(a[1::2], c, strict=True):
        assert torch.equal(xa, xc)
    again = inproc.get(1, 1)  # out of order: the stream restarts there
    assert torch.equal(again[0], a[2][0])
    with pytest.raises(ValueError, match="EST 0 does not run on this process"):
        inproc.get(0, 0)


def test_each_est_gets_its_own_cuda_seed_before_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU here, the CUDA calls are recorded: an EST whose context never saw an initialised CUDA
    must still seed the CUDA generators with its own seed at every switch-in (and keep it in checkpoints)."""
    a, b = RNGState.seeded(est_seed(0, 0)), RNGState.seeded(est_seed(0, 1))
    assert a.cuda_seed == est_seed(0, 0) and b.cuda_seed == est_seed(0, 1) and not a.torch_cuda
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    saved = RNGState.capture()
    a.restore()
    after_a = RNGState.capture(previous=a)  # the switch-out of EST 0
    b.restore()
    after_a.restore()
    assert seeded == [est_seed(0, 0), est_seed(0, 1), est_seed(0, 0)]
    assert RNGState.capture().cuda_seed is None  # a capture with no EST behind it has no seed to carry
    buf = io.BytesIO()
    torch.save(ESTContext(0, after_a).to_state(), buf)
    buf.seek(0)
    assert ESTContext.from_state(torch.load(buf, weights_only=True)).rng.cuda_seed == est_seed(0, 0)
    monkeypatch.undo()
    saved.restore()
