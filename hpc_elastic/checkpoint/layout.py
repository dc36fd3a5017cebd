"""Names and manifest of a checkpoint directory (pure logic: no I/O).

``<root>/ckpt-<step:012d>/`` holds one ``shard-<rank:05d>.pt`` per rank that saved something and ``MANIFEST.json``::

    {"format": "hpc-elastic-checkpoint/1", "step": 1200, "world_size": 4, "created_at": 1766412345.2,
     "files": {"shard-00000.pt": {"sha256": "<hex>", "size": 123}, ...}, "meta": {...user JSON...}}

A checkpoint directory is only ever created by renaming a complete temporary directory
(``.tmp-ckpt-<step:012d>-<token>``), whose manifest was written and fsynced last.  A directory without a valid
manifest, or whose files do not match it, is not a checkpoint.  Directories being deleted are first renamed to
``.trash-...`` so that they never look complete while half gone.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpc_elastic.files import loads_json

FORMAT = "hpc-elastic-checkpoint/1"
MANIFEST = "MANIFEST.json"
#: the manifest's checksum of its own content (:func:`body_sha256`)
BODY_SHA256 = "body_sha256"
PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-ckpt-"
TRASH_PREFIX = ".trash-"
#: a committed checkpoint being replaced by a new one of the same step: deleted once the new one is published, and
#: a candidate to load while no ``ckpt-<step>`` exists (a save killed between the two renames)
REPLACED_PREFIX = ".replaced-"
#: newer checkpoints of a timeline a run abandoned, set aside (kept, never loaded, never pruned)
ABANDONED_PREFIX = "abandoned-"
_DIR_RE = re.compile(r"^ckpt-(\d{12})$")
_REPLACED_RE = re.compile(r"^\.replaced-ckpt-(\d{12})-[0-9a-f]+$")
_SHARD_RE = re.compile(r"^shard-(\d{5})\.pt$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_STEP = 10**12 - 1


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return step


def dir_name(step: int) -> str:
    return f"{PREFIX}{check_step(step):012d}"


def tmp_dir_name(step: int, token: str) -> str:
    if not re.fullmatch(r"[0-9A-Za-z]+", token):
        raise ValueError(f"token must be alphanumeric, got {token!r}")
    return f"{TMP_PREFIX}{check_step(step):012d}-{token}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name, or ``None`` when ``name`` is not one."""
    m = _DIR_RE.match(name)
    return int(m.group(1)) if m else None


def replaced_step(name: str) -> int | None:
    """The step of a checkpoint set aside while a new one of its step was published, or ``None``."""
    m = _REPLACED_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int) -> str:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 100000:
        raise ValueError(f"rank must be in [0, 100000), got {rank!r}")
    return f"shard-{rank:05d}.pt"


def rank_of_shard(name: str) -> int | None:
    m = _SHARD_RE.match(name)
    return int(m.group(1)) if m else None


def is_scratch(name: str) -> bool:
    """A temporary or to-be-deleted directory left by an interrupted save or prune (a replaced checkpoint is
    deleted only while its step has a published one: :meth:`CheckpointStore._committed_dirs`)."""
    return name.startswith((TMP_PREFIX, TRASH_PREFIX, REPLACED_PREFIX))


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    created_at: float
    files: Mapping[str, FileEntry]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        """Ranks that wrote a shard, in increasing order."""
        return sorted(r for r in (rank_of_shard(n) for n in self.files) if r is not None)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "files": {n: {"sha256": e.sha256, "size": e.size} for n, e in sorted(self.files.items())},
            "meta": dict(self.meta),
        }
        doc[BODY_SHA256] = body_sha256(doc)
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def body_sha256(doc: Mapping[str, Any]) -> str:
    """The sha256 of a manifest's content without its own checksum, in canonical JSON: a flipped bit in the
    manifest (its step, seed or layout in ``meta``) makes the checkpoint corrupt, not a state that fails later."""
    body = {k: v for k, v in doc.items() if k != BODY_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_entry(name: str, raw: object) -> FileEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"manifest entry of {name!r} must be an object, got {raw!r}")
    sha, size = raw.get("sha256"), raw.get("size")
    if not isinstance(sha, str) or not _SHA_RE.match(sha):
        raise ValueError(f"manifest entry of {name!r} has a bad sha256 {sha!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"manifest entry of {name!r} has a bad size {size!r}")
    if "/" in name or name.startswith(".") or name == MANIFEST:
        raise ValueError(f"manifest names a file outside the checkpoint: {name!r}")
    return FileEntry(sha, size)


def parse_manifest(text: str) -> Manifest:
    """Parse ``MANIFEST.json``; raise ``ValueError`` naming what is wrong."""
    doc = loads_json(text, "manifest")
    if not isinstance(doc, dict):
        raise ValueError(f"manifest must be a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"manifest format must be {FORMAT!r}, got {doc.get('format')!r}")
    if BODY_SHA256 in doc and doc[BODY_SHA256] != body_sha256(doc):  # (manifests written before it have none)
        raise ValueError(f"manifest content does not match its {BODY_SHA256} {str(doc[BODY_SHA256])[:16]!r}...")
    step = check_step(doc.get("step"))
    world = doc.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"manifest world_size must be a positive integer, got {world!r}")
    created = doc.get("created_at")
    if isinstance(created, bool) or not isinstance(created, int | float) or not math.isfinite(created):
        raise ValueError(f"manifest created_at must be epoch seconds, got {created!r}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"manifest files must be an object, got {files!r}")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"manifest meta must be an object, got {meta!r}")
    return Manifest(step, world, float(created), {n: _file_entry(n, e) for n, e in files.items()}, meta)


def to_prune(committed_steps: Iterable[int], keep: int) -> list[int]:
    """Which committed checkpoints to delete so that the newest ``keep`` remain (oldest first)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive integer, got {keep!r}")
    steps = sorted(set(committed_steps))
    return steps[:-keep] if len(steps) > keep else []
