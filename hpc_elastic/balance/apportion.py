"""Integer batch sizes that add up to X exactly (pure; numpy only).

LB-BSP §3.1, problem (3): the worker batch sizes x_i must keep Σ x_i = X, the global batch of BSP.  Alg. 1 line 9
"round x_i^k to integers with Σ x_i^k = X": :func:`apportion` does it by the largest-remainder method, under an
optional per-worker cap (the memory limit x^o of §3.3.1(4)) by water-filling first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_caps(caps: Sequence[int | None], n: int) -> tuple[int | None, ...]:
    """``caps`` as a tuple of n positive integers or None (no cap); ValueError naming a bad one."""
    if len(caps) != n:
        raise ValueError(f"expected {n} memory caps, got {len(caps)}")
    for cap in caps:
        if cap is not None:
            _positive_int("memory cap", cap)
    return tuple(caps)


def apportion(weights: Sequence[float], total: int, caps: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """Non-negative integers proportional to ``weights`` with sum exactly ``total``, none above its cap.

    Shares are ``total · w_i / Σ w`` (Alg. 1 line 8); a share above its cap is fixed at the cap and the rest is
    shared again among the others (water-filling).  The floors of the shares are then topped up by one, in order
    of decreasing remainder (ties: lower index first), until the sum is ``total`` (line 9).  A worker whose share
    is exactly its cap has remainder 0 and is never topped up above it.
    """
    n = len(weights)
    if n == 0:
        raise ValueError("apportion needs at least one weight")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be a non-negative integer, got {total!r}")
    for w in weights:
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"weights must be finite and >= 0, got {w!r}")
    limits = check_caps(caps if caps is not None else [None] * n, n)
    room = sum(c for c in limits if c is not None) if all(c is not None for c in limits) else None
    if room is not None and room < total:
        raise ValueError(f"memory caps {list(limits)} hold only {room} samples, fewer than the total {total}")
    cap = [math.inf if c is None else float(c) for c in limits]
    shares = [0.0] * n
    fixed: set[int] = set()
    raw: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        if not free:
            raw = {}
            break
        left = total - sum(cap[i] for i in fixed)
        weight = sum(weights[i] for i in free)
        # with no weight left, what remains is shared equally among the uncapped
        raw = {i: left * weights[i] / weight if weight > 0 else left / len(free) for i in free}
        over = [i for i in free if raw[i] > cap[i]]
        if not over:
            break
        fixed.update(over)
    for i in fixed:
        shares[i] = cap[i]
    for i, share in raw.items():
        shares[i] = share
    floors = [int(min(math.floor(s), cap[i])) for i, s in enumerate(shares)]
    missing = total - sum(floors)
    order = sorted(range(n), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order:
        if missing == 0:
            break
        if floors[i] < cap[i]:
            floors[i] += 1
            missing -= 1
    if missing != 0:
        raise ValueError(f"cannot apportion {total} samples under caps {list(limits)}")
    return tuple(floors)
