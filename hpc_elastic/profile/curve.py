"""The batch-size → step-time curve Γ(x) (pure; no torch).

LB-BSP §3.1, problem (3), writes a worker's computation time as t^p = Γ(x), x its batch size. §3.2.1(2)
finds Γ linear on CPU workers, Γ(x) = x/v with v the sample processing speed; §3.3.1 finds on GPUs a
non-negligible launch overhead Γ(0) > 0 (item 2), a saturation effect Γ(x) = C for all x < x^s (item 3),
and a monotonically increasing Γ (end of §3.3.1). :func:`fit_gamma` fits the smallest model with all three
features to measured points, a hinge::

    Γ(x) = C                    for x <= x^s
    Γ(x) = C + b·(x - x^s)      for x >  x^s,    b >= 0

by weighted least squares with weights 1/t² (relative errors, since step times span orders of magnitude
across batch sizes), trying each measured batch size as the breakpoint x^s. A breakpoint at the smallest
measured batch is the plain line Γ(x) = a + b·x of §3.2.1; a later one is taken only when it fits better
than every earlier breakpoint by more than the stated noise level, so that noise alone does not invent a
saturation point. Γ(0) is then C when a flat region was found and the line's intercept (clamped at 0)
otherwise; 1/b is the marginal sample speed v.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_NOISE = 0.05


@dataclass(frozen=True)
class RepeatSummary:
    """Median of repeated step-time measurements and their spread."""

    median_s: float
    min_s: float
    max_s: float

    @property
    def relative_spread(self) -> float:
        """(max - min) / median."""
        return (self.max_s - self.min_s) / self.median_s


def summarize_repeats(step_times_s: Sequence[float]) -> RepeatSummary:
    """Median and range of per-repeat step times (each repeat's mean step time, warm-up excluded)."""
    if not step_times_s:
        raise ValueError("at least one repeat is needed, got none")
    for value in step_times_s:
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"step times must be positive finite seconds, got {value!r}")
    return RepeatSummary(statistics.median(step_times_s), min(step_times_s), max(step_times_s))


@dataclass(frozen=True)
class GammaFit:
    """Fitted Γ(x) (LB-BSP §3.3.1): launch overhead Γ(0), flat level C up to x^s, slope b after it."""

    launch_overhead_s: float
    flat_time_s: float  # C: Γ at the knee x^s (the line's intercept a when there is no flat region)
    per_sample_s: float
    saturation_batch: int | None
    rms_relative_error: float

    def predict(self, batch_size: float) -> float:
        """Γ(x) of the fitted hinge, floored at 0; x = 0 gives the launch overhead Γ(0)."""
        if not batch_size >= 0:
            raise ValueError(f"batch size must be non-negative, got {batch_size!r}")
        knee = 0.0 if self.saturation_batch is None else float(self.saturation_batch)
        return max(0.0, self.flat_time_s + self.per_sample_s * max(0.0, batch_size - knee))


def _checked_points(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    checked: list[tuple[int, float]] = []
    seen: set[int] = set()
    for batch, seconds in points:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch sizes must be positive integers, got {batch!r}")
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step times must be positive finite seconds, got {seconds!r} at batch {batch}")
        if batch in seen:
            raise ValueError(f"batch size {batch} appears twice in the Γ(x) points")
        seen.add(batch)
        checked.append((batch, float(seconds)))
    if len(checked) < 2:
        raise ValueError(f"fitting Γ(x) needs at least two distinct batch sizes, got {len(checked)}")
    return sorted(checked)


def _weighted_fit(features: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Weighted LS of t ≈ c + b·z with w = 1/t² and b >= 0; returns (c, b, weighted SSE)."""
    weights = [1.0 / (t * t) for t in times]
    sw = sum(weights)
    sz = sum(w * z for w, z in zip(weights, features, strict=True))
    st = sum(w * t for w, t in zip(weights, times, strict=True))
    szz = sum(w * z * z for w, z in zip(weights, features, strict=True))
    szt = sum(w * z * t for w, z, t in zip(weights, features, times, strict=True))
    det = sw * szz - sz * sz
    slope = (sw * szt - sz * st) / det if det > 0 else 0.0
    if slope < 0:
        slope = 0.0
    intercept = (st - slope * sz) / sw
    sse = sum(w * (t - intercept - slope * z) ** 2 for w, z, t in zip(weights, features, times, strict=True))
    return intercept, slope, sse


def fit_gamma(points: Sequence[tuple[int, float]], noise: float = DEFAULT_NOISE) -> GammaFit:
    """Fit the hinge Γ(x) to ``(batch_size, step_time_s)`` points (see the module docstring).

    ``noise`` is the relative measurement noise (0.05 = 5 %) below which a later breakpoint does not count
    as a better fit.
    """
    if not (isinstance(noise, int | float) and math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a non-negative relative level, got {noise!r}")
    checked = _checked_points(points)
    batches = [float(b) for b, _ in checked]
    times = [t for _, t in checked]
    candidates: list[tuple[float, float, float, float]] = []  # (knee, c, b, sse)
    for knee in batches[:-1]:
        features = [max(0.0, x - knee) for x in batches]
        c, b, sse = _weighted_fit(features, times)
        candidates.append((knee, c, b, sse))
    # Parsimony: start from the plain line (knee at the smallest batch) and move the knee right only when
    # that lowers the weighted SSE by more than the noise allows for the points involved.
    margin = len(checked) * noise * noise
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate[3] + margin < best[3]:
            best = candidate
    knee, c, b, sse = best
    rms = math.sqrt(sse / len(checked))
    if knee == batches[0]:
        # No flat region within the measured range: the line Γ(x) = a + b·x of §3.2.1, a = c - b·x_min.
        a = c - b * knee
        return GammaFit(max(0.0, a), a, b, None, rms)
    return GammaFit(max(0.0, c), c, b, int(knee), rms)


def monotone_violations(points: Sequence[tuple[int, float]], relative_tolerance: float) -> list[tuple[int, int]]:
    """Pairs of consecutive batch sizes where Γ drops by more than ``relative_tolerance`` (LB-BSP §3.3.1).

    Γ is monotonically increasing in x; measured points may dip within noise. A pair (x_i, x_j), x_i < x_j,
    violates when Γ(x_j) < (1 - tolerance)·Γ(x_i).
    """
    if not (isinstance(relative_tolerance, int | float) and 0 <= relative_tolerance < 1):
        raise ValueError(f"relative_tolerance must be in [0, 1), got {relative_tolerance!r}")
    if len(points) < 2:
        return []
    violations: list[tuple[int, int]] = []
    for (x_i, t_i), (x_j, t_j) in itertools.pairwise(_checked_points(points)):
        if t_j < (1.0 - relative_tolerance) * t_i:
            violations.append((x_i, x_j))
    return violations
