"""The PS-mode job's checkpoint: the master's queues and ledger with every parameter server's partition, taken at
one instant, written atomically through :mod:`hpc_elastic.files`.

Layout under the checkpoint root (the directory names and the manifest of :mod:`hpc_elastic.checkpoint.layout`, so
that ``hpc-elastic job`` lists these checkpoints as it lists an EST-mode job's)::

    ckpt-<seq, 12 digits>/queues.json     the ShardState (TODO, DOING, failed, ledger) as JSON, and the loss curve
    ckpt-<seq, 12 digits>/ps<p>.npz       partition p: row ids, rows, Adagrad accumulators, dense arrays (no pickle)
    ckpt-<seq, 12 digits>/MANIFEST.json   every file's sha256 and size, written after them
    LATEST                                "<seq>", written last: a checkpoint counts once LATEST names it

Every file is written with :func:`hpc_elastic.files.atomic_write_bytes`, ``LATEST`` after all the others, so a
master killed while saving leaves the previous checkpoint the latest (and temporaries, which a later save removes).
The two newest are kept, and a restore takes the newest of them whose files match its manifest (:func:`latest`): a
damaged partition or queue file falls back to the previous checkpoint instead of failing every restore or restoring
altered queues.

Partitions are keyed by global row id and array name, so a job may restore onto another number of PS: each new PS
reads every old partition and keeps what hashes to it (:meth:`hpc_elastic.ps.server.ParameterServer.load`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hpc_elastic.checkpoint import CheckpointError, layout, open_checkpoint
from hpc_elastic.files import atomic_write_bytes, sweep_temporaries
from hpc_elastic.ps import wire
from hpc_elastic.ps.shards import ShardState

LATEST = "LATEST"
QUEUES = "queues.json"
KEEP = 2

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class PsSnapshot:
    """One parameter server's partition and optimizer state."""

    ids: npt.NDArray[np.int64]
    rows: F32
    rows_acc: F32
    dense: dict[str, F32]
    dense_acc: dict[str, F32]
    updates: int

    def to_arrays(self) -> wire.Arrays:
        out: wire.Arrays = {"ids": self.ids, "rows": self.rows, "rows_acc": self.rows_acc}
        out.update({f"d:{n}": v for n, v in self.dense.items()})
        out.update({f"a:{n}": v for n, v in self.dense_acc.items()})
        out["updates"] = np.array([self.updates], dtype=np.int64)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> PsSnapshot:
        try:
            return cls(
                ids=np.asarray(arrays["ids"], dtype=np.int64),
                rows=np.array(arrays["rows"], dtype=np.float32),
                rows_acc=np.array(arrays["rows_acc"], dtype=np.float32),
                dense={k[2:]: np.array(v, dtype=np.float32) for k, v in arrays.items() if k.startswith("d:")},
                dense_acc={k[2:]: np.array(v, dtype=np.float32) for k, v in arrays.items() if k.startswith("a:")},
                updates=int(arrays["updates"][0]),
            )
        except KeyError as exc:
            raise ValueError(f"not a PS snapshot: {exc} missing") from exc


def merge(parts: list[PsSnapshot]) -> PsSnapshot:
    """The partitions of several PS as one (rows concatenated, arrays united, updates summed)."""
    if not parts:
        raise ValueError("no partition to merge")
    dense: dict[str, F32] = {}
    dense_acc: dict[str, F32] = {}
    for part in parts:
        dense.update(part.dense)
        dense_acc.update(part.dense_acc)
    return PsSnapshot(
        ids=np.concatenate([p.ids for p in parts]),
        rows=np.concatenate([p.rows for p in parts]),
        rows_acc=np.concatenate([p.rows_acc for p in parts]),
        dense=dense,
        dense_acc=dense_acc,
        updates=sum(p.updates for p in parts),
    )


def write(root: Path, seq: int, queues: ShardState, partitions: list[PsSnapshot], losses: Sequence[float] = ()) -> Path:
    """Write checkpoint ``seq``; return its directory. The previous ones but the newest :data:`KEEP` go.
    ``losses``: the mean loss of each shard the ledger counts, in order (the job's loss curve survives a restore)."""
    root.mkdir(parents=True, exist_ok=True)
    where = root / layout.dir_name(seq)
    where.mkdir(exist_ok=True)
    files: dict[str, layout.FileEntry] = {}

    def put(name: str, data: bytes) -> None:
        atomic_write_bytes(where / name, data)
        files[name] = layout.FileEntry(hashlib.sha256(data).hexdigest(), len(data))

    for p, part in enumerate(partitions):
        buf = io.BytesIO()
        np.savez(buf, **part.to_arrays())  # type: ignore[arg-type]
        put(f"ps{p}.npz", buf.getvalue())
    doc = {"seq": seq, "num_ps": len(partitions), "queues": queues.to_json(), "losses": [float(x) for x in losses]}
    put(QUEUES, json.dumps(doc).encode())
    manifest = layout.Manifest(seq, len(partitions), time.time(), files, {"kind": "ps"})
    atomic_write_bytes(where / layout.MANIFEST, manifest.to_json().encode())
    atomic_write_bytes(root / LATEST, str(seq).encode())
    for old in _dirs(root):
        if _seq(old.name) <= seq - KEEP:
            shutil.rmtree(old, ignore_errors=True)
    for kept in (root, where):  # what a master killed while saving left (an older save's directory goes whole)
        sweep_temporaries(kept, now=time.time())
    return where


def _seq(name: str) -> int:
    tail = name.removeprefix("ckpt-")
    return int(tail) if tail.isdigit() else -1


def _dirs(root: Path) -> list[Path]:
    """The checkpoint directories under ``root``, newest first (``ckpt-<seq>`` of older versions too)."""
    return sorted((d for d in root.glob("ckpt-*") if _seq(d.name) >= 0 and d.is_dir()), key=lambda d: -_seq(d.name))


def verified(where: Path) -> bool:
    """Whether every file of the checkpoint in ``where`` has the size and sha256 its manifest gives (the check of
    the EST checkpoints: :func:`~hpc_elastic.checkpoint.open_checkpoint`, then ``verify``)."""
    try:
        ckpt = open_checkpoint(where)
        ckpt.verify()
    except CheckpointError:
        return False
    return QUEUES in ckpt.manifest.files


def latest(root: Path) -> Path | None:
    """The newest checkpoint, from the one ``LATEST`` names down, whose files match its manifest (a checkpoint of
    a version that wrote no manifest counts when ``LATEST`` names it); None when there is none."""
    try:
        named = int((root / LATEST).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"{root / LATEST} does not hold a checkpoint number") from exc
    for where in _dirs(root):
        seq = _seq(where.name)
        if seq > named:  # a save killed before its LATEST
            continue
        if verified(where) or (seq == named and not (where / layout.MANIFEST).exists()):
            return where
        log.warning("PS checkpoint %s does not match its manifest: trying the previous one", where)
    return None


def read_queues(where: Path) -> tuple[int, ShardState]:
    """The sequence number and the queues of the checkpoint in ``where``."""
    doc = json.loads((where / QUEUES).read_text())
    return int(doc["seq"]), ShardState.from_json(doc["queues"])


def read_losses(where: Path) -> list[float]:
    """The per-shard mean losses the checkpoint in ``where`` holds (none in a checkpoint written without them)."""
    doc = json.loads((where / QUEUES).read_text())
    return [float(x) for x in doc.get("losses", [])]


def read_partitions(where: Path) -> list[PsSnapshot]:
    doc = json.loads((where / QUEUES).read_text())
    parts = []
    for p in range(int(doc["num_ps"])):
        with np.load(where / f"ps{p}.npz", allow_pickle=False) as data:
            parts.append(PsSnapshot.from_arrays({k: data[k] for k in data.files}))
    return parts
