"""The job master of a PS-mode job: it runs the Data Shard Manager and serves shards to the workers over the PS
transport, tells new workers where the parameter servers are, hears about lost workers (from whoever watches the
processes: the local launcher, or the wrapper of a Slurm job), and reports progress, the ledger and the loss.

With a checkpoint root it checkpoints the job (:mod:`hpc_elastic.ps.checkpoint`) on request and every
``checkpoint_every`` accepted shards: holding its lock (no lease or done meanwhile) it takes every PS's snapshot and
then its own queues, so every shard counted done in the checkpoint has all of its gradients in the parameters saved
(a worker pushes a mini-batch's gradient and waits for the PS to apply it before it reports the shard done). A
master started with ``restore`` continues from the latest checkpoint: its queues with DOING first, its ledger; the
parameter servers are started from the same checkpoint.

A parameter server lost while the job runs (killed, its node gone) is replaced without restarting the workers
(§5.3): whoever watches the processes starts a new PS and calls ``replace_ps``. Holding its lock, the master rolls
the *whole job* back to its latest checkpoint: every PS (the new one and the survivors) is reconfigured with the
checkpoint's parameters under a new partition generation, and the queues and the ledger become the checkpoint's
(DOING first). The checkpoint is one consistent cut of parameters, queues and ledger, so the ledger again counts
exactly the shards whose gradients are all in the parameters; restoring the lost partition alone would leave its
rows older than the dense arrays and the ledger counting shards whose updates to it are gone. Workers learn of the
rollback at their next PS call (refused: other generation) or lease, re-register, drop the shard they were on
without reporting it, and lease again."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from hpc_elastic.ps import checkpoint, rpc, wire
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.shards import DoneOutcome, LeaseStatus, ShardManager, ShardState

#: seconds the master waits for a PS's answer (a lost PS does not answer at all)
PS_TIMEOUT_S = 10.0
#: shards whose losses are averaged for the loss at the start and at the end of training
LOSS_WINDOW = 5


class Master:
    def __init__(
        self,
        config: PsJobConfig,
        ps_addresses: list[str],
        checkpoint_root: Path | None = None,
        checkpoint_every: int = 0,
        restore: bool = False,
    ) -> None:
        if len(ps_addresses) != config.num_ps:
            raise ValueError(f"{len(ps_addresses)} PS addresses for num_ps={config.num_ps}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, not {checkpoint_every}")
        if (restore or checkpoint_every) and checkpoint_root is None:
            raise ValueError("restoring or checkpointing needs a checkpoint root")
        self.config = config
        self.ps_addresses = list(ps_addresses)
        self.checkpoint_root = checkpoint_root
        self.checkpoint_every = checkpoint_every
        self.seq = 0
        self.restored_from: int | None = None
        state: ShardState | None = None
        if restore and checkpoint_root is not None:
            where = checkpoint.latest(checkpoint_root)
            if where is None:
                raise ValueError(f"no checkpoint to restore in {checkpoint_root}")
            self.seq, state = checkpoint.read_queues(where)
            self.restored_from = self.seq
        self.shards = ShardManager(config.shards(), state)
        self.lost: set[str] = set()
        self.registered: list[str] = []
        self.requeued = 0
        self.stale = 0
        self.accepted = 0
        self._ps: list[rpc.Client] | None = None
        self.repartition_seconds: list[float] = []
        self.generation = 0  # of the PS partition: one more at each re-partition
        self.rollbacks = 0  # rollbacks to a checkpoint after a PS was lost
        self.ps_replaced: list[dict[str, Any]] = []  # each replacement: index, checkpoint restored, seconds
        self._first_lease: float | None = None
        self._last_done: float | None = None
        self.samples_accepted = 0  # samples of the shards accepted, redone ones again (a rate, not the ledger)
        self.worker_usage: dict[str, tuple[float, float, float]] = {}  # CPU s, peak MiB, master's clock at reading
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
        reply = {
            "config": self.config.to_json(),
            "ps": self.ps_addresses,
            "generation": self.generation,
            "rollbacks": self.rollbacks,
        }
        return reply, {}

    def lease(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        speed = header.get("speed")
        with self._lock:
            if "cpu_s" in header:
                reading = (float(header["cpu_s"]), float(header.get("rss_mb", 0.0)), time.monotonic())
                self.worker_usage[self._worker(header)] = reading
            lease = self.shards.lease(self._worker(header), None if speed is None else float(speed))
            if self._first_lease is None and lease.status is LeaseStatus.SHARD:
                self._first_lease = time.monotonic()
        reply: dict[str, Any] = {"status": lease.status.value, "rollbacks": self.rollbacks}
        if lease.status is LeaseStatus.SHARD and lease.shard is not None:
            reply["shard"] = lease.shard.to_json()
        return reply, {}

    def done(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        with self._lock:
            worker = self._worker(header)
            outcome = self.shards.done(worker, int(header["shard_id"]))
            if outcome is DoneOutcome.ACCEPTED:
                if header.get("count"):
                    self.losses.append(float(header["loss_sum"]) / int(header["count"]))
                self.accepted += 1
                self.samples_accepted += int(header.get("count", 0))
                self._last_done = time.monotonic()
                if self.checkpoint_every and self.accepted % self.checkpoint_every == 0:
                    try:
                        self._checkpoint()
                    except rpc.PeerUnavailable:  # a PS is lost: its replacement rolls back to the last checkpoint
                        self._close_ps()
            else:
                self.stale += 1
        return {"outcome": outcome.value}, {}

    def _checkpoint(self) -> int:
        """Checkpoint parameters and queues at one instant (the caller holds the lock); the new sequence number."""
        assert self.checkpoint_root is not None
        if self._ps is None:
            self._ps = [rpc.Client(a, timeout=PS_TIMEOUT_S) for a in self.ps_addresses]
        parts = [checkpoint.PsSnapshot.from_arrays(c.call("snapshot")[1]) for c in self._ps]
        self.seq += 1
        checkpoint.write(self.checkpoint_root, self.seq, self.shards.checkpoint(), parts)
        return self.seq

    def repartition(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """Move the parameters onto the PS at ``header["ps"]`` (a PS added or removed, §5.3). Holding the lock (no
        lease, done or registration meanwhile) it freezes every current PS, which hands over its partition, and
        reconfigures each PS of the new list with its index, the new count and all the partitions. Workers whose
        pull or push meets a frozen PS ask for the new list (their registration waits for this to end) and go on.
        A current PS left out of the new list stays frozen: whoever started it stops it."""
        new = header.get("ps")
        if not isinstance(new, list) or not new or not all(isinstance(a, str) and a for a in new):
            raise ValueError(f"repartition needs a non-empty list of PS addresses, not {new!r}")
        with self._lock:
            t0 = time.monotonic()
            old = [rpc.Client(a) for a in self.ps_addresses]
            merged = checkpoint.merge([checkpoint.PsSnapshot.from_arrays(c.call("freeze")[1]) for c in old])
            payload = merged.to_arrays()
            self.generation += 1
            for index, address in enumerate(new):
                client = rpc.Client(address)
                client.call("reconfigure", {"index": index, "num_ps": len(new), "generation": self.generation}, payload)
                client.close()
            for c in old:
                c.close()
            self._close_ps()
            self.ps_addresses = list(new)
            took = time.monotonic() - t0
            self.repartition_seconds.append(took)
        return {"num_ps": len(new), "seconds": took}, {}

    def _close_ps(self) -> None:
        for c in self._ps or []:
            c.close()
        self._ps = None

    def replace_ps(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """PS ``header["index"]`` was lost and a new one listens at ``header["address"]``: roll the job back to the
        latest checkpoint (see the module's docstring) onto the new set of PS."""
        index, address = int(header["index"]), header.get("address")
        if not 0 <= index < len(self.ps_addresses):
            raise ValueError(f"no PS {index} among {len(self.ps_addresses)}")
        if not isinstance(address, str) or not address:
            raise ValueError(f"replace_ps needs the new PS's address, not {address!r}")
        if self.checkpoint_root is None:
            raise ValueError("a lost PS is recovered from a checkpoint: this master has no checkpoint root")
        with self._lock:
            t0 = time.monotonic()
            where = checkpoint.latest(self.checkpoint_root)
            if where is None:
                raise ValueError(f"no checkpoint in {self.checkpoint_root} to recover PS {index} from")
            seq, state = checkpoint.read_queues(where)
            payload = checkpoint.merge(checkpoint.read_partitions(where)).to_arrays()
            addresses = [*self.ps_addresses[:index], address, *self.ps_addresses[index + 1 :]]
            self.generation += 1
            for p, a in enumerate(addresses):
                client = rpc.Client(a, timeout=PS_TIMEOUT_S)
                client.call(
                    "reconfigure", {"index": p, "num_ps": len(addresses), "generation": self.generation}, payload
                )
                client.close()
            self._close_ps()
            self.ps_addresses = addresses
            workers = [w for w in self.registered if w not in self.lost]
            self.shards = ShardManager(self.config.shards(), state)
            for worker in workers:
                self.shards.add_worker(worker)
            self.rollbacks += 1
            took = time.monotonic() - t0
            self.ps_replaced.append({"index": index, "checkpoint": seq, "seconds": took})
        return {"generation": self.generation, "checkpoint": seq, "seconds": took}, {}

    def usage(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """The processes' readings now: each live worker's last one (CPU s, peak MiB, when), each PS's, asked now,
        and the samples accepted so far, with the master's clock."""
        with self._lock:
            workers = {w: list(u) for w, u in self.worker_usage.items() if w not in self.lost}
            addresses = list(self.ps_addresses)
            samples, now = self.samples_accepted, time.monotonic()
        ps = []
        for index, address in enumerate(addresses):
            client = rpc.Client(address, timeout=PS_TIMEOUT_S)
            try:
                ps.append(client.call("usage")[0])
            except rpc.PeerUnavailable:
                raise ValueError(f"PS {index} did not answer (lost, or being replaced): read again later") from None
            finally:
                client.close()
        return {"workers": workers, "ps": ps, "samples": samples, "time": now}, {}

    def checkpoint_handler(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        if self.checkpoint_root is None:
            raise ValueError("this master has no checkpoint root")
        with self._lock:
            return {"seq": self._checkpoint()}, {}

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
            "checkpoint_seq": self.seq,
            "num_ps": len(self.ps_addresses),
            "repartition_seconds": self.repartition_seconds,
            "ps_replaced": self.ps_replaced,
            "rollbacks": self.rollbacks,
            "restored_from": self.restored_from,
            "queues": self.shards.counts(),
            "failed_shards": [s.to_json() for s in self.shards.failed],
            "doing_by_worker": doing,
            "registered": self.registered,
            "lost": sorted(self.lost),
            "requeued": self.requeued,
            "stale_dones": self.stale,
            "shards_done": len(self.losses),
            "train_seconds": (self._last_done - self._first_lease if self._first_lease and self._last_done else None),
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
            "checkpoint": self.checkpoint_handler,
            "repartition": self.repartition,
            "replace_ps": self.replace_ps,
            "usage": self.usage,
            "stop": self.stop,
        }
