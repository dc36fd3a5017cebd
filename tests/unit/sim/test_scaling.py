"""Elastic jobs in the simulator: N ESTs on M GPUs (step time follows ceil(N / M))."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hpc_elastic.policy.types import LINEAR, ScalingCurve
from hpc_elastic.sim.scaling import (
    GAVEL_GPU_TYPES,
    load_gavel_capabilities,
    load_gavel_curves,
    make_elastic,
    with_ests,
)
from hpc_elastic.sim.trace import TraceJob


def test_ests_run_at_the_curve_where_m_divides_n_and_no_faster_in_between() -> None:
    assert [with_ests(LINEAR, 8).at(m) for m in range(1, 9)] == pytest.approx([1, 2, 8 / 3, 4, 4, 4, 4, 8])
    curve = ScalingCurve((1, 2, 4, 8), (1.0, 1.8, 2.15, 3.94))
    ests = with_ests(curve, 8)
    for m in (1, 2, 4, 8):
        assert ests.at(m) == pytest.approx(curve.at(m))
    for m in (5, 6, 7):  # 2 ESTs on the busiest GPU: its GPUs are busy 8 / (2 m) of the time
        assert ests.at(m) == pytest.approx(max(curve.at(m) * 8 / (2 * m), ests.at(m - 1)))
    assert ests.at(7) < 1.1 * ests.at(4)
    with pytest.raises(ValueError, match="EST"):
        with_ests(LINEAR, 0)


def test_make_elastic_gives_a_job_as_many_ests_as_its_maximum() -> None:
    job = TraceJob("a", 0.0, 3, 100.0)
    (elastic,) = make_elastic([job], 2.0, None)
    assert (elastic.min_gpus, elastic.max_gpus) == (2, 6)
    assert elastic.scaling is not None
    assert elastic.scaling.at(4) == elastic.scaling.at(3) == pytest.approx(3.0)  # 6 ESTs: ceil(6 / 4) = 2
    assert elastic.scaling.at(6) == pytest.approx(6.0)


def _throughputs(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "throughputs.json"
    path.write_text(text)
    return path


GOOD = {"('A', 1)": {"null": 1.0}, "('A', 2)": {"null": 1.8}}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("('A', 1e400)", {"null": 2.0}, "unexpected entry \"('A', 1e400)\""),
        ("('A', [2])", {"null": 2.0}, "unexpected entry"),
        ("('A', '2')", {"null": 2.0}, "unexpected entry"),
        ("('A', True)", {"null": 2.0}, "unexpected entry"),
        ("('A', 0)", {"null": 2.0}, "unexpected entry"),
        ("('A', 99999999999999999999)", {"null": 2.0}, "unexpected entry"),
        ("(None, 2)", {"null": 2.0}, "unexpected entry '(None, 2)'"),
        ("('A', 2)", {"null": 10**400}, "unexpected entry"),
        ("('A', 2)", {"null": "fast"}, "unexpected entry"),
        ("('A', 2)", [1.0], "unexpected entry"),
        ("(" * 200 + ")" * 200, {"null": 2.0}, "unexpected entry"),
    ],
)
def test_a_hostile_throughputs_entry_is_one_value_error_naming_it(
    tmp_path: Path, key: str, value: object, message: str
) -> None:
    table = {**GOOD, key: value}
    path = _throughputs(tmp_path, json.dumps({t: table for t in GAVEL_GPU_TYPES}))
    for load in (load_gavel_curves, load_gavel_capabilities):
        with pytest.raises(ValueError, match=re.escape(message)):
            load(path)


def test_a_throughputs_file_nested_too_deeply_is_a_value_error(tmp_path: Path) -> None:
    path = _throughputs(tmp_path, "[" * 100_000 + "]" * 100_000)
    for load in (load_gavel_curves, load_gavel_capabilities):
        with pytest.raises(ValueError, match="nested too deeply"):
            load(path)
    good = _throughputs(tmp_path, json.dumps({t: GOOD for t in GAVEL_GPU_TYPES}))
    assert load_gavel_curves(good)["A"] == ScalingCurve((1, 2), (1.0, 1.8))
    assert load_gavel_capabilities(good)["A"] == {t: 1.0 for t in GAVEL_GPU_TYPES}
