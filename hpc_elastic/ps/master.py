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
without reporting it, and lease again.

**One call per batch of shards.** A worker's ``lease`` carries its reports of the shards it finished since its last
call (their ids, loss sums and sample counts as arrays) and takes back the next batch of shards, as many as bring
what it holds up to its bound (:meth:`hpc_elastic.ps.shards.ShardManager.lease`): the reports are applied first,
each accepted or refused as stale on its own, then the lease. A job master is thus asked once per batch, not twice
per shard. Each report names the *timeline* the worker trained in (the master's incarnation and its rollback count):
one of another timeline (before a rollback, or of a master that was lost and restored) is refused as stale, since
its gradients were rolled back. A ``lease`` carries the worker's sequence number: the same one again (a retry after
a lost reply) gets the same reply, applied once.

**Liveness.** Every call of a worker (``register``, ``lease``) is a heartbeat; a worker that made none for
``liveness_s`` seconds (a hung or frozen process, a worker on a node that died, which a launcher watching its own
children cannot see) is declared lost, as if ``worker_lost`` had been called (a worker told that training has
ended is not watched any more): its shards go back to TODO and every
later call of it, its late reports included, is refused (``refused`` counts them), so nothing is counted twice.
:meth:`Master.watch` checks every worker's last call in a thread of its own."""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hpc_elastic.ps import checkpoint, rpc, wire
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.data import CriteoLike
from hpc_elastic.ps.model import init_dense, init_rows, log_loss
from hpc_elastic.ps.shards import DoneOutcome, LeaseStatus, Shard, ShardManager, ShardState

#: seconds the master waits for a PS's answer (a lost PS does not answer at all)
PS_TIMEOUT_S = 10.0
#: shards whose losses are averaged for the loss at the start and at the end of training
LOSS_WINDOW = 5
#: records past the training set's (the same generator, ids ``num_samples`` on) on which the model is evaluated
HELD_OUT = 5000
#: seconds without a call after which a worker is declared lost (a worker calls at least every third of it)
LIVENESS_S = 30.0


class Master:
    def __init__(
        self,
        config: PsJobConfig,
        ps_addresses: list[str],
        checkpoint_root: Path | None = None,
        checkpoint_every: int = 0,
        restore: bool = False,
        *,
        liveness_s: float = LIVENESS_S,
    ) -> None:
        if not 0 < liveness_s < math.inf:
            raise ValueError(f"liveness_s must be a positive, finite number of seconds, not {liveness_s!r}")
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
        losses: list[float] = []
        if restore and checkpoint_root is not None:
            where = checkpoint.latest(checkpoint_root)
            if where is None:
                raise ValueError(f"no checkpoint to restore in {checkpoint_root}")
            self.seq, state = checkpoint.read_queues(where)
            losses = checkpoint.read_losses(where)
            self.restored_from = self.seq
        self.shards = ShardManager(config.shards(), state)
        self.lost: set[str] = set()
        self.registered: list[str] = []
        self.requeued = 0
        self.stale = 0
        self.accepted = 0
        self.liveness_s = liveness_s
        self.last_call: dict[str, float] = {}  # worker -> the master's clock at its last call
        self.expired: list[str] = []  # the workers declared lost for want of a call, in that order
        self.refused = 0  # calls of workers declared lost
        self.incarnation = uuid.uuid4().hex[:12]  # this master process's: a restored master is another timeline
        self._replies: dict[str, tuple[int, rpc.Reply]] = {}  # worker -> its last lease's sequence number and reply
        self._ps: list[rpc.Client] | None = None
        self.repartition_seconds: list[float] = []
        self.generation = 0  # of the PS partition: one more at each re-partition
        self.rollbacks = 0  # rollbacks to a checkpoint after a PS was lost
        self.ps_replaced: list[dict[str, Any]] = []  # each replacement: index, checkpoint restored, seconds
        self._first_lease: float | None = None
        self._last_done: float | None = None
        self.samples_accepted = 0  # samples of the shards accepted, redone ones again (a rate, not the ledger)
        self.worker_usage: dict[str, tuple[float, float, float]] = {}  # CPU s, peak MiB, master's clock at reading
        self.losses = losses  # mean loss of each accepted shard, in the order of acceptance (restored with the ledger)
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def _worker(self, header: dict[str, Any]) -> str:
        """The calling worker's id (the caller holds the lock); a worker declared lost is refused."""
        worker = header.get("worker")
        if not isinstance(worker, str) or not worker:
            raise ValueError(f"not a worker id: {worker!r}")
        if worker in self.lost:
            self.refused += 1
            raise ValueError(f"worker {worker} was declared lost")
        return worker

    def _heard(self, header: dict[str, Any]) -> None:
        """A worker's heartbeat: the time of its call, taken as it arrives (before it waits for the lock)."""
        worker = header.get("worker")
        if isinstance(worker, str):
            self.last_call[worker] = time.monotonic()

    def register(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        self._heard(header)
        with self._lock:
            worker = self._worker(header)
            if worker not in self.registered:
                self.registered.append(worker)
            self.shards.add_worker(worker)
        reply = {
            "config": self.config.to_json(),
            "ps": self.ps_addresses,
            "generation": self.generation,
            "timeline": self.timeline,
            "heartbeat_s": self.liveness_s / 3,
        }
        return reply, {}

    @property
    def timeline(self) -> str:
        """What the parameters and the queues descend from: this process, and the rollbacks it made."""
        return f"{self.incarnation}.{self.rollbacks}"

    def lease(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """Apply the worker's reports (arrays ``done``: shard ids, ``loss``: loss sums, ``count``: samples), then
        lease it the next shards (array ``shards``, :meth:`Shard.pack`). Header: ``worker``, ``seq`` (one more at
        each new call), ``timeline`` (the one its reports were trained in), optional ``speed`` (samples/s) and usage
        readings (``cpu_s``, ``rss_mb``)."""
        self._heard(header)
        seq = int(header["seq"])
        speed = header.get("speed")
        done = np.asarray(arrays.get("done", np.zeros(0, np.int64)), dtype=np.int64)
        loss = np.asarray(arrays.get("loss", np.zeros(done.size)), dtype=np.float64)
        count = np.asarray(arrays.get("count", np.zeros(done.size, np.int64)), dtype=np.int64)
        if not done.ndim == loss.ndim == count.ndim == 1 or not done.size == loss.size == count.size:
            raise ValueError(f"reports of {done.shape} shards with {loss.shape} losses and {count.shape} counts")
        with self._lock:
            worker = self._worker(header)
            last = self._replies.get(worker)
            if last is not None and last[0] == seq:
                return last[1]
            if "cpu_s" in header:
                self.worker_usage[worker] = (float(header["cpu_s"]), float(header.get("rss_mb", 0.0)), time.monotonic())
            accepted = stale = 0
            current = header.get("timeline") == self.timeline
            for sid, loss_sum, n in zip(done.tolist(), loss.tolist(), count.tolist(), strict=True):
                if current and self.shards.done(worker, sid) is DoneOutcome.ACCEPTED:
                    if n:
                        self.losses.append(loss_sum / n)
                    self.samples_accepted += n
                    accepted += 1
                else:
                    stale += 1
            self.stale += stale
            if accepted:
                before, self.accepted = self.accepted, self.accepted + accepted
                self._last_done = time.monotonic()
                every = self.checkpoint_every
                if every and self.accepted // every > before // every:
                    try:
                        self._checkpoint()
                    except rpc.PeerUnavailable:  # a PS is lost: its replacement rolls back to the last checkpoint
                        self._close_ps()
            lease = self.shards.lease(worker, None if speed is None else float(speed))
            if self._first_lease is None and lease.status is LeaseStatus.SHARD:
                self._first_lease = time.monotonic()
            if lease.status is LeaseStatus.END:  # the worker is done and exits: its silence is no loss
                self.last_call.pop(worker, None)
            head = {"status": lease.status.value, "timeline": self.timeline, "accepted": accepted, "stale": stale}
            reply: rpc.Reply = (head, {"shards": Shard.pack(lease.shards)})
            self._replies[worker] = (seq, reply)
        return reply

    def expire(self, now: float) -> list[str]:
        """Declare lost every worker whose last call is more than ``liveness_s`` before ``now`` (the master's
        clock): its shards go back to TODO. The workers declared lost."""
        with self._lock:
            silent = [w for w, t in self.last_call.items() if now - t > self.liveness_s and w not in self.lost]
            for worker in silent:
                self._declare_lost(worker)
                self.expired.append(worker)
        return silent

    def watch(self) -> threading.Thread:
        """Check the workers' heartbeats in a thread of its own until the master is stopped."""

        def loop() -> None:
            while not self.stopped.wait(self.liveness_s / 4):
                self.expire(time.monotonic())

        thread = threading.Thread(target=loop, name="liveness", daemon=True)
        thread.start()
        return thread

    def _checkpoint(self) -> int:
        """Checkpoint parameters and queues at one instant (the caller holds the lock); the new sequence number."""
        assert self.checkpoint_root is not None
        if self._ps is None:
            self._ps = [rpc.Client(a, timeout=PS_TIMEOUT_S) for a in self.ps_addresses]
        parts = [checkpoint.PsSnapshot.from_arrays(c.call("snapshot")[1]) for c in self._ps]
        self.seq += 1
        checkpoint.write(self.checkpoint_root, self.seq, self.shards.checkpoint(), parts, self.losses)
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
            addresses = [*self.ps_addresses[:index], address, *self.ps_addresses[index + 1 :]]
            self._load_ps(addresses, where)
            workers = [w for w in self.registered if w not in self.lost]
            self.shards = ShardManager(self.config.shards(), state)
            for worker in workers:
                self.shards.add_worker(worker)
            self.rollbacks += 1
            took = time.monotonic() - t0
            self.ps_replaced.append({"index": index, "checkpoint": seq, "seconds": took})
        return {"generation": self.generation, "checkpoint": seq, "seconds": took}, {}

    def _load_ps(self, addresses: list[str], where: Path) -> None:
        """Reconfigure the PS at ``addresses`` with the parameters of the checkpoint in ``where``, under a partition
        generation newer than any of theirs (the caller holds the lock, or serves nobody yet)."""
        payload = checkpoint.merge(checkpoint.read_partitions(where)).to_arrays()
        clients = [rpc.Client(a, timeout=PS_TIMEOUT_S) for a in addresses]
        try:
            newest = max(int(c.call("usage")[0]["generation"]) for c in clients)
            self.generation = max(self.generation, newest) + 1
            for p, client in enumerate(clients):
                client.call(
                    "reconfigure", {"index": p, "num_ps": len(addresses), "generation": self.generation}, payload
                )
        finally:
            for c in clients:
                c.close()
        self._close_ps()
        self.ps_addresses = list(addresses)

    def restore_ps(self) -> None:
        """A master restored from a checkpoint (``restore``) puts the PS back to its parameters too: the queues and
        the ledger it restored count exactly the shards whose gradients those parameters hold. (The PS may have
        trained on since, when the master was lost while they ran.)"""
        if self.restored_from is None or self.checkpoint_root is None:
            raise ValueError("only a master restored from a checkpoint restores its PS")
        with self._lock:
            where = checkpoint.latest(self.checkpoint_root)
            assert where is not None
            self._load_ps(self.ps_addresses, where)

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

    def worker_lost(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """A worker is gone (dead or scaled in): its DOING shards go back to TODO; it may not lease again."""
        worker = header.get("worker")
        if not isinstance(worker, str):
            raise ValueError(f"not a worker id: {worker!r}")
        with self._lock:
            back = self._declare_lost(worker)
        return {"requeued": back}, {}

    def _declare_lost(self, worker: str) -> int:
        """``worker`` may not call again; its DOING shards go back to TODO (the caller holds the lock). How many."""
        self.lost.add(worker)
        self.last_call.pop(worker, None)
        self._replies.pop(worker, None)
        back = len(self.shards.remove_worker(worker))
        self.requeued += back
        return back

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
            "expired": self.expired,
            "refused": self.refused,
            "requeued": self.requeued,
            "stale_dones": self.stale,
            "shards_done": len(self.losses),
            "train_seconds": (self._last_done - self._first_lease if self._first_lease and self._last_done else None),
            "loss_first": sum(self.losses[:k]) / k if k else None,
            "loss_last": sum(self.losses[-k:]) / k if k else None,
            "epochs": epochs,
        }

    def held_out(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        """The mean log loss on :data:`HELD_OUT` records no worker trains on, of the parameters the PS hold now
        (``final``) and of the initial ones (``initial``): whether training learned. The per-shard training losses
        (``loss_first``, ``loss_last``) are not a sound measure of it: shards differ in size (a straggler's are
        split, §5.4, down to single records) and asynchronous SGD's losses are taken on parameters of any age."""
        with self._lock:
            if self._ps is None:
                self._ps = [rpc.Client(a, timeout=PS_TIMEOUT_S) for a in self.ps_addresses]
            parts = [checkpoint.PsSnapshot.from_arrays(c.call("snapshot")[1]) for c in self._ps]
        merged, spec, data = checkpoint.merge(parts), self.config.model(), self.config.criteo()
        n = data.num_samples
        batch = CriteoLike(replace(data, num_samples=n + HELD_OUT)).records(n, n + HELD_OUT)
        final = log_loss(spec, merged.dense, merged.ids, merged.rows, batch)
        initial = log_loss(spec, init_dense(spec), merged.ids, init_rows(spec, merged.ids), batch)
        return {"samples": HELD_OUT, "initial": initial, "final": final}, {}

    def stop(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        self.stopped.set()
        return {}, {}

    def handlers(self) -> dict[str, rpc.Handler]:
        return {
            "register": self.register,
            "lease": self.lease,
            "worker_lost": self.worker_lost,
            "status": self.status,
            "checkpoint": self.checkpoint_handler,
            "repartition": self.repartition,
            "replace_ps": self.replace_ps,
            "usage": self.usage,
            "held_out": self.held_out,
            "stop": self.stop,
        }
