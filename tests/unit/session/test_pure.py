"""Pure parts of the session side: control-file formats, checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.checkpoint import layout
from hpc_elastic.jobdir import (
    Ack,
    StopReason,
    StopRequest,
    parse_ack,
    parse_stop,
    parse_stop_lenient,
)


def test_stop_file_format() -> None:
    req = parse_stop('{"reason": "preempt", "requested_at": 1766400000.5}')
    assert req == StopRequest(StopReason.PREEMPT, 1766400000.5)
    assert parse_stop(req.to_json()) == req
    for reason in ("timelimit", "resize"):
        assert parse_stop(json.dumps({"reason": reason, "requested_at": 1})).reason.value == reason
    at = StopRequest(StopReason.RESIZE, 5.0, 12)
    assert parse_stop(at.to_json()) == at and json.loads(at.to_json())["at_step"] == 12
    with pytest.raises(ValueError, match="at_step must be a non-negative integer, got -1"):
        parse_stop('{"reason": "resize", "requested_at": 1, "at_step": -1}')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "stop file is not JSON"),
        ("[1]", "must hold a JSON object"),
        ('{"reason": "nap", "requested_at": 1}', "stop reason must be one of preempt, timelimit, .*, got 'nap'"),
        ('{"reason": "unknown", "requested_at": 1}', "got 'unknown'"),
        ('{"reason": "preempt"}', "requested_at must be epoch seconds, got None"),
        ('{"reason": "preempt", "requested_at": true}', "got True"),
    ],
)
def test_bad_stop_files(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_stop(text)
    assert parse_stop_lenient(text) == StopRequest(StopReason.UNKNOWN, None)  # still a stop


def test_ack_format_round_trip() -> None:
    ack = Ack(4711, 2, 120, Path("/gpfs/j/checkpoints/ckpt-000000000120"), 1766400001.25)
    doc = json.loads(ack.to_json())
    assert doc == {
        "job_id": 4711,
        "restart_count": 2,
        "step": 120,
        "checkpoint": "/gpfs/j/checkpoints/ckpt-000000000120",
        "written_at": 1766400001.25,
    }
    assert parse_ack(ack.to_json()) == ack
    with pytest.raises(ValueError, match="ack file lacks 'step'"):
        parse_ack(json.dumps({k: v for k, v in doc.items() if k != "step"}))
    with pytest.raises(ValueError, match="step must be a non-negative integer, got -1"):
        Ack(None, 0, -1, Path("/x"), 0.0)


def test_layout_names() -> None:
    assert layout.dir_name(42) == "ckpt-000000000042"
    assert layout.step_of("ckpt-000000000042") == 42
    assert layout.step_of("ckpt-42") is None
    assert layout.step_of(".tmp-ckpt-000000000042-ab") is None
    assert layout.shard_name(3) == "shard-00003.pt" and layout.rank_of_shard("shard-00003.pt") == 3
    assert layout.is_scratch(layout.tmp_dir_name(1, "abc")) and layout.is_scratch(".trash-ckpt-000000000001-x")
    with pytest.raises(ValueError, match="step must be an integer"):
        layout.dir_name(10**12)
    with pytest.raises(ValueError, match="token must be alphanumeric"):
        layout.tmp_dir_name(1, "../x")


def test_to_prune_keeps_the_newest() -> None:
    assert layout.to_prune([5, 1, 3, 9], 2) == [1, 3]
    assert layout.to_prune([5], 3) == []
    with pytest.raises(ValueError, match="keep must be a positive integer, got 0"):
        layout.to_prune([1], 0)


def manifest_doc(**over: Any) -> str:
    doc: dict[str, Any] = {
        "format": layout.FORMAT,
        "step": 3,
        "world_size": 2,
        "created_at": 1.0,
        "files": {"shard-00000.pt": {"sha256": "a" * 64, "size": 10}},
        "meta": {},
    }
    doc.update(over)
    return json.dumps(doc)


def test_manifest_parse_and_checks() -> None:
    m = layout.parse_manifest(manifest_doc())
    assert (m.step, m.world_size, m.ranks) == (3, 2, [0])
    assert layout.parse_manifest(m.to_json()) == m
    bad = [
        (manifest_doc(format="other/1"), "manifest format must be"),
        (manifest_doc(world_size=0), "world_size must be a positive integer"),
        (manifest_doc(files={"../etc": {"sha256": "a" * 64, "size": 1}}), "outside the checkpoint"),
        (manifest_doc(files={"x": {"sha256": "zz", "size": 1}}), "bad sha256"),
        (manifest_doc(files={"x": {"sha256": "a" * 64, "size": -1}}), "bad size"),
        ("{", "manifest is not JSON"),
    ]
    for text, message in bad:
        with pytest.raises(ValueError, match=message):
            layout.parse_manifest(text)
