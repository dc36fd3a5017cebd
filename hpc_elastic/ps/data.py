"""A synthetic Criteo-like click dataset, generated locally from a seed: 13 dense and 26 categorical features and a
click label with a learnable signal, as a pure function of the sample id (any worker reads any record range
without a file), and the stable hash that partitions ids over parameter servers.

Record ``i``: dense feature ``j`` is a uniform value in [-1, 1) from the hash of ``(seed, i, j)``; categorical
feature ``j`` takes value ``v`` in ``[0, vocab)`` with a skew toward small values (``floor(u² · vocab)``), and its
global id (the embedding row) is ``j · vocab + v``. The label is 1 with probability ``sigmoid(w·dense + Σ_j
e[j, v_j] + b)``, where ``w`` and the per-category effects ``e`` are drawn once from ``seed``: a model with an
embedding per category and a dense layer can learn it, so the loss falls well below the label entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

NUM_DENSE = 13
NUM_SPARSE = 26

U64 = npt.NDArray[np.uint64]
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: U64) -> U64:
    """splitmix64's finalizer: a stable, well-spread 64-bit hash of each element."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def owner(ids: npt.NDArray[np.int64], num_ps: int) -> npt.NDArray[np.int64]:
    """The parameter server (0 .. num_ps-1) that owns each embedding row id: a stable hash, the same in every
    process and run."""
    return (mix64(ids.astype(np.uint64)) % np.uint64(num_ps)).astype(np.int64)


def _uniform(seed: int, ids: npt.NDArray[np.int64], width: int, salt: int) -> npt.NDArray[np.float64]:
    """Uniform [0, 1) values, ``(len(ids), width)``, a function of (seed, salt, id, column)."""
    base = mix64(np.uint64(seed) * np.uint64(1_000_003) + np.uint64(salt) + ids.astype(np.uint64) * np.uint64(64))
    cols = np.arange(width, dtype=np.uint64)
    bits = mix64(base[:, None] + cols[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass(frozen=True)
class CriteoSpec:
    num_samples: int
    vocab: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_samples", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, not {self.seed!r}")

    @property
    def num_ids(self) -> int:
        """Embedding rows in all: one per (categorical feature, value)."""
        return NUM_SPARSE * self.vocab


@dataclass(frozen=True)
class Batch:
    dense: npt.NDArray[np.float32]  # (n, 13)
    ids: npt.NDArray[np.int64]  # (n, 26) global embedding row ids
    label: npt.NDArray[np.float32]  # (n,)


class CriteoLike:
    """The records of a :class:`CriteoSpec`."""

    def __init__(self, spec: CriteoSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        self._w = rng.normal(0.0, 1.0, NUM_DENSE)
        self._effect = rng.normal(0.0, 0.6, (NUM_SPARSE, spec.vocab))
        self._bias = -0.3

    def _check(self, sample_ids: npt.NDArray[np.int64]) -> None:
        n = self.spec.num_samples
        if sample_ids.size and (sample_ids.min() < 0 or sample_ids.max() >= n):
            raise ValueError(f"sample ids outside [0, {n})")

    def _features(self, sample_ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        s = self.spec
        self._check(sample_ids)
        dense = _uniform(s.seed, sample_ids, NUM_DENSE, 1) * 2.0 - 1.0
        values = np.minimum((_uniform(s.seed, sample_ids, NUM_SPARSE, 2) ** 2 * s.vocab).astype(np.int64), s.vocab - 1)
        return dense, values

    def true_logits(self, sample_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """The logits the labels are drawn from: the best any model can do."""
        dense, values = self._features(sample_ids)
        return np.asarray(
            dense @ self._w + self._effect[np.arange(NUM_SPARSE)[None, :], values].sum(axis=1) + self._bias
        )

    def batch(self, sample_ids: npt.NDArray[np.int64]) -> Batch:
        dense, values = self._features(sample_ids)
        logit = self.true_logits(sample_ids)
        u = _uniform(self.spec.seed, sample_ids, 1, 3)[:, 0]
        label = (u < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        ids = values + np.arange(NUM_SPARSE, dtype=np.int64)[None, :] * self.spec.vocab
        return Batch(dense.astype(np.float32), ids, label)

    def records(self, start: int, end: int) -> Batch:
        return self.batch(np.arange(start, end, dtype=np.int64))


def label_entropy(batch: Batch) -> float:
    """The log loss of always predicting the mean click rate: what a model must beat to have learned anything."""
    p = float(np.clip(batch.label.mean(), 1e-6, 1 - 1e-6))
    return float(-(p * np.log(p) + (1 - p) * np.log(1 - p)))
