"""The NARX speed model of LB-BSP §3.2.2 (Eq. 4): one hidden layer, trained online (pure numpy, seeded).

v^k = F(v^{k-1}, ..., v^{k-d_v}, c^k, ..., c^{k-d_c}, m^k, ..., m^{k-d_m}) with look-back windows of 2 ("the
look-back window sizes for all the three input series are set to 2, and we include only one hidden layer").  F is
``w2 · tanh(W1 z + b1) + b2 + a · z`` on standardised inputs z (the linear term ``a · z`` is the autoregressive
part a NARX network keeps beside its hidden layer).  :func:`fit` trains it full-batch with Adam and early stopping
on the most recent fifth of the samples (§4 "Online NARX Training": enabled after 500 iterations, early
stopping); :func:`update` takes a few Adam steps on the latest window, which is how it keeps training online.
Everything is deterministic given the seed: no clock, no global random state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]

_BETA1, _BETA2, _EPS = 0.9, 0.999, 1e-8


@dataclass(frozen=True)
class NarxConfig:
    """Shape and training of the model; the defaults are the paper's look-back 2 and one small hidden layer."""

    lookback: int = 2
    hidden: int = 8
    seed: int = 0
    learning_rate: float = 0.01
    max_epochs: int = 1500
    patience: int = 50
    online_steps: int = 2
    weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("lookback", "hidden", "max_epochs", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.online_steps < 0:
            raise ValueError(f"online_steps must be >= 0, got {self.online_steps!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")

    @property
    def inputs(self) -> int:
        """d_v past speeds, then d_c + 1 and d_m + 1 current and past CPU and memory readings (Eq. 4)."""
        return 3 * self.lookback + 2


def features(speeds: Array, cpus: Array, mems: Array, k: int, lookback: int) -> Array:
    """Eq. 4's inputs for predicting v^k: v^{k-1..k-d}, c^{k..k-d}, m^{k..k-d} (k ≥ d)."""
    if k < lookback:
        raise ValueError(f"iteration {k} has fewer than {lookback} past speeds")
    return np.concatenate(
        [speeds[k - lookback : k][::-1], cpus[k - lookback : k + 1][::-1], mems[k - lookback : k + 1][::-1]]
    )


def design(speeds: Array, cpus: Array, mems: Array, lookback: int) -> tuple[Array, Array]:
    """All (inputs, target) pairs of a series: one row per k in [d, len(speeds))."""
    ks = range(lookback, len(speeds))
    if len(ks) == 0:
        return np.zeros((0, 3 * lookback + 2)), np.zeros(0)
    x = np.stack([features(speeds, cpus, mems, k, lookback) for k in ks])
    return x, speeds[lookback:].astype(np.float64)


@dataclass(frozen=True, eq=False)
class Narx:
    """Weights, input/output scaling and Adam moments of one worker's model (arrays are never written in place)."""

    w1: Array
    b1: Array
    w2: Array
    b2: float
    lin: Array
    mean: Array
    scale: Array
    y_mean: float
    y_scale: float
    moments: tuple[Array, ...]  # Adam first and second moments, in the order of _params
    steps: int

    @property
    def lookback(self) -> int:
        """d of Eq. 4 (the model has 3·d + 2 inputs)."""
        return int(self.w1.shape[0] - 2) // 3

    def predict(self, x: Array) -> Array:
        """Predicted speeds for rows of inputs ``x`` (or one row)."""
        z = (np.atleast_2d(x) - self.mean) / self.scale
        return _forward(self, z)[0] * self.y_scale + self.y_mean


def _params(model: Narx) -> tuple[Array, ...]:
    return (model.w1, model.b1, model.w2, np.array([model.b2]), model.lin)


def _with_params(model: Narx, params: tuple[Array, ...], moments: tuple[Array, ...], steps: int) -> Narx:
    w1, b1, w2, b2, lin = params
    return replace(model, w1=w1, b1=b1, w2=w2, b2=float(b2[0]), lin=lin, moments=moments, steps=steps)


def _forward(model: Narx, z: Array) -> tuple[Array, Array]:
    h = np.tanh(z @ model.w1 + model.b1)
    return h @ model.w2 + model.b2 + z @ model.lin, h


def _loss(model: Narx, z: Array, y: Array) -> float:
    return float(np.mean((_forward(model, z)[0] - y) ** 2))


def _adam(model: Narx, z: Array, y: Array, cfg: NarxConfig) -> Narx:
    out, h = _forward(model, z)
    err = 2.0 * (out - y) / len(y)
    g_w2 = h.T @ err
    g_b2 = np.array([err.sum()])
    g_lin = z.T @ err
    dh = np.outer(err, model.w2) * (1.0 - h * h)
    g_w1 = z.T @ dh
    g_b1 = dh.sum(axis=0)
    grads = (g_w1, g_b1, g_w2, g_b2, g_lin)
    params = _params(model)
    grads = tuple(g + cfg.weight_decay * p for g, p in zip(grads, params, strict=True))
    steps = model.steps + 1
    m_old, v_old = model.moments[: len(params)], model.moments[len(params) :]
    m_new = tuple(_BETA1 * m + (1 - _BETA1) * g for m, g in zip(m_old, grads, strict=True))
    v_new = tuple(_BETA2 * v + (1 - _BETA2) * g * g for v, g in zip(v_old, grads, strict=True))
    c1, c2 = 1 - _BETA1**steps, 1 - _BETA2**steps
    new = tuple(
        p - cfg.learning_rate * (m / c1) / (np.sqrt(v / c2) + _EPS)
        for p, m, v in zip(params, m_new, v_new, strict=True)
    )
    return _with_params(model, new, m_new + v_new, steps)


def init(x: Array, y: Array, cfg: NarxConfig) -> Narx:
    """A fresh model scaled to the samples ``x``, ``y`` (seeded Glorot-uniform weights, zero biases)."""
    if len(y) < 2:
        raise ValueError(f"a NARX model needs at least 2 samples, got {len(y)}")
    rng = np.random.default_rng(cfg.seed)
    d, hdim = x.shape[1], cfg.hidden
    bound = float(np.sqrt(6.0 / (d + hdim)))
    scale = x.std(axis=0)
    y_scale = float(y.std())
    model = Narx(
        w1=rng.uniform(-bound, bound, (d, hdim)),
        b1=np.zeros(hdim),
        w2=rng.uniform(-bound, bound, hdim),
        b2=0.0,
        lin=np.zeros(d),
        mean=x.mean(axis=0),
        scale=np.where(scale > 1e-12, scale, 1.0),
        y_mean=float(y.mean()),
        y_scale=y_scale if y_scale > 1e-12 else 1.0,
        moments=(),
        steps=0,
    )
    zeros = tuple(np.zeros_like(p) for p in _params(model))
    return replace(model, moments=zeros + zeros)


def _scaled(model: Narx, x: Array, y: Array) -> tuple[Array, Array]:
    return (x - model.mean) / model.scale, (y - model.y_mean) / model.y_scale


def fit(x: Array, y: Array, cfg: NarxConfig) -> Narx:
    """Train a fresh model full-batch, keeping the weights with the lowest loss on the last fifth of the samples
    (early stopping after ``patience`` epochs without improvement)."""
    model = init(x, y, cfg)
    split = max(1, len(y) - max(1, len(y) // 5))
    z, t = _scaled(model, x, y)
    best, best_loss, since = model, _loss(model, z[split:], t[split:]), 0
    for _ in range(cfg.max_epochs):
        model = _adam(model, z[:split], t[:split], cfg)
        loss = _loss(model, z[split:], t[split:])
        if loss < best_loss:
            best, best_loss, since = model, loss, 0
        else:
            since += 1
            if since >= cfg.patience:
                break
    return best


def update(model: Narx, x: Array, y: Array, cfg: NarxConfig) -> Narx:
    """``online_steps`` Adam steps on the latest samples (the model's scaling stays that of its first fit)."""
    z, t = _scaled(model, x, y)
    for _ in range(cfg.online_steps):
        model = _adam(model, z, t, cfg)
    return model
