"""Skew of a model's tensor-size distribution (pure; no torch).

Tiresias §3.3 ("How important is consolidation?") finds that a model's sensitivity to consolidated placement
is predicted by the skew S_J of its tensor sizes across parameter servers: each tensor is one communication
message, the framework assigns tensors to parameter servers round-robin (TensorFlow's default, §3.3), and
"for the VGG family and AlexNet, the size of each model is dominated by its largest tensor" (Table 6).
Tiresias measures S_J from RDMA traffic; here it is read from the model itself, so two numbers are derived
from the tensor sizes alone:

- :func:`largest_tensor_share`: the largest tensor's share of the model (Table 6's "largest tensor / model"),
- :func:`shard_skew`: the load skew across K parameter-server shards under round-robin assignment of the
  tensors in model order, ``max shard bytes / mean shard bytes`` (1.0 = perfectly balanced, K = worst).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEFAULT_SHARD_COUNTS: tuple[int, ...] = (2, 4, 8)


def _checked_sizes(sizes: Iterable[int]) -> list[int]:
    checked: list[int] = []
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"tensor sizes must be non-negative integers, got {size!r}")
        checked.append(size)
    if not checked or sum(checked) == 0:
        raise ValueError(f"a model needs at least one non-empty tensor to have a skew, got sizes {checked!r}")
    return checked


def _checked_shards(shards: int) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"the number of parameter-server shards must be a positive integer, got {shards!r}")
    return shards


def largest_tensor_share(sizes: Iterable[int]) -> float:
    """Largest tensor's share of the whole model, in [1/n, 1] (Tiresias §3.3, Table 6)."""
    checked = _checked_sizes(sizes)
    return max(checked) / sum(checked)


def round_robin_shards(sizes: Iterable[int], shards: int) -> list[int]:
    """Total size per parameter-server shard when tensor i goes to shard i mod K (Tiresias §3.3)."""
    checked = _checked_sizes(sizes)
    loads = [0] * _checked_shards(shards)
    for index, size in enumerate(checked):
        loads[index % len(loads)] += size
    return loads


def shard_skew(sizes: Iterable[int], shards: int) -> float:
    """Load skew S_J across K shards under round-robin tensor assignment: max shard / mean shard.

    The mean is over all K shards (total / K), so a shard left empty because the model has fewer than K
    tensors still counts: a 1-tensor model on K shards has skew K.
    """
    loads = round_robin_shards(sizes, shards)
    return max(loads) * len(loads) / sum(loads)


def shard_skews(sizes: Sequence[int], shard_counts: Iterable[int] = DEFAULT_SHARD_COUNTS) -> dict[int, float]:
    """:func:`shard_skew` for each K in ``shard_counts`` (each K once, in the order given)."""
    result: dict[int, float] = {}
    for shards in shard_counts:
        result[_checked_shards(shards)] = shard_skew(sizes, shards)
    if not result:
        raise ValueError("at least one parameter-server shard count is needed, got none")
    return result
