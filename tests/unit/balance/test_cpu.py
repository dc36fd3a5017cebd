"""LB-BSP Alg. 1: speed prediction (last value, EMA, NARX) on a recorded trace, and the batch split."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from hpc_elastic.balance.cpu import (
    Alg1Config,
    Alg1State,
    CpuReading,
    Method,
    SpeedPredictor,
    alg1_step,
    replay,
    rmse,
)
from hpc_elastic.balance.narx import NarxConfig

TRACE = Path(__file__).parents[2] / "fixtures" / "lbbsp_speed_trace.csv"


def load_trace() -> tuple[list[float], list[float], list[float]]:
    with TRACE.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [float(r["speed"]) for r in rows], [float(r["cpu"]) for r in rows], [float(r["mem"]) for r in rows]


def test_narx_predicts_the_recorded_trace_better_than_ema_and_last_value() -> None:
    speeds, cpus, mems = load_trace()
    config = Alg1Config()
    assert len(speeds) > config.warmup + 200
    predicted = replay(speeds, cpus, mems, config)
    start = config.warmup + 1  # the first prediction of the NARX model, fitted on the 500 warm-up speeds
    errors = {m: rmse(predicted[m], speeds, start) for m in Method}
    spread = float(np.std(speeds[start:]))
    print(
        f"RMSE over iterations {start}..{len(speeds) - 1} (speed std {spread:.0f} samples/s): "
        + ", ".join(f"{m.value} {e:.0f}" for m, e in errors.items())
    )
    assert errors[Method.NARX] < errors[Method.EMA]
    assert errors[Method.NARX] < errors[Method.LAST]
    assert np.isnan(predicted[Method.NARX][: config.warmup]).all()  # EMA only during the warm-up
    # seeded and clock-free: the same trace gives the same predictions
    again = replay(speeds[: config.warmup + 50], cpus[: config.warmup + 50], mems[: config.warmup + 50], config)
    np.testing.assert_array_equal(again[Method.NARX], predicted[Method.NARX][: config.warmup + 50])


def test_batch_sizes_follow_predicted_speeds_and_keep_the_total() -> None:
    config = Alg1Config(warmup=30, window=60, model=NarxConfig(max_epochs=200))
    speeds = [100.0, 200.0, 300.0, 400.0]
    state = Alg1State.initial(1000, [None] * 4)
    rng = np.random.default_rng(3)
    readings = [CpuReading(x, None, 0.1, 0.2) for x in state.sizes]
    methods = []
    for _ in range(60):
        state, decision = alg1_step(state, readings, config)
        assert sum(state.sizes) == 1000 and decision.sizes == state.sizes
        methods.append(decision.methods)
        noise = rng.uniform(0.98, 1.02, 4)
        readings = [CpuReading(x, x / (v * e), 0.1, 0.2) for x, v, e in zip(state.sizes, speeds, noise, strict=True)]
    assert methods[0] == ()  # k = 0: no times yet, the sizes stay
    assert methods[1] == (Method.EMA,) * 4
    assert methods[-1] == (Method.NARX,) * 4
    ideal = [100, 200, 300, 400]
    assert all(abs(x - i) <= 15 for x, i in zip(state.sizes, ideal, strict=True)), state.sizes
    times = [x / v for x, v in zip(state.sizes, speeds, strict=True)]
    assert max(times) <= 1.05 * 1000 / sum(speeds)


def test_bad_readings_are_rejected() -> None:
    state = Alg1State.initial(10, [None, None])
    with pytest.raises(ValueError, match="reports 4 samples, its batch was 5"):
        alg1_step(state, [CpuReading(4, None, 0.0, 0.0), CpuReading(5, None, 0.0, 0.0)])
    with pytest.raises(ValueError, match="cpu usage"):
        CpuReading(5, 1.0, 1.5, 0.0)
    with pytest.raises(ValueError, match="no speed"):
        SpeedPredictor().predict()
