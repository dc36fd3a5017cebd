"""Integer batch sizes with Σ x_i = X (Alg. 1 line 9), under memory caps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_elastic.balance.apportion import apportion


def test_largest_remainder() -> None:
    assert apportion([1.0, 2.0, 3.0, 4.0], 256) == (26, 51, 77, 102)  # 25.6, 51.2, 76.8, 102.4
    assert apportion([1.0, 1.0, 1.0], 10) == (4, 3, 3)  # ties: lower index first
    assert apportion([0.0, 0.0], 5) == (3, 2)


def test_caps_are_filled_first() -> None:
    assert apportion([1.0, 1.0, 8.0], 100, [None, None, 50]) == (25, 25, 50)
    with pytest.raises(ValueError, match="hold only 20 samples"):
        apportion([1.0, 1.0], 30, [10, 10])


@given(
    st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=8),
    st.integers(0, 10_000),
    st.data(),
)
def test_sum_caps_and_closeness(weights: list[float], total: int, data: st.DataObject) -> None:
    caps = data.draw(st.lists(st.one_of(st.none(), st.integers(1, 5000)), min_size=len(weights), max_size=len(weights)))
    room = math.inf if None in caps else sum(c for c in caps if c is not None)
    if room < total:
        with pytest.raises(ValueError):
            apportion(weights, total, caps)
        return
    sizes = apportion(weights, total, caps)
    assert sum(sizes) == total
    assert all(x >= 0 for x in sizes)
    assert all(c is None or x <= c for x, c in zip(sizes, caps, strict=True))
    if all(c is None for c in caps) and sum(weights) > 0:
        shares = [total * w / sum(weights) for w in weights]
        assert all(abs(x - s) < 1 + 1e-9 for x, s in zip(sizes, shares, strict=True))
