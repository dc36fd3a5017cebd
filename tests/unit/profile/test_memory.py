"""Memory limit x^o (LB-BSP §3.3.1(4)) by search against a fake allocation limit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_elastic.profile.memory import find_memory_limit, format_size, parse_size
from hpc_elastic.profile.meters import ChildProcessStepPeak, fits_under


class FakeAllocator:
    """Peak bytes = baseline + per_sample * x; batches above the limit do not fit."""

    def __init__(self, cap: int, baseline: int = 300, per_sample: int = 7) -> None:
        self.cap, self.baseline, self.per_sample = cap, baseline, per_sample
        self.calls: list[int] = []

    def __call__(self, batch: int) -> bool:
        self.calls.append(batch)
        return self.baseline + self.per_sample * batch <= self.cap

    @property
    def true_limit(self) -> int:
        return (self.cap - self.baseline) // self.per_sample


@pytest.mark.parametrize("cap", [307, 308, 1000, 7300, 7301, 10**6])
def test_finds_the_exact_limit(cap: int) -> None:
    fake = FakeAllocator(cap)
    search = find_memory_limit(fake, max_batch=1 << 20)
    assert search.limit == fake.true_limit
    assert search.first_failing == fake.true_limit + 1
    assert not search.capped
    assert len(fake.calls) == len(set(fake.calls))
    assert [batch for batch, _ in search.probes] == fake.calls


def test_doubles_then_bisects() -> None:
    fake = FakeAllocator(cap=300 + 7 * 100)  # x^o = 100
    search = find_memory_limit(fake, max_batch=4096)
    assert fake.calls == [1, 2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]
    assert search.probes[-1] == (101, False)


def test_capped_when_max_batch_fits() -> None:
    search = find_memory_limit(FakeAllocator(cap=10**9), max_batch=48)
    assert (search.limit, search.capped, search.first_failing) == (48, True, None)
    assert [batch for batch, _ in search.probes] == [1, 2, 4, 8, 16, 32, 48]


def test_none_when_nothing_fits() -> None:
    search = find_memory_limit(FakeAllocator(cap=10), max_batch=64)
    assert (search.limit, search.capped, search.first_failing) == (None, False, 1)


def test_resolution_stops_within_the_bracket() -> None:
    fake = FakeAllocator(cap=300 + 7 * 1000)
    search = find_memory_limit(fake, max_batch=1 << 16, resolution=1 / 32)
    assert search.limit is not None and search.first_failing is not None
    assert search.limit <= fake.true_limit < search.first_failing
    assert search.first_failing - search.limit <= search.limit / 32
    assert len(fake.calls) < len(find_memory_limit(FakeAllocator(cap=7300), max_batch=1 << 16).probes)


@given(cap=st.integers(min_value=1, max_value=10**7), max_batch=st.integers(min_value=1, max_value=5000))
def test_matches_brute_force(cap: int, max_batch: int) -> None:
    fake = FakeAllocator(cap, baseline=50, per_sample=3)
    search = find_memory_limit(fake, max_batch=max_batch)
    expected = min(fake.true_limit, max_batch) if cap >= 53 else None
    assert search.limit == expected
    assert search.capped == (fake.true_limit >= max_batch)


@pytest.mark.parametrize(("max_batch", "start", "resolution"), [(0, 1, 0.0), (4, 8, 0.0), (4, 0, 0.0), (4, 1, 1.0)])
def test_bad_arguments(max_batch: int, start: int, resolution: float) -> None:
    with pytest.raises(ValueError, match="got|larger"):
        find_memory_limit(FakeAllocator(100), max_batch=max_batch, start=start, resolution=resolution)


def test_fits_under_records_peaks_and_treats_oom_as_not_fitting() -> None:
    peaks_by_batch = {1: 100, 2: 200, 3: None}
    peaks: dict[int, int | None] = {}
    fits = fits_under(peaks_by_batch.__getitem__, cap_bytes=150, peaks=peaks)
    assert [fits(1), fits(2), fits(3)] == [True, False, False]
    assert peaks == peaks_by_batch


def test_a_real_probe_in_a_fresh_process() -> None:
    probe = ChildProcessStepPeak("tests.unit.profile.tiny_models:tiny", seed=0)
    small, large = probe(1), probe(200_000)
    assert small is not None and large is not None
    assert 10 << 20 < small < large  # a process with torch loaded holds tens of MiB; 200k samples add more


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 << 30), ("512M", 512 << 20), ("1.5G", 3 << 29), ("4GB", 4 * 10**9), ("100", 100), ("8 KiB", 8192)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "2Gi", "lots", "-1G", "0", "1X"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 << 29) == "1.50 GiB"
