"""Run by test_collectives.py on every backend: exercise each Collective method and write, per rank,
``$HPC_ELASTIC_JOB_DIR/probe-<rank>.json`` (files, not stdout: mpirun interleaves the ranks' output)."""

from __future__ import annotations

import json
import sys

import torch

from hpc_elastic.env import read_job_environment
from hpc_elastic.est.comm import open_communicator


def main() -> int:
    job = read_job_environment()
    coll = open_communicator(
        job.backend, rank=job.rank, world_size=job.world_size, master_addr=job.master_addr, master_port=job.master_port
    ).collective
    r, m = coll.rank, coll.world_size
    root = m - 1
    coll.barrier()
    rows = torch.tensor([[r * 10.0 + 0.5, -r], [r * 10.0 + 1.5, 7.0]], dtype=torch.float32)
    gathered = coll.allgather_tensor(rows)
    bf16 = coll.allgather_tensor(torch.full((1, 3), r + 0.25, dtype=torch.bfloat16))
    out = {
        "rank": r,
        "world": m,
        "bcast_root0": coll.broadcast_object({"from": r, "kind": "dict"} if r == 0 else None),
        "bcast_last": coll.broadcast_object([r, "x"] if r == root else r, root=root),
        "gather_last": coll.gather_object({"r": r} if r % 2 else f"rank{r}", root=root),
        "allgather": coll.allgather_object((r, "t")),
        "max": coll.allreduce_max_int(100 - 7 * r),
        "max_negative": coll.allreduce_max_int(-(2**40) - r),
        "tensor": gathered.tolist(),
        "tensor_dtype": str(gathered.dtype),
        "bf16": bf16.float().tolist(),
    }
    coll.barrier()
    if job.job_dir is None:
        raise SystemExit("HPC_ELASTIC_JOB_DIR is not set")
    job.job_dir.mkdir(parents=True, exist_ok=True)
    (job.job_dir / f"probe-{r}.json").write_text(json.dumps(out))
    coll.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
