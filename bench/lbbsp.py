"""LB-BSP (paper mode) against plain BSP with 4 real worker processes whose speeds are 1:2:3:4, in one run.

Four processes (torch.distributed, gloo on localhost) train a small MLP on synthetic data with a global batch of
X samples.  Worker i's batch processing time is the real forward/backward of its x_i samples plus a sleep of
``x_i · per_sample / s_i`` with s = 1, 2, 3, 4: the speeds 1:2:3:4 are made by **sleep proportional to the batch**
(four CPU-bound processes on a 2-core machine shared with other work would measure the machine, not the algorithm).
Every iteration the workers all-gather their batch processing times (the iteration minus the wait at the
allreduce, LB-BSP §4), each runs the pure Alg. 2 step on the same readings (so all agree on x^{k+1} without a
manager process), takes its x_i samples from the exact-once sampler, and pushes its mean gradient scaled by n·x_i/X
(Eq. 7) into a mean allreduce.

Measured, all in this run:

1. plain BSP (x_i = X/n) and LB-BSP iteration times (mean over the last ``--steady`` iterations of each) against the
   ideal X/Σv, that is the time if every worker finished together (goals: LB-BSP ≤ 1.10× ideal, ≥ 1.5× faster
   than BSP);
2. the LB-BSP run's final parameters against one process training on the same global batches with the full-batch
   mean gradient (what Eq. 7 promises, up to float32 rounding);
3. NARX, EMA and last-value RMSE of Alg. 1's speed prediction on the recorded trace in tests/fixtures;
4. EST mode: the same four processes run the job's ``--ests`` ESTs through the runtime
   (:class:`hpc_elastic.state.State` over gloo), each EST taking ``--per-est-ms / s_i`` of sleep on process i
   besides its real forward/backward.  Plain BSP keeps the contiguous blocks (N/4 ESTs each); EST mode's balancer
   (Alg. 2 with whole ESTs, :mod:`hpc_elastic.balancer`) moves them.  Both runs train the same iterations, so their
   final parameters must be the same bits (printed).  The ideal for whole ESTs is the best integer split's slowest
   process, min over splits of max_i c_i / s_i ESTs' sleep.

Prints one line per measurement and, last, one JSON object.  Usage::

    python bench/lbbsp.py [--iterations 150] [--steady 40] [--per-sample-ms 4] [--batch 256]
                          [--ests 16] [--per-est-ms 40] [--est-iterations 60] [--est-steady 20]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hpc_elastic.balance.aggregate import aggregation_factor
from hpc_elastic.balance.cpu import Alg1Config, Method, replay, rmse
from hpc_elastic.balance.gpu import Alg2State, Outcome, WorkerReading, alg2_step
from hpc_elastic.balance.sampler import BalancedSampler, SamplerState
from hpc_elastic.balancer import ESTBalanceConfig
from hpc_elastic.collective import Backend
from hpc_elastic.est.comm import open_communicator
from hpc_elastic.launch.workers import free_port
from hpc_elastic.state import RuntimeConfig, State

WORKERS = 4
SPEEDS = (1.0, 2.0, 3.0, 4.0)
DATASET = 8192
FEATURES, CLASSES = 32, 10
TRACE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "lbbsp_speed_trace.csv"


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(DATASET, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return x, (x @ w).argmax(dim=1)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def worker(rank: int, port: int, mode: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    x, y = data()
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sampler = BalancedSampler(DATASET, seed=3)
    position = SamplerState()
    balancer = Alg2State.initial(args.batch, [None] * WORKERS)
    per_sample = args.per_sample_ms / 1000.0
    stamps, sizes_seen, outcomes, slowest = [], [], [], []
    dist.barrier()
    stamps.append(time.perf_counter())
    for _ in range(args.iterations):
        sizes = balancer.sizes
        batch = sampler.take(position, sizes)
        position = batch.state
        mine = list(batch.indices[rank])
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()  # type: ignore[no-untyped-call]
        time.sleep(sizes[rank] * per_sample / SPEEDS[rank])
        busy = time.perf_counter() - start  # t_i: the batch processing time, before the wait at the barrier
        factor = aggregation_factor(sizes, rank)  # n·x_i/X (Eq. 7)
        grads = [p.grad.reshape(-1).double() * factor for p in net.parameters() if p.grad is not None]
        times = torch.zeros(WORKERS, dtype=torch.float64)
        times[rank] = busy
        flat = torch.cat([*grads, times])  # one allreduce: the weighted gradients and everyone's t_i
        dist.all_reduce(flat)
        times = flat[-WORKERS:]
        offset = 0
        for p in net.parameters():
            n = p.numel()
            p.grad = (flat[offset : offset + n] / WORKERS).reshape(p.shape).to(p.dtype)
            offset += n
        opt.step()
        if mode == "lbbsp":
            balancer, decision = alg2_step(balancer, [WorkerReading(float(t)) for t in times])
            outcomes.append(decision.outcome.value)
            if decision.outcome is Outcome.DROP:
                print(f"warning: {decision.warning}", file=sys.stderr)
        sizes_seen.append(list(sizes))
        slowest.append(float(times.max()))
        stamps.append(time.perf_counter())
    if rank == 0:
        params = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()
        Path(out).write_text(
            json.dumps(
                {"stamps": stamps, "sizes": sizes_seen, "outcomes": outcomes, "slowest": slowest, "params": params}
            )
        )
    dist.destroy_process_group()


def est_worker(rank: int, port: int, mode: str, args: argparse.Namespace, out: str) -> None:
    """One process of the EST-mode runs: the runtime's State with ``--ests`` ESTs, balanced or not."""
    torch.set_num_threads(1)
    comm = open_communicator(Backend.TORCH, rank=rank, world_size=WORKERS, master_port=port)
    x, y = data()
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    balance = ESTBalanceConfig(every=2, fast_window=2, fine_window=4) if mode == "est" else None
    state = State(net, opt, RuntimeConfig(num_ests=args.ests, seed=3), comm=comm, balance=balance)
    state.plan_data(DATASET, 16)
    per_est = args.per_est_ms / 1000.0
    stamps, counts = [], []
    comm.barrier()
    stamps.append(time.perf_counter())
    for _ in range(args.est_iterations):
        counts.append(list(state.placement.counts()))
        for indices in state.batches():
            mine = list(indices)
            nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()  # type: ignore[no-untyped-call]
            time.sleep(per_est / SPEEDS[rank])
        state.finish_step()
        stamps.append(time.perf_counter())
    sha = state.params_sha256()
    if rank == 0:
        Path(out).write_text(
            json.dumps({"stamps": stamps, "counts": counts, "sha": sha, "moves": len(state.rebalances)})
        )
    comm.close()


def best_est_split(ests: int, per_est_ms: float) -> tuple[float, list[int]]:
    """The smallest slowest-process sleep over integer EST counts (each >= 1) and a split reaching it."""
    best: tuple[float, list[int]] = (float("inf"), [])
    for split in itertools.product(range(1, ests + 1), repeat=WORKERS - 1):
        last = ests - sum(split)
        if last < 1:
            continue
        counts = [*split, last]
        slowest = max(c * per_est_ms / v for c, v in zip(counts, SPEEDS, strict=True))
        best = min(best, (slowest, counts))
    return best


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        target = est_worker if mode in ("est", "est-bsp") else worker
        mp.spawn(target, args=(free_port(), mode, args, out), nprocs=WORKERS, join=True)
        result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def iteration_times(result: dict[str, Any]) -> list[float]:
    stamps = result["stamps"]
    return [b - a for a, b in itertools.pairwise(stamps)]


def reference(sizes: list[list[int]]) -> list[float]:
    """One process over the same global batches, full-batch mean gradient."""
    torch.set_num_threads(1)
    x, y = data()
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sampler = BalancedSampler(DATASET, seed=3)
    position = SamplerState()
    for split in sizes:
        batch = sampler.take(position, split)
        position = batch.state
        idx = [i for part in batch.indices for i in part]
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def trace_rmse() -> dict[str, float]:
    with TRACE.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    speeds = [float(r["speed"]) for r in rows]
    cfg = Alg1Config()
    predicted = replay(speeds, [float(r["cpu"]) for r in rows], [float(r["mem"]) for r in rows], cfg)
    return {m.value: rmse(predicted[m], speeds, cfg.warmup + 1) for m in Method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--steady", type=int, default=40)
    parser.add_argument("--per-sample-ms", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ests", type=int, default=16)
    parser.add_argument("--per-est-ms", type=float, default=40.0)
    parser.add_argument("--est-iterations", type=int, default=60)
    parser.add_argument("--est-steady", type=int, default=20)
    args = parser.parse_args()
    ideal = args.batch * args.per_sample_ms / 1000.0 / sum(SPEEDS)
    bsp_args = argparse.Namespace(**{**vars(args), "iterations": args.steady + 5})
    bsp = run("bsp", bsp_args)
    lb = run("lbbsp", args)
    steady = slice(-args.steady, None)
    bsp_t = statistics.mean(iteration_times(bsp)[steady])
    lb_t = statistics.mean(iteration_times(lb)[steady])
    lb_median = statistics.median(iteration_times(lb)[steady])
    lb_slowest = statistics.mean(lb["slowest"][steady])  # the straggler's t_i: what remains is the synchronisation
    final = lb["sizes"][-1]
    # the sleeps alone at the final integer sizes: the integer rounding's share of the gap to the ideal
    rounded = max(x * args.per_sample_ms / 1000.0 / v for x, v in zip(final, SPEEDS, strict=True))
    converged = next(
        (i for i, o in enumerate(lb["outcomes"]) if o == Outcome.SWITCHED.value), None
    )  # the end of the fast approach
    ref = reference(lb["sizes"])
    diff = max(abs(a - b) for a, b in zip(ref, lb["params"], strict=True))
    scale = max(abs(a) for a in ref)
    errors = trace_rmse()
    est_bsp = run("est-bsp", args)
    est = run("est", args)
    est_steady = slice(-args.est_steady, None)
    est_bsp_t = statistics.mean(iteration_times(est_bsp)[est_steady])
    est_t = statistics.mean(iteration_times(est)[est_steady])
    est_ideal_ms, best_split = best_est_split(args.ests, args.per_est_ms)
    print(
        f"4 gloo workers on localhost, speeds 1:2:3:4 by a sleep of {args.per_sample_ms:g} ms per sample / speed;"
        f" X = {args.batch}"
    )
    print("machine: 2 cores shared with other work (timings include its noise)")
    print(f"  ideal X/Σv                      {ideal * 1e3:8.1f} ms")
    print(f"  plain BSP, last {args.steady:3d} its         {bsp_t * 1e3:8.1f} ms  (sizes {bsp['sizes'][-1]})")
    print(
        f"  LB-BSP (Alg. 2), last {args.steady:3d} its    {lb_t * 1e3:8.1f} ms  (sizes {lb['sizes'][-1]}, "
        f"fine-tune from iteration {converged})"
    )
    print(
        f"    of which: slowest sleep at the final sizes {rounded * 1e3:.1f} ms, slowest t_i {lb_slowest * 1e3:.1f} ms,"
        f" median iteration {lb_median * 1e3:.1f} ms"
    )
    print(f"  LB-BSP / ideal                  {lb_t / ideal:8.3f}x  (goal <= 1.10)")
    print(f"  BSP / LB-BSP                    {bsp_t / lb_t:8.3f}x  (goal >= 1.5)")
    print(f"  Eq. 7: max |param - one-process full batch| {diff:.2e} (params up to {scale:.2f}, float32)")
    print(
        "  Alg. 1 speed prediction RMSE on the recorded trace (samples/s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in errors.items())
    )
    print(f"  EST mode, {args.ests} ESTs of {args.per_est_ms:g} ms / speed, last {args.est_steady} of each run:")
    print(f"    plain BSP, contiguous {est_bsp['counts'][-1]}  {est_bsp_t * 1e3:8.1f} ms")
    print(f"    EST balancer, final {est['counts'][-1]}  {est_t * 1e3:8.1f} ms  ({est['moves']} moves)")
    print(f"    best whole-EST split {best_split}: {est_ideal_ms:.1f} ms of sleep on its slowest process")
    print(f"  BSP / EST mode                  {est_bsp_t / est_t:8.3f}x  (goal >= 1.5)")
    print(f"  EST mode / best whole-EST split {est_t * 1e3 / est_ideal_ms:8.3f}x")
    print(f"  EST mode final parameters equal plain BSP's bit for bit: {est['sha'] == est_bsp['sha']}")
    print(
        json.dumps(
            {
                "est_bsp_ms": est_bsp_t * 1e3,
                "est_mode_ms": est_t * 1e3,
                "bsp_over_est_mode": est_bsp_t / est_t,
                "est_ideal_split_ms": est_ideal_ms,
                "est_final_counts": est["counts"][-1],
                "est_moves": est["moves"],
                "est_params_bitwise_equal": est["sha"] == est_bsp["sha"],
                "ideal_ms": ideal * 1e3,
                "bsp_ms": bsp_t * 1e3,
                "lbbsp_ms": lb_t * 1e3,
                "lbbsp_median_ms": lb_median * 1e3,
                "lbbsp_slowest_ti_ms": lb_slowest * 1e3,
                "lbbsp_rounded_sleep_ms": rounded * 1e3,
                "lbbsp_over_ideal": lb_t / ideal,
                "bsp_over_lbbsp": bsp_t / lb_t,
                "final_sizes": final,
                "fine_tune_from": converged,
                "param_max_abs_diff_vs_full_batch": diff,
                "rmse": errors,
            }
        )
    )


if __name__ == "__main__":
    main()
