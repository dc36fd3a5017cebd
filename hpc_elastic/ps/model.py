"""The parameters of Wide & Deep on the Criteo-like data, which live on the parameter servers (numpy only; the
forward pass in torch is the worker's, :func:`hpc_elastic.ps.worker.forward`).

The sparse part is one embedding table with a row per global categorical id: ``dim`` deep-embedding values and one
wide (linear) weight, ``dim + 1`` floats. The dense part is the deep MLP over ``[13 dense features, 26 embeddings]``
and the wide layer over the dense features, as named numpy arrays. :func:`dense_owner` and
:func:`hpc_elastic.ps.data.owner` place every array and every row on a parameter server by a stable hash; initial
values are functions of the seed (and of the row id), so any process can create any part of the model.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hpc_elastic.ps.data import NUM_DENSE, NUM_SPARSE, Batch, mix64

F32 = npt.NDArray[np.float32]
#: the model a ps-mode job trains (its job type's name for the scheduler's DL² policy)
MODEL_NAME = "wide-deep"


@dataclass(frozen=True)
class ModelSpec:
    dim: int = 8
    hidden: tuple[int, ...] = (64, 32)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, not {self.dim!r}")
        if not self.hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden):
            raise ValueError(f"hidden must be positive layer widths, not {self.hidden!r}")

    @property
    def row_width(self) -> int:
        return self.dim + 1


def dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    width = NUM_DENSE + NUM_SPARSE * spec.dim
    for k, h in enumerate(spec.hidden):
        shapes[f"deep.{k}.w"] = (width, h)
        shapes[f"deep.{k}.b"] = (h,)
        width = h
    shapes["deep.out.w"] = (width, 1)
    shapes["deep.out.b"] = (1,)
    shapes["wide.dense"] = (NUM_DENSE, 1)
    shapes["wide.bias"] = (1,)
    return shapes


def dense_owner(name: str, num_ps: int) -> int:
    return zlib.crc32(name.encode()) % num_ps


def init_dense(spec: ModelSpec, names: list[str] | None = None) -> dict[str, F32]:
    """The initial dense arrays (all, or ``names``): uniform ±1/sqrt(fan-in) for weights, zero for biases."""
    out: dict[str, F32] = {}
    for name, shape in dense_shapes(spec).items():
        if names is not None and name not in names:
            continue
        rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
        if len(shape) == 2:
            bound = 1.0 / np.sqrt(shape[0])
            out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, dtype=np.float32)
    return out


def init_rows(spec: ModelSpec, ids: npt.NDArray[np.int64]) -> F32:
    """The initial embedding rows of ``ids``: deep values uniform in ±0.05 from the hash of (seed, id, column), wide
    weight 0."""
    base = mix64(ids.astype(np.uint64) * np.uint64(4099) + np.uint64(spec.seed) * np.uint64(7919))
    bits = mix64(base[:, None] + np.arange(spec.dim, dtype=np.uint64)[None, :])
    u = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    rows = np.zeros((ids.size, spec.row_width), dtype=np.float32)
    rows[:, : spec.dim] = (u * 0.1 - 0.05).astype(np.float32)
    return rows


def logits(spec: ModelSpec, dense: dict[str, F32], rows: F32, x: F32) -> npt.NDArray[np.float64]:
    """Logits ``(n,)`` of Wide & Deep for dense features ``x (n, 13)`` and embedding rows ``(n, 26, dim + 1)``: the
    worker's forward pass (:func:`hpc_elastic.ps.worker.forward`) in numpy, for evaluation."""
    emb, wide_w = rows[..., : spec.dim].astype(np.float64), rows[..., spec.dim].astype(np.float64)
    h = np.concatenate([x.astype(np.float64), emb.reshape(x.shape[0], -1)], axis=1)
    for k in range(len(spec.hidden)):
        h = np.maximum(h @ dense[f"deep.{k}.w"] + dense[f"deep.{k}.b"], 0.0)
    deep = (h @ dense["deep.out.w"] + dense["deep.out.b"])[:, 0]
    wide = (x @ dense["wide.dense"])[:, 0] + wide_w.sum(axis=1) + dense["wide.bias"][0]
    return np.asarray(deep + wide, dtype=np.float64)


def log_loss(spec: ModelSpec, dense: dict[str, F32], ids: npt.NDArray[np.int64], rows: F32, batch: Batch) -> float:
    """The mean binary cross-entropy of the model whose embedding rows ``rows`` are those of ``ids`` (any order) on
    ``batch``."""
    order = np.argsort(ids)
    slots = order[np.searchsorted(ids, batch.ids, sorter=order)]
    z = logits(spec, dense, rows[slots], batch.dense)
    y = batch.label.astype(np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))
