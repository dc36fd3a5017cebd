"""PS mode's figures in one run:

- ``dispatch``: the Data Shard Manager's lease + done rate, in the process (the pure manager, one shard a lease)
  and through the job master over gRPC (a ``python -m hpc_elastic.ps master`` process; ``--clients`` client
  processes, each a worker that reports the shards of its last lease done with its next lease), with the job's
  default settings (a worker's shard cap starts at ``start_hold`` and follows it up to ``max_hold``) and with the
  bounded settings (a fixed cap of ``--bounded-hold`` shards: ``start_hold = max_hold``, the default before the cap
  followed the worker), and the ratios: each to the manager alone, default to bounded;
- ``ps_add``: a PS added to a training job (1 → 2 PS, 2 workers): the time of the whole ``add_ps`` (the new
  process starting, the workers training meanwhile) and of the re-partition alone (the workers wait for it only);
- ``scaling``: samples/s of Wide & Deep training against the number of workers (1, 2, 4) with 2 PS, from the
  master's first lease to its last accepted shard (process start-up excluded), every epoch checked exactly once;
- ``brain``: DLRover's Brain in the loop (:mod:`hpc_elastic.ps.brain_agent`: from a cold start, sample, optimize,
  adjust on a running job, ``--max-adjust`` steps at most, each step and the number taken printed) against a grid
  search over (workers, cores per worker, PS, cores per PS) within the job's budget: this machine's cores
  (``os.sched_getaffinity``; ``--cores`` may assume more than there are, the rest then run unpinned), every worker
  and PS pinned to cores of its own, the job master beside them unpinned. Each configuration's samples/s is read over
  ``--window`` seconds once its workers train; the goal is Brain's final plan at >= 0.9x the grid's best.

Prints one line per measurement and, last, one JSON object. Usage::

    python bench/ps.py [--dispatch-shards 200000] [--bounded-hold 16] [--samples 8192] [--workers 1,2,4] [--clients 1,4]
                       [--only dispatch,ps_add,scaling,brain] [--window 3] [--max-adjust 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpc_elastic.policy.brain import Group, JobLimits, Range, ResourcePlan, Stage
from hpc_elastic.ps.brain_agent import BrainAgent
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.job import PsJob
from hpc_elastic.ps.rpc import Client
from hpc_elastic.ps.shards import LeaseStatus, ShardConfig, ShardManager


def dispatch_in_process(shards: int) -> float:
    m = ShardManager(ShardConfig(num_samples=shards, shard_size=1))
    t0 = time.perf_counter()
    n = 0
    while (lease := m.lease("w")).status is LeaseStatus.SHARD:
        for shard in lease.shards:
            m.done("w", shard.shard_id)
            n += 1
    return n / (time.perf_counter() - t0)


def _dispatch_client(address: str, worker: str, start: float, stop: float) -> int:
    """One worker's leases from ``start`` to ``stop`` (wall clock), each reporting the previous lease's shards done;
    the shards reported done and accepted."""
    c = Client(address)
    timeline = c.call("register", {"worker": worker})[0]["timeline"]
    time.sleep(max(0.0, start - time.time()))
    done = np.zeros(0, dtype=np.int64)
    accepted = seq = 0
    while True:
        seq += 1
        header = {"worker": worker, "seq": seq, "timeline": timeline, "speed": 1e9}
        reports = {"done": done, "loss": np.zeros(done.size), "count": np.ones(done.size, dtype=np.int64)}
        reply, out = c.call("lease", header, reports)
        accepted += int(reply["accepted"])
        done = out["shards"][:, 0].copy()
        if time.time() >= stop or reply["status"] == LeaseStatus.END.value:
            break
    c.close()
    return accepted


def dispatch_over_grpc(address: str, clients: int, seconds: float) -> float:
    """Shards leased and reported done per second by ``clients`` client processes over ``seconds``."""
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        pool.map(time.sleep, [0.2] * clients, chunksize=1)  # every client process started and its imports done
        start = time.time() + 1.0  # every client registered and ready
        args = [(address, f"b{clients}.{k}", start, start + seconds) for k in range(clients)]
        counts = pool.starmap(_dispatch_client, args, chunksize=1)
    return sum(counts) / seconds


def dispatch_job(shards: int, clients: list[int], seconds: float, **hold: int) -> dict[int, float]:
    """Shards/s through a job master of the settings ``hold`` (none: the defaults) for each number of clients."""
    # shards of one sample, so that only dispatch is measured; epochs enough not to run dry while measured
    config = PsJobConfig(num_ps=1, num_workers=0, num_samples=shards, shard_size=1, epochs=50, **hold)
    rates = {}
    with tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp:
        job = PsJob(config, Path(tmp))
        job.start()  # a master and one PS, no worker: the clients are the workers
        try:
            assert job.master is not None
            job.master.call("register", {"worker": "warm-up"})
            job.master.call("lease", {"worker": "warm-up", "seq": 1})  # the first lease queues the first epoch
            for n in clients:
                rates[n] = dispatch_over_grpc(job.master.address, n, seconds)
        finally:
            job.close()
    return rates


#: a job long enough to be measured while it trains (it is stopped once read)
BRAIN_JOB = {"num_samples": 1_000_000, "shard_size": 64, "batch_size": 32}


#: the grid's sizes: workers, cores per worker, PS, cores per PS (the points within the budget)
GRID_WORKERS, GRID_WORKER_CORES, GRID_PS, GRID_PS_CORES = (1, 2, 4, 8, 12), (1, 2, 4), (1, 2, 4), (1, 2, 4)


def grid_point(workers: int, worker_cores: int, num_ps: int, ps_cores: int, window: float) -> float:
    """Samples/s of a job of ``workers`` workers of ``worker_cores`` cores and ``num_ps`` PS of ``ps_cores`` cores."""
    config = PsJobConfig(num_ps=num_ps, num_workers=0, **BRAIN_JOB)
    plan = ResourcePlan(Group(workers, worker_cores, 1024), (ps_cores,) * num_ps, 1024, Stage.OPTIMIZE)
    limits = JobLimits(c_total=max(plan.total_cores, 2), workers=Range(1, workers), ps=Range(1, num_ps))
    with (
        tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp,
        PsJob(config, Path(tmp), ps_cpus=ps_cores) as job,
    ):
        for _ in range(workers):
            job.add_worker(cpus=worker_cores)
        agent = BrainAgent(
            limits, cores=limits.c_total, cores_per_node=os.cpu_count() or 1, mem_per_node_mb=1 << 20, window_s=window
        )
        _, rate = agent.measure(job, plan)
    return rate


def bench_brain(window: float, max_adjust: int, cores: int | None, out: dict[str, Any]) -> None:
    cpus = cores or len(os.sched_getaffinity(0))
    budget = cpus  # the workers' and the PS's; the job master runs beside them
    grid = []
    for ps_cores in GRID_PS_CORES:
        for num_ps in GRID_PS:
            for worker_cores in GRID_WORKER_CORES:
                for workers in GRID_WORKERS:
                    if workers * worker_cores + num_ps * ps_cores > budget:
                        continue
                    rate = grid_point(workers, worker_cores, num_ps, ps_cores, window)
                    print(
                        f"grid: {workers} workers of {worker_cores} cores, {num_ps} PS of {ps_cores} cores: "
                        f"{rate:,.0f} samples/s",
                        flush=True,
                    )
                    grid.append({"workers": workers, "worker_cores": worker_cores, "ps": num_ps,
                                 "ps_cores": ps_cores, "samples_s": round(rate, 1)})  # fmt: skip
    best = max(grid, key=lambda g: g["samples_s"])
    limits = JobLimits(c_total=budget, workers=Range(1, 12), ps=Range(1, 4))
    agent = BrainAgent(
        limits, cores=budget, cores_per_node=cpus, mem_per_node_mb=1 << 20, window_s=window, max_adjust=max_adjust
    )
    first = agent.initial_plan()
    config = PsJobConfig(num_ps=first.num_ps, num_workers=0, **BRAIN_JOB)
    with (
        tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp,
        PsJob(config, Path(tmp), ps_cpus=first.ps_cores[0]) as job,
    ):
        steps = agent.run(job)
    for step in steps:
        print(f"brain {step.describe()}", flush=True)
    for refusal in agent.refused:
        print(f"brain refused ({refusal.stage.value}): {refusal.reason}", flush=True)
    # the rate of the plan Brain ends on: its last window that had work to the end (a window that ran out of
    # shards measured the job's end, not the plan; a fallback step is the best plan measured again)
    final = next((step.samples_s for step in reversed(steps) if step.full_window), 0.0)
    ratio = final / best["samples_s"]
    print(
        f"brain: {final:,.0f} samples/s after {agent.adjust_steps} adjust step(s) (at most {max_adjust}); grid best "
        f"{best['samples_s']:,.0f} ({best['workers']} workers of {best['worker_cores']} cores, {best['ps']} PS of "
        f"{best['ps_cores']} cores, {len(grid)} points): {ratio:.2f}x (goal >= 0.9x)",
        flush=True,
    )
    out["brain"] = {**agent.report(), "budget_cores": cpus, "grid": grid, "grid_best": best, "ratio": round(ratio, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dispatch-shards", type=int, default=200_000)
    ap.add_argument("--dispatch-seconds", type=float, default=3.0)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--bounded-hold", type=int, default=16, help="the bounded settings' fixed shard cap")
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--only", default="dispatch,ps_add,scaling,brain", help="the sections to run")
    ap.add_argument("--window", type=float, default=3.0, help="seconds each configuration is read over (brain)")
    ap.add_argument("--max-adjust", type=int, default=4, help="Brain's adjust steps at most")
    ap.add_argument(
        "--cores", type=int, default=None, help="the cores Brain and the grid share (default: this machine's, affinity)"
    )
    args = ap.parse_args()
    out: dict[str, Any] = {"bench": "ps", "cpus": os.cpu_count()}
    only = set(args.only.split(","))
    if "dispatch" in only:
        alone = dispatch_in_process(args.dispatch_shards)
        print(f"dispatch in process: {alone:,.0f} shards/s (lease + done)", flush=True)
        out["dispatch_in_process_shards_s"] = round(alone)

        clients = [int(c) for c in args.clients.split(",")]
        bounded_hold = {"start_hold": args.bounded_hold, "max_hold": args.bounded_hold}
        default = dispatch_job(args.dispatch_shards, clients, args.dispatch_seconds)
        bounded = dispatch_job(args.dispatch_shards, clients, args.dispatch_seconds, **bounded_hold)
        cfg = PsJobConfig()
        out["dispatch_default_hold"] = {"start_hold": cfg.start_hold, "max_hold": cfg.max_hold}
        out["dispatch_bounded_hold"] = args.bounded_hold
        out["dispatch_grpc_shards_s"] = {}
        for n in clients:
            print(
                f"dispatch over gRPC, {n} client(s): default settings (cap {cfg.start_hold} -> {cfg.max_hold}) "
                f"{default[n]:,.0f} shards/s ({default[n] / alone:.2f}x the Shard Manager alone); bounded settings "
                f"(cap {args.bounded_hold}) {bounded[n]:,.0f} shards/s ({bounded[n] / alone:.2f}x); "
                f"default / bounded {default[n] / bounded[n]:.2f}x (goal >= 20,000 shards/s)",
                flush=True,
            )
            out["dispatch_grpc_shards_s"][str(n)] = {
                "default": round(default[n]),
                "bounded": round(bounded[n]),
                "default_to_alone": round(default[n] / alone, 3),
                "bounded_to_alone": round(bounded[n] / alone, 3),
                "default_to_bounded": round(default[n] / bounded[n], 3),
            }
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: say how busy it was

    if "ps_add" in only:
        config = PsJobConfig(num_ps=1, num_workers=2, num_samples=args.samples, shard_size=128, batch_size=64)
        with tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp, PsJob(config, Path(tmp)) as job:
            deadline = time.monotonic() + 300
            while job.status()["shards_done"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.perf_counter()
            reply = job.add_ps()
            whole = time.perf_counter() - t0
            status = job.wait()
        assert all(e["exactly_once"] for e in status["epochs"])
        print(f"PS added: add_ps {whole:.2f} s, of which the workers waited {reply['seconds']:.3f} s", flush=True)
        out["ps_add"] = {"add_ps_s": round(whole, 3), "repartition_s": round(reply["seconds"], 4)}

    if "scaling" in only:
        out["scaling"] = []
        for workers in (int(w) for w in args.workers.split(",")):
            config = PsJobConfig(num_ps=2, num_workers=workers, num_samples=args.samples, shard_size=128, batch_size=64)
            with tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp, PsJob(config, Path(tmp)) as job:
                status = job.wait()
            assert all(e["exactly_once"] for e in status["epochs"])
            rate = args.samples / status["train_seconds"]
            print(f"training, 2 PS, {workers} worker(s): {rate:,.0f} samples/s", flush=True)
            out["scaling"].append({"workers": workers, "ps": 2, "samples_s": round(rate, 1)})

    if "brain" in only:
        bench_brain(args.window, args.max_adjust, args.cores, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
