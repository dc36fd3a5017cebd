"""Deterministic allreduce vs the backend's own fp32 SUM allreduce, side by side in one run.

Starts RANKS processes through the library's launcher (torch.distributed's gloo by default, or MPI through mpi4py
under mpirun), each holding SIZE_MB of fp32 gradient, and times, interleaved repetition by repetition:

- ``native``: ``all_reduce(fp32, SUM)`` of the backend;
- ``det``: ``GradientReducer.reduce`` at D1 on one flat parameter with one EST per process (N = M, the runtime's
  case when the job has as many devices as ESTs): raw fp32 of every range to its owner, top bins, exact int64 sum
  and conversion there, the owner's fp32 back to everyone (pipelined by pieces);
- ``det_binned``: the path used when some process hosts several ESTs, here with one EST per process: the top bins
  of the gradient, a MAX allreduce of one byte per chunk, the gradient folded into one int64 per element, the exact
  int64 SUM as a reduce-scatter over chunk-aligned ranges, conversion of the process's own range to fp32, fp32
  allgather (over MPI: the int64 of every range to its owner, which adds them and sends the fp32 back);
- ``det_two``: the same path with two ESTs per process (N = 2M): the first EST's gradient is deposited into the
  int64 bins when the second switches in (``switch``, reported apart), the second's is folded in at the reduce.
  The ratio puts both against one fp32 SUM: the baseline's second micro-batch only accumulates in fp32 autograd;
- ``det_allreduce``: the binned reducer on one int64 allreduce instead (the path of Horovod and NCCL).
``det``, ``det_binned`` and ``det_allreduce`` must give the same bits.

Prints one line per measurement and, last, one JSON object.  Usage::

    python bench/allreduce.py [--ranks 4] [--size-mb 64] [--reps 5] [--backend torch|mpi]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_elastic.collective import Backend
from hpc_elastic.env import read_job_environment
from hpc_elastic.est.comm import Communicator, ReduceOp, open_communicator
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.plan import plan_buckets
from hpc_elastic.est.reducer import GradientReducer
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers

D1 = DeterminismLevel.D1
KEYS = ("native", "det", "det_binned", "det_two", "switch", "det_allreduce")


def worker(*, size_mb: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    job = read_job_environment()
    comm: Communicator = open_communicator(
        job.backend, rank=job.rank, world_size=job.world_size, master_addr=job.master_addr, master_port=job.master_port
    )
    rank, size = comm.rank, comm.size
    n = size_mb * (1 << 20) // 4
    g = torch.from_numpy(np.random.default_rng(rank).standard_normal(n).astype(np.float32))
    native = g.clone()
    # the library's reducer on one flat parameter of n elements, one EST per process (N = M = size)
    layout = plan_buckets([n])
    one = GradientReducer(
        [torch.nn.Parameter(torch.zeros(n))],
        layout,
        num_ests=size,
        comm=comm,
        level=DeterminismLevel.D1,
        max_local_ests=1,
    )
    if not one.one_est_each:
        raise SystemExit("the one-EST-per-process path is not available on this backend")
    param = torch.nn.Parameter(torch.zeros(n))
    ring = GradientReducer([param], layout, num_ests=size, comm=comm, level=DeterminismLevel.D1)
    # the same reducer made to use one int64 allreduce (the path of backends without a reduce-scatter)
    whole = comm.allreduce_only()
    plain_param = torch.nn.Parameter(torch.zeros(n))
    plain = GradientReducer([plain_param], layout, num_ests=size, comm=whole, level=DeterminismLevel.D1)
    two = GradientReducer([torch.nn.Parameter(torch.zeros(n))], layout, num_ests=2 * size, comm=comm, level=D1)
    g2 = torch.from_numpy(np.random.default_rng(size + rank).standard_normal(n).astype(np.float32))
    times: dict[str, list[float]] = {key: [] for key in KEYS}
    for rep in range(reps + 1):  # the first repetition warms up
        native.copy_(g)
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce_(native, ReduceOp.SUM)
        t1 = time.perf_counter()
        for name, reducer in (("det", one), ("det_binned", ring), ("det_allreduce", plain)):
            reducer.flat_grad.copy_(g)
            comm.barrier()
            t2 = time.perf_counter()
            reducer.deposit()
            reducer.reduce()
            t3 = time.perf_counter()
            if rep:
                times[name].append(t3 - t2)
        two.flat_grad.copy_(g)
        two.deposit()  # the first EST's backward ended
        comm.barrier()
        t4 = time.perf_counter()
        two.switch_in()  # the second EST starts: the first's gradient goes into the bins
        t5 = time.perf_counter()
        two.flat_grad.copy_(g2)  # (its backward)
        comm.barrier()
        t6 = time.perf_counter()
        two.deposit()
        two.reduce()
        t7 = time.perf_counter()
        if rep:
            times["native"].append(t1 - t0)
            times["switch"].append(t5 - t4)
            times["det_two"].append(t7 - t6)
    # the two deterministic paths give the same bits; both agree with the fp32 sum to rounding
    same = bool(torch.equal(one.flat_grad, ring.flat_grad) and torch.equal(ring.flat_grad, plain.flat_grad))
    close = bool(torch.allclose(native / size, one.flat_grad, rtol=1e-5, atol=1e-6))
    medians = {k_: statistics.median(v) for k_, v in times.items()}
    gathered = comm.allgather_object(medians | {"close": close, "same": same})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", choices=[Backend.TORCH.value, Backend.MPI.value], default=Backend.TORCH.value)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a started worker
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(size_mb=args.size_mb, reps=args.reps, out=args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        start = time.perf_counter()
        command = (sys.executable, __file__, "--worker", "--size-mb", str(args.size_mb), "--reps", str(args.reps))
        step = WorkerStep(
            command=(*command, "--out", out),
            ntasks=args.ranks,
            num_ests=args.ranks,
            job_dir=Path(tmp),
            backend=Backend.parse(args.backend),
            launcher=Launcher.LOCAL,
        )
        code = start_workers(step, logs=Path(tmp) / "logs").wait()
        if code:
            logs = "".join(p.read_text() for p in sorted((Path(tmp) / "logs").glob("*.log")))
            raise SystemExit(f"a worker failed (exit {code}):\n{logs[-3000:]}")
        per_rank: list[dict[str, Any]] = json.loads(Path(out).read_text())
        wall = time.perf_counter() - start
    # a collective ends when its slowest rank ends
    agg = {key: max(r[key] for r in per_rank) for key in KEYS}
    ratio = agg["native"] / agg["det"]
    ratio_binned = agg["native"] / agg["det_binned"]
    ratio_two = agg["native"] / (agg["det_two"] + agg["switch"])
    ratio_allreduce = agg["native"] / agg["det_allreduce"]
    print(f"{args.backend} allreduce of {args.size_mb} MB fp32 over {args.ranks} ranks (median of {args.reps}):")
    print(f"  native fp32 SUM                          {agg['native'] * 1e3:9.1f} ms")
    print(f"  deterministic, one EST per process       {agg['det'] * 1e3:9.1f} ms  (fp32 to owners and back)")
    binned = "reduce-scatter" if args.backend == "torch" else "int64 to owners"  # MPI has no ring here
    print(f"  deterministic, binned, {binned:<17} {agg['det_binned'] * 1e3:9.1f} ms  (one EST, the binned path)")
    print(f"  deterministic, binned, two ESTs each     {agg['det_two'] * 1e3:9.1f} ms")
    print(f"  + deposit at the second EST's switch-in  {agg['switch'] * 1e3:9.1f} ms")
    print(f"  deterministic, one int64 allreduce      {agg['det_allreduce'] * 1e3:9.1f} ms  (Horovod/NCCL path)")
    print(
        f"  throughput ratio native/det: {ratio:.3f} (goal >= 0.9); binned path with the gradient's conversion "
        f"{ratio_binned:.3f} (goal >= 0.5); two ESTs per process with the switch-in deposit {ratio_two:.3f}; "
        f"int64-allreduce path {ratio_allreduce:.3f}"
    )
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
                "det_binned_s": round(agg["det_binned"], 6),
                "det_two_s": round(agg["det_two"], 6),
                "switch_s": round(agg["switch"], 6),
                "det_allreduce_s": round(agg["det_allreduce"], 6),
                "ratio_det_vs_native": round(ratio, 4),
                "ratio_binned": round(ratio_binned, 4),
                "ratio_two_ests_per_process": round(ratio_two, 4),
                "ratio_allreduce_path": round(ratio_allreduce, 4),
                "goals": {"ratio_det_vs_native": 0.9, "ratio_binned": 0.5},
                "results_close": all(r["close"] for r in per_rank),
                "paths_bitwise_equal": all(r["same"] for r in per_rank),
                "device": f"cpu ({os.cpu_count()} cores)",
                "nccl": "not measured: no GPU",
                "wall_s": round(wall, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
