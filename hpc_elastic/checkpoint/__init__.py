"""Checkpoints on the shared filesystem: per-rank shards, atomic commit, sha256 manifest, keep-K, async persist.

torch is imported only when a shard is written or read.  See :mod:`hpc_elastic.checkpoint.store` for the protocol
and :mod:`hpc_elastic.checkpoint.layout` for the on-disk format.
"""

from hpc_elastic.checkpoint.layout import FileEntry, Manifest
from hpc_elastic.checkpoint.store import (
    DEFAULT_KEEP,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    CorruptCheckpoint,
    PendingSave,
    SaveMode,
    UnreadableCheckpoint,
    open_checkpoint,
)

__all__ = [
    "DEFAULT_KEEP",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CorruptCheckpoint",
    "FileEntry",
    "Manifest",
    "PendingSave",
    "SaveMode",
    "UnreadableCheckpoint",
    "open_checkpoint",
]
