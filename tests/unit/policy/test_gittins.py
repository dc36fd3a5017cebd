"""2D-Gittins index (Tiresias Pseudocode 1 line 11) against brute force on small distributions."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.policy import GittinsTable, ServiceDistribution, gittins_index, gittins_index_sup
from hpc_elastic.policy.gittins import ReferenceIndex


def brute(samples: list[int], a: Fraction, delta: Fraction) -> Fraction:
    """P(S - a <= Δ | S > a) / E[min(S - a, Δ) | S > a], exactly, by enumeration."""
    alive = [Fraction(s) for s in samples if s > a]
    if not alive:
        return Fraction(0)
    prob = Fraction(sum(1 for s in alive if s - a <= delta), len(alive))
    mean = sum((min(s - a, delta) for s in alive), Fraction(0)) / len(alive)
    return prob / mean


sizes = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    samples=sizes,
    delta=st.integers(min_value=1, max_value=30),
    a_num=st.integers(0, 200),
    a_den=st.sampled_from([1, 2, 4]),
)
def test_table_matches_brute_force(samples: list[int], delta: int, a_num: int, a_den: int) -> None:
    a = Fraction(a_num, a_den)
    dist = ServiceDistribution.from_samples(samples)
    table = GittinsTable.build(dist, float(delta))
    got = float(table.index(np.array([float(a)]))[0])
    want = float(brute(samples, a, Fraction(delta)))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert gittins_index(dist, float(a), float(delta)) == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=80, deadline=None)
@given(samples=sizes, delta=st.integers(min_value=1, max_value=30))
def test_table_exact_at_breakpoints(samples: list[int], delta: int) -> None:
    """At a = s_j and a = s_j - Δ the piece boundaries must give the value of the definition."""
    dist = ServiceDistribution.from_samples(samples)
    table = GittinsTable.build(dist, float(delta))
    points = sorted({float(s) for s in samples} | {float(s - delta) for s in samples if s - delta >= 0})
    got = table.index(np.array(points))
    want = [float(brute(samples, Fraction(p), Fraction(delta))) for p in points]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(samples=sizes, a=st.integers(0, 45))
def test_sup_index_matches_brute_force_over_all_deltas(samples: list[int], a: int) -> None:
    dist = ServiceDistribution.from_samples(samples)
    candidates = [Fraction(d, 2) for d in range(1, 100)]
    want = max((brute(samples, Fraction(a), d) for d in candidates), default=Fraction(0))
    got = float(gittins_index_sup(dist, np.array([float(a)]))[0])
    assert got == pytest.approx(float(want), rel=1e-9, abs=1e-12)


def test_remaining_service_not_total_size() -> None:
    """S = {10, 100}, a = 5, Δ = 10: the job completes within Δ if S - a <= 10, i.e. S = 10 (P = 1/2);
    comparing S itself with Δ would give the same P but E[min(S, Δ)] = 10 instead of E[min(S - a, Δ)] = 7.5."""
    dist = ServiceDistribution.from_samples([10, 100])
    assert gittins_index(dist, 5.0, 10.0) == pytest.approx(0.5 / 7.5)
    table = GittinsTable.build(dist, 10.0)
    assert float(table.index(np.array([5.0]))[0]) == pytest.approx(0.5 / 7.5)


def test_job_that_outlived_history_has_zero_index() -> None:
    dist = ServiceDistribution.from_samples([3, 7])
    table = GittinsTable.build(dist, 5.0)
    assert table.index(np.array([7.0, 50.0])).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("bad", [0.0, -3.0, math.inf, math.nan])
def test_bad_sizes_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="job sizes"):
        ServiceDistribution.from_samples([5.0, bad])


@pytest.mark.parametrize("delta", [0.0, -1.0, math.inf])
def test_bad_delta_rejected(delta: float) -> None:
    with pytest.raises(ValueError, match="Δ"):
        GittinsTable.build(ServiceDistribution.from_samples([1.0]), delta)


def reference_index(data: list[int], a: int, delta: int) -> float:
    """The public Tiresias simulator's index, transcribed from its run_sim.py (get_gittins_index and
    cal_r_gittins_index, Python 2 integer division as floor)."""
    data = sorted(data)
    num = len(data)
    if a >= data[-1]:
        return 0.0
    nxt = next(i for i, s in enumerate(data) if s > a)
    x = data[nxt] - 1
    idx = next(i for i, s in enumerate(data) if s > x)
    idx_delta = num - 1 if x + delta > data[-1] - 1 else next(i for i, s in enumerate(data) if s > x + delta)
    p = round((idx_delta - idx) * 1.0 / (num - idx), 5)
    e = (sum(data[idx:idx_delta]) + delta * (num - idx_delta)) // (num - idx)
    return round(p * 1000000 / e, 4)


@settings(max_examples=100, deadline=None)
@given(samples=sizes, delta=st.integers(1, 30), attained=st.lists(st.integers(0, 60), min_size=1, max_size=8))
def test_reference_index_is_the_public_simulators(samples: list[int], delta: int, attained: list[int]) -> None:
    table = ReferenceIndex.build(ServiceDistribution.from_samples(samples), float(delta))
    got = table.index(np.array(attained, dtype=np.float64))
    assert got.tolist() == [reference_index(samples, a, delta) for a in attained]


@settings(max_examples=100, deadline=None)
@given(
    samples=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    delta=st.integers(1, 3000),
    attained=st.lists(st.sampled_from([0.0, -1e-9, 0.5, 17.0, 999.5, 3000.0, 4999.0, 6000.0]), max_size=12),
)
def test_index_of_mostly_run_jobs_is_each_jobs_own(samples: list[int], delta: int, attained: list[float]) -> None:
    """A pass whose jobs mostly ran looks every job up at once: the same index, to the bit, as a pass whose
    jobs mostly never ran (which looks up only the others)."""
    table = GittinsTable.build(ServiceDistribution.from_samples(samples), float(delta))
    got = table.index(np.array(attained, dtype=np.float64))
    among_new = [float(table.index(np.array([0.0, 0.0, a]))[2]) for a in attained]
    assert got.tolist() == among_new


@settings(max_examples=150, deadline=None)
@given(
    samples=st.lists(st.floats(0.001, 1e7), min_size=1, max_size=40),
    delta=st.floats(0.5, 5000.0),
    attained=st.lists(
        st.one_of(
            st.floats(-1e4, 2e7, allow_nan=False),
            st.sampled_from([0.0, -0.0, -1e-300, 5e-324]),
        ),
        min_size=1,
        max_size=30,
    ),
    at_breakpoints=st.booleans(),
)
def test_lookup_finds_the_piece_a_float_search_finds(
    samples: list[float], delta: float, attained: list[float], at_breakpoints: bool
) -> None:
    """The lookup searches the breakpoints' bits as integers: the same piece, hence the same index to the bit, as
    a search over the floats (negative a_J, -0.0 and a_J on a breakpoint included)."""
    table = GittinsTable.build(ServiceDistribution.from_samples(samples), delta)
    a = np.array(attained, dtype=np.float64)
    if at_breakpoints:
        a = np.concatenate((a, table.breakpoints, np.nextafter(table.breakpoints, -math.inf)))
    k = table.breakpoints.searchsorted(a, side="right")
    c = np.concatenate((table.within[:1], table.within))[k]
    denom = np.concatenate((table.fixed[:1], table.fixed))[k] - a * c
    want = np.divide(c, denom, out=np.zeros(a.shape), where=denom > 0.0)
    got = table.index(a)
    assert got.tobytes() == want.tobytes()
