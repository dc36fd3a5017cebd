"""A PS-mode worker: it leases shards from the job master, and for every mini-batch of a shard pulls the embedding
rows and dense arrays it needs from the parameter servers, computes the gradient of Wide & Deep, and pushes it
back (asynchronous SGD: no barrier with the other workers); then it reports the shard done."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import click
import numpy as np
import torch
import torch.nn.functional as F

from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.data import NUM_SPARSE, Batch, CriteoLike, owner
from hpc_elastic.ps.model import ModelSpec, dense_owner, dense_shapes
from hpc_elastic.ps.rpc import Client
from hpc_elastic.ps.shards import LeaseStatus, Shard

#: seconds between two leases while the master has no shard to give (TODO empty, shards in DOING)
WAIT_S = 0.05


def forward(spec: ModelSpec, dense: dict[str, torch.Tensor], rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Logits ``(n,)`` of Wide & Deep for dense features ``x (n, 13)`` and embedding rows ``(n, 26, dim + 1)``."""
    emb, wide_w = rows[..., : spec.dim], rows[..., spec.dim]
    h = torch.cat([x, emb.reshape(x.shape[0], -1)], dim=1)
    for k in range(len(spec.hidden)):
        h = torch.relu(h @ dense[f"deep.{k}.w"] + dense[f"deep.{k}.b"])
    deep = (h @ dense["deep.out.w"] + dense["deep.out.b"])[:, 0]
    wide = (x @ dense["wide.dense"])[:, 0] + wide_w.sum(dim=1) + dense["wide.bias"][0]
    return deep + wide


@dataclass(frozen=True)
class WorkerReport:
    worker: str
    shards: int
    samples: int


class Worker:
    def __init__(self, worker: str, master_address: str, delay: float = 0.0) -> None:
        self.worker = worker
        self.delay = delay
        self.master = Client(master_address)
        reply, _ = self.master.call("register", {"worker": worker})
        self.config = PsJobConfig.from_json(reply["config"])
        self.ps = [Client(a) for a in reply["ps"]]
        self.spec = self.config.model()
        self.data = CriteoLike(self.config.criteo())
        names = list(dense_shapes(self.spec))
        self.names = [[n for n in names if dense_owner(n, len(self.ps)) == p] for p in range(len(self.ps))]

    def step(self, batch: Batch) -> float:
        """One asynchronous SGD step on ``batch``; its mean loss."""
        n = batch.label.shape[0]
        uniq, inverse = np.unique(batch.ids, return_inverse=True)
        where = owner(uniq, len(self.ps))
        rows = np.empty((uniq.size, self.spec.row_width), dtype=np.float32)
        dense: dict[str, torch.Tensor] = {}
        for p, client in enumerate(self.ps):
            sel = where == p
            _, arrays = client.call("pull", {"names": self.names[p]}, {"ids": uniq[sel]})
            rows[sel] = arrays["rows"]
            for name in self.names[p]:
                dense[name] = torch.tensor(arrays[f"d:{name}"], requires_grad=True)
        rows_t = torch.from_numpy(rows).requires_grad_()
        index = torch.from_numpy(inverse.reshape(n, NUM_SPARSE).astype(np.int64))
        logits = forward(self.spec, dense, rows_t[index], torch.from_numpy(batch.dense))
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.label))
        loss.backward()  # type: ignore[no-untyped-call]
        assert rows_t.grad is not None
        grads = rows_t.grad.numpy()
        for p, client in enumerate(self.ps):
            sel = where == p
            push = {"ids": uniq[sel], "rows": grads[sel]}
            for name in self.names[p]:
                g = dense[name].grad
                assert g is not None
                push[f"d:{name}"] = g.numpy()
            client.call("push", {}, push)
        return float(loss.item())

    def train_shard(self, shard: Shard) -> float:
        """Train on every record of ``shard``; the sum of the per-sample losses."""
        total = 0.0
        bs = self.config.batch_size
        for start in range(shard.start, shard.end, bs):
            batch = self.data.records(start, min(start + bs, shard.end))
            total += self.step(batch) * batch.label.shape[0]
            if self.delay:
                time.sleep(self.delay)
        return total

    def run(self) -> WorkerReport:
        speed: float | None = None
        shards = samples = 0
        while True:
            reply, _ = self.master.call("lease", {"worker": self.worker, "speed": speed})
            status = LeaseStatus(reply["status"])
            if status is LeaseStatus.END:
                return WorkerReport(self.worker, shards, samples)
            if status is LeaseStatus.WAIT:
                time.sleep(WAIT_S)
                continue
            shard = Shard.from_json(reply["shard"])
            t0 = time.perf_counter()
            loss_sum = self.train_shard(shard)
            speed = shard.size / max(time.perf_counter() - t0, 1e-9)
            self.master.call(
                "done", {"worker": self.worker, "shard_id": shard.shard_id, "loss_sum": loss_sum, "count": shard.size}
            )
            shards += 1
            samples += shard.size

    def close(self) -> None:
        self.master.close()
        for c in self.ps:
            c.close()


@click.command("worker")
@click.option("--id", "worker_id", required=True)
@click.option("--master", "master_address", required=True)
@click.option("--delay", type=float, default=0.0, help="seconds of sleep after each mini-batch (a slow worker)")
def worker_command(worker_id: str, master_address: str, delay: float) -> None:
    """A worker: train on the master's shards until there are none left."""
    torch.set_num_threads(1)
    worker = Worker(worker_id, master_address, delay)
    report = worker.run()
    worker.close()
    click.echo(json.dumps({"worker": report.worker, "shards": report.shards, "samples": report.samples}))
