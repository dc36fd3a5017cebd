"""The job master of a PS-mode job: it runs the Data Shard Manager and serves shards to the workers over the PS
transport, tells new workers where the parameter servers are, hears about lost workers (from whoever watches the
processes: the local launcher, or the wrapper of a Slurm job), and reports progress, the ledger and the loss."""

from __future__ import annotations

import threading
from typing import Any

from hpc_elastic.ps import rpc, wire
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.shards import DoneOutcome, LeaseStatus, ShardManager, ShardState

#: shards whose losses are averaged for the loss at the start and at the end of training
LOSS_WINDOW = 5


class Master:
    def __init__(self, config: PsJobConfig, ps_addresses: list[str], state: ShardState | None = None) -> None:
        if len(ps_addresses) != config.num_ps:
            raise ValueError(f"{len(ps_addresses)} PS addresses for num_ps={config.num_ps}")
        self.config = config
        self.ps_addresses = list(ps_addresses)
        self.shards = ShardManager(config.shards(), state)
        self.lost: set[str] = set()
        self.registered: list[str] = []
        self.requeued = 0
        self.stale = 0
        self.losses: list[float] = []  # mean loss of each accepted shard, in the order of acceptance
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def _worker(self, header: dict[str, Any]) -> str:
        worker = header.get("worker")
        if not isinstance(worker, str) or not worker:
            raise ValueError(f"not a worker id: {worker!r}")
        if worker in self.lost:
            raise ValueError(f"worker {worker} was declared lost")
        return worker

    def register(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        with self._lock:
            worker = self._worker(header)
            if worker not in self.registered:
                self.registered.append(worker)
            self.shards.add_worker(worker)
        return {"config": self.config.to_json(), "ps": self.ps_addresses}, {}

    def lease(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        speed = header.get("speed")
        with self._lock:
            lease = self.shards.lease(self._worker(header), None if speed is None else float(speed))
        reply: dict[str, Any] = {"status": lease.status.value}
        if lease.status is LeaseStatus.SHARD and lease.shard is not None:
            reply["shard"] = lease.shard.to_json()
        return reply, {}

    def done(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        with self._lock:
            worker = self._worker(header)
            outcome = self.shards.done(worker, int(header["shard_id"]))
            if outcome is DoneOutcome.ACCEPTED and header.get("count"):
                self.losses.append(float(header["loss_sum"]) / int(header["count"]))
            elif outcome is DoneOutcome.STALE:
                self.stale += 1
        return {"outcome": outcome.value}, {}

    def fail(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        with self._lock:
            outcome = self.shards.fail(self._worker(header), int(header["shard_id"]))
        return {"outcome": outcome.value}, {}

    def worker_lost(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """A worker is gone (dead or scaled in): its DOING shards go back to TODO; it may not lease again."""
        worker = header.get("worker")
        if not isinstance(worker, str):
            raise ValueError(f"not a worker id: {worker!r}")
        with self._lock:
            self.lost.add(worker)
            back = self.shards.remove_worker(worker)
            self.requeued += len(back)
        return {"requeued": len(back)}, {}

    def status(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        with self._lock:
            return self.summary(), {}

    def summary(self) -> dict[str, Any]:
        ledger = self.shards.ledger
        epochs = []
        for epoch in range(self.config.epochs):
            counts = ledger.counts(epoch)
            epochs.append(
                {
                    "epoch": epoch,
                    "complete": self.shards.epoch_complete(epoch),
                    "exactly_once": ledger.exactly_once(epoch),
                    "min_count": int(counts.min()),
                    "max_count": int(counts.max()),
                    "samples_by_worker": ledger.workers(epoch),
                }
            )
        doing: dict[str, int] = {}
        for worker, _ in self.shards.checkpoint().doing:
            doing[worker] = doing.get(worker, 0) + 1
        k = min(LOSS_WINDOW, len(self.losses) // 2)
        return {
            "finished": self.shards.finished,
            "queues": self.shards.counts(),
            "failed_shards": [s.to_json() for s in self.shards.failed],
            "doing_by_worker": doing,
            "registered": self.registered,
            "lost": sorted(self.lost),
            "requeued": self.requeued,
            "stale_dones": self.stale,
            "shards_done": len(self.losses),
            "loss_first": sum(self.losses[:k]) / k if k else None,
            "loss_last": sum(self.losses[-k:]) / k if k else None,
            "epochs": epochs,
        }

    def stop(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        self.stopped.set()
        return {}, {}

    def handlers(self) -> dict[str, rpc.Handler]:
        return {
            "register": self.register,
            "lease": self.lease,
            "done": self.done,
            "fail": self.fail,
            "worker_lost": self.worker_lost,
            "status": self.status,
            "stop": self.stop,
        }
