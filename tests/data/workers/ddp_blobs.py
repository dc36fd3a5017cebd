"""Plain PyTorch DDP on N processes, rank r fed exactly what EST r of the bundled example is fed (same model, data
plan, loader seeds and RNG stream): the baseline the runtime is compared with (tests/unit/est/test_multiprocess.py).

Usage, one process per rank under the launcher (torch backend): ``ddp_blobs.py OUT STEPS [LOADER_WORKERS]``; rank 0
saves the final parameters to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from hpc_elastic.env import read_job_environment
from hpc_elastic.est.context import RNGState, est_seed
from hpc_elastic.est.data import DataPlan, ESTLoader
from hpc_elastic.est.determinism import apply_determinism, seed_everything
from hpc_elastic.est.example import AugmentedBlobs, build_model
from hpc_elastic.est.levels import DeterminismLevel

SEED, BATCH, DATASET, HIDDEN, LR = 0, 8, 96, 32, 0.1  # the bundled example's defaults


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    job = read_job_environment()
    rank, n = job.rank, job.world_size
    dist.init_process_group("gloo", init_method=f"tcp://{job.master_addr}:{job.master_port}", rank=rank, world_size=n)
    apply_determinism(DeterminismLevel.D0)
    seed_everything(SEED)
    model = build_model("bn-dropout", HIDDEN)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    RNGState.seeded(est_seed(SEED, rank)).restore()  # the RNG stream EST ``rank`` starts with
    dataset = AugmentedBlobs(DATASET)
    loader = ESTLoader(dataset, DataPlan(len(dataset), n, BATCH, SEED), [rank], num_workers=workers)
    for step in range(steps):
        x, y = loader.get(rank, step)
        F.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
    loader.close()
    if rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
