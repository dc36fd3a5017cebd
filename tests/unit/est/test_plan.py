from __future__ import annotations

import pytest

from hpc_elastic.est.plan import BucketLayout, Placement, plan_buckets


def test_contiguous_placement_is_balanced() -> None:
    p = Placement.contiguous(5, 2)
    assert p.owner == (0, 0, 0, 1, 1)
    assert p.local_ests(1) == (3, 4)
    assert p.as_map() == {0: [0, 1, 2], 1: [3, 4]}
    assert Placement.contiguous(4, 4).owner == (0, 1, 2, 3)


def test_explicit_map_and_parse() -> None:
    p = Placement.from_map({0: [3, 0], 1: [1, 2]})
    assert p.owner == (0, 1, 1, 0)
    assert p.local_ests(0) == (0, 3)
    assert Placement.parse("0,3;1,2", 4) == p


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({0: [0, 1], 1: [1]}, "EST 1 is placed twice"),
        ({0: [0], 1: [2]}, "EST 1 is missing"),
        ({0: [0], 2: [1]}, r"process ids must be 0..1, got \[0, 2\]"),
        ({0: [0, 1], 1: []}, "process 1 has no EST"),
        ({0: [-1]}, "virtual rank -1"),
        ({}, "empty"),
    ],
)
def test_bad_maps_name_the_bad_value(mapping: dict[int, list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement.from_map(mapping)


def test_bad_placements() -> None:
    with pytest.raises(ValueError, match=r"num_procs \(3\) must not exceed num_ests \(2\)"):
        Placement.contiguous(2, 3)
    with pytest.raises(ValueError, match="EST 1 is placed on process 5"):
        Placement((0, 5), 2)
    with pytest.raises(ValueError, match="places 2 ESTs, expected 4"):
        Placement.parse("0;1", 4)
    with pytest.raises(ValueError, match="bad EST map 'a;b'"):
        Placement.parse("a;b", 2)


def test_buckets_follow_parameter_index() -> None:
    layout = plan_buckets([10, 5, 100, 3, 4], bucket_elements=16, chunk=4)
    assert [[s.index for s in b.slots] for b in layout.buckets] == [[0, 1], [2], [3, 4]]
    assert [b.numel for b in layout.buckets] == [15, 100, 7]
    assert layout.buckets[0].slots[1].offset == 10
    assert BucketLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ValueError, match="bucket_elements must be an integer >= 1, got 0"):
        plan_buckets([1], bucket_elements=0)
    with pytest.raises(ValueError, match="numel of parameter 1"):
        plan_buckets([1, -2])
    with pytest.raises(ValueError, match="malformed bucket layout"):
        BucketLayout.from_json({"chunk": 4})


def test_with_counts_moves_only_what_must_move() -> None:
    start = Placement.contiguous(8, 4)  # (0,0,1,1,2,2,3,3)
    assert start.counts() == (2, 2, 2, 2)
    moved = start.with_counts((1, 2, 2, 3))
    assert moved.counts() == (1, 2, 2, 3)
    assert moved.owner == (0, 3, 1, 1, 2, 2, 3, 3)  # EST 1 alone moves, from process 0 to process 3
    assert start.with_counts((2, 2, 2, 2)) == start
    two = Placement.contiguous(8, 4).with_counts((1, 1, 3, 3))
    assert two.owner == (0, 2, 1, 3, 2, 2, 3, 3)
    assert two.with_counts((2, 2, 2, 2)).counts() == (2, 2, 2, 2)


@pytest.mark.parametrize("counts", [(1, 1, 1), (0, 4, 4, 0), (1, 1, 1, 6), (2, 2, 2, 1)])
def test_with_counts_rejects_bad_counts(counts: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="EST count"):
        Placement.contiguous(8, 4).with_counts(counts)


def test_placement_by_capability_gives_faster_devices_more_ests_eq_1d() -> None:
    # 2 a100 at twice a v100's capability and 3 v100, 8 ESTs: shares 2.29, 2.29, 1.14 x 3 -> 3, 2, 1, 1, 1
    placement = Placement.by_capability(8, [2.0, 2.0, 1.0, 1.0, 1.0])
    assert placement.counts() == (3, 2, 1, 1, 1) and placement.owner == (0, 0, 0, 1, 1, 2, 3, 4)
    # f_overload (Eq. 1b: the most ESTs per unit of capability) of that split against the even one
    assert max(a / c for a, c in zip(placement.counts(), [2, 2, 1, 1, 1], strict=True)) == 1.5
    assert max(a / c for a, c in zip((2, 2, 2, 1, 1), [2, 2, 1, 1, 1], strict=True)) == 2.0
    # equal capabilities: the even contiguous blocks
    assert Placement.by_capability(8, [1.0] * 5) == Placement.contiguous(8, 5)
    # every process keeps at least one EST, taken from the most loaded per unit of capability
    assert Placement.by_capability(5, [10.0, 1.0, 1.0, 1.0, 1.0]).counts() == (1, 1, 1, 1, 1)
    assert Placement.by_capability(6, [10.0, 3.0, 1.0]).counts() == (4, 1, 1)
    for bad in ([0.0, 1.0], [float("nan"), 1.0], [1.0] * 9):
        with pytest.raises(ValueError, match="capabilities|num_procs"):
            Placement.by_capability(8, bad)
