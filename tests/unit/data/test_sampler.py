"""ElasticSampler: exactly-once per epoch across restarts and resizes (hypothesis), determinism, state checks."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hpc_elastic.data import ElasticSampler, epoch_permutation

# A run is a list of segments; each segment is one incarnation of the job: (steps, replicas, batch size).  Between
# segments the sampler is rebuilt from its state_dict, as after a requeue onto a different number of processes.
segments_st = st.lists(
    st.tuples(st.integers(0, 25), st.integers(1, 9), st.integers(1, 7)),
    min_size=1,
    max_size=6,
)


def run_segments(
    dataset_len: int, seed: int, segments: list[tuple[int, int, int]], drop_last: bool = False
) -> tuple[dict[int, list[int]], ElasticSampler, list[list[int]]]:
    """Consume the segments; return the indices each epoch consumed (in order), the final sampler, all batches."""
    per_epoch: dict[int, list[int]] = defaultdict(list)
    batches: list[list[int]] = []
    state: dict[str, Any] | None = None
    sampler = ElasticSampler(dataset_len, 1, seed=seed)
    for steps, replicas, batch in segments:
        sampler = ElasticSampler(dataset_len, batch, seed=seed, drop_last=drop_last)
        if state is not None:
            sampler.load_state_dict(state)
        for _ in range(steps):
            window = sampler.window(replicas)
            step = sampler.step_indices(replicas)
            batches.extend(step)
            per_epoch[window.epoch].extend(i for b in step for i in b)
            assert sampler.advance(replicas) == window
        state = sampler.state_dict()
    return per_epoch, sampler, batches


@settings(max_examples=150, deadline=None)
@given(dataset_len=st.integers(1, 60), seed=st.integers(0, 2**32), segments=segments_st)
def test_every_sample_exactly_once_per_epoch_across_restarts_and_resizes(
    dataset_len: int, seed: int, segments: list[tuple[int, int, int]]
) -> None:
    per_epoch, sampler, _ = run_segments(dataset_len, seed, segments)
    for epoch, used in per_epoch.items():
        counts = Counter(used)
        assert all(c == 1 for c in counts.values()), f"epoch {epoch} repeated {counts.most_common(1)}"
        assert set(used) <= set(range(dataset_len))
        if epoch < sampler.epoch:  # a finished epoch covered the whole dataset
            assert sorted(used) == list(range(dataset_len))
        else:  # the epoch in progress consumed exactly the first `position` samples of its permutation
            assert used == epoch_permutation(dataset_len, seed, epoch)[: sampler.position]
    assert sum(len(v) for v in per_epoch.values()) == sampler.epoch * dataset_len + sampler.position


@settings(max_examples=100, deadline=None)
@given(dataset_len=st.integers(1, 60), seed=st.integers(0, 1000), segments=segments_st)
def test_the_sample_order_does_not_depend_on_how_the_run_was_cut(
    dataset_len: int, seed: int, segments: list[tuple[int, int, int]]
) -> None:
    """Concatenating the step windows gives the permutations of consecutive epochs, whatever the segments."""
    per_epoch, _, _ = run_segments(dataset_len, seed, segments)
    for epoch, used in per_epoch.items():
        perm = epoch_permutation(dataset_len, seed, epoch)
        assert used == perm[: len(used)]


@settings(max_examples=100, deadline=None)
@given(dataset_len=st.integers(1, 60), seed=st.integers(0, 1000), segments=segments_st)
def test_drop_last_gives_full_batches_and_no_duplicates(
    dataset_len: int, seed: int, segments: list[tuple[int, int, int]]
) -> None:
    usable = [(s, r, b) for s, r, b in segments if r * b <= dataset_len]
    assume(usable)
    per_epoch, _, batches = run_segments(dataset_len, seed, usable, drop_last=True)
    assert all(len(b) == bs for b, bs in zip(batches, _batch_sizes(usable), strict=True))
    for used in per_epoch.values():
        assert len(used) == len(set(used))


def _batch_sizes(segments: list[tuple[int, int, int]]) -> list[int]:
    return [b for steps, replicas, b in segments for _ in range(steps * replicas)]


def test_last_window_of_an_epoch_goes_to_the_first_replicas() -> None:
    s = ElasticSampler(10, 3, shuffle=False)
    assert s.step_indices(2) == [[0, 1, 2], [3, 4, 5]]
    s.advance(2)
    assert s.step_size(2) == 4
    assert s.step_indices(2) == [[6, 7, 8], [9]]
    s.advance(2)
    assert (s.epoch, s.position) == (1, 0)
    assert s.step_indices(4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    s.advance(4)
    assert s.step_indices(5) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], []]


def test_drop_last_skips_the_short_tail() -> None:
    s = ElasticSampler(10, 3, shuffle=False, drop_last=True)
    s.advance(3)  # 9 of 10 used; the next window of 3 would be short
    assert s.steps_left_in_epoch(3) == 0
    assert s.window(3).epoch == 1 and s.indices(0, 3) == [0, 1, 2]
    s.advance(3)
    assert (s.epoch, s.position) == (1, 9)
    with pytest.raises(ValueError, match="exceeds the dataset of 10 samples"):
        s.window(4)


def test_permutations_are_deterministic_and_differ_between_epochs_and_seeds() -> None:
    a = epoch_permutation(1000, seed=3, epoch=0)
    assert a == epoch_permutation(1000, seed=3, epoch=0)
    assert sorted(a) == list(range(1000))
    assert a != epoch_permutation(1000, seed=3, epoch=1)
    assert a != epoch_permutation(1000, seed=4, epoch=0)
    assert epoch_permutation(5, seed=3, epoch=0, shuffle=False) == [0, 1, 2, 3, 4]


def test_state_dict_round_trip_and_the_batch_size_may_change() -> None:
    s = ElasticSampler(50, 4, seed=9)
    for _ in range(3):
        s.advance(2)
    state = s.state_dict()
    assert state == {
        "epoch": 0,
        "position": 24,
        "seed": 9,
        "dataset_len": 50,
        "batch_size": 4,
        "shuffle": True,
        "drop_last": False,
    }
    t = ElasticSampler(50, 6, seed=9)
    t.load_state_dict(state)
    assert t.indices(0, 1) == epoch_permutation(50, 9, 0)[24:30]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("dataset_len", 51, "dataset_len=51 but this sampler has dataset_len=50"),
        ("seed", 1, "seed=1 but this sampler has seed=9"),
        ("shuffle", False, "shuffle=False"),
        ("position", 51, "position 51 is beyond the dataset of 50 samples"),
        ("epoch", -1, "epoch must be a non-negative integer, got -1"),
    ],
)
def test_load_state_dict_rejects_a_foreign_state(key: str, value: Any, message: str) -> None:
    s = ElasticSampler(50, 4, seed=9)
    state: dict[str, Any] = {**s.state_dict(), key: value}
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(state)
    with pytest.raises(ValueError, match="sampler state lacks 'position'"):
        s.load_state_dict({"epoch": 0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset_len": 0, "batch_size": 1}, "dataset_len must be a positive integer, got 0"),
        ({"dataset_len": 5, "batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"dataset_len": 5, "batch_size": 1, "seed": -1}, "seed must be a non-negative integer, got -1"),
        ({"dataset_len": 5, "batch_size": 1, "shuffle": 1}, "shuffle must be a bool, got 1"),
        ({"dataset_len": True, "batch_size": 1}, "dataset_len must be a positive integer, got True"),
    ],
)
def test_constructor_checks(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ElasticSampler(**kwargs)


def test_replica_arguments_are_checked() -> None:
    s = ElasticSampler(10, 2)
    with pytest.raises(ValueError, match="replicas must be a positive integer, got 0"):
        s.window(0)
    with pytest.raises(ValueError, match=r"replica must be in \[0, 2\), got 2"):
        s.indices(2, 2)
    with pytest.raises(ValueError, match="epoch must be a non-negative integer"):
        s.set_epoch(-3)
    s.set_epoch(4)
    assert (s.epoch, s.position) == (4, 0)
