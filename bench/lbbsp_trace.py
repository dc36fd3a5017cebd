"""Record a CPU worker's sample-processing speed under periodic contention (the trace LB-BSP Alg. 1 predicts).

LB-BSP §3.2.2 predicts a CPU worker's speed v^k from the look-back of its speed and of the "driving resources", CPU
and memory usage (Eq. 4).  This records such a series on this machine, for real, once: a worker process runs a
CPU-bound numpy loop (``--samples`` 128x128 matrix products per iteration, one BLAS thread) pinned to CPU 0, and a
competitor process pinned to the same CPU alternates between a busy loop holding ``--competitor-mb`` MiB and sleep,
for seeded random durations of 0.5 to 2.5 s.  Before each iteration the worker sleeps ``--probe-ms`` while psutil
measures how busy CPU 0 is (the load of everything else on the worker's CPU: c^k) and reads the machine's memory
usage (m^k); then it times the iteration (v^k = samples / seconds).  Other processes on the machine add their own,
unscripted, contention.

Writes a CSV with a commented header (``#`` lines) describing the run, then ``k,speed,cpu,mem,competitor``
(``competitor`` is the competitor's scripted state, 1 = busy; for reading the trace, not an input to predictors).
Usage::

    python bench/lbbsp_trace.py --out tests/fixtures/lbbsp_speed_trace.csv [--iterations 1200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

CPU = 0


def compete(seed: int, megabytes: int, state: Any, stop: Any) -> None:
    os.sched_setaffinity(0, {CPU})
    rng = random.Random(seed)
    busy = False
    while not stop.is_set():
        until = time.monotonic() + rng.uniform(0.5, 2.5)
        state.value = int(busy)
        if busy:
            hold = bytearray(megabytes << 20)
            for i in range(0, len(hold), 4096):  # touch every page so the memory is resident
                hold[i] = 1
            x = 0
            while time.monotonic() < until and not stop.is_set():
                for i in range(20000):
                    x += i * i
            del hold
        else:
            stop.wait(max(0.0, until - time.monotonic()))
        busy = not busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=1200)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--probe-ms", type=float, default=50.0)
    parser.add_argument("--competitor-mb", type=int, default=512)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import numpy as np  # noqa: PLC0415 - after the thread settings, which numpy reads when it loads

    os.sched_setaffinity(0, {CPU})
    state = mp.Value("i", 0)
    stop = mp.Event()
    competitor = mp.Process(target=compete, args=(args.seed, args.competitor_mb, state, stop), daemon=True)
    competitor.start()
    rng = np.random.default_rng(args.seed)
    a = rng.standard_normal((128, 128))
    b = rng.standard_normal((128, 128))
    rows = []
    psutil.cpu_percent(percpu=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        for k in range(args.iterations):
            cpu = psutil.cpu_percent(interval=args.probe_ms / 1000, percpu=True)[CPU] / 100.0
            mem = psutil.virtual_memory().percent / 100.0
            busy = state.value
            t0 = time.perf_counter()
            acc = a
            for _ in range(args.samples):
                acc = np.tanh(acc @ b * 0.01)
            seconds = time.perf_counter() - t0
            rows.append(f"{k},{args.samples / seconds:.3f},{cpu:.3f},{mem:.4f},{busy}")
    finally:
        stop.set()
        competitor.join(10)
    header = [
        "# LB-BSP Alg. 1 speed trace, recorded once by bench/lbbsp_trace.py (see its docstring)",
        f"# started {started}; host {platform.machine()} with {psutil.cpu_count()} CPUs shared with other work;"
        f" worker and competitor pinned to CPU {CPU}",
        f"# {args.iterations} iterations of {args.samples} samples (128x128 matmul + tanh each, one BLAS thread);"
        f" probe {args.probe_ms:g} ms; competitor {args.competitor_mb} MiB busy loop, on/off 0.5-2.5 s,"
        f" seed {args.seed}",
        "# speed: samples/s of iteration k; cpu: busy fraction of CPU 0 during the probe before iteration k (the"
        " worker idle); mem: machine memory used fraction before k; competitor: its scripted state (1 busy)",
        "k,speed,cpu,mem,competitor",
    ]
    args.out.write_text("\n".join(header + rows) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
