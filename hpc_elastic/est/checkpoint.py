"""The checkpoint format of the runtime (EasyScale §3.2, "Adapting to elasticity") on the library's checkpoint store.

The files, their atomic commit (temporary directory, fsync, rename), the sha256 manifest, keep-K, asynchronous
persistence and the fall-back to the previous checkpoint when one is damaged are :mod:`hpc_elastic.checkpoint`'s.
This module only decides what goes into the shards and how a restart on another number of processes finds its ESTs:

- every process saves one shard: ``{"ests": {vrank: context}, "shared": ...}`` holding the contexts of the
  ESTs it runs (:meth:`hpc_elastic.est.context.ESTContext.to_state`) and, on rank 0 only, the state the ESTs
  share (step, parameters, optimizer, LR scheduler, the script's extras);
- the manifest's ``meta["est"]`` records N, the EST-to-process placement of the saving run (which shard
  holds which EST) and what a restart must not change (seed, level, bin width, bucket layout, parameters), plus the
  device types the run trained on;
- a restart on any M reads shard 0 for the shared state and, for each EST now placed on it, the shard of
  the process that ran it (hashes checked by the store on read).

:func:`fingerprint` hashes a checkpoint the way :meth:`hpc_elastic.state.State.state_sha256` hashes the live state,
so a run's final checkpoint tells whether two runs ended with the same bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_elastic.checkpoint import Checkpoint, CheckpointStore, CorruptCheckpoint, SaveMode, open_checkpoint
from hpc_elastic.checkpoint.layout import dir_name

EST_FORMAT = "hpc-elastic-est/2"
META_KEY = "est"


@dataclass(frozen=True)
class ESTState:
    """What one process reads from a checkpoint to continue: the shared state and its ESTs' contexts."""

    step: int
    meta: Mapping[str, Any]
    shared: Mapping[str, Any]
    contexts: Mapping[int, Mapping[str, Any]]
    source: Path


def save_state(
    store: CheckpointStore,
    step: int,
    contexts: Mapping[int, Mapping[str, Any]],
    shared: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
    *,
    mode: SaveMode = SaveMode.SYNC,
) -> Path:
    """Save this process's part of checkpoint ``step`` (collective over the store's collective): its ESTs'
    ``contexts`` and, on rank 0, the ``shared`` state.  ``meta`` (JSON) must hold ``num_ests`` and
    ``placement`` (the owner process of every EST).  Return the checkpoint's directory (committed when an
    asynchronous save is waited for)."""
    for key in ("num_ests", "placement"):
        if key not in meta:
            raise ValueError(f"EST checkpoint meta needs {key!r}")
    shard = {"ests": {int(v): dict(c) for v, c in contexts.items()}, "shared": dict(shared) if shared else None}
    pending = store.save(step, shard, meta={META_KEY: {"format": EST_FORMAT, **dict(meta)}}, mode=mode)
    return pending.path


def est_meta(checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The EST part of a checkpoint's meta; :class:`CorruptCheckpoint` when it is not an EST checkpoint."""
    meta = checkpoint.meta.get(META_KEY)
    if not isinstance(meta, Mapping) or meta.get("format") != EST_FORMAT:
        raise CorruptCheckpoint(f"{checkpoint.path} is not a checkpoint of this runtime (no {EST_FORMAT} meta)")
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
        raise ValueError(
            f"checkpoint {checkpoint.path} was written for {meta['num_ests']} logical workers (ESTs), this job has "
            f"{num_ests}: N must not change across restarts"
        )
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
) -> tuple[Checkpoint, ESTState] | None:
    """The newest checkpoint every process can read its ESTs from (collective; a damaged one is skipped on
    every process); ``check`` may refuse a state by raising.  ``None`` when there is no checkpoint."""

    def load(ckpt: Checkpoint) -> ESTState:
        state = read_state(ckpt, wanted, num_ests)
        if check is not None:
            check(state)
        return state

    return store.load_latest(load)


# ------------------------------------------------------------------------------------------------ fingerprints


def _walk(prefix: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """Leaves of a state tree in a fixed order: mappings by sorted key, sequences by index."""
    if isinstance(obj, Mapping):
        for key in sorted(obj, key=repr):
            yield from _walk(f"{prefix}.{key!r}", obj[key])
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(f"{prefix}[{i}]", value)
    else:
        yield prefix, obj


def digest_tree(obj: Any, h: Any = None) -> str:
    """sha256 of a state tree: tensors by name, dtype, shape and raw bytes; other leaves by ``repr``."""
    h = hashlib.sha256() if h is None else h
    for name, leaf in _walk("", obj):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(leaf, np.generic):
            h.update(f"{name}={leaf.item()!r}|".encode())
        else:
            h.update(f"{name}={leaf!r}|".encode())
    return str(h.hexdigest())


def params_sha256(names: Sequence[str], params: Sequence[torch.Tensor]) -> str:
    """sha256 of parameters (name, dtype, shape and raw bytes, in order)."""
    return digest_tree([[n, p] for n, p in zip(names, params, strict=True)])


def combine_digests(params_digest: str, shared_digest: str, context_digests: Sequence[str]) -> str:
    """The state fingerprint: parameters, the rest of the shared state, then every EST's context in EST order."""
    h = hashlib.sha256(params_digest.encode())
    h.update(shared_digest.encode())
    for d in context_digests:
        h.update(d.encode())
    return h.hexdigest()


def without_params(shared: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in shared.items() if k != "params"}


@dataclass(frozen=True)
class Fingerprint:
    """Which bits a checkpoint holds: its step, the sha256 of the parameters and of the whole state (parameters,
    optimizer, scheduler, extras and every EST's context)."""

    step: int
    params_sha256: str
    state_sha256: str
    num_ests: int
    procs: int


def fingerprint(checkpoint: Checkpoint) -> Fingerprint:
    """The fingerprint of a committed checkpoint (every shard read and verified)."""
    meta = est_meta(checkpoint)
    state = read_state(checkpoint, range(int(meta["num_ests"])))
    names = meta.get("param_names")
    params = state.shared.get("params")
    if not isinstance(names, list) or not isinstance(params, list) or len(names) != len(params):
        raise CorruptCheckpoint(f"checkpoint {checkpoint.path}: parameters and their names do not match")
    p = params_sha256(names, params)
    contexts = [digest_tree(state.contexts[v]) for v in range(int(meta["num_ests"]))]
    full = combine_digests(p, digest_tree(without_params(state.shared)), contexts)
    return Fingerprint(checkpoint.step, p, full, int(meta["num_ests"]), checkpoint.world_size)
