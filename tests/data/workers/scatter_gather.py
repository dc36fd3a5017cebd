"""Worker of tests/unit/est/test_scatter_gather.py: one rank of a reduce-scatter + allgather over uneven ranges.

Usage: ``scatter_gather.py gloo OUT RANK SIZE INIT``. Every rank builds the data of every rank from its seed,
so it knows the exact sums; it writes whether its own range and the gathered tensor came out right.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hpc_elastic.est.comm import make_communicator


def main() -> None:
    backend, out = sys.argv[1], Path(sys.argv[2])
    rank, size, init = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    comm = make_communicator(backend, rank=rank, size=size, init_method=init)
    n = 300_001  # several ring pieces per range, odd length
    # uneven ranges, the second one empty
    bounds = [0, 1000, 1000, *[1000 + (n - 1000) * k // (size - 2) for k in range(1, size - 1)]]
    data = [
        torch.randint(-(2**50), 2**50, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(r))
        for r in range(size)
    ]
    expected = torch.stack(data).sum(dim=0)
    exchange = comm.scatter_gather
    if exchange is None:
        raise SystemExit(f"{backend} has no reduce-scatter")
    tensor = data[rank].clone()
    exchange.sum_scatter(tensor, bounds)
    lo, hi = bounds[rank], bounds[rank + 1]
    own_ok = bool(torch.equal(tensor[lo:hi], expected[lo:hi]))
    # the allgather: each rank fills only its range of a float tensor
    values = torch.full((n,), float("nan"))
    values[lo:hi] = expected[lo:hi].to(torch.float32)
    exchange.gather(values, bounds)
    gathered_ok = bool(torch.equal(values, expected.to(torch.float32)))
    (out.parent / f"{out.name}.{rank}").write_text(json.dumps({"own": own_ok, "gathered": gathered_ok}))
    comm.close()


if __name__ == "__main__":
    main()
