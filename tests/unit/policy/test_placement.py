"""Placement (Tiresias §3.3): consolidate skewed jobs, reduce fragmentation otherwise; PACKLIMIT refit."""

from __future__ import annotations

import math
import random

import pytest

from hpc_elastic.policy import ClusterState, FreeIndex, NodeView, PlacementMode, PlacementSample, fit_pack_limit


def index(free: list[int], size: int = 4) -> FreeIndex:
    nodes = [NodeView(f"n{i}", size, f) for i, f in enumerate(free)]
    return FreeIndex(ClusterState.from_nodes(nodes))


def nodes_of(alloc: list[tuple[int, int]] | None) -> list[int]:
    assert alloc is not None
    return sorted(node for node, _ in alloc)


def test_single_node_best_fit() -> None:
    idx = index([4, 2, 3])
    assert idx.place(0, 2, PlacementMode.SPREAD, math.nan, 0.5) == [(1, 2)]
    assert idx.free == [4, 0, 3]


def test_skewed_job_consolidates_on_fewest_nodes() -> None:
    # 6 GPUs over nodes with free 1, 1, 2, 4, 4: fewest nodes = two 4s (or 4 + 2).
    idx = index([1, 1, 2, 4, 4])
    alloc = idx.place(0, 6, PlacementMode.SKEW_AWARE, 0.9, 0.5)
    assert alloc is not None and len(alloc) == 2
    assert sum(c for _, c in alloc) == 6


def test_unskewed_job_fills_fragments_first() -> None:
    idx = index([1, 1, 2, 4, 4])
    alloc = idx.place(0, 6, PlacementMode.SKEW_AWARE, 0.1, 0.5)
    assert nodes_of(alloc) == [0, 1, 2, 3]
    assert idx.free[4] == 4, "a whole node stays free for a job that needs consolidation"


def test_unknown_skew_is_not_skewed() -> None:
    idx = index([1, 1, 2, 4, 4])
    assert len(nodes_of(idx.place(0, 6, PlacementMode.SKEW_AWARE, math.nan, 0.5))) == 4


def test_strict_requires_minimum_nodes() -> None:
    idx = index([3, 3, 3])
    assert idx.place(0, 7, PlacementMode.STRICT, math.nan, 0.5) is None, "7 GPUs must fit 2 nodes, not 3"
    assert idx.free == [3, 3, 3]
    assert len(nodes_of(idx.place(0, 5, PlacementMode.STRICT, math.nan, 0.5))) == 2
    assert len(nodes_of(idx.place(0, 4, PlacementMode.CONSOLIDATE, math.nan, 0.5))) == 2
    idx2 = index([4, 4, 1])
    assert nodes_of(idx2.place(0, 8, PlacementMode.STRICT, math.nan, 0.5)) == [0, 1]


def test_strict_counts_the_nodes_an_empty_pool_of_mixed_sizes_needs() -> None:
    # nodes of 1, 2, 2 and 8 GPUs: 12 GPUs need three of them (8 + 2 + 2), not ceil(12 / 8) = 2
    nodes = [NodeView(f"n{i}", size, size) for i, size in enumerate([1, 2, 2, 8])]
    cluster = ClusterState.from_nodes(nodes)
    assert [cluster.fewest_nodes(g) for g in (1, 8, 9, 10, 12, 13)] == [1, 1, 2, 2, 3, 4]
    assert cluster.fewest_nodes(12, 0) == 3
    with pytest.raises(ValueError, match="14"):
        cluster.fewest_nodes(14)
    assert nodes_of(FreeIndex(cluster).place(0, 12, PlacementMode.STRICT, math.nan, 0.5)) == [1, 2, 3]
    assert nodes_of(FreeIndex(cluster).place(0, 13, PlacementMode.STRICT, math.nan, 0.5)) == [0, 1, 2, 3]
    partly = ClusterState.from_nodes([NodeView("n0", 1, 1), NodeView("n1", 2, 2), NodeView("n2", 8, 6)])
    assert FreeIndex(partly).place(0, 9, PlacementMode.STRICT, math.nan, 0.5) is None  # 6 + 2: on two, not three


def test_place_fails_without_enough_free() -> None:
    idx = index([1, 1])
    assert idx.place(0, 3, PlacementMode.SPREAD, math.nan, 0.5) is None
    assert idx.place(0, 3, PlacementMode.CONSOLIDATE, math.nan, 0.5) is None


def test_release_and_take_round_trip() -> None:
    idx = index([4, 4])
    alloc = idx.place(0, 6, PlacementMode.CONSOLIDATE, math.nan, 0.5)
    assert alloc is not None
    idx.release(alloc)
    assert idx.free == [4, 4] and idx.pool_free(0) == 8
    with pytest.raises(ValueError, match="cannot take"):
        idx.take([(0, 5)])


def samples(model: str, skew: float, packed: float, spread: float) -> list[PlacementSample]:
    return [PlacementSample(model, skew, True, packed), PlacementSample(model, skew, False, spread)]


def test_pack_limit_separates_sensitive_models() -> None:
    data = (
        samples("vgg16", 0.74, 10.0, 6.0)
        + samples("alexnet", 0.62, 10.0, 7.0)
        + samples("resnet50", 0.09, 10.0, 9.8)
        + samples("googlenet", 0.15, 10.0, 9.9)
    )
    limit = fit_pack_limit(data, tolerance=1.1)
    assert 0.15 < limit < 0.62
    assert limit == pytest.approx((0.15 + 0.62) / 2)


def test_pack_limit_keeps_current_with_one_class() -> None:
    data = samples("resnet50", 0.09, 10.0, 9.9) + samples("inception3", 0.08, 10.0, 9.8)
    assert fit_pack_limit(data, current=0.42) == 0.42
    assert fit_pack_limit([], current=0.3) == 0.3


def test_pack_limit_minimises_errors_with_noisy_labels() -> None:
    data = (
        samples("a", 0.1, 10.0, 9.9)
        + samples("b", 0.2, 10.0, 6.0)  # a sensitive outlier among low-skew models
        + samples("c", 0.3, 10.0, 9.9)
        + samples("d", 0.7, 10.0, 6.0)
        + samples("e", 0.8, 10.0, 6.0)
    )
    assert fit_pack_limit(data) == pytest.approx(0.5)


def test_bad_samples_rejected() -> None:
    with pytest.raises(ValueError, match="speed"):
        PlacementSample("m", 0.5, True, 0.0)
    with pytest.raises(ValueError, match="tolerance"):
        fit_pack_limit([], tolerance=0.5)


def test_consolidation_prefers_one_switch() -> None:
    nodes = [NodeView("a", 4, 4, switch="s1"), NodeView("b", 4, 4, switch="s2"), NodeView("c", 4, 4, switch="s2")]
    idx = FreeIndex(ClusterState.from_nodes(nodes))
    assert nodes_of(idx.place(0, 8, PlacementMode.CONSOLIDATE, math.nan, 0.5)) == [1, 2]
    # no single switch can hold 12 GPUs: fall back to the whole pool
    idx = FreeIndex(ClusterState.from_nodes(nodes))
    assert nodes_of(idx.place(0, 12, PlacementMode.CONSOLIDATE, math.nan, 0.5)) == [0, 1, 2]


def test_best_fit_from_the_fit_sets_places_as_the_scan_does() -> None:
    """After a few single-node fits a FreeIndex looks them up in its sets of nodes per free count: every placement
    (single- and multi-node, every mode, with releases in between) is the one an index that always scans makes,
    including the order in which multi-node placements visit the free-GPU buckets."""
    rng = random.Random(7)
    placed = 0
    for trial in range(200):
        types = ["a", "b"] if trial % 2 else [""]
        sizes = [rng.choice([4, 8]) for _ in range(rng.randint(1, 30))]
        nodes = [NodeView(f"n{i}", t, rng.randint(0, t), rng.choice(types)) for i, t in enumerate(sizes)]
        cluster = ClusterState.from_nodes(nodes)
        scanning, indexed = FreeIndex(cluster), FreeIndex(cluster)
        scanning._scans = -(10**9)  # never reaches the sets
        for _ in range(40):
            pool, gpus = rng.randrange(cluster.n_pools), rng.randint(1, 12)
            mode = rng.choice(list(PlacementMode))
            skew = rng.choice([math.nan, 0.1, 0.9])
            expected = scanning.place(pool, gpus, mode, skew, 0.5)
            assert indexed.place(pool, gpus, mode, skew, 0.5) == expected
            placed += expected is not None
            node = rng.randrange(len(nodes))
            if rng.random() < 0.3 and scanning.free_of(node) < int(cluster.total[node]):
                scanning.release([(node, 1)])
                indexed.release([(node, 1)])
    assert placed > 1000
