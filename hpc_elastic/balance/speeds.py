"""Observed computing capability per device type, from the processes' EST timings (pure).

EasyScale §3.4 plans with ``C_i``, the mini-batches per second one GPU of type ``i`` gives this job (one EST's
mini-batch takes ``1 / C_i`` seconds there: :mod:`hpc_elastic.policy.easyscale`), and its companion corrects the
profile's estimate with what the running job observes (:func:`hpc_elastic.policy.easyscale.correct_capability`).
The runtime times each process's ESTs at every global step (data, forward, backward; not the wait in the
allreduce: LB-BSP §4's batch processing time), so a process running ``a`` ESTs in ``t`` seconds per step
observes ``a / t`` mini-batches per second on its device. :func:`capability_by_type` is the mean of that over the
processes of each type: the observed ``C_i`` the job reports to the scheduler in its progress record
(:class:`hpc_elastic.jobdir.Progress`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: at most this many device types in one report (a job spans a few types; the daemon reads the report)
MAX_TYPES = 16
#: the longest device type name accepted
MAX_TYPE_NAME = 64
#: the range of a reported rate (EST mini-batches per second per device): a microsecond's step to one in eleven
#: days, so that ratios and sums of rates stay finite in the planners
MIN_RATE, MAX_RATE = 1e-6, 1e6


@dataclass(frozen=True)
class ProcessReading:
    """One process over a window of steps: its device type, its ESTs and their mean time per step in seconds."""

    device_type: str
    ests: int
    seconds: float

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str) or not 0 < len(self.device_type) <= MAX_TYPE_NAME:
            raise ValueError(f"device type must be a name of 1-{MAX_TYPE_NAME} characters, got {self.device_type!r}")
        if isinstance(self.ests, bool) or not isinstance(self.ests, int) or self.ests < 0:
            raise ValueError(f"ESTs must be an integer >= 0, got {self.ests!r}")
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"time per step must be finite and >= 0, got {self.seconds!r}")


def capability_by_type(readings: Sequence[ProcessReading]) -> tuple[tuple[str, float], ...]:
    """The observed ``C_i`` of each device type (mini-batches per second per device: the mean over its processes
    of ESTs / seconds per step), sorted by type. Processes without ESTs or without a measurable time say nothing
    about their device and are left out; so is a type left with none."""
    rates: dict[str, list[float]] = {}
    for r in readings:
        if r.ests > 0 and r.seconds > 0:
            rates.setdefault(r.device_type, []).append(r.ests / r.seconds)
    return tuple((t, math.fsum(v) / len(v)) for t, v in sorted(rates.items()))


def check_capability(pairs: object, what: str = "capability") -> tuple[tuple[str, float], ...]:
    """``pairs`` as a sorted tuple of (device type, rate in [:data:`MIN_RATE`, :data:`MAX_RATE`]) with distinct
    short names and at most :data:`MAX_TYPES` of them; ``ValueError`` naming what is wrong otherwise (the daemon
    reads it from a job)."""
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"{what} must be a list of [type, rate] pairs, got {pairs!r}")
    if len(pairs) > MAX_TYPES:
        raise ValueError(f"{what} has {len(pairs)} device types, at most {MAX_TYPES}")
    out: list[tuple[str, float]] = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"{what} entry must be a [type, rate] pair, got {pair!r}")
        name, rate = pair
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TYPE_NAME:
            raise ValueError(f"{what} device type must be a name of 1-{MAX_TYPE_NAME} characters, got {name!r}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not MIN_RATE <= rate <= MAX_RATE:
            raise ValueError(f"{what} of {name} must be a number in [{MIN_RATE:g}, {MAX_RATE:g}], got {rate!r}")
        out.append((name, float(rate)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names a device type twice: {names}")
    return tuple(sorted(out))
