"""EST overhead, side by side in one run (issue 6 benchmarks).

1. Throughput of 8 ESTs on one process vs 1 EST on one process, same per-EST batch (goal >= 0.97x), with a
   plain PyTorch loop (no EST runtime, no deterministic reduction) as context; repetitions interleaved.
2. The same 8 ESTs as 8 separate processes (N = M = 8, gloo).
3. Peak memory (ru_maxrss) of one process running N = 1, 2, 4, 8 ESTs (goal: <= 5 % growth from 1 to 8).
4. The cost of one context switch (RNG states, buffers, deposit of the EST's gradient).

The model is an MLP with BatchNorm and Dropout; data come from an in-memory dataset through the EST
loader.  Prints one line per measurement and, last, one JSON object.  Usage::

    python bench/est.py [--ests 8] [--batch 32] [--steps 48] [--hidden 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hpc_elastic.env import read_environment
from hpc_elastic.est.backends import CommBackend
from hpc_elastic.est.data import DataPlan, ESTLoader
from hpc_elastic.est.job import RunSpec, job_from_environment
from hpc_elastic.est.launch import free_port, start
from hpc_elastic.est.levels import DeterminismLevel, apply_determinism, seed_everything
from hpc_elastic.est.runtime import ESTConfig, ESTRuntime

IN_FEATURES = 256
CLASSES = 10


def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    seed_everything(0)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN_FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def run_runtime(rt: ESTRuntime, model: nn.Module, steps: int) -> float:
    start_t = time.perf_counter()
    target = rt.step + steps
    while rt.step < target:
        for _ in rt.local_steps():
            x, y = rt.next_batch()
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        rt.finish_step()
    return time.perf_counter() - start_t


def est_runtime(n: int, args: argparse.Namespace) -> tuple[ESTRuntime, nn.Module]:
    model, opt = build(args.hidden)
    rt = ESTRuntime(model, opt, ESTConfig(num_ests=n, seed=0, level=DeterminismLevel.D1))
    rt.attach_data(dataset(args.batch * args.ests * 64), args.batch)
    return rt, model


def plain_throughput(args: argparse.Namespace, steps: int) -> float:
    model, opt = build(args.hidden)
    ds = dataset(args.batch * args.ests * 64)
    loader = ESTLoader(ds, DataPlan(len(ds), 1, args.batch), [0])
    for c in range(2):  # warm-up
        x, y = loader.get(0, c)
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    t = time.perf_counter()
    for c in range(2, 2 + steps):
        x, y = loader.get(0, c)
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return float(steps * int(args.batch)) / (time.perf_counter() - t)


def in_process(args: argparse.Namespace) -> dict[str, float]:
    apply_determinism(DeterminismLevel.D1, 1)
    est_steps = args.steps  # EST-steps per measurement, the same for every configuration
    samples = est_steps * args.batch
    res: dict[str, list[float]] = {"plain": [], "est1": [], "est8": []}
    one, m1 = est_runtime(1, args)
    many, m8 = est_runtime(args.ests, args)
    run_runtime(one, m1, 2)  # warm-up
    run_runtime(many, m8, 1)
    for _ in range(args.rounds):  # interleaved: every configuration sees the same machine load
        res["plain"].append(plain_throughput(args, est_steps))
        res["est1"].append(samples / run_runtime(one, m1, est_steps))
        res["est8"].append(samples / run_runtime(many, m8, est_steps // args.ests))
    switches = []
    for _ in range(5):  # global steps whose ESTs do nothing: what remains is the switching itself
        t = time.perf_counter()
        for _ in many.local_steps():
            pass
        switches.append((time.perf_counter() - t) / len(many.local_ests))
        many.finish_step()
    out: dict[str, float] = {k: statistics.median(v) for k, v in res.items()}
    return out | {"switch_s": statistics.median(switches)}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(n: int, args: argparse.Namespace) -> None:
    """Peak resident memory while training with ``n`` ESTs: the high-water mark is reset (Linux
    clear_refs) once torch, the optimizer machinery and the data are loaded, so import-time transients
    cannot hide the runtime's own peak."""
    apply_determinism(DeterminismLevel.D1, 1)
    model, opt = build(args.hidden)
    ds = dataset(args.batch * args.ests * 64)
    loader = ESTLoader(ds, DataPlan(len(ds), 1, args.batch), [0])
    x, y = loader.get(0, 0)
    F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
    opt.step()  # imports what the first optimizer step imports
    del model, opt, loader
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmRSS")
    rt, model = est_runtime(n, args)
    run_runtime(rt, model, 3)
    peak = _status_kb("VmHWM")
    print(
        json.dumps(
            {
                "ests": n,
                "peak_kb": peak,
                "rss_before_kb": before,
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        )
    )


def memory_curve(args: argparse.Namespace) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Peak RSS per N, the minimum of ``args.mem_reps`` fresh processes (allocator noise is a few MiB)."""
    runs: dict[int, list[int]] = {n: [] for n in (1, 2, 4, 8)}
    for _ in range(args.mem_reps):
        for n, values in runs.items():
            cmd = [sys.executable, __file__, "--memory-worker", str(n), "--hidden", str(args.hidden)]
            cmd += ["--batch", str(args.batch), "--ests", str(args.ests)]
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
            values.append(int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_kb"]))
    return {n: min(v) for n, v in runs.items()}, runs


def launched_worker() -> None:
    """One of the M processes of part 2 (started through hpc_elastic.est.launch)."""
    job = job_from_environment()
    opts = job.options
    hidden, batch, steps = int(opts["hidden"]), int(opts["batch"]), int(opts["steps"])
    model, opt = build(hidden)
    rt = job.runtime(model, opt)
    rt.attach_data(dataset(batch * job.spec.num_ests * 64), batch)
    run_runtime(rt, model, 2)
    job.comm.barrier()
    t = time.perf_counter()
    run_runtime(rt, model, steps)
    job.comm.barrier()
    elapsed = time.perf_counter() - t
    job.report(rt, extra={"bench_s": elapsed})
    job.close()


def separate_processes(args: argparse.Namespace) -> float:
    steps = max(1, args.steps // args.ests)
    with tempfile.TemporaryDirectory() as tmp:
        spec = RunSpec(
            backend=CommBackend.GLOO,
            num_ests=args.ests,
            procs=args.ests,
            steps=steps + 2,
            result_path=str(Path(tmp) / "r.json"),
            init_method=f"tcp://127.0.0.1:{free_port()}",
            options={"hidden": args.hidden, "batch": args.batch, "steps": steps},
        )
        result = start(spec, Path(tmp), Path(__file__), name="sep").wait()
        if not result.ok or result.result is None:
            raise RuntimeError(f"separate-process run failed:\n{result.tail()}")
        elapsed = float(result.result["bench_s"])
        return float(steps * args.ests * args.batch) / elapsed


def main() -> None:
    if read_environment().est_spec is not None:
        launched_worker()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ests", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48, help="EST-steps per throughput measurement")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem-reps", type=int, default=2, help="processes per N for the memory curve")
    ap.add_argument("--memory-worker", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker, args)
        return
    t0 = time.perf_counter()
    model, _ = build(args.hidden)
    params = sum(p.numel() for p in model.parameters())
    inproc = in_process(args)
    sep = separate_processes(args)
    mem, mem_runs = memory_curve(args)
    ratio_1 = inproc["est8"] / inproc["est1"]
    ratio_sep = inproc["est8"] / sep
    growth = (mem[8] - mem[1]) / mem[1]
    print(f"MLP {params / 1e6:.2f} M parameters, batch {args.batch} per EST, {args.steps} EST-steps per measurement")
    print(f"  plain PyTorch loop (no EST runtime)  {inproc['plain']:9.1f} samples/s")
    print(f"  1 EST  on 1 process                  {inproc['est1']:9.1f} samples/s")
    print(f"  {args.ests} ESTs on 1 process                  {inproc['est8']:9.1f} samples/s")
    print(f"  {args.ests} ESTs on {args.ests} processes (gloo)         {sep:9.1f} samples/s")
    print(f"  ratio {args.ests} ESTs / 1 EST: {ratio_1:.3f} (goal >= 0.97); / {args.ests} processes: {ratio_sep:.3f}")
    print(f"  1 EST vs plain loop: {inproc['est1'] / inproc['plain']:.3f}")
    print(f"  context switch (RNG + buffers + deposit): {inproc['switch_s'] * 1e3:.2f} ms")
    print(
        "  peak RSS while training, by N (min of runs): "
        + ", ".join(f"N={n}: {kb / 1024:.1f} MiB" for n, kb in mem.items())
    )
    print(
        "  all runs (MiB): "
        + "; ".join(f"N={n}: " + ",".join(f"{kb / 1024:.1f}" for kb in v) for n, v in mem_runs.items())
    )
    print(f"  peak memory growth 1 -> 8 ESTs: {growth * 100:.2f} % (goal <= 5 %)")
    print(
        json.dumps(
            {
                "bench": "est",
                "params": params,
                "batch_per_est": args.batch,
                "ests": args.ests,
                "plain_samples_s": round(inproc["plain"], 1),
                "est1_samples_s": round(inproc["est1"], 1),
                "est8_samples_s": round(inproc["est8"], 1),
                "separate_procs_samples_s": round(sep, 1),
                "ratio_est8_vs_est1": round(ratio_1, 4),
                "ratio_est8_vs_separate_procs": round(ratio_sep, 4),
                "ratio_est1_vs_plain": round(inproc["est1"] / inproc["plain"], 4),
                "context_switch_ms": round(inproc["switch_s"] * 1e3, 3),
                "peak_rss_kib": mem,
                "peak_rss_kib_runs": mem_runs,
                "peak_memory_growth_1_to_8": round(growth, 4),
                "goals": {"ratio_est8_vs_est1": 0.97, "peak_memory_growth_1_to_8": 0.05},
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
