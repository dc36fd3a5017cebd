"""An elastic distributed sampler whose position is part of the training state (pure logic, no I/O).

Every epoch is a permutation of ``range(dataset_len)`` drawn from ``(seed, epoch)`` alone (NumPy's PCG64 seeded
with ``SeedSequence([seed, epoch])``), so any process, on any restart, computes the same order.  The sampler keeps
one cursor, ``position``: how many samples of the current epoch's permutation the job has consumed.  A training step
with ``R`` replicas (processes, or logical workers) and a per-replica batch of ``b`` consumes the next window of
``R * b`` positions; replica ``i`` reads ``window[i*b : (i+1)*b]``.  Because the cursor counts samples, not steps,
``R`` may change between any two steps (a restart on a different number of processes): the next window simply
starts where the last one ended, and every sample is used exactly once per epoch.

At the end of an epoch the last window is shorter than ``R * b``; its samples go to the first replicas, so trailing
replicas may get a short or empty batch (weight gradients by the global sample count, see
:meth:`ElasticSampler.step_size`).  With ``drop_last=True`` a window that would be short is skipped instead and the
epoch ends early: batches always have ``b`` samples, and the skipped tail of each epoch is the price.

The sampler advances only when the training loop says a step is done (:meth:`ElasticSampler.advance`), never when a
loader prefetches, so a checkpoint taken between steps records exactly the samples consumed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

STATE_KEYS = ("epoch", "position", "seed", "dataset_len", "batch_size", "shuffle", "drop_last")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _non_negative(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def epoch_permutation(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order in which epoch ``epoch`` visits the dataset: a pure function of its arguments."""
    _positive("dataset_len", dataset_len)
    _non_negative("seed", seed)
    _non_negative("epoch", epoch)
    if not shuffle:
        return list(range(dataset_len))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return [int(i) for i in rng.permutation(dataset_len)]


@dataclass(frozen=True)
class Window:
    """The samples of one step: positions ``[start, stop)`` of epoch ``epoch``'s permutation."""

    epoch: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class ElasticSampler:
    """Deterministic, resumable, resizable sampling; see the module docstring for the exact rule."""

    def __init__(
        self, dataset_len: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False
    ) -> None:
        self.dataset_len = _positive("dataset_len", dataset_len)
        self.batch_size = _positive("batch_size", batch_size)
        self.seed = _non_negative("seed", seed)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last must be a bool, got {drop_last!r}")
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._cache: tuple[int, list[int]] | None = None

    # -- position -------------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the cursor is in (the epoch of the next step, unless ``drop_last`` skips a short tail)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch's permutation already consumed."""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (``DistributedSampler`` compatibility)."""
        self._epoch = _non_negative("epoch", epoch)
        self._position = 0

    def _check_replicas(self, replicas: int) -> int:
        _positive("replicas", replicas)
        if self.drop_last and replicas * self.batch_size > self.dataset_len:
            raise ValueError(
                f"replicas={replicas} x batch_size={self.batch_size} exceeds the dataset of {self.dataset_len} "
                "samples: with drop_last=True no step could be formed"
            )
        return replicas

    def window(self, replicas: int) -> Window:
        """The positions the next step with ``replicas`` replicas consumes (the sampler is not changed)."""
        self._check_replicas(replicas)
        epoch, start = self._epoch, self._position
        want = replicas * self.batch_size
        remaining = self.dataset_len - start
        if remaining == 0 or (self.drop_last and remaining < want):
            epoch, start = epoch + 1, 0
        return Window(epoch, start, min(start + want, self.dataset_len))

    def step_size(self, replicas: int) -> int:
        """Samples the next step consumes over all replicas (``replicas * batch_size`` except at an epoch's end)."""
        return self.window(replicas).size

    def permutation(self, epoch: int) -> list[int]:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, epoch_permutation(self.dataset_len, self.seed, epoch, self.shuffle))
        return self._cache[1]

    def indices(self, replica: int, replicas: int) -> list[int]:
        """Dataset indices replica ``replica`` of ``replicas`` reads in the next step (possibly fewer than
        ``batch_size``, or none, in an epoch's last step)."""
        w = self.window(replicas)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
            raise ValueError(f"replica must be in [0, {replicas}), got {replica!r}")
        lo = min(w.start + replica * self.batch_size, w.stop)
        hi = min(lo + self.batch_size, w.stop)
        return self.permutation(w.epoch)[lo:hi]

    def step_indices(self, replicas: int) -> list[list[int]]:
        """The next step's indices of every replica, in replica order."""
        return [self.indices(r, replicas) for r in range(replicas)]

    def advance(self, replicas: int) -> Window:
        """Record that the step with ``replicas`` replicas is done; return the window it consumed."""
        w = self.window(replicas)
        self._epoch, self._position = w.epoch, w.stop
        if self._position == self.dataset_len:  # the epoch is complete: the cursor moves to the next one now
            self._epoch, self._position = self._epoch + 1, 0
        return w

    def steps_left_in_epoch(self, replicas: int) -> int:
        """Steps with ``replicas`` replicas until the current epoch is exhausted."""
        self._check_replicas(replicas)
        remaining = self.dataset_len - self._position
        want = replicas * self.batch_size
        return remaining // want if self.drop_last else -(-remaining // want)

    # -- state ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int | bool]:
        """Everything needed to continue exactly here (plain ints and bools: safe for ``weights_only`` loads)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``.  The dataset, seed and shuffle flag must match (they define the sample order);
        the batch size and the number of replicas may differ from the run that saved it."""
        missing = [k for k in ("epoch", "position", "seed", "dataset_len", "shuffle") if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing[0]!r}: {dict(state)!r}")
        for key, mine in (("dataset_len", self.dataset_len), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {key}={mine!r}")
        epoch = _non_negative("epoch", state["epoch"])
        position = _non_negative("position", state["position"])
        if position > self.dataset_len:
            raise ValueError(f"sampler position {position} is beyond the dataset of {self.dataset_len} samples")
        self._epoch, self._position = epoch, position
