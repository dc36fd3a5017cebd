"""The job-comment marker as the daemon reads it: anyone can write one, so every field is checked."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.collective import Backend
from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.launch.spec import (
    MARKER,
    MAX_MARKER_LENGTH,
    JobMarker,
    MarkerError,
    MarkerUnit,
    decode_marker,
)

GOOD = "hpc-elastic:v=1,workers=8,min=2,max=8,unit=gpu,backend=torch"


def test_a_valid_marker_and_a_plain_comment() -> None:
    assert decode_marker(GOOD) == JobMarker(8, 2, 8, MarkerUnit.GPU, Backend.TORCH)
    assert decode_marker("just a comment") is None
    assert decode_marker("") is None


@pytest.mark.parametrize(
    ("comment", "why"),
    [
        ("hpc-elastic:garbage", "not key=value"),
        (GOOD.replace("min=2", "min=0"), "not a count"),  # min=0 once made every pass a partial read
        (GOOD.replace("min=2", "min=-1"), "not a count"),
        (GOOD.replace("max=8", "max=9"), "min <= max <= workers"),
        (GOOD.replace("min=2", "min=9"), "min <= max <= workers"),
        (GOOD.replace("workers=8", f"workers={MAX_ESTS + 1}"), "in \\[1, "),
        (GOOD.replace("workers=8", "workers=1e9"), "not a count"),
        (GOOD.replace("workers=8", "workers=08"), "not a count"),
        (GOOD.replace("unit=gpu", "unit=tpu"), "bad marker"),
        (GOOD.replace("backend=torch", "backend=carrier-pigeon"), "bad marker"),
        (GOOD.replace("v=1", "v=2"), "version"),
        (GOOD.replace("v=1,", ""), "lacks v"),
        (GOOD + ",profile=/dev/zero", "not a path"),
        (GOOD + ",profile=../../etc/shadow", "not a path"),
        (GOOD + ",profile=..", "not a path"),
        (GOOD + ",gpu_type=a100/../x", "bad marker gpu_type"),
        (GOOD + ",level=d9", "bad marker"),
        (GOOD + ",min=3", "given twice"),
        (GOOD + ",owner=root", "unknown marker key"),
        ("hpc-elastic:v=1,workers=3,min=1,max=3,unit=proc,backend=torch", "one size"),
        (GOOD + ",x" * MAX_MARKER_LENGTH, "longer than"),
    ],
)
def test_a_forged_or_broken_marker_names_its_fault(comment: str, why: str) -> None:
    with pytest.raises(MarkerError, match=why):
        decode_marker(comment)


def test_markers_built_in_code_are_checked_too() -> None:
    with pytest.raises(MarkerError, match="min <= max"):
        JobMarker(4, 3, 2, MarkerUnit.GPU, Backend.TORCH)
    with pytest.raises(MarkerError, match="integer"):
        JobMarker(True, 1, 1, MarkerUnit.GPU, Backend.TORCH)


valid_markers = st.builds(
    lambda n, lo, hi, gpu, backend, extra: (
        JobMarker(n, min(lo, hi, n), min(max(lo, hi), n), MarkerUnit.GPU, backend, *extra)
        if gpu
        else JobMarker(n, n, n, MarkerUnit.PROC, backend, *extra)
    ),
    st.integers(1, MAX_ESTS),
    st.integers(1, MAX_ESTS),
    st.integers(1, MAX_ESTS),
    st.booleans(),
    st.sampled_from(list(Backend)),
    st.tuples(
        st.none() | st.from_regex(r"[A-Za-z0-9_.-]{1,32}", fullmatch=True),
        st.none() | st.from_regex(r"[A-Za-z0-9_+-][A-Za-z0-9_.@+-]{0,127}", fullmatch=True),
    ),
)


@settings(max_examples=300, deadline=None)
@given(valid_markers)
def test_every_valid_marker_round_trips(marker: JobMarker) -> None:
    assert decode_marker(marker.encode()) == marker


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=200) | st.builds(lambda tail: MARKER + tail, st.text(max_size=200)))
def test_any_comment_gives_a_marker_none_or_a_marker_error(comment: str) -> None:
    with contextlib.suppress(MarkerError):
        decode_marker(comment)  # anything else (IndexError, TypeError, ...) fails the test


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["v", "workers", "min", "max", "unit", "backend", "gpu_type", "profile", "level", "x"]),
            st.sampled_from(
                ["1", "0", "-3", "8", "99999999", "gpu", "proc", "torch", "mpi", "d2", "a/b", "", "=", "é"]
            ),
        ),
        max_size=12,
    )
)
def test_near_miss_markers_give_a_marker_or_a_marker_error(items: list[tuple[str, str]]) -> None:
    comment = MARKER + ",".join(f"{k}={v}" for k, v in items)
    try:
        marker = decode_marker(comment)
    except MarkerError:
        return
    assert marker is not None and 1 <= marker.min <= marker.max <= marker.workers <= MAX_ESTS
