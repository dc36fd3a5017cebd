"""Γ(x) (LB-BSP §3.1, §3.2.1, §3.3.1): fitting, saturation, monotonicity within noise."""

from __future__ import annotations

import random

import pytest
import torch

from hpc_elastic.profile.curve import fit_gamma, monotone_violations, summarize_repeats
from hpc_elastic.profile.model import LoadedModel
from hpc_elastic.profile.schema import StepClock
from hpc_elastic.profile.step import StepRunner, measure_curve, measure_point

from .tiny_models import tiny

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_a_line_is_fitted_exactly_without_a_saturation_point() -> None:
    # CPU-like (§3.2.1): Γ(x) = a + x / v.
    fit = fit_gamma([(x, 0.002 + 0.0005 * x) for x in BATCHES])
    assert fit.saturation_batch is None
    assert fit.launch_overhead_s == pytest.approx(0.002)
    assert fit.per_sample_s == pytest.approx(0.0005)
    assert fit.rms_relative_error == pytest.approx(0.0, abs=1e-12)
    assert fit.predict(0) == pytest.approx(0.002)
    assert fit.predict(100) == pytest.approx(0.052)


def test_a_flat_region_gives_the_saturation_point_and_launch_overhead() -> None:
    # GPU-like (§3.3.1): Γ(x) = C for x <= 32, then linear.
    fit = fit_gamma([(x, 0.010 + 0.0001 * max(0, x - 32)) for x in BATCHES])
    assert fit.saturation_batch == 32
    assert fit.launch_overhead_s == pytest.approx(0.010)
    assert fit.per_sample_s == pytest.approx(0.0001)
    assert fit.predict(0) == fit.predict(32) == pytest.approx(0.010)
    assert fit.predict(64) == pytest.approx(0.0132)


def test_noise_alone_does_not_invent_a_saturation_point() -> None:
    rng = random.Random(7)
    points = [(x, (0.001 + 0.0002 * x) * (1 + rng.uniform(-0.02, 0.02))) for x in BATCHES]
    fit = fit_gamma(points, noise=0.05)
    assert fit.saturation_batch is None
    assert fit.per_sample_s == pytest.approx(0.0002, rel=0.05)


def test_negative_intercept_is_clamped_and_fit_is_monotone() -> None:
    fit = fit_gamma([(1, 0.001), (100, 0.2), (200, 0.45)])
    assert fit.launch_overhead_s >= 0.0
    values = [fit.predict(x) for x in range(0, 300, 7)]
    assert values == sorted(values)


def test_a_decreasing_curve_is_fitted_flat() -> None:
    fit = fit_gamma([(1, 0.3), (2, 0.2), (4, 0.1)])
    assert fit.per_sample_s == 0.0


@pytest.mark.parametrize(
    "points",
    [[(1, 0.1)], [(1, 0.1), (1, 0.2)], [(0, 0.1), (2, 0.2)], [(1, 0.0), (2, 0.1)], [(1, float("nan")), (2, 0.1)]],
)
def test_bad_points_are_rejected(points: list[tuple[int, float]]) -> None:
    with pytest.raises(ValueError, match=r"got|twice"):
        fit_gamma(points)


def test_monotone_violations_respect_the_tolerance() -> None:
    points = [(1, 1.0), (2, 0.95), (4, 0.5), (8, 2.0)]
    assert monotone_violations(points, 0.1) == [(2, 4)]
    assert monotone_violations(points, 0.6) == []
    assert monotone_violations(points, 0.0) == [(1, 2), (2, 4)]
    with pytest.raises(ValueError, match="tolerance"):
        monotone_violations(points, 1.5)


def test_summarize_repeats() -> None:
    summary = summarize_repeats([0.3, 0.1, 0.2, 0.5])
    assert (summary.median_s, summary.min_s, summary.max_s) == (0.25, 0.1, 0.5)
    assert summary.relative_spread == pytest.approx(1.6)
    with pytest.raises(ValueError, match="at least one"):
        summarize_repeats([])


def test_a_real_measurement_gives_one_consistent_point_per_batch_size() -> None:
    """Real steps of a tiny model, interleaved over batch sizes: one point per size with consistent statistics.
    Whether Γ grows is a property of the machine's timing, not asserted here (see the fake-clock tests below and
    the pure tests of ``monotone_violations`` / ``fit_gamma`` above)."""
    module, sample_batch = tiny()[:2]
    runner = StepRunner(LoadedModel("t:tiny", "tiny", module, sample_batch, None), torch.device("cpu"), seed=0)
    runner.step(*runner.batch(1))
    runner.snapshot()
    assert measure_point(runner, 2, warmup=0, iters=1, repeats=1, meter=None).batch_size == 2
    points = measure_curve(runner, [1, 64, 4096, 32768], warmup=1, iters=2, repeats=5, meter=None)
    assert [p.batch_size for p in points] == [1, 64, 4096, 32768]
    for measured in points:
        assert 0 < measured.step_time_min_s <= measured.step_time_s <= measured.step_time_max_s
        assert measured.samples_per_s == pytest.approx(measured.batch_size / measured.step_time_s)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedRunner:
    """Stands in for StepRunner: a step at batch x takes 1 ms + 0.1 ms·x on a fake clock, the first two
    steps at each batch size take 1 s extra (first-use set-up), and round 2 of batch 8 is hit by a load burst."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.steps: list[int] = []
        self.restores = 0

    def batch(self, batch_size: int) -> tuple[int, int]:
        return batch_size, batch_size

    def restore(self) -> None:
        self.restores += 1

    def step(self, inputs: int, targets: int) -> None:
        cold = 1.0 if self.steps.count(inputs) < 2 else 0.0
        burst = 0.5 if (inputs == 8 and self.restores == 2 * 3 + 2) else 0.0  # round index 2, second size
        self.clock.now += 0.001 + 0.0001 * inputs + cold + burst
        self.steps.append(inputs)

    def sync(self) -> None:
        pass


def test_warm_up_is_excluded_and_repeats_are_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr("hpc_elastic.profile.step.time.perf_counter", clock)
    runner = ScriptedRunner(clock)
    points = measure_curve(runner, [1, 8, 64], warmup=2, iters=4, repeats=5, meter=None)  # type: ignore[arg-type]
    # Round 0: 2 warm-up + 4 timed steps per size; later rounds: 1 untimed + 4 timed; sizes interleaved.
    assert runner.steps[:18] == [1] * 6 + [8] * 6 + [64] * 6
    assert runner.steps[18:33] == [1] * 5 + [8] * 5 + [64] * 5
    assert len(runner.steps) == 3 * (6 + 4 * 5)
    for point in points:
        exact = 0.001 + 0.0001 * point.batch_size
        assert point.step_time_s == pytest.approx(exact)  # warm-up untimed; the median drops the burst
        assert point.step_time_min_s == pytest.approx(exact)
        assert point.samples_per_s == pytest.approx(point.batch_size / exact)
    assert points[1].step_time_max_s > points[1].step_time_s  # the burst shows up in the spread only
    assert [p.batch_size for p in points] == [1, 8, 64]


def test_the_process_clock_times_steps_with_process_time(monkeypatch: pytest.MonkeyPatch) -> None:
    wall, cpu = FakeClock(), FakeClock()
    monkeypatch.setattr("hpc_elastic.profile.step.time.perf_counter", wall)
    monkeypatch.setattr("hpc_elastic.profile.step.time.process_time", cpu)
    runner = ScriptedRunner(cpu)  # the steps advance only the CPU clock
    points = measure_curve(
        runner,  # type: ignore[arg-type]
        [4],
        warmup=2,
        iters=2,
        repeats=3,
        meter=None,
        clock=StepClock.PROCESS,
    )
    assert points[0].step_time_s == pytest.approx(0.0014)
    assert wall.now == 0.0
