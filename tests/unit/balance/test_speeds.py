"""Observed capability per device type (the job's telemetry), and the check the daemon's reader applies."""

from __future__ import annotations

import math

import pytest

from hpc_elastic.balance.speeds import (
    MAX_RATE,
    MAX_TYPES,
    MIN_RATE,
    ProcessReading,
    capability_by_type,
    check_capability,
)


def test_capability_is_the_mean_of_ests_per_second_over_each_types_processes() -> None:
    readings = [
        ProcessReading("a100", 3, 0.1),  # 30 mini-batches/s
        ProcessReading("a100", 2, 0.05),  # 40
        ProcessReading("v100", 1, 0.2),  # 5
        ProcessReading("v100", 0, 0.0),  # no EST: says nothing about its device
        ProcessReading("t4", 2, 0.0),  # not measurable
    ]
    assert capability_by_type(readings) == (("a100", 35.0), ("v100", 5.0))
    assert capability_by_type([]) == ()


@pytest.mark.parametrize(
    ("kind", "ests", "seconds", "match"),
    [("", 1, 0.1, "device type"), ("x" * 65, 1, 0.1, "device type"), ("cpu", -1, 0.1, "ESTs"),
     ("cpu", True, 0.1, "ESTs"), ("cpu", 1, math.nan, "time per step"), ("cpu", 1, -1.0, "time per step")],
)  # fmt: skip
def test_a_reading_names_what_is_wrong(kind: str, ests: int, seconds: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProcessReading(kind, ests, seconds)


def test_a_report_is_sorted_and_hostile_ones_are_refused() -> None:
    assert check_capability([["v100", 5], ["a100", 35.5]]) == (("a100", 35.5), ("v100", 5.0))
    assert check_capability([["a", MIN_RATE], ["b", MAX_RATE]]) == (("a", MIN_RATE), ("b", MAX_RATE))
    bad = [
        ({"a100": 1.0}, "list of"),
        ([["a100", 1.0, 2.0]], "pair"),
        ([["a100", math.inf]], r"a number in \[1e-06, 1e\+06\]"),
        ([["a100", float("nan")]], "a number in"),
        ([["a100", 0]], "a number in"),
        ([["a100", True]], "a number in"),
        ([["a100", "9"]], "a number in"),
        ([["a100", 1e308]], "a number in"),  # finite, but its ratios to others overflow in the planner
        ([["a100", 5e-324]], "a number in"),
        ([[7, 1.0]], "device type"),
        ([["y" * 65, 1.0]], "device type"),
        ([["a100", 1.0], ["a100", 2.0]], "twice"),
        ([[f"t{i}", 1.0] for i in range(MAX_TYPES + 1)], "at most"),
    ]
    for pairs, match in bad:
        with pytest.raises(ValueError, match=match):
            check_capability(pairs)
