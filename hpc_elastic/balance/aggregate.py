"""Weighted gradient aggregation, LB-BSP §3.4 (pure; numpy only).

With batch sizes x_i (Σ x_i = X) and per-worker mean gradients g_i, the plain BSP average (1/n) Σ g_i (Eq. 5) weighs
a sample of worker i by 1/(n·x_i) (Eq. 6), biased towards small batches.  LB-BSP's worker i pushes
ḡ_i = (n·x_i / X) · g_i (Alg. 3, Worker line 8) and the average (1/n) Σ ḡ_i = (1/X) Σ x_i g_i (Eq. 7) weighs every
sample by 1/X: the full-batch mean gradient.  So the reducers need no change: each worker scales its gradient by
:func:`aggregation_factor` before the usual mean allreduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

UNIT_ROUNDOFF = float(np.finfo(np.float64).eps) / 2  # u = 2^-53


def _sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    if not sizes:
        raise ValueError("no batch sizes")
    for x in sizes:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"batch sizes must be positive integers, got {list(sizes)}")
    return tuple(sizes)


def aggregation_factor(sizes: Sequence[int], worker: int) -> float:
    """n·x_i / X for ``worker`` i (Alg. 3, Worker line 8; Eq. 7)."""
    xs = _sizes(sizes)
    if not 0 <= worker < len(xs):
        raise ValueError(f"worker {worker} is not one of {len(xs)}")
    return len(xs) * xs[worker] / sum(xs)


def aggregation_factors(sizes: Sequence[int]) -> tuple[float, ...]:
    """n·x_i / X for every worker; they average to 1."""
    return tuple(aggregation_factor(sizes, i) for i in range(len(_sizes(sizes))))


def weighted_mean(sizes: Sequence[int], worker_means: Sequence[NDArray[np.float64]]) -> NDArray[np.float64]:
    """(1/n) Σ (n·x_i/X) g_i in float64 (Alg. 3, Parameter Server line 3): the reference for a reducer's result."""
    factors = aggregation_factors(sizes)
    if len(worker_means) != len(factors):
        raise ValueError(f"expected {len(factors)} worker gradients, got {len(worker_means)}")
    total = np.zeros_like(np.asarray(worker_means[0], dtype=np.float64))
    for f, g in zip(factors, worker_means, strict=True):
        total = total + f * np.asarray(g, dtype=np.float64)
    return total / len(factors)


def float64_bound(sizes: Sequence[int], abs_mean: NDArray[np.float64]) -> NDArray[np.float64]:
    """Elementwise bound on |weighted aggregate - full-batch mean| when both are computed in float64.

    ``abs_mean`` is (1/X) Σ_s |∇l(s)|, elementwise.  The full-batch mean is a sum of X terms; the weighted aggregate
    sums x_i terms per worker, scales (two roundings for n·x_i/X, one for the product, one for 1/x_i), sums n
    terms and divides by n.  Recursive summation of m terms errs by at most (m - 1)·u·Σ|terms| (+O(u²)), so the
    two results lie within (X + x_max + n + 8)·u·Σ|terms| of the exact mean each; the bound is twice that sum
    (a factor 2 over the first-order term covers the O(u²) rest by far).
    """
    xs = _sizes(sizes)
    gamma = (sum(xs) + max(xs) + len(xs) + 8) * UNIT_ROUNDOFF
    return 2.0 * 2.0 * gamma * np.asarray(abs_mean, dtype=np.float64)
