"""Every sample exactly once per epoch, whatever the per-worker batch sizes and wherever the restarts."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.balance.sampler import BalancedSampler, SamplerState
from hpc_elastic.est.data import DataPlan


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, int, list[tuple[list[int], bool]]]:
    dataset_len = draw(st.integers(1, 200))
    workers = draw(st.integers(1, 5))
    steps = []
    for _ in range(draw(st.integers(1, 60))):
        total = draw(st.integers(workers, max(workers, dataset_len)))
        if total > dataset_len:
            total = dataset_len
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=workers - 1, max_size=workers - 1)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        steps.append((sizes, draw(st.booleans())))  # the bool: checkpoint and restore after this step
    return dataset_len, draw(st.integers(0, 1000)), steps


@settings(max_examples=200, deadline=None)
@given(runs())
def test_each_sample_once_per_epoch(run: tuple[int, int, list[tuple[list[int], bool]]]) -> None:
    dataset_len, seed, steps = run
    sampler = BalancedSampler(dataset_len, seed=seed)
    state = SamplerState()
    stream: list[int] = []
    for sizes, restart in steps:
        batch = sampler.take(state, sizes)
        assert [len(b) for b in batch.indices] == sizes
        for b in batch.indices:
            stream.extend(b)
        state = batch.state
        if restart:  # through JSON, and a new sampler object, as a resumed job would
            state = SamplerState.from_json(json.loads(json.dumps(state.to_json())))
            sampler = BalancedSampler(dataset_len, seed=seed)
    assert state.epoch * dataset_len + state.cursor == len(stream)
    for e in range(len(stream) // dataset_len + 1):
        epoch = stream[e * dataset_len : (e + 1) * dataset_len]
        counts = Counter(epoch)
        assert all(c == 1 for c in counts.values())  # no sample twice within an epoch
        if len(epoch) == dataset_len:  # a completed epoch used every sample
            assert sorted(epoch) == list(range(dataset_len))
        # and in the epoch's permutation, the one the EST data plan uses
        plan = DataPlan(dataset_len, num_ests=1, batch_size=1, seed=seed)
        assert epoch == plan.permutation(e)[: len(epoch)]


def test_state_and_errors() -> None:
    sampler = BalancedSampler(10, shuffle=False)
    batch = sampler.take(SamplerState(0, 8), [1, 3])
    assert batch.indices == ((8,), (9, 0, 1)) and batch.state == SamplerState(1, 2)
    with pytest.raises(ValueError, match="larger than the dataset"):
        sampler.take(SamplerState(), [6, 5])
    with pytest.raises(ValueError, match="exactly the keys"):
        SamplerState.from_json({"epoch": 1})
    with pytest.raises(ValueError, match="cursor must be"):
        SamplerState.from_json({"epoch": 1, "cursor": -1})
    with pytest.raises(ValueError, match="past the end"):
        sampler.take(SamplerState(0, 10), [1])
