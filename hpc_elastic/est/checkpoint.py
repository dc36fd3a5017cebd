"""On-demand checkpoint of an EST job (EasyScale §3.2, "Adapting to elasticity").

One directory per global step: ``shared.pt`` (parameters, optimizer, LR scheduler and the extra state
of §3.3: step, bucket layout, seed, level), one ``est-<vrank>.pt`` per EST context, and ``MANIFEST.json``
with the sha256 of every file.  A checkpoint exists once ``LATEST`` names it: every file is written to a
temporary name, fsynced and renamed, the manifest last, then ``LATEST``, so a process killed at any moment
leaves either the previous checkpoint or the new one, never a torn one.  A restart with another number
of processes reads ``shared.pt`` plus the contexts of the ESTs now placed on it.

(A simple store of its own until the shared checkpoint library arrives with a later issue.)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpc_elastic.errors import HpcElasticError

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
SHARED = "shared.pt"


def est_file(vrank: int) -> str:
    return f"est-{vrank:05d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync dir); return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def save_object(path: Path, obj: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_object(path: Path, sha256: str) -> Any:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise HpcElasticError(f"checkpoint file {path} cannot be read: {exc.strerror}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise HpcElasticError(f"checkpoint file {path} is corrupt: sha256 {digest[:12]}… != manifest {sha256[:12]}…")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of the checkpoint in ``directory`` (complete by construction once it exists)."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise HpcElasticError(f"{directory} is not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, ValueError) as exc:
        raise HpcElasticError(f"checkpoint manifest {path} is unreadable: {exc}") from exc
    try:
        if doc["format"] != FORMAT_VERSION:
            raise HpcElasticError(f"checkpoint {directory} has format {doc['format']}, expected {FORMAT_VERSION}")
        return Manifest(directory, int(doc["step"]), int(doc["num_ests"]), dict(doc["files"]), dict(doc["meta"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise HpcElasticError(f"checkpoint manifest {path} is malformed: {exc!r}") from exc


def load_file(manifest: Manifest, name: str) -> Any:
    """Load one file of a checkpoint, checking its sha256 against the manifest."""
    return load_object(manifest.directory / name, manifest.sha(name))


@dataclass(frozen=True)
class Manifest:
    directory: Path
    step: int
    num_ests: int
    files: dict[str, str]
    meta: dict[str, Any]

    def sha(self, name: str) -> str:
        try:
            return self.files[name]
        except KeyError:
            raise HpcElasticError(f"checkpoint {self.directory} has no {name}") from None


class CheckpointStore:
    """The checkpoints of one job under ``root``."""

    def __init__(self, root: Path | str, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.root = Path(root)
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:09d}"

    def write(self, step: int, name: str, obj: Any) -> str:
        return save_object(self.step_dir(step) / name, obj)

    def commit(self, step: int, num_ests: int, files: Mapping[str, str], meta: Mapping[str, Any]) -> Manifest:
        """Publish checkpoint ``step`` once all its files are written (one process calls this)."""
        expected = {SHARED} | {est_file(v) for v in range(num_ests)}
        missing = sorted(expected - set(files))
        if missing:
            raise HpcElasticError(f"checkpoint of step {step} lacks {missing[0]}")
        directory = self.step_dir(step)
        doc = {"format": FORMAT_VERSION, "step": step, "num_ests": num_ests, "files": dict(files), "meta": dict(meta)}
        atomic_write_bytes(directory / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())
        atomic_write_bytes(self.root / LATEST, f"{directory.name}\n".encode())
        self._prune(directory.name)
        return Manifest(directory, step, num_ests, dict(files), dict(meta))

    def _prune(self, latest: str) -> None:
        steps = sorted(p.name for p in self.root.glob("step-*") if p.is_dir())
        committed = [s for s in steps if (self.root / s / MANIFEST).exists() and s <= latest]
        for name in committed[: -self.keep]:
            shutil.rmtree(self.root / name, ignore_errors=True)
        for name in steps:  # leftovers of a run killed while writing a checkpoint
            if name != latest and not (self.root / name / MANIFEST).exists():
                shutil.rmtree(self.root / name, ignore_errors=True)

    def latest(self) -> Manifest | None:
        """The newest complete checkpoint, or ``None`` when there is none."""
        pointer = self.root / LATEST
        try:
            name = pointer.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HpcElasticError(f"cannot read {pointer}: {exc.strerror}") from exc
        return read_manifest(self.root / name)

    def at(self, step: int) -> Manifest:
        """The complete checkpoint of global step ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return read_manifest(self.step_dir(step))

    def load(self, manifest: Manifest, name: str) -> Any:
        return load_file(manifest, name)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.root)
