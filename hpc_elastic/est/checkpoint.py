"""Checkpoints of an EST job (EasyScale §3.2, "Adapting to elasticity") on the library's checkpoint store.

The files, their atomic commit (temporary directory, fsync, rename), the sha256 manifest, keep-K and the
fall-back to the previous checkpoint when one is damaged are :mod:`hpc_elastic.checkpoint`'s.  This module
only decides what goes into the shards and how a restart on another number of processes finds its ESTs:

- every process saves one shard: ``{"ests": {vrank: context}, "shared": ...}`` holding the contexts of the
  ESTs it runs (:meth:`hpc_elastic.est.context.ESTContext.to_state`) and, on rank 0 only, the state the ESTs
  share (parameters, optimizer, LR scheduler; §3.3's "extra state" step and bucket layout go to the meta);
- the manifest's ``meta["est"]`` records N, the EST-to-process placement of the saving run (which shard
  holds which EST) and what a restart must not change (seed, level, bin width, bucket layout, parameters);
- a restart on any M reads shard 0 for the shared state and, for each EST now placed on it, the shard of
  the process that ran it (hashes checked by the store on read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_elastic.checkpoint import Checkpoint, CheckpointStore, CorruptCheckpoint, open_checkpoint
from hpc_elastic.checkpoint.layout import dir_name
from hpc_elastic.collective import Collective

EST_FORMAT = "hpc-elastic-est/1"
META_KEY = "est"


@dataclass(frozen=True)
class ESTState:
    """What one process reads from a checkpoint to continue: the shared state and its ESTs' contexts."""

    step: int
    meta: Mapping[str, Any]
    shared: Mapping[str, Any]
    contexts: Mapping[int, Mapping[str, Any]]
    source: Path


def open_store(root: Path | str, collective: Collective | None = None, keep: int = 2) -> CheckpointStore:
    """The checkpoint store of an EST job under ``root`` (``collective``: the job's process group)."""
    return CheckpointStore(root, collective, keep=keep)


def save_state(
    store: CheckpointStore,
    step: int,
    contexts: Mapping[int, Mapping[str, Any]],
    shared: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
) -> Path:
    """Save this process's part of checkpoint ``step`` (collective over the store's collective): its ESTs'
    ``contexts`` and, on rank 0, the ``shared`` state.  ``meta`` (JSON) must hold ``num_ests`` and
    ``placement`` (the owner process of every EST)."""
    for key in ("num_ests", "placement"):
        if key not in meta:
            raise ValueError(f"EST checkpoint meta needs {key!r}")
    shard = {"ests": {int(v): dict(c) for v, c in contexts.items()}, "shared": dict(shared) if shared else None}
    pending = store.save(step, shard, meta={META_KEY: {"format": EST_FORMAT, **dict(meta)}})
    return pending.path


def est_meta(checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The EST part of a checkpoint's meta; :class:`CorruptCheckpoint` when it is not an EST checkpoint."""
    meta = checkpoint.meta.get(META_KEY)
    if not isinstance(meta, Mapping) or meta.get("format") != EST_FORMAT:
        raise CorruptCheckpoint(f"{checkpoint.path} is not an EST checkpoint (no {EST_FORMAT} meta)")
    placement = meta.get("placement")
    n = meta.get("num_ests")
    if not isinstance(placement, list) or not isinstance(n, int) or len(placement) != n:
        raise CorruptCheckpoint(f"{checkpoint.path}: EST meta has a bad placement {placement!r} for num_ests {n!r}")
    return meta


def read_state(checkpoint: Checkpoint, wanted: Sequence[int], num_ests: int | None = None) -> ESTState:
    """The shared state plus the contexts of the ESTs in ``wanted``, whatever process saved them
    (``ValueError`` when ``num_ests`` is given and the checkpoint's job has another N)."""
    meta = est_meta(checkpoint)
    if num_ests is not None and meta["num_ests"] != num_ests:
        raise ValueError(f"checkpoint {checkpoint.path} has {meta['num_ests']} ESTs, this job has {num_ests}")
    owner: list[int] = meta["placement"]
    for v in wanted:
        if not 0 <= v < len(owner):
            raise ValueError(f"checkpoint {checkpoint.path} has ESTs 0..{len(owner) - 1}, not {v}")
    shards: dict[int, Any] = {}

    def shard(rank: int) -> Any:
        if rank not in shards:
            shards[rank] = checkpoint.load_shard(rank)
        return shards[rank]

    shared = shard(0).get("shared")
    if not isinstance(shared, Mapping):
        raise CorruptCheckpoint(f"checkpoint {checkpoint.path}: shard 0 holds no shared state")
    contexts: dict[int, Mapping[str, Any]] = {}
    for v in wanted:
        ests = shard(owner[v]).get("ests", {})
        if v not in ests:
            raise CorruptCheckpoint(f"checkpoint {checkpoint.path}: shard {owner[v]} lacks the context of EST {v}")
        contexts[v] = ests[v]
    return ESTState(checkpoint.step, meta, shared, contexts, checkpoint.path)


def checkpoint_at(root: Path | str, step: int) -> Checkpoint:
    """The committed checkpoint of global step ``step`` under ``root`` (:class:`CorruptCheckpoint` if none)."""
    return open_checkpoint(Path(root) / dir_name(step))


def load_latest_state(
    store: CheckpointStore,
    wanted: Sequence[int],
    num_ests: int | None = None,
    check: Callable[[ESTState], None] | None = None,
) -> ESTState | None:
    """The newest checkpoint every process can read its ESTs from (collective; a damaged one is skipped on
    every process); ``check`` may refuse a state by raising.  ``None`` when there is no checkpoint."""

    def load(ckpt: Checkpoint) -> ESTState:
        state = read_state(ckpt, wanted, num_ests)
        if check is not None:
            check(state)
        return state

    found = store.load_latest(load)
    return None if found is None else found[1]
