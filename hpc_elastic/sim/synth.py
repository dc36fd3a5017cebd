"""Synthetic traces for scale tests, resampled from the shared traces.

- job size S (GPU-seconds): drawn from an empirical sample, e.g. ``tiresias_yarn-gput1000.csv`` (1,001 job sizes
  from a production cluster, SymbioticLab/Tiresias @ 959f9b0, Apache-2.0), loaded with :func:`load_sizes`;
- GPUs per job: the mix of Tiresias's testbed workload, itself following the Microsoft trace (§5.1 "Workload"):
  of 480 jobs, 240 use 1 GPU, 40 use 2, 80 use 4, 90 use 8, 25 use 16 and 5 use 32;
- duration = S / GPUs; model drawn uniformly from the ten models of Table 6 (48 jobs each in the testbed);
- Poisson arrivals whose rate puts the offered load at ``load`` x the cluster's GPUs: λ = load x GPUs / E[S].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hpc_elastic.files import read_text_input
from hpc_elastic.sim.models import model_info
from hpc_elastic.sim.trace import TraceJob

GPU_MIX: tuple[tuple[int, int], ...] = ((1, 240), (2, 40), (4, 80), (8, 90), (16, 25), (32, 5))
TABLE6_MODELS: tuple[str, ...] = (
    "vgg11",
    "vgg16",
    "vgg19",
    "alexnet",
    "resnet50",
    "resnet101",
    "resnet152",
    "inception3",
    "inception4",
    "googlenet",
)


def load_sizes(path: str | Path) -> list[float]:
    """Job sizes (GPU-seconds), one per line after an optional header line; errors name the line."""
    file = Path(path)
    lines = read_text_input(file, "job sizes from").splitlines()
    sizes: list[float] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip().split(",")[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            if number == 1 and not sizes:
                continue  # header
            raise ValueError(f"{file}:{number}: job size must be a number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{file}:{number}: job size must be > 0 GPU-seconds, got {text!r}")
        sizes.append(value)
    if not sizes:
        raise ValueError(f"{file}: no job sizes")
    return sizes


def synthesize(
    sizes: Sequence[float], n_jobs: int, capacity_gpus: int, *, load: float = 0.8, seed: int = 0
) -> tuple[TraceJob, ...]:
    """``n_jobs`` jobs resampled as described in the module doc (deterministic for a given seed)."""
    if n_jobs < 1 or capacity_gpus < 1 or not (math.isfinite(load) and load > 0) or not sizes:
        raise ValueError(f"need n_jobs >= 1, capacity >= 1, load > 0 and sizes; got {n_jobs}, {capacity_gpus}, {load}")
    rng = np.random.default_rng(seed)
    pool = np.asarray(sizes, dtype=np.float64)
    service = rng.choice(pool, size=n_jobs)
    gpu_values = np.array([g for g, _ in GPU_MIX])
    weights = np.array([w for _, w in GPU_MIX], dtype=np.float64)
    gpus = rng.choice(gpu_values, size=n_jobs, p=weights / weights.sum())
    gpus = np.minimum(gpus, capacity_gpus)
    rate = load * capacity_gpus / float(pool.mean())
    submit = np.cumsum(rng.exponential(1.0 / rate, size=n_jobs))
    submit -= submit[0]
    models = rng.integers(0, len(TABLE6_MODELS), size=n_jobs)
    jobs: list[TraceJob] = []
    for i in range(n_jobs):
        name = TABLE6_MODELS[int(models[i])]
        info = model_info(name)
        jobs.append(
            TraceJob(
                name=f"syn-{i}",
                submit=float(submit[i]),
                gpus=int(gpus[i]),
                duration=float(service[i] / gpus[i]),
                model=name,
                skew=info.skew if info else None,
                checkpoint_bytes=info.checkpoint_bytes if info else None,
                line=i + 1,
            )
        )
    return tuple(jobs)
