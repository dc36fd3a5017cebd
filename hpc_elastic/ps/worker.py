"""A PS-mode worker: it leases shards from the job master, a batch at a time into a small local queue, and for every
mini-batch of a shard pulls the embedding rows and dense arrays it needs from the parameter servers, computes the
gradient of Wide & Deep, and pushes it back (asynchronous SGD: no barrier with the other workers). It reports the
shards it finished with its next lease, which it makes when its queue is empty, or between mini-batches when it has
not called the master for the master's heartbeat interval (so a worker on a long shard is not taken for lost).

A parameter server that does not answer (lost) makes the worker wait: it asks the master again for the PS until a
replacement is in place (a new partition generation). If the master's *timeline* changed meanwhile (it rolled the
job back to a checkpoint, or it was lost itself and restored from one), the shard in hand, the shards queued and
the reports not yet sent are dropped (the checkpoint's queues hold them again, and the gradients already pushed for
them were rolled back with the parameters) and the worker leases anew. A job master that does not answer is looked
up again in the run directory (``master.addr``), where a restored master writes its address."""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.data import NUM_SPARSE, Batch, CriteoLike, owner
from hpc_elastic.ps.model import ModelSpec, dense_owner, dense_shapes
from hpc_elastic.ps.rpc import Client, PeerMoved, PeerUnavailable, Reply
from hpc_elastic.ps.shards import LeaseStatus, Shard
from hpc_elastic.ps.usage import own_usage

#: seconds between two leases while the master has no shard to give (TODO empty, shards in DOING)
WAIT_S = 0.05
#: seconds a worker waits for a PS's answer before it asks the master whether the PS was replaced
PS_TIMEOUT_S = 10.0
#: seconds a worker waits for a lost PS or job master to be replaced before it gives up
REPLACE_TIMEOUT_S = 300.0


class RolledBack(HpcElasticError):
    """The master's timeline changed while this worker trained a shard: drop the shard and the queued ones."""


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
    dropped: int = 0


class Worker:
    def __init__(self, worker: str, master_address: str, delay: float = 0.0, run_dir: Path | None = None) -> None:
        self.worker = worker
        self.delay = delay
        self.run_dir = run_dir
        self.master = Client(master_address, wait_for_ready=False)
        self.ps: list[Client] = []
        self.timeline: str | None = None
        self.dropped = 0  # shards dropped because the master's timeline changed
        self.queue: deque[Shard] = deque()  # leased, not started
        self.reports: list[tuple[int, float, int]] = []  # (shard id, loss sum, samples) finished, not yet reported
        self.speed: float | None = None
        self.seq = 0
        self._last_call = time.monotonic()
        self._in_shard = False
        self.ballast = bytearray()  # ``worker_ballast_mb``, taken after the first shard
        self._register()
        self.spec = self.config.model()
        self.data = CriteoLike(self.config.criteo())

    def _call_master(self, op: str, header: dict[str, Any], arrays: dict[str, Any] | None = None) -> Reply:
        """Call the job master; one that does not answer is looked up again in the run directory until a master
        answers (the same, or a restored one at its new address)."""
        deadline = time.monotonic() + REPLACE_TIMEOUT_S
        while True:
            try:
                reply = self.master.call(op, header, arrays)
                self._last_call = time.monotonic()
                return reply
            except PeerUnavailable:
                if self.run_dir is None or time.monotonic() > deadline:
                    raise
            time.sleep(WAIT_S * 4)
            try:
                address = (self.run_dir / "master.addr").read_text()
            except FileNotFoundError:
                continue
            if address != self.master.address:
                self.master.close()
                self.master = Client(address, wait_for_ready=False)

    def _register(self) -> None:
        """(Re-)register with the master: the job's configuration and the current PS (after a re-partition)."""
        reply, _ = self._call_master("register", {"worker": self.worker})
        self.config = PsJobConfig.from_json(reply["config"])
        for c in self.ps:
            c.close()
        self.ps = [Client(a, timeout=PS_TIMEOUT_S) for a in reply["ps"]]
        self.generation = int(reply["generation"])
        self.heartbeat_s = float(reply["heartbeat_s"])
        names = list(dense_shapes(self.config.model()))
        self.names = [[n for n in names if dense_owner(n, len(self.ps)) == p] for p in range(len(self.ps))]
        if self._follow(str(reply["timeline"])) and self._in_shard:
            raise RolledBack(f"the job master went back to a checkpoint (timeline {self.timeline})")

    def _follow(self, timeline: str) -> bool:
        """The master's timeline is ``timeline``: if it changed, drop what was leased or trained in the old one
        (and say so)."""
        if timeline == self.timeline:
            return False
        moved = self.timeline is not None
        self.timeline = timeline
        if moved:
            self.dropped += len(self.queue) + len(self.reports)
            self.queue.clear()
            self.reports.clear()
        return moved

    def _await_replacement(self, deadline: float) -> None:
        """A PS did not answer: re-register until the master serves another partition generation."""
        generation = self.generation
        while True:
            self._register()
            if self.generation != generation:
                return
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"no PS replaced within {REPLACE_TIMEOUT_S:.0f} s")
            time.sleep(WAIT_S * 10)

    def _pull(self, ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.float32], dict[str, npt.NDArray[np.float32]]]:
        """The rows of ``ids`` (sorted, unique) and every dense array, from their PS."""
        while True:
            rows = np.empty((ids.size, self.spec.row_width), dtype=np.float32)
            dense: dict[str, npt.NDArray[np.float32]] = {}
            where = owner(ids, len(self.ps))
            try:
                for p, client in enumerate(self.ps):
                    sel = where == p
                    _, arrays = client.call(
                        "pull", {"names": self.names[p], "generation": self.generation}, {"ids": ids[sel]}
                    )
                    rows[sel] = arrays["rows"]
                    dense.update({n: arrays[f"d:{n}"] for n in self.names[p]})
                return rows, dense
            except PeerMoved:
                self._register()
            except PeerUnavailable:
                self._await_replacement(time.monotonic() + REPLACE_TIMEOUT_S)

    def _push(
        self, ids: npt.NDArray[np.int64], grads: npt.NDArray[np.float32], dense: dict[str, npt.NDArray[np.float32]]
    ) -> None:
        """Push the gradients of rows ``ids`` (sorted, unique) and of the dense arrays to their PS. A push refused
        by a frozen PS applied nothing: what was not applied goes to the new owners after a re-registration."""
        while True:
            where = owner(ids, len(self.ps))
            sent = np.zeros(ids.size, dtype=bool)
            sent_names: set[str] = set()
            try:
                for p, client in enumerate(self.ps):
                    sel = where == p
                    names = [n for n in self.names[p] if n in dense]
                    push = {"ids": ids[sel], "rows": grads[sel], **{f"d:{n}": dense[n] for n in names}}
                    client.call("push", {"generation": self.generation}, push)
                    sent |= sel
                    sent_names.update(names)
                return
            except (PeerMoved, PeerUnavailable) as exc:
                ids, grads = ids[~sent], grads[~sent]
                dense = {n: g for n, g in dense.items() if n not in sent_names}
                if isinstance(exc, PeerMoved):
                    self._register()
                else:
                    self._await_replacement(time.monotonic() + REPLACE_TIMEOUT_S)

    def step(self, batch: Batch) -> float:
        """One asynchronous SGD step on ``batch``; its mean loss."""
        n = batch.label.shape[0]
        uniq, inverse = np.unique(batch.ids, return_inverse=True)
        rows, dense_np = self._pull(uniq)
        dense = {name: torch.tensor(v, requires_grad=True) for name, v in dense_np.items()}
        rows_t = torch.from_numpy(rows).requires_grad_()
        index = torch.from_numpy(inverse.reshape(n, NUM_SPARSE).astype(np.int64))
        logits = forward(self.spec, dense, rows_t[index], torch.from_numpy(batch.dense))
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.label))
        loss.backward()  # type: ignore[no-untyped-call]
        assert rows_t.grad is not None
        grads: dict[str, npt.NDArray[np.float32]] = {}
        for name, t in dense.items():
            assert t.grad is not None
            grads[name] = t.grad.numpy()
        self._push(uniq, rows_t.grad.numpy(), grads)
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
            if time.monotonic() - self._last_call > self.heartbeat_s:
                self.lease()
        return total

    def lease(self) -> LeaseStatus:
        """One call to the master: report the shards finished, queue the shards leased."""
        self.seq += 1
        reports = self.reports
        header = {"worker": self.worker, "seq": self.seq, "timeline": self.timeline, "speed": self.speed}
        arrays = {
            "done": np.array([r[0] for r in reports], dtype=np.int64),
            "loss": np.array([r[1] for r in reports], dtype=np.float64),
            "count": np.array([r[2] for r in reports], dtype=np.int64),
        }
        reply, out = self._call_master("lease", {**header, **own_usage()}, arrays)
        self.reports = []
        moved = self._follow(str(reply["timeline"]))  # what was sent was trained in an older one: refused as stale
        self.queue.extend(Shard.unpack(out["shards"]))
        if moved and self._in_shard:
            raise RolledBack(f"the job master went back to a checkpoint (timeline {self.timeline})")
        return LeaseStatus(reply["status"])

    def run(self) -> WorkerReport:
        shards = samples = 0
        while True:
            if not self.queue:
                status = self.lease()
                if status is LeaseStatus.END and not self.queue:
                    return WorkerReport(self.worker, shards, samples, self.dropped)
                if not self.queue:
                    time.sleep(WAIT_S)
                    continue
            shard = self.queue.popleft()
            t0 = time.perf_counter()
            self._in_shard = True
            try:
                loss_sum = self.train_shard(shard)
            except RolledBack:
                self.dropped += 1
                continue
            finally:
                self._in_shard = False
            self.speed = shard.size / max(time.perf_counter() - t0, 1e-9)
            self.reports.append((shard.shard_id, loss_sum, shard.size))
            shards += 1
            samples += shard.size
            if shards == 1 and self.config.worker_ballast_mb:
                self.ballast = grow_resident(self.config.worker_ballast_mb)

    def close(self) -> None:
        self.master.close()
        for c in self.ps:
            c.close()


def grow_resident(mb: int) -> bytearray:
    """``mb`` MiB written page by page, so that they count in the resident set."""
    ballast = bytearray(mb * 2**20)
    for page in range(0, len(ballast), 4096):
        ballast[page] = 1
    return ballast


@click.command("worker")
@click.option("--id", "worker_id", required=True)
@click.option("--master", "master_address", required=True)
@click.option("--delay", type=float, default=0.0, help="seconds of sleep after each mini-batch (a slow worker)")
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="where a restored job master writes its address (master.addr): looked up when the master does not answer",
)
def worker_command(worker_id: str, master_address: str, delay: float, run_dir: Path | None) -> None:
    """A worker: train on the master's shards until there are none left."""
    host, colon, port = master_address.rpartition(":")
    if not (host and colon and port.isdigit()):
        raise ValueError(f"--master must be HOST:PORT, got {master_address!r}")
    torch.set_num_threads(1)
    worker = Worker(worker_id, master_address, delay, run_dir)
    report = worker.run()
    worker.close()
    out = {"worker": report.worker, "shards": report.shards, "samples": report.samples, "dropped": report.dropped}
    click.echo(json.dumps(out))
