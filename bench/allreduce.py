"""Deterministic allreduce vs the backend's own fp32 SUM allreduce, side by side in one run.

Spawns RANKS processes (gloo by default, or MPI through mpi4py under mpirun), each holding SIZE_MB of fp32
gradient, and times, interleaved repetition by repetition:

- ``native``: ``all_reduce(fp32, SUM)`` of the backend;
- ``det``: the deterministic allreduce of hpc_elastic.est: MAX of one byte per chunk, exact int64 SUM,
  conversion back to fp32 (what ``GradientReducer.reduce`` does), plus the deposit of the process's one
  EST gradient (what a context switch costs), reported separately.

Prints one line per measurement and, last, one JSON object.  Usage::

    python bench/allreduce.py [--ranks 4] [--size-mb 64] [--reps 5] [--backend gloo|mpi]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_elastic.est.comm import Communicator, ReduceOp, make_communicator
from hpc_elastic.est.detsum import bin_width, num_chunks
from hpc_elastic.est.launch import free_port
from hpc_elastic.est.reducer import tensor_kernels


def worker(rank: int, size: int, *, backend: str, init: str, size_mb: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    comm: Communicator = make_communicator(backend, rank=rank, size=size, init_method=init)
    n = size_mb * (1 << 20) // 4
    chunk = 64
    width = bin_width(size)
    k = tensor_kernels(torch.device("cpu"))
    g = torch.from_numpy(np.random.default_rng(rank).standard_normal(n).astype(np.float32))
    native = g.clone()
    grad = g.clone()
    hi = torch.zeros(n, dtype=torch.int64)
    lo = torch.zeros(n, dtype=torch.int64)
    ltops = torch.zeros(num_chunks(n, chunk), dtype=torch.uint8)
    gtops = torch.zeros_like(ltops)
    times: dict[str, list[float]] = {"native": [], "det": [], "deposit": [], "det_comm": [], "det_kernels": []}
    for rep in range(reps + 1):  # the first repetition warms up
        native.copy_(g)
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce_(native, ReduceOp.SUM)
        t1 = time.perf_counter()
        grad.copy_(g)
        comm.barrier()
        t2 = time.perf_counter()
        k.deposit(grad, hi, lo, ltops, chunk=chunk, width=width, first=True, clear=True)
        t3 = time.perf_counter()
        gtops.copy_(ltops)
        comm.allreduce_(gtops, ReduceOp.MAX)
        t4 = time.perf_counter()
        k.combine(hi, lo, ltops, gtops, chunk=chunk, width=width)
        t5 = time.perf_counter()
        comm.allreduce_(hi, ReduceOp.SUM)
        t6 = time.perf_counter()
        k.finalize(hi, gtops, grad, chunk=chunk, width=width, divisor=1.0)
        t7 = time.perf_counter()
        if rep:
            times["native"].append(t1 - t0)
            times["deposit"].append(t3 - t2)
            times["det"].append(t7 - t3)
            times["det_comm"].append((t4 - t3) + (t6 - t5))
            times["det_kernels"].append((t5 - t4) + (t7 - t6))
    # both results are sums of the same data: sanity-check they agree to rounding
    close = bool(torch.allclose(native, grad, rtol=1e-5, atol=1e-5))
    gathered = comm.allgather_object({k_: statistics.median(v) for k_, v in times.items()} | {"close": close})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", choices=["gloo", "mpi"], default="gloo")
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)  # rank of a spawned worker
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker >= 0:
        rank = args.worker
        if args.backend == "mpi":
            from mpi4py import MPI

            rank = MPI.COMM_WORLD.Get_rank()
        worker(
            rank,
            args.ranks,
            backend=args.backend,
            init=args.init,
            size_mb=args.size_mb,
            reps=args.reps,
            out=args.out,
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        start = time.perf_counter()
        common = ["--ranks", str(args.ranks), "--size-mb", str(args.size_mb), "--reps", str(args.reps)]
        common += ["--backend", args.backend, "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.backend == "gloo":
            init = f"tcp://127.0.0.1:{free_port()}"
            procs = [
                subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--init", init, *common], env=env)
                for r in range(args.ranks)
            ]
            codes = [p.wait() for p in procs]
            if any(codes):
                raise SystemExit(f"a worker failed: exit codes {codes}")
        else:
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(args.ranks)]
            subprocess.run([*cmd, sys.executable, __file__, "--worker", "0", *common], check=True, env=env)
        per_rank: list[dict[str, Any]] = json.loads(Path(out).read_text())
        wall = time.perf_counter() - start
    # a collective ends when its slowest rank ends
    agg = {key: max(r[key] for r in per_rank) for key in ("native", "det", "deposit", "det_comm", "det_kernels")}
    ratio = agg["native"] / agg["det"]
    ratio_with_deposit = agg["native"] / (agg["det"] + agg["deposit"])
    print(f"{args.backend} allreduce of {args.size_mb} MB fp32 over {args.ranks} ranks (median of {args.reps}):")
    print(f"  native fp32 SUM         {agg['native'] * 1e3:9.1f} ms")
    print(
        f"  deterministic allreduce {agg['det'] * 1e3:9.1f} ms  (comm {agg['det_comm'] * 1e3:.1f} ms, "
        f"kernels {agg['det_kernels'] * 1e3:.1f} ms)"
    )
    print(f"  + deposit of one EST    {agg['deposit'] * 1e3:9.1f} ms  (paid at the context switch)")
    print(f"  throughput ratio det/native: {ratio:.3f} (goal >= 0.8); with the deposit: {ratio_with_deposit:.3f}")
    print("  NCCL comparison: not measured (no GPU on this machine)")
    print(
        json.dumps(
            {
                "bench": "allreduce",
                "backend": args.backend,
                "ranks": args.ranks,
                "size_mb": args.size_mb,
                "reps": args.reps,
                "native_s": round(agg["native"], 6),
                "det_s": round(agg["det"], 6),
                "det_comm_s": round(agg["det_comm"], 6),
                "det_kernels_s": round(agg["det_kernels"], 6),
                "deposit_s": round(agg["deposit"], 6),
                "ratio_det_vs_native": round(ratio, 4),
                "ratio_with_deposit": round(ratio_with_deposit, 4),
                "goal": 0.8,
                "results_close": all(r["close"] for r in per_rank),
                "device": f"cpu ({os.cpu_count()} cores)",
                "nccl": "not measured: no GPU",
                "wall_s": round(wall, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
