"""The runtime's overhead on a model of realistic size, side by side in one run.

The model is the CIFAR ResNet-18 of ``hpc_elastic.models`` (11.2 M parameters, BatchNorm everywhere), trained with
SGD + momentum on in-memory images served through the runtime's loader; one intra-op thread everywhere (what the
runtime fixes for determinism), repetitions interleaved so every configuration sees the same machine load.

1. The D1 runtime with 1 EST on 1 process against a plain PyTorch loop of the same model (goal >= 0.90x).
2. 8 ESTs on 1 process against 1 EST on 1 process, same per-EST batch (goal >= 0.97x).
3. The same 8 ESTs as 8 separate processes (N = M = 8, gloo), for context.
4. Peak memory (RSS high-water mark of fresh processes) with N = 1, 2, 4, 8 ESTs on one process (goal <= 5 %
   growth from 1 to 8).
5. The cost of one context switch (RNG states, buffers, deposit of the EST's gradient).

Prints one line per measurement and, last, one JSON object.  Usage::

    python bench/est.py [--ests 8] [--batch 8] [--steps 16] [--rounds 3] [--model resnet18]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hpc_elastic import models
from hpc_elastic.env import read_job_environment
from hpc_elastic.est.determinism import apply_determinism, seed_everything
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers
from hpc_elastic.session import Session
from hpc_elastic.state import State

MODELS: dict[str, Callable[[], models.ModelBundle]] = {
    "resnet18": models.resnet18,
    "resnet_like": models.resnet_like,
}


def build(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    seed_everything(0)
    model = MODELS[name]()[0]
    model.train()
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, *models.IMAGE_SHAPE, generator=g), torch.randint(0, 10, (n,), generator=g))


def run_state(state: State, model: nn.Module, steps: int) -> float:
    """Seconds for ``steps`` global steps."""
    start = time.perf_counter()
    target = state.step + steps
    while state.step < target:
        for x, y in state.batches():
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        state.finish_step()
    return time.perf_counter() - start


def make_state(n: int, args: argparse.Namespace, session: Session | None = None) -> tuple[State, nn.Module]:
    session = session if session is not None else Session.local(num_workers=n, seed=0)
    model, opt = build(args.model)
    # the same data whatever N: memory is compared across N
    state = session.state(model, opt, data=dataset(args.batch * args.ests * 16), batch_size=args.batch)
    return state, model


def plain_seconds(model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, ...]]) -> float:
    """A plain PyTorch loop over the same batches (no ESTs, no deterministic reduction)."""
    start = time.perf_counter()
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - start


def in_process(args: argparse.Namespace) -> dict[str, float]:
    apply_determinism(DeterminismLevel.D1, 1)
    est_steps = args.steps  # EST-steps per measurement, the same for every configuration
    samples = est_steps * args.batch
    one, m1 = make_state(1, args)
    many, m8 = make_state(args.ests, args)
    model, opt = build(args.model)
    data = dataset(args.batch * est_steps)
    batches = [data[i * args.batch : (i + 1) * args.batch] for i in range(est_steps)]
    run_state(one, m1, 2)  # warm-up
    run_state(many, m8, 1)
    plain_seconds(model, opt, batches[:2])
    res: dict[str, list[float]] = {"plain": [], "est1": [], "est8": []}
    for _ in range(args.rounds):
        res["plain"].append(samples / plain_seconds(model, opt, batches))
        res["est1"].append(samples / run_state(one, m1, est_steps))
        res["est8"].append(samples / run_state(many, m8, est_steps // args.ests))
    switches = []
    for _ in range(3):  # global steps whose ESTs do nothing: what remains is the switching itself
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
    """Peak resident memory while training with ``n`` ESTs: the high-water mark is reset (Linux clear_refs) once
    torch and the optimizer machinery are loaded, so import-time transients cannot hide the runtime's own peak."""
    apply_determinism(DeterminismLevel.D1, 1)
    model, opt = build(args.model)
    x, y = dataset(args.batch)[:]
    F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
    opt.step()  # imports what the first optimizer step imports
    del model, opt
    Path("/proc/self/clear_refs").write_text("5")
    state, model = make_state(n, args)
    run_state(state, model, 2)
    print(json.dumps({"ests": n, "peak_kb": _status_kb("VmHWM")}))


def memory_curve(args: argparse.Namespace) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Peak RSS per N, the minimum of ``args.mem_reps`` fresh processes (allocator noise is a few MiB)."""
    runs: dict[int, list[int]] = {n: [] for n in (1, 2, 4, 8)}
    for _ in range(args.mem_reps):
        for n, values in runs.items():
            cmd = [sys.executable, __file__, "--memory-worker", str(n), "--model", args.model]
            cmd += ["--batch", str(args.batch), "--ests", str(args.ests)]
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
            values.append(int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_kb"]))
    return {n: min(v) for n, v in runs.items()}, runs


def launched_worker(args: argparse.Namespace) -> None:
    """One of the M processes of part 3 (started by the launcher)."""
    session = Session.from_environment(seed=0)
    state, model = make_state(session.num_workers, args, session)
    run_state(state, model, 1)
    session.barrier()
    elapsed = run_state(state, model, args.steps // args.ests)
    session.barrier()
    if session.is_root and read_job_environment().job_dir is not None:
        Path(str(read_job_environment().job_dir), "bench.json").write_text(json.dumps({"bench_s": elapsed}))
    session.close()


def separate_processes(args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        command = (sys.executable, __file__, "--launched", "--model", args.model, "--batch", str(args.batch))
        step = WorkerStep(
            command=(*command, "--steps", str(args.steps), "--ests", str(args.ests)),
            ntasks=args.ests,
            num_ests=args.ests,
            job_dir=Path(tmp),
            launcher=Launcher.LOCAL,
        )
        code = start_workers(step, logs=Path(tmp) / "logs").wait()
        if code:
            logs = "".join(p.read_text() for p in sorted((Path(tmp) / "logs").glob("*.log")))
            raise SystemExit(f"the separate-process run failed (exit {code}):\n{logs[-3000:]}")
        elapsed = float(json.loads((Path(tmp) / "bench.json").read_text())["bench_s"])
        return float((args.steps // args.ests) * args.ests * args.batch) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    ap.add_argument("--ests", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="mini-batch per EST")
    ap.add_argument("--steps", type=int, default=16, help="EST-steps per throughput measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem-reps", type=int, default=2, help="processes per N for the memory curve")
    ap.add_argument("--memory-worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker, args)
        return
    if args.launched:
        launched_worker(args)
        return
    t0 = time.perf_counter()
    params = sum(p.numel() for p in build(args.model)[0].parameters())
    inproc = in_process(args)
    sep = separate_processes(args)
    mem, mem_runs = memory_curve(args)
    ratio_plain = inproc["est1"] / inproc["plain"]
    ratio_1 = inproc["est8"] / inproc["est1"]
    ratio_sep = inproc["est8"] / sep
    growth = (mem[8] - mem[1]) / mem[1]
    print(f"{args.model}: {params / 1e6:.2f} M parameters, batch {args.batch} per EST, {args.steps} EST-steps each")
    print(f"  plain PyTorch loop (no EST runtime)  {inproc['plain']:9.2f} samples/s")
    print(f"  1 EST  on 1 process (D1)             {inproc['est1']:9.2f} samples/s")
    print(f"  {args.ests} ESTs on 1 process (D1)             {inproc['est8']:9.2f} samples/s")
    print(f"  {args.ests} ESTs on {args.ests} processes (gloo, D1)    {sep:9.2f} samples/s")
    print(f"  1 EST / plain loop: {ratio_plain:.3f} (goal >= 0.90)")
    print(f"  {args.ests} ESTs / 1 EST: {ratio_1:.3f} (goal >= 0.97); / {args.ests} processes: {ratio_sep:.3f}")
    print(f"  context switch (RNG + buffers + deposit): {inproc['switch_s'] * 1e3:.2f} ms")
    peaks = ", ".join(f"N={n}: {kb / 1024:.1f} MiB" for n, kb in mem.items())
    print(f"  peak RSS while training, by N (min of runs): {peaks}")
    print(f"  peak memory growth 1 -> 8 ESTs: {growth * 100:.2f} % (goal <= 5 %)")
    print(
        json.dumps(
            {
                "bench": "est",
                "model": args.model,
                "params": params,
                "batch_per_est": args.batch,
                "ests": args.ests,
                "plain_samples_s": round(inproc["plain"], 2),
                "est1_samples_s": round(inproc["est1"], 2),
                "est8_samples_s": round(inproc["est8"], 2),
                "separate_procs_samples_s": round(sep, 2),
                "ratio_est1_vs_plain": round(ratio_plain, 4),
                "ratio_est8_vs_est1": round(ratio_1, 4),
                "ratio_est8_vs_separate_procs": round(ratio_sep, 4),
                "context_switch_ms": round(inproc["switch_s"] * 1e3, 3),
                "peak_rss_kib": mem,
                "peak_rss_kib_runs": mem_runs,
                "peak_memory_growth_1_to_8": round(growth, 4),
                "goals": {"ratio_est1_vs_plain": 0.90, "ratio_est8_vs_est1": 0.97, "peak_memory_growth_1_to_8": 0.05},
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
