"""PS transport candidates side by side in one run: torch.distributed.rpc (TensorPipe) against gRPC (the project's
:mod:`hpc_elastic.ps.rpc`: one generic unary method, :mod:`hpc_elastic.ps.wire` messages) between local processes.

Two server processes (one per transport) hold the same state: dense fp32 tensors and an embedding table
(``--rows`` x ``--dim`` fp32). The client, this process, times the PS operations on both, interleaved round by
round so that a busy machine slows both alike:

- ``push`` of a dense tensor (the server adds it into its copy) and ``pull`` of it, 1 KB to 16 MB;
- ``gather`` of rows of the table by id (sparse pull) and ``scatter`` (sparse push: the server adds the rows into
  the table; ids unique, as a worker sends them), 512 and 8192 rows.

Each figure is the median over ``--rounds`` rounds of the mean time of one operation in a batch of ~0.1 s;
MB/s counts the payload (tensor or rows, plus ids), ops/s one operation. Prints a table with the ratio grpc/torch
(> 1: gRPC is faster) and, last, one JSON object. Usage::

    python bench/ps_transport.py [--rounds 5] [--rows 100000] [--dim 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed import rpc

from hpc_elastic.launch.workers import free_port
from hpc_elastic.ps import rpc as grpc_rpc

DENSE_BYTES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)
SPARSE_ROWS = (512, 8192)

# -- the torch.distributed.rpc server's state and functions (run in the server process) ---------------------------
DENSE: dict[str, torch.Tensor] = {}
TABLE: list[torch.Tensor] = []


def t_setup(rows: int, dim: int) -> None:
    TABLE.append(torch.zeros(rows, dim))


def t_push(key: str, tensor: torch.Tensor) -> None:
    if key in DENSE:
        DENSE[key].add_(tensor)
    else:
        DENSE[key] = tensor.clone()


def t_pull(key: str) -> torch.Tensor:
    return DENSE[key]


def t_gather(ids: torch.Tensor) -> torch.Tensor:
    return TABLE[0][ids]


def t_scatter(ids: torch.Tensor, rows: torch.Tensor) -> None:
    TABLE[0][ids] += rows


def serve_torch(port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("ps", rank=0, world_size=2)
    rpc.shutdown()  # waits for the client's shutdown


def serve_grpc(port: int, rows: int, dim: int) -> None:
    dense: dict[str, np.ndarray[Any, Any]] = {}
    table = np.zeros((rows, dim), dtype=np.float32)

    def push(h: dict[str, Any], a: dict[str, np.ndarray[Any, Any]]) -> grpc_rpc.Reply:
        if h["key"] in dense:
            dense[h["key"]] += a["t"]
        else:
            dense[h["key"]] = a["t"].copy()
        return {}, {}

    def pull(h: dict[str, Any], a: dict[str, np.ndarray[Any, Any]]) -> grpc_rpc.Reply:
        return {}, {"t": dense[h["key"]]}

    def gather(h: dict[str, Any], a: dict[str, np.ndarray[Any, Any]]) -> grpc_rpc.Reply:
        return {}, {"rows": table[a["ids"]]}

    def scatter(h: dict[str, Any], a: dict[str, np.ndarray[Any, Any]]) -> grpc_rpc.Reply:
        table[a["ids"]] += a["rows"]
        return {}, {}

    def stop(h: dict[str, Any], a: dict[str, np.ndarray[Any, Any]]) -> grpc_rpc.Reply:
        done.append(True)
        return {}, {}

    done: list[bool] = []
    server, _ = grpc_rpc.serve(
        {"push": push, "pull": pull, "gather": gather, "scatter": scatter, "stop": stop}, port=port, threads=4
    )
    while not done:
        time.sleep(0.05)
    server.stop(grace=1)


def timed(op: Callable[[], object], budget: float = 0.1) -> Callable[[], float]:
    """A measurement: the mean seconds of one ``op`` over a batch sized to take about ``budget`` seconds."""
    start = time.perf_counter()
    op()
    op()
    one = max((time.perf_counter() - start) / 2, 1e-6)
    n = max(1, min(2000, int(budget / one)))

    def measure() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        return (time.perf_counter() - t0) / n

    return measure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--serve", choices=["torch", "grpc"])
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.serve == "torch":
        serve_torch(args.port)
        return
    if args.serve == "grpc":
        serve_grpc(args.port, args.rows, args.dim)
        return

    tport, gport = free_port(), free_port()
    me = [sys.executable, os.path.abspath(__file__), "--rows", str(args.rows), "--dim", str(args.dim)]
    servers = [
        subprocess.Popen([*me, "--serve", "torch", "--port", str(tport)]),
        subprocess.Popen([*me, "--serve", "grpc", "--port", str(gport)]),
    ]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(tport))
    rpc.init_rpc("worker", rank=1, world_size=2)
    rpc.rpc_sync("ps", t_setup, args=(args.rows, args.dim))
    client = grpc_rpc.Client(f"127.0.0.1:{gport}")
    rng = np.random.default_rng(0)

    cases: list[tuple[str, int, int, Callable[[], object], Callable[[], object]]] = []
    for nbytes in DENSE_BYTES:
        arr = rng.standard_normal(nbytes // 4).astype(np.float32)
        ten = torch.from_numpy(arr.copy())
        key = f"d{nbytes}"
        rpc.rpc_sync("ps", t_push, args=(key, ten))
        client.call("push", {"key": key}, {"t": arr})
        cases.append(
            (
                "push",
                nbytes,
                nbytes,
                lambda key=key, ten=ten: rpc.rpc_sync("ps", t_push, args=(key, ten)),
                lambda key=key, arr=arr: client.call("push", {"key": key}, {"t": arr}),
            )
        )
        cases.append(
            (
                "pull",
                nbytes,
                nbytes,
                lambda key=key: rpc.rpc_sync("ps", t_pull, args=(key,)),
                lambda key=key: client.call("pull", {"key": key}),
            )
        )
    for k in SPARSE_ROWS:
        ids = rng.choice(args.rows, size=k, replace=False).astype(np.int64)
        rows = rng.standard_normal((k, args.dim)).astype(np.float32)
        tids, trows = torch.from_numpy(ids.copy()), torch.from_numpy(rows.copy())
        payload = ids.nbytes + rows.nbytes
        cases.append(
            (
                "gather",
                k,
                payload,
                lambda tids=tids: rpc.rpc_sync("ps", t_gather, args=(tids,)),
                lambda ids=ids: client.call("gather", {}, {"ids": ids}),
            )
        )
        cases.append(
            (
                "scatter",
                k,
                payload,
                lambda tids=tids, trows=trows: rpc.rpc_sync("ps", t_scatter, args=(tids, trows)),
                lambda ids=ids, rows=rows: client.call("scatter", {}, {"ids": ids, "rows": rows}),
            )
        )

    results: list[dict[str, Any]] = []
    print(f"{'op':8} {'size':>10} {'torch MB/s':>11} {'grpc MB/s':>10} {'torch op/s':>11} {'grpc op/s':>10} ratio")
    for op, size, payload, t_op, g_op in cases:
        t_measure, g_measure = timed(t_op), timed(g_op)
        t_times, g_times = [], []
        for _ in range(args.rounds):
            t_times.append(t_measure())
            g_times.append(g_measure())
        t_s, g_s = statistics.median(t_times), statistics.median(g_times)
        row = {
            "op": op,
            "size": size,
            "unit": "rows" if op in {"gather", "scatter"} else "bytes",
            "payload_bytes": payload,
            "torch_mb_s": round(payload / t_s / 1e6, 1),
            "grpc_mb_s": round(payload / g_s / 1e6, 1),
            "torch_ops_s": round(1 / t_s, 1),
            "grpc_ops_s": round(1 / g_s, 1),
            "grpc_over_torch": round(t_s / g_s, 3),
        }
        results.append(row)
        label = f"{size} rows" if row["unit"] == "rows" else f"{size >> 10} KB"
        print(
            f"{op:8} {label:>10} {row['torch_mb_s']:>11} {row['grpc_mb_s']:>10} {row['torch_ops_s']:>11} "
            f"{row['grpc_ops_s']:>10} {row['grpc_over_torch']}",
            flush=True,
        )

    client.call("stop")
    client.close()
    rpc.shutdown()
    for p in servers:
        p.wait(timeout=60)
    ratios = [r["grpc_over_torch"] for r in results]
    summary = {
        "bench": "ps_transport",
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "results": results,
        "geomean_grpc_over_torch": round(float(np.exp(np.mean(np.log(ratios)))), 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
