"""Profile JSON: round-trip, schema errors, atomic writes, load / list / find."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.env import Environment, read_environment
from hpc_elastic.profile import (
    ProfileError,
    default_profile_dir,
    find_profile,
    list_profiles,
    load_profile,
    parse_profile,
    read_profile_file,
    save_profile,
)
from hpc_elastic.profile.schema import slugify
from hpc_elastic.profile.store import SOURCE_PROFILE_DIR, atomic_write_text, profile_path, profile_to_json

from .helpers import make_profile, profile_dict


def test_json_round_trip(tmp_path: Path) -> None:
    original = make_profile()
    path = save_profile(original, tmp_path)
    assert path == tmp_path / "toy@cpu-test.json"
    loaded = read_profile_file(path)
    assert loaded == original
    assert profile_to_json(loaded) == path.read_text()
    assert json.loads(path.read_text())["schema_version"] == 1


def test_atomic_write_leaves_only_the_target(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "x.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "x.json"
    atomic_write_text(target, "old")

    def broken_replace(source: str, destination: Path) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr("hpc_elastic.profile.store.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (profile_dict(schema_version=2), "unsupported profile schema_version 2"),
        (profile_dict(schema_version=None), "unsupported profile schema_version None"),
        ([1, 2], "a profile is a JSON object"),
        (profile_dict(extra=1), "extra: Extra inputs are not permitted"),
        (profile_dict(name="has space"), "name: String should match pattern"),
        (profile_dict(points=[]), "points: List should have at least 1 item"),
    ],
)
def test_schema_errors_are_one_clear_line(data: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=message) as caught:
        parse_profile(data, "f.json")
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("f.json: ")


def _edited(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data = profile_dict()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("model", "largest_tensor_share"), 0.9, "does not match the tensors"),
        (("model", "parameter_bytes"), 1, "not the sum of the tensor bytes"),
        (("model", "num_parameters"), 5, "not the sum of the tensor shapes"),
        (("model", "shard_skew"), [{"shards": 2, "skew": 1.9}], "shard_skew for 2 shards"),
        (("device", "kind"), "tpu", "device.kind"),
        (("measurement", "created_at"), "2026-01-01T00:00:00", "created_at needs a time zone"),
        (("memory_limit", "first_failing_batch"), 40, "must be above the limit"),
        (("memory_limit", "capped"), True, "capped search ends at max_batch"),
    ],
)
def test_inconsistent_profiles_are_rejected(path: tuple[str, ...], value: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        parse_profile(_edited(path, value), "f.json")


def test_inconsistent_points_are_rejected() -> None:
    data = profile_dict()
    data["points"][0]["samples_per_s"] = 1.0
    with pytest.raises(ProfileError, match="samples_per_s"):
        parse_profile(data)
    data = profile_dict()
    data["points"].reverse()
    with pytest.raises(ProfileError, match="increasing, distinct batch sizes"):
        parse_profile(data)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no profile file"):
        read_profile_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        read_profile_file(bad)


def test_load_by_name_path_and_unique_model_name(tmp_path: Path) -> None:
    save_profile(make_profile("toy", "cpu-a"), tmp_path)
    save_profile(make_profile("other", "cpu-a"), tmp_path)
    assert load_profile("toy@cpu-a", tmp_path).name == "toy@cpu-a"
    assert load_profile(tmp_path / "toy@cpu-a.json").name == "toy@cpu-a"
    assert load_profile(str(tmp_path / "toy@cpu-a.json")).name == "toy@cpu-a"
    assert load_profile("toy", tmp_path).name == "toy@cpu-a"
    save_profile(make_profile("toy", "cpu-b"), tmp_path)
    with pytest.raises(ProfileError, match="several profiles"):
        load_profile("toy", tmp_path)
    with pytest.raises(ProfileError, match="no profile named 'nope'"):
        load_profile("nope", tmp_path)
    with pytest.raises(ValueError, match="not a profile name"):
        profile_path("../x", tmp_path)


def test_list_and_find_by_model_and_device_type(tmp_path: Path) -> None:
    assert list_profiles(tmp_path / "missing") == []
    older = datetime(2026, 1, 1, tzinfo=UTC)
    newer = datetime(2026, 2, 1, tzinfo=UTC)
    save_profile(make_profile("toy", "nvidia-h100", created_at=older), tmp_path)
    save_profile(make_profile("toy", "nvidia-h100", created_at=newer, name="toy-rerun"), tmp_path)
    save_profile(make_profile("toy", "cpu-a"), tmp_path)
    (tmp_path / "notes.txt").write_text("ignored")
    assert [p.name for p in list_profiles(tmp_path)] == ["toy-rerun", "toy@cpu-a", "toy@nvidia-h100"]
    found = find_profile("toy", "NVIDIA H100", tmp_path)
    assert found is not None and found.name == "toy-rerun"
    by_spec = find_profile("tests.unit.profile.tiny_models:toy", "cpu-a", tmp_path)
    assert by_spec is not None and by_spec.name == "toy@cpu-a"
    assert find_profile("toy", "a100", tmp_path) is None
    (tmp_path / "broken.json").write_text("[]")
    with pytest.raises(ProfileError, match="broken.json"):
        list_profiles(tmp_path)


def test_default_directory_comes_from_the_environment(tmp_path: Path) -> None:
    assert read_environment({"HPC_ELASTIC_PROFILES": str(tmp_path)}).profile_dir == tmp_path
    assert read_environment({}).profile_dir is None
    assert default_profile_dir(Environment(profile_dir=tmp_path)) == tmp_path
    assert default_profile_dir(Environment()) == SOURCE_PROFILE_DIR


def test_slugify() -> None:
    assert slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slugify("cpu AMD EPYC 7R13 Processor") == "cpu-amd-epyc-7r13-processor"
    with pytest.raises(ValueError, match="cannot make a name"):
        slugify("!!")


def test_shipped_reference_profiles_are_valid() -> None:
    profiles = list_profiles(SOURCE_PROFILE_DIR)
    assert {p.model.name for p in profiles} >= {"vgg_like", "resnet_like", "transformer_small", "mlp"}
    for item in profiles:
        assert item.name == f"{item.model.name}@{item.device.type}"
        assert item.gamma is not None and item.memory_limit is not None
