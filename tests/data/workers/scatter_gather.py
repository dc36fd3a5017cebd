"""Worker of tests/unit/est/test_scatter_gather.py: one rank of a reduce-scatter + allgather over uneven ranges.

Usage: ``scatter_gather.py OUT``, started by the launcher (``hpc_elastic.launch.workers``, local mode) on the
torch (gloo) or mpi backend. Every rank builds the data of every rank from its seed, so it knows the exact sums; it
writes whether its own range, the gathered tensor (gloo's ring), the owner exchange and the reducer's paths came out
right.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from hpc_elastic.env import read_job_environment
from hpc_elastic.est.comm import Communicator, open_communicator
from hpc_elastic.est.detsum import reference_allreduce
from hpc_elastic.est.exchange import ScatterGather
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.plan import plan_buckets
from hpc_elastic.est.reducer import GradientReducer


def main() -> None:
    out = Path(sys.argv[1])
    job = read_job_environment()
    comm = open_communicator(
        job.backend, rank=job.rank, world_size=job.world_size, master_addr=job.master_addr, master_port=job.master_port
    )
    rank, size = comm.rank, comm.size
    n = 300_001  # several ring pieces per range, odd length
    # uneven ranges, the second one empty
    bounds = [0, 1000, 1000, *[1000 + (n - 1000) * k // (size - 2) for k in range(1, size - 1)]]
    data = [
        torch.randint(-(2**50), 2**50, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(r))
        for r in range(size)
    ]
    report: dict[str, bool] = {}
    if comm.scatter_gather is not None:
        report.update(ring_checks(comm.scatter_gather, rank, bounds, data))
    report.update(owner_checks(comm, bounds, data))
    report["reducers"] = reducers_agree(comm)
    (out.parent / f"{out.name}.{rank}").write_text(json.dumps(report))
    comm.close()


def ring_checks(exchange: ScatterGather, rank: int, bounds: list[int], data: list[torch.Tensor]) -> dict[str, bool]:
    """The ring reduce-scatter sums this rank's range exactly; the allgather fills in every other range."""
    expected = torch.stack(data).sum(dim=0)
    tensor = data[rank].clone()
    exchange.sum_scatter(tensor, bounds)
    lo, hi = bounds[rank], bounds[rank + 1]
    own_ok = bool(torch.equal(tensor[lo:hi], expected[lo:hi]))
    # the allgather: each rank fills only its range of a float tensor
    values = torch.full((expected.numel(),), float("nan"))
    values[lo:hi] = expected[lo:hi].to(torch.float32)
    exchange.gather(values, bounds)
    return {"own": own_ok, "gathered": bool(torch.equal(values, expected.to(torch.float32)))}


def owner_checks(comm: Communicator, bounds: list[int], data: list[torch.Tensor]) -> dict[str, bool]:
    """Every process's copy of this rank's range reaches this rank piece by piece, and the owners' results come back:
    results into the tensor the copies left from (the one-EST path: fp32 both ways), and into another tensor (the
    binned path over MPI: int64 copies, fp32 results)."""
    start = comm.owner_exchange
    if start is None:
        raise SystemExit(f"{comm.backend} has no exchange to the range owners")
    rank, size, n = comm.rank, comm.size, data[0].numel()
    lo, hi = bounds[rank], bounds[rank + 1]
    cuts = sorted({*bounds, 17, 1003, n // 2, n // 2 + 64, n - 3})  # uneven pieces; some ranges in several
    floats = [d.to(torch.float32) for d in data]
    results = torch.stack(floats).sum(dim=0).neg()  # what each owner "computes" for its range
    owners_ok, published_ok = True, True
    for copies, separate in ((floats, False), (data, True)):
        inbox = torch.zeros(size * (hi - lo), dtype=copies[0].dtype)
        tensor = copies[rank].clone()
        result = torch.full((n,), float("nan")) if separate else tensor
        rnd = start(tensor, bounds, cuts, inbox, result)
        pieces = list(rnd.pieces)
        owners_ok &= [a for a, _ in pieces] + [hi] * bool(pieces) == [c for c in cuts if lo <= c <= hi] * bool(pieces)
        for i, (a, b) in enumerate(pieces):
            rows = rnd.arrived(i)
            owners_ok &= all(torch.equal(rows[k], copies[(rank - k) % size][a:b]) for k in range(size))
            result[a:b] = results[a:b]
        # odd ranks publish their pieces last first: the round must not depend on the order
        for i in reversed(range(len(pieces))) if rank % 2 else range(len(pieces)):
            rnd.publish(i)
        rnd.finish()
        published_ok &= bool(torch.equal(result, results))
        if separate:  # the copies' buffer is left as it was
            published_ok &= bool(torch.equal(tensor, copies[rank]))
    return {"owners": owners_ok, "published": published_ok}


def reducers_agree(comm: Communicator) -> bool:
    """The one-EST-per-process reducer and the binned one give the same bits (and the definition's) on a model of
    several buckets, with a chunk holding an infinity and a process contributing zeros."""
    size, rank = comm.size, comm.rank
    shapes = [(37, 11), (5,), (1000,), (3, 3)]
    grads = [
        [
            torch.randn(s, generator=torch.Generator().manual_seed(100 * r + i)) * 2.0 ** (4 * i)
            for i, s in enumerate(shapes)
        ]
        for r in range(size)
    ]
    grads[1][2][7] = float("inf")
    grads[size - 1] = [torch.zeros(s) for s in shapes]
    layout = plan_buckets([math.prod(s) for s in shapes], bucket_elements=600, chunk=16)
    outs = []
    for one in (1, 2):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        red = GradientReducer(params, layout, num_ests=size, comm=comm, level=DeterminismLevel.D1, max_local_ests=one)
        if red.one_est_each != (one == 1):
            return False
        for p, g in zip(params, grads[rank], strict=True):
            p.grad = g.clone()
        red.deposit()
        red.reduce()
        outs.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
    flat = [np.concatenate([g.reshape(-1).numpy() for g in grads[r]]) for r in range(size)]
    parts, start = [], 0  # chunks start again at every bucket
    for bucket in layout.buckets:
        piece = [f[start : start + bucket.numel] for f in flat]
        parts.append(reference_allreduce(piece, size, chunk=16, divisor=float(size)))
        start += bucket.numel
    want = torch.from_numpy(np.concatenate(parts))
    return all(torch.equal(o.view(torch.int32), want.view(torch.int32)) for o in outs)


if __name__ == "__main__":
    main()
