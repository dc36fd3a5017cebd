"""Checkpoint benchmarks, measured side by side on the shared filesystem (the GPFS stand-in).

1. ``save``: one rank saves ``--size-gb`` of fp32 state with :class:`hpc_elastic.checkpoint.CheckpointStore`
   (torch.save stream + sha256 + fsync + rename + manifest) vs ``dd`` writing the same bytes
   (``conv=fsync``, source file in the page cache) on the same filesystem.  Goal: ours >= 0.8x dd's throughput.
2. ``stall``: how long a training loop is blocked by one checkpoint of a model of ``--model-mb`` (parameters +
   SGD momentum), with a synchronous commit vs an asynchronous one (copy to host memory, persist off the
   critical path).  Also the time for the asynchronous save to be durable.
3. ``signal``: on the dev cluster (skipped with a reason when none answers), time from the preemption signal
   (``scancel --signal=USR1 --batch``, what the plugin sends) to the checkpoint acknowledgement on the shared
   filesystem and to the job being requeued (pending again, restart count 1).  Goal: <= 15 s.

Median of ``--repeats``; the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.env import read_environment
from hpc_elastic.session import Session
from hpc_elastic.slurm import SlurmError, connect

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "wrappers" / "examples" / "train_mlp.py"


def bench_save(root: Path, size_gb: float, repeats: int) -> dict[str, Any]:
    numel = int(size_gb * (1 << 30)) // 4
    tensor = torch.rand(numel, generator=torch.Generator().manual_seed(0))
    nbytes = tensor.numel() * 4
    src = root / "dd-source.bin"
    src.write_bytes(tensor.numpy().tobytes())  # the same bytes, in the page cache, for dd to copy
    ours: list[float] = []
    dd: list[float] = []

    def save_ours(i: int) -> None:
        store = CheckpointStore(root / f"ours-{i}", keep=1)
        t0 = time.perf_counter()
        store.save(1, {"weights": tensor}, meta={"bench": True})
        ours.append(time.perf_counter() - t0)
        shutil.rmtree(root / f"ours-{i}")

    def save_dd(i: int) -> None:
        dst = root / f"dd-{i}.bin"
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=8M", "conv=fsync", "status=none"], check=True, timeout=600)
        dd.append(time.perf_counter() - t0)
        dst.unlink()

    for i in range(repeats):
        # Each side starts with no dirty pages left by the other (the source file, a deleted 1 GB file), and
        # the sides take turns going first.
        for run in (save_ours, save_dd) if i % 2 == 0 else (save_dd, save_ours):
            os.sync()
            run(i)
    src.unlink()
    t_ours, t_dd = statistics.median(ours), statistics.median(dd)
    print(f"save {nbytes / 1e9:.2f} GB: ours {t_ours:.2f} s ({nbytes / t_ours / 1e9:.2f} GB/s), dd {t_dd:.2f} s")
    print(f"  throughput ours/dd = {t_dd / t_ours:.2f}x (goal >= 0.8x)")
    return {"save_bytes": nbytes, "save_s": t_ours, "dd_s": t_dd, "save_vs_dd": t_dd / t_ours}


def bench_stall(root: Path, model_mb: float, repeats: int) -> dict[str, Any]:
    width = 2048
    layers = max(1, int(model_mb * (1 << 20) / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # momentum buffers exist: they are part of the state
    state_mb = 2 * sum(p.numel() for p in model.parameters()) * 4 / (1 << 20)
    figures: dict[str, list[float]] = {"sync": [], "async": [], "async_durable": []}
    for mode in ("sync", "async"):
        session = Session.local(root / f"stall-{mode}", keep=1)
        state = session.state(model, optimizer, mode=mode)
        for step in range(1, repeats + 1):
            state.step = step
            t0 = time.perf_counter()
            state.commit()
            figures[mode].append(time.perf_counter() - t0)
            state.wait()
            if mode == "async":
                figures["async_durable"].append(time.perf_counter() - t0)
        session.close()
    sync_s, async_s = statistics.median(figures["sync"]), statistics.median(figures["async"])
    durable_s = statistics.median(figures["async_durable"])
    print(f"stall per checkpoint of {state_mb:.0f} MB: sync {sync_s * 1e3:.0f} ms, async {async_s * 1e3:.0f} ms")
    print(f"  async stall / sync stall = {async_s / sync_s:.2f}; async durable after {durable_s * 1e3:.0f} ms")
    return {
        "state_mb": state_mb,
        "stall_sync_s": sync_s,
        "stall_async_s": async_s,
        "async_durable_s": durable_s,
        "async_vs_sync_stall": async_s / sync_s,
    }


def bench_signal(root: Path) -> dict[str, Any]:
    try:
        slurm = connect(read_environment())
        slurm.ping()
    except SlurmError as exc:
        print(f"signal: skipped, no dev cluster answers ({exc})")
        return {"signal_skipped": str(exc)}
    out = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "submit", str(TRAIN), f"--ckpt-root={root}", "--gpus=0", "--procs=2",
         "--workers=4", "--partition=cpu", "--job-name=bench-ckpt", "--", "--steps=100000", "--step-delay=0.05",
         f"--trace={root / 'trace'}"],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    job_id = int(out.stdout.strip())
    job_dir = root / f"bench-ckpt-{job_id}"
    try:
        _wait(lambda: len(list((root / "trace").glob("*.jsonl"))) == 2, 120)  # both workers are training
        time.sleep(1.0)
        t0 = time.monotonic()
        slurm.cancel([job_id], "USR1", batch=True)
        _wait((job_dir / "control" / "ack.json").exists, 120)
        ack_s = time.monotonic() - t0
        _wait(lambda: slurm.job(job_id).restart_count >= 1, 120)
        requeue_s = time.monotonic() - t0
    finally:
        slurm.cancel([job_id])
    print(f"signal -> checkpoint acknowledged {ack_s:.2f} s, -> requeued {requeue_s:.2f} s (goal <= 15 s)")
    return {"signal_to_ack_s": ack_s, "signal_to_requeue_s": requeue_s}


def _wait(probe: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--model-mb", type=float, default=128.0, help="parameters (the state is twice that)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-signal", action="store_true", help="do not use the dev cluster")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = read_environment().gpfs_root / "bench"
    base.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"filesystem": str(base)}
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        root = Path(tmp)
        figures |= bench_save(root, args.size_gb, args.repeats)
        figures |= bench_stall(root, args.model_mb, args.repeats)
        if not args.skip_signal:
            figures |= bench_signal(root)
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
