"""Memory limit x^o by search over a "does batch x fit" predicate (pure; no torch).

LB-BSP §3.3.1(4): "the GPU memory size imposes a limit x^o on the maximum batch size", which any batch-size
adjustment must respect to avoid out-of-memory errors (Alg. 2 keeps workers short of memory from growing).
Here x^o is the largest batch size x for which ``fits(x)`` is true, assuming ``fits`` is monotone (if x fits,
every smaller batch fits). :func:`find_memory_limit` doubles x until a probe fails (or ``max_batch`` is
reached), then bisects between the last batch that fitted and the first that did not.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class MemorySearch:
    """Outcome of :func:`find_memory_limit`.

    ``limit`` is x^o, or None when not even the smallest batch fits. ``capped`` is True when ``max_batch``
    itself fitted, so the true x^o is at least ``limit``. Otherwise ``first_failing`` is the smallest batch
    seen not to fit, so x^o lies in [limit, first_failing). ``probes`` lists each ``(batch, fitted)`` in order.
    """

    limit: int | None
    capped: bool
    max_batch: int
    first_failing: int | None
    probes: tuple[tuple[int, bool], ...]


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def find_memory_limit(
    fits: Callable[[int], bool], max_batch: int, start: int = 1, resolution: float = 0.0
) -> MemorySearch:
    """Largest batch size in [1, max_batch] for which ``fits`` holds (doubling, then bisection).

    Each batch size is probed at most once; the number of probes is about 2·log2(x^o / start). With
    ``resolution`` r > 0 the bisection stops once the bracket [fits, fails) is narrower than r·(fitting batch),
    which is all a noisy measurement can tell apart; r = 0 finds the exact boundary.
    """
    _positive_int("max_batch", max_batch)
    _positive_int("start", start)
    if start > max_batch:
        raise ValueError(f"start batch {start} is larger than max_batch {max_batch}")
    if not (isinstance(resolution, int | float) and 0 <= resolution < 1):
        raise ValueError(f"resolution must be in [0, 1), got {resolution!r}")
    probes: list[tuple[int, bool]] = []

    def probe(batch: int) -> bool:
        fitted = bool(fits(batch))
        probes.append((batch, fitted))
        return fitted

    low = 0  # largest batch known to fit (0: none yet)
    high: int | None = None  # smallest batch known not to fit
    batch = start
    while True:
        if probe(batch):
            low = batch
            if batch == max_batch:
                return MemorySearch(low, capped=True, max_batch=max_batch, first_failing=None, probes=tuple(probes))
            batch = min(batch * 2, max_batch)
        else:
            high = batch
            break
    while high - low > max(1, int(low * resolution)):
        middle = (low + high) // 2
        if probe(middle):
            low = middle
        else:
            high = middle
    return MemorySearch(low or None, capped=False, max_batch=max_batch, first_failing=high, probes=tuple(probes))


def parse_size(text: str) -> int:
    """Bytes in a size such as ``2GiB``, ``512M``, ``1.5G``, ``4000000000`` or ``4GB``.

    K/M/G/T alone or with ``iB`` are binary (as in Slurm's ``--mem``); ``KB``/``MB``/``GB``/``TB`` are decimal.
    """
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not a memory size (try 2GiB, 512M or a number of bytes): {text!r}")
    number, prefix, suffix = match.group(1), match.group(2).lower(), match.group(3).lower()
    if suffix == "i":
        raise ValueError(f"not a memory size (try 2GiB, 512M or a number of bytes): {text!r}")
    scale = _DECIMAL[prefix] if suffix == "b" and prefix else _BINARY[prefix]
    value = float(number) * scale
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"a memory size must be at least 1 byte, got {text!r}")
    return int(value)


def format_size(num_bytes: int | float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
