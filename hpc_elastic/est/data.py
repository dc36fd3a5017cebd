"""Data for ESTs: a sampler plan per virtual rank and one loader whose workers all ESTs of a process share.

EasyScale §3.2 ("Optimizing data pre-processing"): the data workers of a process serve every EST it runs,
in the order the ESTs consume batches, and "each sample request carries the EST's RNG state so
augmentation is identical to the fixed-N run".  Here a request carries the seeds of Python's
``random``, NumPy's global generator and torch for that (EST, mini-batch); the worker installs them
before calling ``dataset[i]`` for the batch's indices.  The seeds are a pure function of
(job seed, virtual rank, batch number), so augmentation does not depend on the number of worker
processes, on prefetching, on M, or on where a restart happened; the RNG-stream bookkeeping of the
paper's queuing buffer reduces to the EST's cursor, which its context stores.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data import default_collate as _default_collate

from hpc_elastic.est.context import RNGState, mix_seed

DATA_TAG = 0x44415441


def epoch_permutation(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of the samples in ``epoch``: a permutation drawn from ``seed + epoch`` (as ``DistributedSampler``
    does), or the identity without ``shuffle``."""
    if not shuffle:
        return list(range(dataset_len))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order: list[int] = torch.randperm(dataset_len, generator=g).tolist()
    return order


@dataclass(frozen=True)
class BatchRequest:
    """One mini-batch of one EST: what a (shared) data worker needs to build it."""

    vrank: int
    cursor: int
    indices: tuple[int, ...]
    seed: int


@dataclass(frozen=True)
class DataPlan:
    """Which samples EST ``v`` reads at its ``cursor``-th mini-batch (pure; no I/O).

    Every epoch is a permutation of the dataset drawn from ``seed + epoch`` (as ``DistributedSampler``
    does), cut to a multiple of ``num_ests``; EST ``v`` reads positions ``v, v + N, v + 2N, ...`` of it in
    mini-batches of ``batch_size``, dropping the last partial one.
    """

    dataset_len: int
    num_ests: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("dataset_len", "num_ests", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"dataset of {self.dataset_len} samples is too small for {self.num_ests} ESTs "
                f"with batch_size {self.batch_size}"
            )

    @property
    def per_est(self) -> int:
        return self.dataset_len // self.num_ests

    @property
    def steps_per_epoch(self) -> int:
        return self.per_est // self.batch_size

    def position(self, cursor: int) -> tuple[int, int]:
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        return divmod(cursor, self.steps_per_epoch)

    def permutation(self, epoch: int) -> list[int]:
        return epoch_permutation(self.dataset_len, self.seed, epoch, self.shuffle)

    def request(self, vrank: int, cursor: int, permutation: Sequence[int] | None = None) -> BatchRequest:
        if not 0 <= vrank < self.num_ests:
            raise ValueError(f"vrank must be in [0, {self.num_ests}), got {vrank}")
        epoch, b = self.position(cursor)
        perm = self.permutation(epoch) if permutation is None else permutation
        total = self.per_est * self.num_ests
        mine = perm[vrank : total : self.num_ests]
        idx = tuple(mine[b * self.batch_size : (b + 1) * self.batch_size])
        return BatchRequest(vrank, cursor, idx, mix_seed(self.seed, DATA_TAG, vrank, cursor))


def seed_generators(seed: int) -> None:
    """Seed the generators sample augmentation uses (CPU: torch.manual_seed would also walk every
    accelerator backend, about a millisecond per batch)."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.default_generator.manual_seed(seed)


class RequestDataset(Dataset[Any]):
    """Builds the batch of a :class:`BatchRequest` under the request's seeds (in a worker or in-process)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else _default_collate

    def __getitem__(self, request: BatchRequest) -> tuple[int, int, Any]:
        saved = RNGState.capture()  # keep the caller's (an EST's) generators intact when run in-process
        try:
            seed_generators(request.seed)
            batch = self.collate_fn([self.dataset[i] for i in request.indices])
        finally:
            saved.restore()
        return request.vrank, request.cursor, batch

    def __len__(self) -> int:
        return len(self.dataset)


class RequestStream(Sampler[BatchRequest]):
    """The requests of a process's ESTs in the order it runs them: step by step, EST by EST, starting
    with EST ``local_ests[first]`` at ``start_cursor``."""

    def __init__(
        self,
        plan: DataPlan,
        local_ests: Sequence[int],
        start_cursor: int,
        stop_cursor: int | None,
        first: int = 0,
    ) -> None:
        self.plan = plan
        self.local_ests = tuple(local_ests)
        self.start = start_cursor
        self.stop = stop_cursor
        self.first = first

    def __iter__(self) -> Iterator[BatchRequest]:
        cursor = self.start
        skip = self.first
        cached_epoch, perm = -1, []
        while self.stop is None or cursor < self.stop:
            epoch, _ = self.plan.position(cursor)
            if epoch != cached_epoch:
                cached_epoch, perm = epoch, self.plan.permutation(epoch)
            for v in self.local_ests[skip:]:
                yield self.plan.request(v, cursor, perm)
            skip = 0
            cursor += 1


def _ignore_sigterm(worker_id: int) -> None:
    """In a loader process: ignore ``SIGTERM``.  Slurm signals every process of a job step; the training process
    takes it as a stop at the next mini-batch boundary (:mod:`hpc_elastic.session`) and needs its loader until then
    (a loader process that dies fails the training process at once).  The training process ends its loader."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ESTLoader:
    """One ``DataLoader`` (and one set of worker processes) for all ESTs of a process."""

    def __init__(
        self,
        dataset: Any,
        plan: DataPlan,
        local_ests: Sequence[int],
        *,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        stop_cursor: int | None = None,
        prefetch_factor: int = 2,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        if not local_ests:
            raise ValueError("an ESTLoader needs at least one EST")
        self.plan = plan
        self.local_ests = tuple(local_ests)
        self.num_workers = num_workers
        self.stop_cursor = stop_cursor
        self.prefetch_factor = prefetch_factor
        self._dataset = RequestDataset(dataset, collate_fn)
        self._iter: Iterator[tuple[int, int, Any]] | None = None
        self._expected: tuple[int, int] | None = None

    def _start(self, vrank: int, cursor: int) -> None:
        self.close()
        loader = DataLoader(
            self._dataset,
            batch_size=None,
            sampler=RequestStream(self.plan, self.local_ests, cursor, self.stop_cursor, self.local_ests.index(vrank)),
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            # a private generator: creating the iterator must not draw from an EST's torch generator
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=_ignore_sigterm,
        )
        self._iter = iter(loader)

    def _advance_expected(self, vrank: int, cursor: int) -> tuple[int, int]:
        i = self.local_ests.index(vrank)
        if i + 1 < len(self.local_ests):
            return self.local_ests[i + 1], cursor
        return self.local_ests[0], cursor + 1

    def get(self, vrank: int, cursor: int) -> Any:
        """The ``cursor``-th mini-batch of EST ``vrank`` (restarts the stream if asked out of order)."""
        if vrank not in self.local_ests:
            raise ValueError(f"EST {vrank} does not run on this process (local ESTs: {list(self.local_ests)})")
        if self._iter is None or self._expected != (vrank, cursor):
            # first call, resume, or a script that skipped an EST: restart the stream from here
            self._start(vrank, cursor)
        if self._iter is None:
            raise RuntimeError("the data stream could not be started")
        try:
            got_v, got_c, batch = next(self._iter)
        except StopIteration:
            raise RuntimeError(f"the data stream ended before batch {cursor} of EST {vrank}") from None
        if (got_v, got_c) != (vrank, cursor):
            raise RuntimeError(f"data stream out of step: wanted EST {vrank} batch {cursor}, got {got_v}/{got_c}")
        self._expected = self._advance_expected(vrank, cursor)
        return batch

    def close(self) -> None:
        self._iter = None
        self._expected = None
