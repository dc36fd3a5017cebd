"""Load, save and list profiles: the one small API the scheduler, the planners and LB-BSP use.

Profiles are JSON files ``<name>.json`` in a profile directory, by default ``profiles/`` of the source
checkout, or the directory named by ``HPC_ELASTIC_PROFILES`` (read in :mod:`hpc_elastic.env`). A profile's
name is ``<model>@<device type>`` unless the user chose another; there is one file per model × device type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hpc_elastic.env import Environment, read_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.files import UnsafeFile, atomic_write_bytes, loads_json, read_input, read_owned
from hpc_elastic.profile.schema import SCHEMA_VERSION, Profile, slugify

SOURCE_PROFILE_DIR = Path(__file__).resolve().parents[2] / "profiles"
SUFFIX = ".json"
#: The largest profile file the scheduler reads (the shipped ones are a few kB).
MAX_PROFILE_BYTES = 1 << 20


class ProfileError(HpcElasticError):
    """A profile is missing, unreadable or does not match the schema."""


class ProfileNotFound(ProfileError):
    """No profile of that name (a site profile lookup): not an error in the file, there is none."""


def default_profile_dir(environment: Environment | None = None) -> Path:
    """``HPC_ELASTIC_PROFILES`` when set, else ``profiles/`` of the source checkout."""
    env = read_environment() if environment is None else environment
    return env.profile_dir if env.profile_dir is not None else SOURCE_PROFILE_DIR


def _directory(directory: Path | str | None) -> Path:
    return default_profile_dir() if directory is None else Path(directory)


def profile_path(name: str, directory: Path | str | None = None) -> Path:
    """Path of the profile called ``name`` in ``directory``."""
    if not name or "/" in name or name in {".", ".."} or name.startswith("."):
        raise ValueError(f"not a profile name: {name!r}")
    return _directory(directory) / f"{name}{SUFFIX}"


def _validation_message(path: Path, error: ValidationError) -> str:
    errors = error.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = " ".join(str(first["msg"]).split())
    return f"{path}: invalid profile: {where}: {message}{more}"


def parse_profile(data: Any, source: str = "<data>") -> Profile:
    """Validate already-decoded JSON ``data`` as a profile; ``source`` names it in errors."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(
            f"{source}: unsupported profile schema_version {version!r} (this hpc-elastic reads {SCHEMA_VERSION})"
        )
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(_validation_message(Path(source), exc)) from None


def read_profile_file(path: Path | str) -> Profile:
    """Load and validate one profile file."""
    file = Path(path)
    try:
        data = read_input(file)
    except FileNotFoundError:
        raise ProfileError(f"no profile file {file}") from None
    except OSError as exc:
        raise ProfileError(f"cannot read profile {file}: {exc.strerror or exc}") from None
    return _decode(data, file)


def _decode(data: bytes, source: Path) -> Profile:
    """A profile from a file's bytes (UTF-8 JSON, validated); ``source`` names it in errors."""
    try:
        decoded = loads_json(data, str(source))
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    return parse_profile(decoded, str(source))


def profile_to_json(profile: Profile) -> str:
    """Canonical JSON text of a profile (2-space indent, trailing newline)."""
    return profile.model_dump_json(indent=2) + "\n"


def save_profile(profile: Profile, directory: Path | str | None = None) -> Path:
    """Write ``profile`` as ``<directory>/<profile.name>.json`` atomically; returns the path."""
    path = profile_path(profile.name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, profile_to_json(profile).encode("utf-8"))
    return path


def list_profiles(directory: Path | str | None = None) -> list[Profile]:
    """All profiles in ``directory``, sorted by name; an invalid file raises :class:`ProfileError`.

    A missing directory has no profiles; a path that is something else than a directory is a :class:`ProfileError`.
    """
    folder = _directory(directory)
    if not folder.is_dir():
        if folder.exists():
            raise ProfileError(f"profile directory {folder} is not a directory")
        return []
    profiles = [read_profile_file(path) for path in sorted(folder.glob(f"*{SUFFIX}")) if not path.name.startswith(".")]
    return sorted(profiles, key=lambda profile: profile.name)


def load_profile(name_or_path: str | Path, directory: Path | str | None = None) -> Profile:
    """Load a profile by file path, by name (``vgg_like@cpu-amd-epyc``), or by model name when unique.

    A ``Path``, or a string that ends in ``.json`` or contains ``/``, is a file path. Otherwise the name is
    looked up as ``<directory>/<name>.json``, then as a model name (``vgg_like``) that must match exactly one
    profile in ``directory``.
    """
    if isinstance(name_or_path, Path) or name_or_path.endswith(SUFFIX) or "/" in name_or_path:
        return read_profile_file(name_or_path)
    if not name_or_path:
        raise ValueError("a profile name is needed, got ''")
    folder = _directory(directory)
    path = profile_path(name_or_path, folder)
    if path.exists():
        return read_profile_file(path)
    matches = [profile for profile in list_profiles(folder) if profile.model.name == name_or_path]
    if len(matches) == 1:
        return matches[0]
    if matches:
        names = ", ".join(profile.name for profile in matches)
        raise ProfileError(f"{name_or_path!r} names the model of several profiles in {folder}: {names}")
    raise ProfileError(f"no profile named {name_or_path!r} in {folder} (see hpc-elastic profile list)")


def find_profile(model: str, device_type: str, directory: Path | str | None = None) -> Profile | None:
    """The profile of ``model`` (model name or full spec) on ``device_type``, or None.

    Device types compare after :func:`~hpc_elastic.profile.schema.slugify` (``"NVIDIA H100"`` matches
    ``nvidia-h100``). When several profiles match, the most recently measured wins.
    """
    wanted = slugify(device_type)
    matches = [
        profile
        for profile in list_profiles(directory)
        if model in (profile.model.name, profile.model.spec) and profile.device.type == wanted
    ]
    if not matches:
        return None
    return max(matches, key=lambda profile: profile.measurement.created_at)


def site_profile(name: str, directory: Path | str) -> Profile:
    """The profile called ``name`` in the site's profile ``directory``, read as the scheduler must read what a job
    names: by name only (never a path, never a model-name search), the file itself no symbolic link, FIFO or
    device, at most :data:`MAX_PROFILE_BYTES`. Raises :class:`ProfileError` (``ValueError`` for a bad name)."""
    path = profile_path(name, directory)
    try:
        data = read_owned(Path(directory), [path.name], limit=MAX_PROFILE_BYTES)
    except FileNotFoundError:
        raise ProfileNotFound(f"no profile named {name!r} in {directory}") from None
    except UnsafeFile as exc:
        raise ProfileError(f"refused profile {name!r}: {exc}") from None
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    return _decode(data, path)


def placement_skew(name: str, directory: Path | str) -> float:
    """S_J of the site profile ``name`` for Tiresias placement (§3.3.2), on the scale of PACKLIMIT: the largest
    tensor's share of the model, see :attr:`~hpc_elastic.profile.schema.ModelInfo.placement_skew`. The
    scheduler's lookup of the profile a job's marker names (:func:`site_profile`)."""
    return site_profile(name, directory).placement_skew
