"""The bundled training script of ``hpc-elastic verify-determinism``: a small classifier with dropout,
BatchNorm and a shuffling DataLoader whose worker processes augment every sample with Python's
``random``, NumPy and torch.  Run it through a launcher (``python -m hpc_elastic.est.example`` with the
variables of :func:`hpc_elastic.est.job.job_from_environment`).

Options (``RunSpec.options``): ``mode`` ``est`` (default) or ``ddp`` (plain ``DistributedDataParallel``
on N processes fed the same batches, the baseline EST runs are compared with), ``model`` ``bn-dropout``
(default) or ``mlp`` (Linear/ReLU only: D2 holds for it), ``batch_size`` (8 per EST), ``dataset_size``
(96), ``loader_workers`` (2), ``hidden`` (32), ``lr`` (0.1), ``sleep_per_step`` (0; tests use it to kill a
run mid-way).
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hpc_elastic.est.context import RNGState, est_seed
from hpc_elastic.est.data import DataPlan, ESTLoader
from hpc_elastic.est.job import ESTJob, job_from_environment
from hpc_elastic.est.levels import apply_determinism, seed_everything

FEATURES = 16
CLASSES = 4


class AugmentedBlobs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian blobs; ``__getitem__`` augments with torch noise, a NumPy gain and a Python-random mask."""

    def __init__(self, size: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 2.0
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)
        self.points = centers[self.labels] + torch.randn(size, FEATURES, generator=g)

    def __len__(self) -> int:
        return int(self.labels.numel())

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.points[i] + 0.1 * torch.randn(FEATURES)
        x = x * float(np.random.uniform(0.8, 1.2))
        keep = torch.tensor([random.random() > 0.1 for _ in range(FEATURES)], dtype=torch.float32)
        return x * keep, self.labels[i]


def build_model(kind: str, hidden: int) -> nn.Module:
    if kind == "bn-dropout":
        return nn.Sequential(
            nn.Linear(FEATURES, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, CLASSES),
        )
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
        )
    raise ValueError(f"model must be bn-dropout or mlp, got {kind!r}")


def _setup(job: ESTJob) -> tuple[nn.Module, torch.optim.Optimizer, AugmentedBlobs, dict[str, Any]]:
    opts = job.options
    apply_determinism(job.spec.level, int(opts.get("intra_op_threads", 1)))
    seed_everything(job.spec.seed)  # identical initial parameters in every process
    model = build_model(str(opts.get("model", "bn-dropout")), int(opts.get("hidden", 32)))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(opts.get("lr", 0.1)), momentum=0.9)
    dataset = AugmentedBlobs(int(opts.get("dataset_size", 96)))
    return model, optimizer, dataset, opts


def run_est(job: ESTJob) -> None:
    model, optimizer, dataset, opts = _setup(job)
    model.train()
    rt = job.runtime(model, optimizer)
    rt.attach_data(dataset, int(opts.get("batch_size", 8)), num_workers=int(opts.get("loader_workers", 2)))
    pause = float(opts.get("sleep_per_step", 0.0))
    while rt.step < job.spec.steps:
        for _ in rt.local_steps():
            x, y = rt.next_batch()
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        rt.finish_step()
        if pause:
            time.sleep(pause)
    if rt.store is not None and rt.last_checkpoint_step != rt.step:
        rt.save_checkpoint()  # a run that stops early (a resize) leaves a checkpoint to continue from
    job.report(rt)
    rt.close()


def run_ddp(job: ESTJob) -> None:
    """Plain PyTorch DDP on N processes, rank r fed exactly what EST r is fed."""
    from torch.nn.parallel import DistributedDataParallel

    if job.spec.procs != job.spec.num_ests:
        raise ValueError(f"the DDP baseline runs one process per worker: procs {job.spec.procs} != {job.spec.num_ests}")
    model, optimizer, dataset, opts = _setup(job)
    model.train()
    rank = job.rank
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    RNGState.seeded(est_seed(job.spec.seed, rank)).restore()  # the RNG stream EST ``rank`` starts with
    plan = DataPlan(len(dataset), job.spec.num_ests, int(opts.get("batch_size", 8)), job.spec.seed)
    loader = ESTLoader(dataset, plan, [rank], num_workers=int(opts.get("loader_workers", 2)))
    for step in range(job.spec.steps):
        x, y = loader.get(rank, step)
        F.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
    loader.close()
    job.report(named_params=[(n, p) for n, p in model.named_parameters()], step=job.spec.steps)


def main() -> None:
    job = job_from_environment()
    try:
        if job.options.get("mode", "est") == "ddp":
            run_ddp(job)
        else:
            run_est(job)
    finally:
        job.close()


if __name__ == "__main__":
    main()
