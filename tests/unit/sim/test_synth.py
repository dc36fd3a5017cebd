"""Synthetic traces resampled from the shared job sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpc_elastic.sim.synth import GPU_MIX, load_sizes, synthesize
from tests.unit.sim.helpers import TRACES, needs_traces


@needs_traces
def test_load_yarn_sizes() -> None:
    sizes = load_sizes(TRACES / "tiresias_yarn-gput1000.csv")
    assert len(sizes) == 1001 and min(sizes) > 0


def test_load_sizes_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("duration\n5\nfive\n")
    with pytest.raises(ValueError, match=r":3: job size must be a number, got 'five'"):
        load_sizes(path)
    path.write_text("duration\n5\n-1\n")
    with pytest.raises(ValueError, match=r":3: job size must be > 0"):
        load_sizes(path)


def test_synthesize_follows_inputs() -> None:
    sizes = [100.0, 1000.0, 10000.0]
    jobs = synthesize(sizes, 4000, 64, load=0.5, seed=3)
    assert len(jobs) == 4000 and jobs == synthesize(sizes, 4000, 64, load=0.5, seed=3)
    services = np.array([j.gpus * j.duration for j in jobs])
    assert set(np.round(services).tolist()) <= set(sizes)
    allowed = {g for g, _ in GPU_MIX}
    assert {j.gpus for j in jobs} <= allowed
    # arrival rate puts the offered load at 0.5 x 64 GPUs (law of large numbers, loose bound)
    span = jobs[-1].submit - jobs[0].submit
    offered = services.sum() / span / 64
    assert 0.35 < offered < 0.7
    with pytest.raises(ValueError, match="n_jobs"):
        synthesize(sizes, 0, 64)
