"""A pass over a few jobs walks in plain Python: the same selection as the vectorised walk (hypothesis)."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.policy import core
from hpc_elastic.policy.types import BoolArray, IntArray, PassInput
from tests.unit.policy.strategies import pass_inputs


def _selections(
    inp: PassInput, order: IntArray, pinned: BoolArray | None, size: IntArray | None, deficit: bool
) -> tuple[core.Selection, core.Selection]:
    small = core.select(inp, order, pinned, size=size, deficit=deficit)
    with mock.patch.object(core, "SMALL_PASS", -1):
        vectorised = core.select(inp, order, pinned, size=size, deficit=deficit)
    return small, vectorised


@settings(max_examples=300, deadline=None)
@given(
    case=pass_inputs(max_jobs=core.SMALL_PASS),
    data=st.data(),
    deficit=st.booleans(),
    pin=st.booleans(),
    resize=st.booleans(),
)
def test_small_select_matches_the_vectorised_walk(
    case: tuple[PassInput, object, object], data: st.DataObject, deficit: bool, pin: bool, resize: bool
) -> None:
    inp = case[0]
    n = len(inp.jobs)
    order = np.asarray(data.draw(st.permutations(range(n))), dtype=np.int64)
    pinned = None
    if pin:
        flags = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
        pinned = np.asarray(flags, dtype=np.bool_) & inp.jobs.running
    size = None
    if resize:
        size = np.asarray(data.draw(st.lists(st.integers(1, 9), min_size=n, max_size=n)), dtype=np.int64)
    small, vectorised = _selections(inp, order, pinned, size, deficit)
    np.testing.assert_array_equal(small.holding, vectorised.holding)
    np.testing.assert_array_equal(small.feasible, vectorised.feasible)
    assert small.start_rows == vectorised.start_rows
    assert small.start_pool == vectorised.start_pool
    assert small.preempt_rows == vectorised.preempt_rows
    assert small.deficit == vectorised.deficit
