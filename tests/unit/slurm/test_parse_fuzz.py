"""Fuzzing the Slurm parsers from captured 22.05 output: any malformed field gives SlurmParseError, nothing else."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_elastic.slurm.errors import SlurmParseError
from hpc_elastic.slurm.parse import (
    FAR_FUTURE,
    epoch,
    number,
    parse_sacct_json,
    parse_sinfo_json,
    parse_squeue_json,
    parse_squeue_text,
)
from tests.conftest import DATA

CAPTURED = DATA / "slurm-22.05"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["NaN", "inf", "-inf", "1e400", "9999-99-99T99:99:99", "2023-13-45T00:00:00", "N/A", "node[1-"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["set", "infinite", "number"]), inner),
    max_leaves=6,
)


def _first(name: str, key: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((CAPTURED / name).read_text())[key][0]
    return record


def _mutated(base: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    record = dict(base)
    for key in data.draw(st.lists(st.sampled_from(sorted(base)), min_size=1, max_size=4, unique=True)):
        record[key] = data.draw(values)
    return record


def _only_typed_errors(parse: Any, text: str) -> None:
    with contextlib.suppress(SlurmParseError):
        parse(text)  # anything else (ValueError, OverflowError, AttributeError, ...) fails the test


@pytest.mark.parametrize(
    ("name", "key", "parse"),
    [
        ("squeue.json", "jobs", parse_squeue_json),
        ("squeue_pending.json", "jobs", parse_squeue_json),
        ("sinfo.json", "nodes", parse_sinfo_json),
        ("sacct.json", "jobs", parse_sacct_json),
    ],
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_json_records_with_malformed_fields(name: str, key: str, parse: Any, data: st.DataObject) -> None:
    record = _mutated(_first(name, key), data)
    _only_typed_errors(parse, json.dumps({key: [record]}))


@settings(max_examples=200, deadline=None)
@given(st.one_of(values, st.lists(values, max_size=3)))
def test_whole_documents_of_any_shape(doc: Any) -> None:
    for parse, key in ((parse_squeue_json, "jobs"), (parse_sinfo_json, "nodes"), (parse_sacct_json, "jobs")):
        _only_typed_errors(parse, json.dumps(doc))
        _only_typed_errors(parse, json.dumps({key: doc}))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="|0123456789abcRUNINGPD-:[],.T ", max_size=40), max_size=4))
def test_squeue_text_lines(lines: list[str]) -> None:
    _only_typed_errors(parse_squeue_text, "\n".join(lines))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1e400", "NaN", 1 << 80])
def test_non_finite_or_huge_numbers_are_typed_errors(bad: Any) -> None:
    with pytest.raises(SlurmParseError):
        number(bad)
    with pytest.raises(SlurmParseError):
        epoch(bad)


def test_out_of_range_dates_are_typed_errors(slurm_data: Path) -> None:
    job = _first("squeue.json", "jobs")
    with pytest.raises(SlurmParseError, match="record 0 .*not a date"):
        parse_squeue_json(json.dumps({"jobs": [{**job, "submit_time": "2023-13-45T00:00:00"}]}))
    # a time past year 9999 is one a user can ask for (sbatch --begin): the far future, not an error
    (far,) = parse_squeue_json(json.dumps({"jobs": [{**job, "submit_time": 10**15}]}))
    assert far.submit_time == FAR_FUTURE
