"""LB-BSP Alg. 1: batch sizes of CPU workers in proportion to their predicted speeds (pure; numpy only).

LB-BSP §3.2.  A CPU worker's computation time is linear in its batch, t ≈ x / v (§3.2.1), so the best split of X
is x_i = v_i / Σ v_j · X; v_i must be *predicted* for the coming iteration because the worker's share of a shared
machine changes (§3.2.2).  Each call of :func:`alg1_step` is CPU_UpdateBatchSize(k):

- line 5: v_i^{k-1} = x_i^{k-1} / t_i^{k-1} from each worker's report;
- line 6: v_i^k predicted from the look-back of speed, CPU and memory usage (Eq. 4) by a per-worker NARX model
  (:mod:`hpc_elastic.balance.narx`); during the first ``warmup`` iterations (500, §4 "Online NARX Training") by the
  exponential moving average of the speed instead;
- lines 7-9: X = Σ x_i^{k-1}, x_i^k = v_i^k / Σ v_j^k · X rounded to integers with Σ x_i^k = X (largest remainder,
  :func:`hpc_elastic.balance.apportion.apportion`).

:func:`replay` runs the three predictors of §5.4 (last value, EMA, NARX) over a recorded series, the same code
path as :func:`alg1_step`, for comparing their RMSE.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from hpc_elastic.balance import narx
from hpc_elastic.balance.apportion import apportion, check_caps


class Method(StrEnum):
    """How a speed was predicted (§5.4, Table 3)."""

    LAST = "last-value"  # "memoryless": the last iteration's speed
    EMA = "ema"
    NARX = "narx"


@dataclass(frozen=True)
class Alg1Config:
    """Warm-up length, EMA smoothing (α = 0.2 as in §5.4), the NARX model, and the training window kept."""

    warmup: int = 500
    ema_alpha: float = 0.2
    window: int = 500
    model: narx.NarxConfig = field(default_factory=narx.NarxConfig)

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha!r}")
        if self.window < self.model.lookback + 2:
            raise ValueError(f"window {self.window} is too short for look-back {self.model.lookback}")


@dataclass(frozen=True)
class CpuReading:
    """Worker i at the start of iteration k: x_i^{k-1}, t_i^{k-1} (None at k = 0), c_i^k and m_i^k in [0, 1]."""

    samples: int
    seconds: float | None
    cpu: float
    mem: float

    def __post_init__(self) -> None:
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"batch processing time must be finite and > 0, got {self.seconds!r}")
        for name in ("cpu", "mem"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"{name} usage must be a fraction in [0, 1], got {value!r}")

    @property
    def speed(self) -> float | None:
        """Line 5: v^{k-1} = x^{k-1} / t^{k-1}."""
        return None if self.seconds is None else self.samples / self.seconds


@dataclass(frozen=True, eq=False)
class SpeedPredictor:
    """One worker's series (speeds v^0..v^{k-1}, readings c^0..c^k, m^0..m^k; the last ``window`` + look-back
    kept), its EMA, its NARX model once trained, and how many speeds it has seen."""

    speeds: tuple[float, ...] = ()
    cpus: tuple[float, ...] = ()
    mems: tuple[float, ...] = ()
    ema: float | None = None
    model: narx.Narx | None = None
    seen: int = 0

    def observe(self, speed: float | None, cpu: float, mem: float, cfg: Alg1Config) -> SpeedPredictor:
        """Add v^{k-1} (None at k = 0) and c^k, m^k; fit the NARX model at the end of the warm-up, then keep
        training it online."""
        keep = cfg.window + cfg.model.lookback + 1
        speeds, ema, seen = self.speeds, self.ema, self.seen
        if speed is not None:
            if not (math.isfinite(speed) and speed > 0):
                raise ValueError(f"speed must be finite and > 0, got {speed!r}")
            speeds = (*speeds, speed)[-keep:]
            ema = speed if ema is None else cfg.ema_alpha * speed + (1 - cfg.ema_alpha) * ema
            seen += 1
        new = replace(
            self,
            speeds=speeds,
            cpus=(*self.cpus, cpu)[-(keep + 1) :],
            mems=(*self.mems, mem)[-(keep + 1) :],
            ema=ema,
            seen=seen,
        )
        if speed is None or seen < cfg.warmup or len(speeds) < cfg.model.lookback + 2:
            return new
        x, y = narx.design(*new._arrays(), cfg.model.lookback)
        if new.model is None:
            return replace(new, model=narx.fit(x, y, cfg.model))
        return replace(new, model=narx.update(new.model, x, y, cfg.model))

    def _arrays(self) -> tuple[narx.Array, narx.Array, narx.Array]:
        n = len(self.speeds)  # c and m have one reading more (c^k, m^k of the iteration to predict)
        return np.array(self.speeds), np.array(self.cpus[-(n + 1) : -1]), np.array(self.mems[-(n + 1) : -1])

    def predict(self, method: Method | None = None) -> tuple[float, Method]:
        """v^k by ``method`` (default: NARX once trained, else EMA — line 6 with §4's warm-up)."""
        if not self.speeds or self.ema is None:
            raise ValueError("no speed observed yet")
        chosen = method if method is not None else (Method.NARX if self.model is not None else Method.EMA)
        if chosen is Method.LAST:
            return self.speeds[-1], chosen
        if chosen is Method.EMA:
            return self.ema, chosen
        if self.model is None:
            raise ValueError("the NARX model is not trained yet")
        d = self.model.lookback
        z = narx.features(
            np.array(self.speeds[-d:]), np.array(self.cpus[-(d + 1) :]), np.array(self.mems[-(d + 1) :]), d, d
        )
        # a trained model may extrapolate below zero on inputs never seen: a speed is positive
        return max(float(self.model.predict(z)[0]), 1e-3 * min(self.speeds)), chosen


@dataclass(frozen=True, eq=False)
class Alg1State:
    """Batch sizes x_i^{k-1}, memory caps (None: no cap) and one predictor per worker."""

    sizes: tuple[int, ...]
    caps: tuple[int | None, ...]
    predictors: tuple[SpeedPredictor, ...]

    def __post_init__(self) -> None:
        check_caps(self.caps, len(self.sizes))
        if len(self.predictors) != len(self.sizes):
            raise ValueError(f"expected {len(self.sizes)} predictors, got {len(self.predictors)}")

    @classmethod
    def initial(cls, total: int, caps: Sequence[int | None]) -> Alg1State:
        sizes = apportion([1.0] * len(caps), total, caps)
        return cls(sizes, tuple(caps), tuple(SpeedPredictor() for _ in caps))

    @property
    def total(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class Alg1Decision:
    """x^k and the speeds v^k it was made from (and how each was predicted)."""

    sizes: tuple[int, ...]
    speeds: tuple[float, ...]
    methods: tuple[Method, ...]


def alg1_step(
    state: Alg1State, readings: Sequence[CpuReading], config: Alg1Config | None = None
) -> tuple[Alg1State, Alg1Decision]:
    """CPU_UpdateBatchSize(k) (Alg. 1).  At k = 0 (no times yet) the sizes are kept."""
    cfg = config if config is not None else Alg1Config()
    n = len(state.sizes)
    if len(readings) != n:
        raise ValueError(f"expected {n} worker readings, got {len(readings)}")
    for r, x in zip(readings, state.sizes, strict=True):
        if r.samples != x:
            raise ValueError(f"a worker reports {r.samples} samples, its batch was {x}")
    predictors = tuple(p.observe(r.speed, r.cpu, r.mem, cfg) for p, r in zip(state.predictors, readings, strict=True))
    new = replace(state, predictors=predictors)
    if any(r.seconds is None for r in readings):
        return new, Alg1Decision(state.sizes, (), ())
    predicted = [p.predict() for p in predictors]
    speeds = tuple(v for v, _ in predicted)
    sizes = apportion(speeds, state.total, state.caps)  # lines 7-9
    return replace(new, sizes=sizes), Alg1Decision(sizes, speeds, tuple(m for _, m in predicted))


def replay(
    speeds: Sequence[float], cpus: Sequence[float], mems: Sequence[float], config: Alg1Config | None = None
) -> dict[Method, narx.Array]:
    """Predictions of v^k for k = 1..len-1 by each method, fed the series as Alg. 1 would be (v^{k-1}, c^k, m^k).

    NARX has no prediction during the warm-up: its entries there are NaN.
    """
    cfg = config if config is not None else Alg1Config()
    if not len(speeds) == len(cpus) == len(mems):
        raise ValueError(f"series of different lengths: {len(speeds)}, {len(cpus)}, {len(mems)}")
    out = {m: np.full(len(speeds), np.nan) for m in Method}
    p = SpeedPredictor().observe(None, cpus[0], mems[0], cfg)
    for k in range(1, len(speeds)):
        p = p.observe(speeds[k - 1], cpus[k], mems[k], cfg)
        for m in Method:
            if m is not Method.NARX or p.model is not None:
                out[m][k] = p.predict(m)[0]
    return out


def rmse(predicted: narx.Array, actual: Sequence[float], start: int) -> float:
    """Root-mean-square error of ``predicted`` against ``actual`` from index ``start`` on."""
    a = np.asarray(actual, dtype=np.float64)[start:]
    p = predicted[start:]
    if np.isnan(p).any():
        raise ValueError(f"no prediction for some iterations after {start}")
    return float(np.sqrt(np.mean((p - a) ** 2)))
