"""Horovod-like training state: ``state.commit()`` checkpoints it, ``state.restore()`` resumes from the newest
valid checkpoint — also on a different number of processes.

What is saved, for data-parallel training (the model and optimizer are replicated on every process):

- rank 0's shard: ``step``, ``epoch``, the model, optimizer and LR-scheduler state dicts, the sampler state and
  ``extras`` (user values: tensors, numbers, strings, lists and dicts of those);
- every rank's shard: ``workers``, the per-logical-worker state (``state.workers[w]``, a dict per logical worker
  this process owns, e.g. an RNG state for that worker's augmentation).

On restore every rank reads rank 0's shard, and for each logical worker it now owns the shard of the rank that
owned it when the checkpoint was written — so per-worker state follows its worker across a resize.  Model-parallel
or sharded (FSDP/ZeRO) state does not fit this scheme: use :class:`~hpc_elastic.checkpoint.CheckpointStore`
directly with one shard per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpc_elastic.checkpoint import Checkpoint, CheckpointStore, CorruptCheckpoint, SaveMode
from hpc_elastic.checkpoint.tree import check_loadable
from hpc_elastic.data.sampler import ElasticSampler
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.workers import WorkerAssignment

if TYPE_CHECKING:
    import torch

STATE_FORMAT = 1


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


@dataclass(frozen=True)
class _Loaded:
    shared: dict[str, Any]
    workers: dict[int, dict[str, Any]]


class State:
    """The state of a training run that checkpoints commit and restarts restore."""

    def __init__(
        self,
        store: CheckpointStore,
        assignment: WorkerAssignment,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        sampler: ElasticSampler | None = None,
        extras: Mapping[str, Any] | None = None,
        mode: SaveMode | str = SaveMode.SYNC,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if assignment.world_size != store.collective.world_size or assignment.rank != store.collective.rank:
            raise ValueError(
                f"worker assignment is for rank {assignment.rank} of {assignment.world_size}, the store's collective "
                f"is rank {store.collective.rank} of {store.collective.world_size}"
            )
        try:
            self.mode = SaveMode(mode)
        except ValueError:
            raise ValueError(f"mode must be sync or async, got {mode!r}") from None
        self.store = store
        self.assignment = assignment
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.extras: dict[str, Any] = dict(extras or {})
        self.workers: dict[int, dict[str, Any]] = {w: {} for w in assignment.workers}
        self.step = 0
        self._epoch = 0
        self._meta = dict(meta or {})
        self.last_checkpoint: Path | None = None  # committed (or, async, being committed) at last_step
        self.last_step: int | None = None

    # -- values ---------------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The sampler's epoch when there is a sampler, else the value the script sets."""
        return self.sampler.epoch if self.sampler is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.sampler is not None:
            raise ValueError("epoch follows the sampler; call sampler.set_epoch() instead")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {value!r}")
        self._epoch = value

    def _shared(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "epoch": self.epoch,
            "model": None if self.model is None else self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "extras": self.extras,
        }

    def _shard(self) -> dict[str, Any]:
        shard: dict[str, Any] = {"workers": {w: self.workers.get(w, {}) for w in self.assignment.workers}}
        if self.store.rank == 0:
            shard["shared"] = self._shared()
        return shard

    def replicated(self) -> dict[str, Any]:
        """The state every rank holds alike (step, epoch, model, optimizer, scheduler, sampler, extras), as
        references to the live objects' state dicts: copy it to keep it."""
        return self._shared()

    def load_replicated(self, shared: Mapping[str, Any]) -> None:
        """Set the replicated state from :meth:`replicated`'s form."""
        self._apply(shared)

    def rebind(self, store: CheckpointStore, assignment: WorkerAssignment, workers: Mapping[int, Any]) -> None:
        """Go on in a new process group (see :meth:`hpc_elastic.session.Session.rebind`): commit through
        ``store``, own ``assignment``'s logical workers, whose contexts ``workers`` must hold."""
        if assignment.world_size != store.collective.world_size or assignment.rank != store.collective.rank:
            raise ValueError(
                f"worker assignment is for rank {assignment.rank} of {assignment.world_size}, the store's collective "
                f"is rank {store.collective.rank} of {store.collective.world_size}"
            )
        if assignment.num_workers != self.assignment.num_workers:
            raise ValueError(
                f"the logical worker count must not change: {self.assignment.num_workers} -> {assignment.num_workers}"
            )
        missing = [w for w in assignment.workers if w not in workers]
        if missing:
            raise ValueError(f"no context for logical workers {missing}")
        self.store = store
        self.assignment = assignment
        self.workers = {w: dict(workers[w]) for w in assignment.workers}

    # -- commit ---------------------------------------------------------------------------------------------

    def commit(self, *, mode: SaveMode | str | None = None) -> Path:
        """Checkpoint the state at ``self.step`` (collective: every rank calls it at the same step).

        Return the checkpoint's directory; with an asynchronous mode it is complete once :meth:`wait` (or the
        next commit) returns."""
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"state.step must be a non-negative integer, got {self.step!r}")
        check_loadable(self.extras, "state.extras")
        meta = {
            **self._meta,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.assignment.world_size,
            "num_workers": self.assignment.num_workers,
        }
        pending = self.store.save(self.step, self._shard(), meta=meta, mode=mode or self.mode)
        self.last_checkpoint, self.last_step = pending.path, self.step
        return pending.path

    def wait(self) -> Path | None:
        """Finish an asynchronous commit in flight (collective)."""
        return self.store.wait()

    def commit_if_needed(self) -> Path:
        """The checkpoint of the current step: the last one when it is already at this step (restored, or
        committed without a step since), else a new synchronous commit.  Used when stopping."""
        if self.last_checkpoint is not None and self.last_step == self.step:
            self.store.wait()
            return self.last_checkpoint
        path = self.commit(mode=SaveMode.SYNC)
        self.store.wait()
        return path

    # -- restore --------------------------------------------------------------------------------------------

    def _load(self, ckpt: Checkpoint) -> _Loaded:
        n = self.assignment.num_workers
        saved_n = ckpt.meta.get("num_workers")
        if saved_n != n:
            raise HpcElasticError(
                f"checkpoint {ckpt.path} was written for {saved_n} logical workers, this job has {n}: the logical "
                "worker count (HPC_ELASTIC_WORKERS) must not change across restarts"
            )
        old = ckpt.world_size
        if n % old:
            raise CorruptCheckpoint(f"checkpoint {ckpt.path}: {n} logical workers cannot have run on {old} processes")
        per_old = n // old
        cache: dict[int, Any] = {}

        def shard(rank: int) -> Any:
            if rank not in cache:
                cache[rank] = ckpt.load_shard(rank)
            return cache[rank]

        root = shard(0)
        if not isinstance(root, dict) or not isinstance(root.get("shared"), dict):
            raise CorruptCheckpoint(f"checkpoint {ckpt.path} has no training state in rank 0's shard")
        shared: dict[str, Any] = root["shared"]
        if shared.get("format") != STATE_FORMAT:
            raise CorruptCheckpoint(f"checkpoint {ckpt.path} holds state format {shared.get('format')!r}")
        workers: dict[int, dict[str, Any]] = {}
        for w in self.assignment.workers:
            owner = shard(w // per_old)
            saved = owner.get("workers", {}) if isinstance(owner, dict) else {}
            if w not in saved:
                raise CorruptCheckpoint(f"checkpoint {ckpt.path} lacks the state of logical worker {w}")
            workers[w] = saved[w]
        return _Loaded(shared, workers)

    def _apply(self, shared: Mapping[str, Any]) -> None:
        for name, target in (("model", self.model), ("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            saved = shared.get(name)
            if target is None:
                continue
            if saved is None:
                raise HpcElasticError(f"the checkpoint has no {name} state, but this State has a {name}")
            target.load_state_dict(saved)
        if self.sampler is not None:
            if shared.get("sampler") is None:
                raise HpcElasticError("the checkpoint has no sampler state, but this State has a sampler")
            self.sampler.load_state_dict(shared["sampler"])
        else:
            self._epoch = int(shared.get("epoch", 0))
        self.step = int(shared["step"])
        self.extras = dict(shared.get("extras") or {})

    def restore(self) -> Checkpoint | None:
        """Load the newest valid checkpoint (collective); ``None`` (state untouched) when there is none."""
        found = self.store.load_latest(self._load)
        if found is None:
            return None
        ckpt, loaded = found
        self._apply(loaded.shared)
        self.workers = {w: dict(loaded.workers[w]) for w in self.assignment.workers}
        self.last_checkpoint, self.last_step = ckpt.path, ckpt.step
        return ckpt

    def sync(self) -> None:
        """Make every rank's replicated state equal rank 0's (collective; pickles the state: meant for start-up,
        when models were not initialised identically)."""
        from hpc_elastic.checkpoint.tree import to_host

        coll = self.store.collective
        shared: dict[str, Any] | None = coll.broadcast_object(to_host(self._shared()) if coll.rank == 0 else None)
        if coll.rank != 0 and shared is not None:
            self._apply(shared)
