"""Profile JSON: round-trip, schema errors, atomic writes, load / list / find."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import hpc_elastic.profile as api
from hpc_elastic.env import Environment, read_environment
from hpc_elastic.policy.placement import DEFAULT_PACK_LIMIT
from hpc_elastic.profile import ProfileError
from hpc_elastic.profile.schema import slugify
from hpc_elastic.profile.store import SOURCE_PROFILE_DIR, profile_path, profile_to_json

from .helpers import make_profile, profile_dict


def test_json_round_trip(tmp_path: Path) -> None:
    original = make_profile()
    path = api.save_profile(original, tmp_path)
    assert path == tmp_path / "toy@cpu-test.json"
    loaded = api.read_profile_file(path)
    assert loaded == original
    assert profile_to_json(loaded) == path.read_text()
    assert json.loads(path.read_text())["schema_version"] == 1


def test_save_leaves_only_the_profile_and_a_failed_save_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "deep"
    first = api.save_profile(make_profile(), folder)
    assert sorted(p.name for p in folder.iterdir()) == [first.name]
    old = first.read_text()

    def broken_replace(source: str, destination: Path) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr("hpc_elastic.files.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        api.save_profile(make_profile(), folder)
    assert first.read_text() == old
    assert [p.name for p in folder.iterdir()] == [first.name]


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
    with pytest.raises(api.ProfileError, match=message) as caught:
        api.parse_profile(data, "f.json")
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
    with pytest.raises(api.ProfileError, match=message):
        api.parse_profile(_edited(path, value), "f.json")


def test_inconsistent_points_are_rejected() -> None:
    data = profile_dict()
    data["points"][0]["samples_per_s"] = 1.0
    with pytest.raises(api.ProfileError, match="samples_per_s"):
        api.parse_profile(data)
    data = profile_dict()
    data["points"].reverse()
    with pytest.raises(api.ProfileError, match="increasing, distinct batch sizes"):
        api.parse_profile(data)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(api.ProfileError, match="no profile file"):
        api.read_profile_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(api.ProfileError, match="bad.json is not JSON: Expecting property name"):
        api.read_profile_file(bad)
    bad.write_text('{"points": ' + "[" * 5000)  # nested past the decoder's depth
    with pytest.raises(api.ProfileError, match="bad.json is not JSON: nested too deeply"):
        api.read_profile_file(bad)
    for unread in (Path("/dev/zero"), tmp_path):  # a device is never read to its end, a directory is no profile
        with pytest.raises(api.ProfileError, match="not a regular file"):
            api.read_profile_file(unread)


def test_load_by_name_path_and_unique_model_name(tmp_path: Path) -> None:
    api.save_profile(make_profile("toy", "cpu-a"), tmp_path)
    api.save_profile(make_profile("other", "cpu-a"), tmp_path)
    assert api.load_profile("toy@cpu-a", tmp_path).name == "toy@cpu-a"
    assert api.load_profile(tmp_path / "toy@cpu-a.json").name == "toy@cpu-a"
    assert api.load_profile(str(tmp_path / "toy@cpu-a.json")).name == "toy@cpu-a"
    assert api.load_profile("toy", tmp_path).name == "toy@cpu-a"
    api.save_profile(make_profile("toy", "cpu-b"), tmp_path)
    with pytest.raises(api.ProfileError, match="several profiles"):
        api.load_profile("toy", tmp_path)
    with pytest.raises(api.ProfileError, match="no profile named 'nope'"):
        api.load_profile("nope", tmp_path)
    with pytest.raises(ValueError, match="not a profile name"):
        profile_path("../x", tmp_path)


def test_list_and_find_by_model_and_device_type(tmp_path: Path) -> None:
    assert api.list_profiles(tmp_path / "missing") == []
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(api.ProfileError, match="a-file is not a directory"):
        api.list_profiles(tmp_path / "a-file")
    (tmp_path / "a-file").unlink()
    older = datetime(2026, 1, 1, tzinfo=UTC)
    newer = datetime(2026, 2, 1, tzinfo=UTC)
    api.save_profile(make_profile("toy", "nvidia-h100", created_at=older), tmp_path)
    api.save_profile(make_profile("toy", "nvidia-h100", created_at=newer, name="toy-rerun"), tmp_path)
    api.save_profile(make_profile("toy", "cpu-a"), tmp_path)
    (tmp_path / "notes.txt").write_text("ignored")
    assert [p.name for p in api.list_profiles(tmp_path)] == ["toy-rerun", "toy@cpu-a", "toy@nvidia-h100"]
    found = api.find_profile("toy", "NVIDIA H100", tmp_path)
    assert found is not None and found.name == "toy-rerun"
    by_spec = api.find_profile("tests.unit.profile.tiny_models:toy", "cpu-a", tmp_path)
    assert by_spec is not None and by_spec.name == "toy@cpu-a"
    assert api.find_profile("toy", "a100", tmp_path) is None
    (tmp_path / "broken.json").write_text("[]")
    with pytest.raises(api.ProfileError, match="broken.json"):
        api.list_profiles(tmp_path)


def test_default_directory_comes_from_the_environment(tmp_path: Path) -> None:
    assert read_environment({"HPC_ELASTIC_PROFILES": str(tmp_path)}).profile_dir == tmp_path
    assert read_environment({}).profile_dir is None
    assert api.default_profile_dir(Environment(profile_dir=tmp_path)) == tmp_path
    assert api.default_profile_dir(Environment()) == SOURCE_PROFILE_DIR


def test_slugify() -> None:
    assert slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slugify("cpu AMD EPYC 7R13 Processor") == "cpu-amd-epyc-7r13-processor"
    with pytest.raises(ValueError, match="cannot make a name"):
        slugify("!!")


def test_shipped_reference_profiles_are_valid() -> None:
    profiles = api.list_profiles(SOURCE_PROFILE_DIR)
    assert {p.model.name for p in profiles} >= {"vgg_like", "resnet_like", "transformer_small", "mlp"}
    for item in profiles:
        assert item.name == f"{item.model.name}@{item.device.type}"
        assert item.gamma is not None and item.memory_limit is not None


def test_placement_skew_is_the_largest_tensor_share_on_the_packlimit_scale(tmp_path: Path) -> None:
    profile = make_profile()
    api.save_profile(profile, tmp_path)
    assert profile.placement_skew == profile.model.largest_tensor_share == 48 / 92
    assert api.placement_skew("toy@cpu-test", tmp_path) == 48 / 92
    assert profile.model.skew_for(4) == 4 * 48 / 92  # PS-shard skew lies in [1, K]: not comparable to PACKLIMIT
    shipped = {item.model.name: item.placement_skew for item in api.list_profiles(SOURCE_PROFILE_DIR)}
    assert shipped["vgg_like"] > DEFAULT_PACK_LIMIT  # Tiresias Table 6: VGG is dominated by one tensor
    assert max(shipped["resnet_like"], shipped["mlp"], shipped["transformer_small"]) < DEFAULT_PACK_LIMIT


def test_step_time_follows_the_fitted_gamma() -> None:
    profile = make_profile()  # Γ(x) = 1.7 ms + 0.4 ms·x, no saturation point
    assert profile.step_time(0) == pytest.approx(0.0017)
    assert profile.step_time(10) == pytest.approx(0.0057)
    unfitted = profile.model_copy(update={"gamma": None})
    with pytest.raises(ValueError, match="no Γ"):
        unfitted.step_time(1)


def test_the_scheduler_reads_a_site_profile_by_name_only(tmp_path: Path) -> None:
    """A job's marker names its profile; the scheduler (root or SlurmUser) must not follow that name anywhere."""
    api.save_profile(make_profile(), tmp_path)
    assert api.site_profile("toy@cpu-test", tmp_path).name == "toy@cpu-test"
    for bad in ("../etc/passwd", "/dev/zero", "..", ".hidden", ""):
        with pytest.raises(ValueError, match="not a profile name"):
            api.site_profile(bad, tmp_path)
    with pytest.raises(ProfileError, match="no profile named"):
        api.site_profile("toy", tmp_path)  # the model-name search is for users' own commands, not the scheduler
    (tmp_path / "link@x.json").symlink_to(tmp_path / "toy@cpu-test.json")
    (tmp_path / "zero@x.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo@x.json")
    (tmp_path / "big@x.json").write_bytes(b" " * (api.MAX_PROFILE_BYTES + 1))
    for name, why in (
        ("link@x", "symbolic link"),
        ("zero@x", "symbolic link"),
        ("fifo@x", "not a regular"),
        ("big@x", "more than"),
    ):
        with pytest.raises(ProfileError, match=why):
            api.site_profile(name, tmp_path)  # refused at once: a FIFO is not waited on, /dev/zero not read
