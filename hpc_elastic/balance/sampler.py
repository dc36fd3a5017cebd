"""Per-worker batches of different sizes that still use every sample exactly once per epoch (LB-BSP §4).

LB-BSP needs a sampler that "can accept a user-specified batch size at runtime and generate a corresponded sample
batch" (§4, Enabling Variable Batch Size), x_i for worker i (Alg. 3, Worker line 5).  Here the samples form one
stream: the permutation of epoch 0, then that of epoch 1, ... (each drawn from ``seed + epoch`` by
:func:`hpc_elastic.est.data.epoch_permutation`, the one the ESTs' data plan uses).  Every iteration takes the next
X = Σ x_i positions of the stream and gives worker i the i-th slice of length x_i.  Whatever the x_i of each
iteration, the positions taken are consecutive and never overlap, so each epoch's permutation is used exactly once:
an iteration that straddles the end of an epoch takes its tail and the head of the next.  The position is the
whole state (:class:`SamplerState`: epoch, cursor), small and JSON-serialisable, so a checkpoint that stores it
resumes the stream exactly, with other batch sizes if need be.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpc_elastic.est.data import epoch_permutation


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplerState:
    """The next sample of the stream: position ``cursor`` in the permutation of ``epoch``."""

    epoch: int = 0
    cursor: int = 0

    def __post_init__(self) -> None:
        _non_negative("epoch", self.epoch)
        _non_negative("cursor", self.cursor)

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SamplerState:
        if set(data) != {"epoch", "cursor"}:
            raise ValueError(f"a sampler state has exactly the keys epoch and cursor, got {sorted(data)}")
        return cls(epoch=data["epoch"], cursor=data["cursor"])


@dataclass(frozen=True)
class WorkerBatches:
    """The samples of one iteration: ``indices[i]`` for worker i, and the sampler state after it."""

    indices: tuple[tuple[int, ...], ...]
    state: SamplerState


@functools.lru_cache(maxsize=4)
def _order(dataset_len: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    return tuple(epoch_permutation(dataset_len, seed, epoch, shuffle))


@dataclass(frozen=True)
class BalancedSampler:
    """The sample stream of a dataset of ``dataset_len`` samples (no state: see :class:`SamplerState`)."""

    dataset_len: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if _non_negative("dataset_len", self.dataset_len) == 0:
            raise ValueError("dataset_len must be positive, got 0")

    def take(self, state: SamplerState, sizes: Sequence[int]) -> WorkerBatches:
        """x_i = ``sizes[i]`` samples for each worker i from ``state`` on (Σ x_i at most one epoch)."""
        for x in sizes:
            _non_negative("batch size", x)
        total = sum(sizes)
        if total > self.dataset_len:
            raise ValueError(f"a global batch of {total} is larger than the dataset ({self.dataset_len} samples)")
        if state.cursor >= self.dataset_len:
            raise ValueError(f"cursor {state.cursor} is past the end of an epoch of {self.dataset_len}")
        head = _order(self.dataset_len, self.seed, state.epoch, self.shuffle)[state.cursor : state.cursor + total]
        stream = head
        if len(head) < total:  # the iteration straddles the end of the epoch
            nxt = _order(self.dataset_len, self.seed, state.epoch + 1, self.shuffle)
            stream = head + nxt[: total - len(head)]
        out: list[tuple[int, ...]] = []
        start = 0
        for x in sizes:
            out.append(stream[start : start + x])
            start += x
        epoch, cursor = divmod(state.cursor + total, self.dataset_len)
        return WorkerBatches(tuple(out), SamplerState(state.epoch + epoch, cursor))
