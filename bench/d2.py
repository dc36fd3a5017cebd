"""D2 operators vs the stock kernels: one training step (forward, loss, backward) of the reference models.

For ``hpc_elastic.models.resnet_like``, ``vgg_like``, ``transformer_small`` and ``lstm_small`` (``--models``: also
``resnet18``, CIFAR ResNet-18) and every device present (the CPU, and the GPU when torch sees one), times
interleaved repetitions of

- ``stock``: the model as built, ``F.cross_entropy``, autograd's backward (torch's own kernels: oneDNN/MKL on the
  CPU, cuDNN/cuBLAS on the GPU);
- ``d2``: the same model after :func:`hpc_elastic.est.d2.to_d2` with :func:`det_cross_entropy` (the D2 operators:
  the same bits on every device),
- on a GPU also ``stock_graph`` and ``d2_graph``: each step captured once in a CUDA graph
  (:func:`hpc_elastic.est.gpu.capture_step`) and replayed (the D2 step launches some 2,000 small kernels; a replay
  launches them without Python), with ``graph_ratio`` = d2_graph / stock (eager) and ``graph_ratio_both`` =
  d2_graph / stock_graph,

and reports the median step times (wall clock, and the process's CPU time: on a shared machine the CPU time of a
one-thread run, ``--threads 1``, is the steadier measure) and their ratios d2 / stock, with the machine's load
average before and after (other jobs on a shared machine slow both paths, not always alike).  The two start from
the same weights and the same batch; their losses agree to float32 rounding (printed).  Prints one line per
measurement and, last, one JSON object.

``--products`` instead times the fixed-order product alone (``kernels/``' ``matmul_nt_view``) on the operands of
every product one D2 step of ``resnet_like`` runs (recorded during a step, then replayed), once per build of the
product's step this CPU runs (``avx512``, ``avx2``, ``scalar`` unless ``--paths`` names fewer; the extension picks the
widest), next to torch's ``a @ b.T`` on dense copies of the same operands: process CPU time, medians, GF/s (2 m n k
per product) and each path's total over the step.  Usage::

    python bench/d2.py [--batch 32] [--reps 5] [--threads N] [--devices cpu,cuda] [--paths avx2] [--models resnet18]
    python bench/d2.py --products [--paths avx512,avx2]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpc_elastic import models
from hpc_elastic.est import detsum
from hpc_elastic.est.d2 import scan_model, to_d2
from hpc_elastic.est.d2_ops import det_cross_entropy
from hpc_elastic.est.gpu import CapturedStep, capture_step

MODELS: dict[str, Callable[[], models.ModelBundle]] = {
    "resnet_like": models.resnet_like,
    "vgg_like": models.vgg_like,
    "transformer_small": models.transformer_small,
    "lstm_small": models.lstm_small,
    "resnet18": models.resnet18,
}
#: measured unless --models names others (resnet18, 11.2 M parameters, takes about a second a step on 2 CPU cores)
DEFAULT_MODELS = ("resnet_like", "vgg_like", "transformer_small", "lstm_small")


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forward_backward(model: nn.Module, loss_fn: LossFn, x: Any, y: Any) -> torch.Tensor:
    """One step without the optimizer: fresh gradients (set to None, so that a captured backward allocates them in
    its graph's memory), the loss, its backward; returns the loss."""
    for p in model.parameters():
        p.grad = None
    loss = loss_fn(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def timed(device: torch.device, fn: Callable[[], float]) -> tuple[float, float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    loss = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, loss


def measure(name: str, device: torch.device, batch: int, reps: int, graphs: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model, sample = MODELS[name]()[:2]
    x, y = sample(batch)
    stock = model.to(device)
    det = to_d2(copy.deepcopy(stock))
    assert scan_model(det).holds, scan_model(det).first_problem()
    x, y = x.to(device), y.to(device)  # type: ignore[union-attr]
    runs: dict[str, Callable[[], float]] = {}
    result: dict[str, Any] = {"model": name, "device": device.type, "batch": batch}
    for key, module, loss_fn in (("stock", stock, F.cross_entropy), ("d2", det, det_cross_entropy)):
        runs[key] = functools.partial(eager_step, module, loss_fn, x, y)
        if graphs:
            # a copy of the model, so that the eager runs' gradients stay theirs
            step = functools.partial(forward_backward, copy.deepcopy(module), loss_fn, x, y)
            try:
                captured = capture_step(step)
            except RuntimeError as err:  # an operator that synchronises with the host: reported, the rest measured
                result[f"{key}_graph_error"] = str(err).splitlines()[0]
            else:
                runs[f"{key}_graph"] = functools.partial(replayed_step, captured)
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu_times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, float] = {}
    for rep in range(reps + 1):  # the first round warms up (allocator, CUDA extension build, oneDNN plans)
        for key, run in runs.items():
            seconds, cpu, losses[key] = timed(device, run)
            if rep:
                times[key].append(seconds)
                cpu_times[key].append(cpu)
    for key in runs:
        result[f"{key}_s"] = statistics.median(times[key])
        result[f"{key}_cpu_s"] = statistics.median(cpu_times[key])
        result[f"loss_{key}"] = losses[key]
    result["ratio"] = result["d2_s"] / result["stock_s"]
    result["cpu_ratio"] = result["d2_cpu_s"] / result["stock_cpu_s"]
    # the D2 step replayed from a graph against the stock step as users run it (eager), and against the stock step
    # replayed from a graph too
    if "d2_graph" in runs:
        result["graph_ratio"] = result["d2_graph_s"] / result["stock_s"]
    if "d2_graph" in runs and "stock_graph" in runs:
        result["graph_ratio_both"] = result["d2_graph_s"] / result["stock_graph_s"]
    return result


def eager_step(model: nn.Module, loss_fn: LossFn, x: Any, y: Any) -> float:
    return float(forward_backward(model, loss_fn, x, y).item())


def replayed_step(captured: CapturedStep[torch.Tensor]) -> float:
    return float(captured.replay().item())


def record_products(batch: int) -> list[tuple[Any, ...]]:
    """The operands of every product of one D2 training step of ``resnet_like`` on the CPU (copies, one thread)."""
    torch.manual_seed(0)
    model, sample = models.resnet_like()[:2]
    x, y = sample(batch)
    det = to_d2(model)
    kernels = detsum.cpu_kernels()
    calls: list[tuple[Any, ...]] = []
    original = kernels.matmul_nt_parts

    def recording(a: Any, ga: Any, b: Any, gb: Any, out: Any, *, parts: Any, threads: int) -> None:
        for part in parts.reshape(-1, detsum.PART_VALUES):  # (one part per product on one thread)
            pa, pb, rows, og = detsum.part_geometries(ga, gb, part)
            calls.append((a.copy(), pa, b.copy(), pb, out.shape, rows, og))
        original(a, ga, b, gb, out, parts=parts, threads=threads)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kernels.matmul_nt_parts = recording  # type: ignore[method-assign]
    try:
        eager_step(det, det_cross_entropy, x, y)
    finally:
        del kernels.matmul_nt_parts
        torch.set_num_threads(threads)
    return calls


def cpu_median(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure_products(batch: int, reps: int, wanted: list[str] | None) -> dict[str, Any]:
    """Each recorded product timed on every path and with torch (see the module doc)."""
    ext = detsum.c_extension()
    kernels = detsum.CKernels(ext)
    # an extension without the private path switch runs its one default path
    paths: list[str] = list(ext._matmul_paths()) if hasattr(ext, "_matmul_paths") else ["default"]
    if wanted is not None:
        paths = [p for p in paths if p in wanted]
    calls = record_products(batch)
    totals = dict.fromkeys([*paths, "torch"], 0.0)
    flops_total = 0.0
    rows_out = []
    try:
        for a, ga, b, gb, shape, span, og in calls:
            am, bm = detsum.view_matrix(a, ga)[span[0] : span[1]], detsum.view_matrix(b, gb)
            m, k = am.shape
            n = bm.shape[0]
            flops = 2.0 * m * n * k
            flops_total += flops
            out = np.empty(shape, np.float32)
            row: dict[str, Any] = {"m": m, "n": n, "k": k, "a_dense": bool(ga[1] == 1 and ga[2] == 1)}
            for path in paths:
                if path != "default":
                    ext._matmul_path(path)
                call = functools.partial(kernels.matmul_nt_view, a, ga, b, gb, out, rows=span, out_geometry=og)
                t = cpu_median(call, reps)
                totals[path] += t
                row[path] = flops / t / 1e9
            ta, tb = torch.from_numpy(np.ascontiguousarray(am)), torch.from_numpy(np.ascontiguousarray(bm))
            t = cpu_median(functools.partial(torch.matmul, ta, tb.T), reps)
            totals["torch"] += t
            row["torch"] = flops / t / 1e9
            rows_out.append(row)
            print(
                f"[{m:6d} x {k:5d}] @ [{n:6d} x {k:5d}].T: "
                + ", ".join(f"{p} {row[p]:6.1f}" for p in [*paths, "torch"])
                + " GF/s"
            )
    finally:
        if hasattr(ext, "_matmul_path"):
            ext._matmul_path("auto")
    print(
        f"{len(calls)} products of one resnet_like step (batch {batch}), total CPU time: "
        + ", ".join(f"{p} {t * 1e3:.1f} ms ({flops_total / t / 1e9:.1f} GF/s)" for p, t in totals.items())
    )
    for p in paths:
        print(f"  {p} / torch: {totals[p] / totals['torch']:.2f}x")
    return {"products": rows_out, "total_s": totals, "gflop": flops_total / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--products", action="store_true", help="time the product alone on resnet_like's products")
    p.add_argument(
        "--paths",
        default=None,
        help="with --products: comma-separated paths to time (default: all); else one path the steps' products take",
    )
    p.add_argument("--devices", default=None, help="comma-separated devices (default: cpu, and cuda if present)")
    p.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated models of {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    args = p.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"--models: unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.products:
        load_before = os.getloadavg()[0]
        wanted = args.paths.split(",") if args.paths else None
        summary = measure_products(args.batch, args.reps, wanted)
        load_after = os.getloadavg()[0]
        print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
        print(json.dumps({"threads": torch.get_num_threads(), "load": [load_before, load_after], **summary}))
        return
    if args.paths:
        detsum.c_extension()._matmul_path(args.paths)  # ValueError naming it if this CPU has no such path
    if args.devices:
        devices = [torch.device(name) for name in args.devices.split(",")]
    else:
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    results = []
    load_before = os.getloadavg()[0]
    for device in devices:
        for name in names:
            r = measure(name, device, args.batch, args.reps, graphs=device.type == "cuda")
            results.append(r)
            print(
                f"{r['model']:12s} {r['device']:4s} batch {r['batch']}: stock {r['stock_s'] * 1e3:8.1f} ms, "
                f"d2 {r['d2_s'] * 1e3:8.1f} ms, ratio {r['ratio']:.2f}; process CPU time ratio {r['cpu_ratio']:.2f} "
                f"(loss {r['loss_stock']:.6f} / {r['loss_d2']:.6f})"
            )
            for key in ("stock", "d2"):
                if f"{key}_graph_s" in r:
                    print(
                        f"{'':12s} {r['device']:4s} {key} in a CUDA graph: {r[f'{key}_graph_s'] * 1e3:8.1f} ms "
                        f"(loss {r[f'loss_{key}_graph']:.6f})"
                    )
                elif f"{key}_graph_error" in r:
                    print(f"{'':12s} {r['device']:4s} {key} not captured: {r[f'{key}_graph_error']}")
            if "graph_ratio" in r:
                print(f"{'':12s} {r['device']:4s} d2 graph / stock eager {r['graph_ratio']:.2f}", end="")
                both = r.get("graph_ratio_both")
                print("" if both is None else f", d2 graph / stock graph {both:.2f}")
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    summary = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load": [load_before, load_after],
        "path": args.paths or "auto",
    }
    print(json.dumps({**summary, "results": results}))


if __name__ == "__main__":
    main()
