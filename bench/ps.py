"""PS mode's figures in one run:

- ``dispatch``: the Data Shard Manager's lease + done rate, in the process (the pure manager) and through the job
  master over gRPC (a ``python -m hpc_elastic.ps master`` process, one client thread per ``--clients``);
- ``ps_add``: a PS added to a training job (1 → 2 PS, 2 workers): the time of the whole ``add_ps`` (the new
  process starting, the workers training meanwhile) and of the re-partition alone (the workers wait for it only);
- ``scaling``: samples/s of Wide & Deep training against the number of workers (1, 2, 4) with 2 PS, from the
  master's first lease to its last accepted shard (process start-up excluded), every epoch checked exactly once.

Prints one line per measurement and, last, one JSON object. Usage::

    python bench/ps.py [--dispatch-shards 200000] [--samples 8192] [--workers 1,2,4] [--clients 1,4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.job import PsJob
from hpc_elastic.ps.rpc import Client
from hpc_elastic.ps.shards import LeaseStatus, ShardConfig, ShardManager


def dispatch_in_process(shards: int) -> float:
    m = ShardManager(ShardConfig(num_samples=shards, shard_size=1))
    t0 = time.perf_counter()
    n = 0
    while (lease := m.lease("w")).status is LeaseStatus.SHARD:
        assert lease.shard is not None
        m.done("w", lease.shard.shard_id)
        n += 1
    return n / (time.perf_counter() - t0)


def dispatch_over_grpc(address: str, clients: int, seconds: float) -> float:
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        c = Client(address)
        w = f"b{k}"
        c.call("register", {"worker": w})
        while time.monotonic() < stop:
            reply, _ = c.call("lease", {"worker": w})
            if reply["status"] != "shard":
                break
            c.call("done", {"worker": w, "shard_id": reply["shard"][0], "loss_sum": 0.0, "count": 0})
            counts[k] += 1
        c.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dispatch-shards", type=int, default=200_000)
    ap.add_argument("--dispatch-seconds", type=float, default=3.0)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--workers", default="1,2,4")
    args = ap.parse_args()
    out: dict[str, Any] = {"bench": "ps", "cpus": os.cpu_count()}

    rate = dispatch_in_process(args.dispatch_shards)
    print(f"dispatch in process: {rate:,.0f} shards/s (lease + done)", flush=True)
    out["dispatch_in_process_shards_s"] = round(rate)

    with tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp:
        config = PsJobConfig(num_ps=1, num_workers=0, num_samples=args.dispatch_shards, shard_size=1)
        job = PsJob(config, Path(tmp))
        job.start()  # a master and one PS, no worker: the clients below are the workers
        try:
            assert job.master is not None
            job.master.call("lease", {"worker": "warm-up"})  # the first lease queues the epoch's shards
            out["dispatch_grpc_shards_s"] = {}
            for clients in (int(c) for c in args.clients.split(",")):
                rate = dispatch_over_grpc(job.master.address, clients, args.dispatch_seconds)
                print(f"dispatch over gRPC, {clients} client(s): {rate:,.0f} shards/s", flush=True)
                out["dispatch_grpc_shards_s"][str(clients)] = round(rate)
        finally:
            job.close()

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

    out["scaling"] = []
    for workers in (int(w) for w in args.workers.split(",")):
        config = PsJobConfig(num_ps=2, num_workers=workers, num_samples=args.samples, shard_size=128, batch_size=64)
        with tempfile.TemporaryDirectory(prefix="hpc-elastic-bench-ps-") as tmp, PsJob(config, Path(tmp)) as job:
            status = job.wait()
        assert all(e["exactly_once"] for e in status["epochs"])
        rate = args.samples / status["train_seconds"]
        print(f"training, 2 PS, {workers} worker(s): {rate:,.0f} samples/s", flush=True)
        out["scaling"].append({"workers": workers, "ps": 2, "samples_s": round(rate, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
