"""Horovod worker for the wrapper's tests: allreduce of the ranks with horovod.torch, written by rank 0."""

from __future__ import annotations

import sys

import horovod.torch as hvd
import torch

from hpc_elastic.env import read_job_environment


def main() -> int:
    hvd.init()
    job = read_job_environment()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    if hvd.rank() == 0 and job.job_dir is not None:
        (job.job_dir / "hvd.txt").write_text(f"size={hvd.size()} sum={int(total.item())}\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
