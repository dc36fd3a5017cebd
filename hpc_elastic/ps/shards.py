"""DLRover's Data Shard Manager (dynamic data sharding) and the per-sample ledger that proves exactly-once use.

Pure: no clock, no file, no socket. The job master owns one :class:`ShardManager` and calls it from its RPC
handlers; whatever it measures (a worker's speed) it passes in as numbers.

**Shards.** The dataset's records ``0 .. num_samples-1`` are cut into many small index shards (record ranges
``[start, end)`` of ``shard_size`` records, not sized by the number of workers). Each epoch the shards are put
into the TODO queue in an order shuffled by ``(seed, epoch)``. :meth:`ShardManager.lease` moves shards from the head
of TODO to DOING under the worker's id, several at a time (below); :meth:`ShardManager.done` removes one from DOING
and records its samples in the ledger; :meth:`ShardManager.fail` and :meth:`ShardManager.remove_worker` (a lost
worker: all of its DOING shards) put it back at the head of TODO with one more attempt counted; a shard that has
been attempted more than ``max_retries`` times without success is set aside in ``failed`` (reported, not retried
forever). The next epoch's shards are queued when TODO runs dry, so fast workers go on while the last shards of an
epoch are still in DOING.

**Batches of shards, bounded.** A lease hands a worker as many shards as bring what it holds in DOING up to
``hold_seconds`` of work at the speed it reported (records), never more than its *shard cap*, and always one
shard to a worker that holds none (a worker that reported no speed yet gets one shard at a time). So a worker holds
a bounded amount of work whatever it asks, a slower worker holds less, and the master is asked once per batch, not
once per shard. Shards leased and not yet started are DOING like the one in training: a lost worker's all go back.

**The shard cap follows the worker** (:meth:`ShardManager.cap`). It starts at ``start_hold`` shards. It doubles,
up to ``max_hold``, when the worker comes back having finished everything it held and its last lease was cut by the
cap (the cap, not its speed, decided how often it must call: with small shards a fast worker would otherwise spend
its time asking); it comes down to what the worker holds (not below ``start_hold``) when a lease is cut by the
worker's speed. A new, restored or lost-and-returned worker starts again at ``start_hold``. The cap only decides how
many shards one call carries; how much work a worker holds is still ``hold_seconds`` at its speed, so a slower
worker (§5.4) holds fewer records and, with shards of one size, fewer shards. ``hold_seconds`` is also how often a
worker reports (it reports with its next lease): a quarter of a second by default, so that a throughput read over a
short window (Brain's, :mod:`hpc_elastic.ps.brain_agent`) sees reports in it.

**Stragglers (§5.4).** Workers pass their measured speed (samples per second) with each lease; besides the bound
above, a worker whose speed is below ``straggler_ratio`` times the median speed of the workers that reported one
gets a *smaller* shard: the head shard is split at ``ceil(size * speed / median)`` records (at least
``min_split``); the worker leases the front part and the rest goes back to the head of TODO as a shard of its own. A
straggler thus holds less work at a time (a lost straggler costs less to redo and the end of an epoch does not wait
on it) and, taking smaller pieces at its slower pace, gets fewer of the dataset's samples; a normal worker gets whole
shards.

**Exactly once.** Under asynchronous SGD there is no global step at which "the model has seen sample i" could be
checked bit for bit: workers push gradients whenever they like and the PS apply them in arrival order. What this
module guarantees is a statement about samples: *in every epoch, every sample id belongs to exactly one shard that
was reported done by the worker holding it* (``SampleLedger.exactly_once``). A shard counts when its ``done`` is
accepted, never before; a shard of a worker that was lost (or that failed) is not counted and goes back to TODO
until another worker reports it done; a late ``done`` from a worker that is no longer its holder is refused
(:attr:`DoneOutcome.STALE`), so a zombie cannot make a sample count twice. Gradients that a lost worker pushed for
the part of a shard it did not finish stay in the parameters, as in DLRover: they are part of the noise of
asynchronous SGD, not a use of the sample that the ledger counts. On a restore from a checkpoint the ledger rolls
back with the queues (they are one state, checkpointed together with the parameters), so the samples counted after
that checkpoint count again only when they are redone. A shard set aside in ``failed`` leaves its samples at zero:
an epoch with failed shards is reported as such (``epoch_complete`` holds, ``exactly_once`` does not).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}")


@dataclass(frozen=True)
class ShardConfig:
    """How the dataset is cut and served.

    ``num_samples`` records, ``shard_size`` records per shard (the last one may be shorter), ``epochs`` passes,
    ``seed`` for the per-epoch shuffle of the shard order, ``max_retries`` further attempts of a shard after its
    first one fails, ``straggler_ratio`` (0 < r <= 1) and ``min_split`` for the smaller shards of stragglers;
    ``hold_seconds`` of work at its speed and at most its shard cap (from ``start_hold`` shards, adapted up to
    ``max_hold``): what one worker holds at a time."""

    num_samples: int
    shard_size: int
    epochs: int = 1
    seed: int = 0
    max_retries: int = 3
    straggler_ratio: float = 0.5
    min_split: int = 1
    max_hold: int = 256
    hold_seconds: float = 0.25
    start_hold: int = 16

    def __post_init__(self) -> None:
        _check_int("num_samples", self.num_samples, 1)
        _check_int("shard_size", self.shard_size, 1)
        _check_int("epochs", self.epochs, 1)
        _check_int("seed", self.seed, 0)
        _check_int("max_retries", self.max_retries, 0)
        _check_int("min_split", self.min_split, 1)
        _check_int("max_hold", self.max_hold, 1)
        _check_int("start_hold", self.start_hold, 1)
        hold = self.hold_seconds
        if isinstance(hold, bool) or not (isinstance(hold, int | float) and math.isfinite(hold)) or not hold > 0:
            raise ValueError(f"hold_seconds must be a positive number, not {self.hold_seconds!r}")
        if not 0.0 < self.straggler_ratio <= 1.0:
            raise ValueError(f"straggler_ratio must be in (0, 1], not {self.straggler_ratio!r}")

    @property
    def shards_per_epoch(self) -> int:
        return -(-self.num_samples // self.shard_size)


@dataclass(frozen=True)
class Shard:
    """Records ``[start, end)`` of epoch ``epoch``; ``attempts``: how many times it was leased and not done."""

    shard_id: int
    epoch: int
    start: int
    end: int
    attempts: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start

    def to_json(self) -> list[int]:
        return [self.shard_id, self.epoch, self.start, self.end, self.attempts]

    @classmethod
    def from_json(cls, data: Any) -> Shard:
        if not isinstance(data, list) or len(data) != 5 or not all(isinstance(x, int) for x in data):
            raise ValueError(f"not a shard: {data!r}")
        return cls(*data)

    @staticmethod
    def pack(shards: Iterable[Shard]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Shards as one ``(n, 5)`` int64 array (how a lease travels)."""
        rows = [(s.shard_id, s.epoch, s.start, s.end, s.attempts) for s in shards]
        return np.array(rows, dtype=np.int64).reshape(len(rows), 5)

    @classmethod
    def unpack(cls, rows: np.ndarray[Any, np.dtype[Any]]) -> list[Shard]:
        if rows.ndim != 2 or rows.shape[1] != 5 or rows.dtype != np.int64:
            raise ValueError(f"not an array of shards: {rows.dtype} {rows.shape}")
        return [cls(*r) for r in rows.tolist()]


class DoneOutcome(StrEnum):
    """What the manager made of a ``done`` report."""

    ACCEPTED = "accepted"  # the shard was DOING under this worker: removed, its samples counted
    STALE = "stale"  # the worker does not hold that shard (lost and requeued, or unknown): nothing counted


class LeaseStatus(StrEnum):
    """Why :meth:`ShardManager.lease` gave no shard, or that it gave some."""

    SHARD = "shard"
    WAIT = "wait"  # none now: TODO is empty but shards are in DOING (one may come back), or the worker holds its bound
    END = "end"  # every epoch is finished


@dataclass(frozen=True)
class Lease:
    status: LeaseStatus
    shards: tuple[Shard, ...] = ()


@dataclass(frozen=True)
class LedgerEntry:
    """Samples ``[start, end)`` of ``epoch`` counted once for ``worker`` (an accepted done)."""

    epoch: int
    start: int
    end: int
    worker: str

    def to_json(self) -> list[Any]:
        return [self.epoch, self.start, self.end, self.worker]


@dataclass(frozen=True)
class ShardState:
    """The manager's checkpoint: JSON-able, small (shards are ranges; the ledger is the list of done ranges)."""

    epoch: int  # the last epoch whose shards were queued (-1: none yet)
    next_shard_id: int
    todo: tuple[Shard, ...]
    doing: tuple[tuple[str, Shard], ...]
    failed: tuple[Shard, ...]
    ledger: tuple[LedgerEntry, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "next_shard_id": self.next_shard_id,
            "todo": [s.to_json() for s in self.todo],
            "doing": [[w, s.to_json()] for w, s in self.doing],
            "failed": [s.to_json() for s in self.failed],
            "ledger": [e.to_json() for e in self.ledger],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardState:
        try:
            return cls(
                epoch=int(data["epoch"]),
                next_shard_id=int(data["next_shard_id"]),
                todo=tuple(Shard.from_json(s) for s in data["todo"]),
                doing=tuple((str(w), Shard.from_json(s)) for w, s in data["doing"]),
                failed=tuple(Shard.from_json(s) for s in data["failed"]),
                ledger=tuple(LedgerEntry(int(e), int(a), int(b), str(w)) for e, a, b, w in data["ledger"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a shard manager state: {exc}") from exc


class SampleLedger:
    """Which sample ids were trained in which epoch, by which worker, how many times (from accepted dones)."""

    def __init__(self, num_samples: int, entries: Iterable[LedgerEntry] = ()) -> None:
        self.num_samples = num_samples
        self._entries: list[LedgerEntry] = list(entries)

    def record(self, entry: LedgerEntry) -> None:
        self._entries.append(entry)

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    def counts(self, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """How many times each sample id of ``epoch`` was counted (index = sample id)."""
        delta = np.zeros(self.num_samples + 1, dtype=np.int64)
        for e in self._entries:
            if e.epoch == epoch:
                delta[e.start] += 1
                delta[e.end] -= 1
        return np.cumsum(delta[:-1])

    def exactly_once(self, epoch: int) -> bool:
        return bool(np.all(self.counts(epoch) == 1))

    def workers(self, epoch: int) -> dict[str, int]:
        """Samples counted per worker in ``epoch``."""
        out: dict[str, int] = {}
        for e in self._entries:
            if e.epoch == epoch:
                out[e.worker] = out.get(e.worker, 0) + e.end - e.start
        return out

    def trained_by(self, epoch: int, sample: int) -> list[str]:
        return [e.worker for e in self._entries if e.epoch == epoch and e.start <= sample < e.end]


class ShardManager:
    """TODO/DOING queues of one job's shards (see the module's docstring)."""

    def __init__(self, config: ShardConfig, state: ShardState | None = None) -> None:
        self.config = config
        self._todo: deque[Shard] = deque()
        self._doing: dict[int, tuple[str, Shard]] = {}
        self._failed: list[Shard] = []
        self._epoch = -1
        self._next_id = 0
        self._speeds: dict[str, float] = {}
        self._held: dict[str, tuple[int, int]] = {}  # worker -> (shards, records) it holds in DOING
        self._caps: dict[str, int] = {}  # worker -> its shard cap (module docstring), once it leased
        self._capped: set[str] = set()  # the workers whose last lease stopped at their cap
        self.ledger = SampleLedger(config.num_samples)
        if state is not None:
            self._restore(state)

    # -- workers -------------------------------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        """A new worker: nothing to do but forget a stale speed and cap; it gets shards by leasing."""
        self._forget(worker)

    def remove_worker(self, worker: str) -> list[Shard]:
        """A worker lost or scaled in: its DOING shards go back to the head of TODO (one attempt more each; set
        aside in ``failed`` past the retry cap). Returns the shards requeued."""
        self._forget(worker)
        self._held.pop(worker, None)
        mine = [sid for sid, (w, _) in self._doing.items() if w == worker]
        requeued: list[Shard] = []
        for sid in reversed(mine):
            _, shard = self._doing.pop(sid)
            back = self._requeue(shard)
            if back is not None:
                requeued.append(back)
        return requeued[::-1]

    def workers(self) -> set[str]:
        """The workers holding a shard now."""
        return {w for w, _ in self._doing.values()}

    # -- the protocol --------------------------------------------------------------------------------------------

    def bound(self, worker: str) -> int:
        """The records ``worker`` may hold: ``hold_seconds`` at its reported speed (0 before it reported one: then
        it gets one shard at a time)."""
        speed = self._speeds.get(worker)
        return 0 if speed is None else int(speed * self.config.hold_seconds)

    def cap(self, worker: str) -> int:
        """The shards ``worker`` may hold at its next lease (the module's docstring: the cap follows the worker)."""
        cap = self._caps.get(worker, min(self.config.start_hold, self.config.max_hold))
        if worker in self._capped and not self.held(worker)[0]:
            cap = min(2 * cap, self.config.max_hold)
        return cap

    def held(self, worker: str) -> tuple[int, int]:
        """The shards and the records ``worker`` holds in DOING."""
        return self._held.get(worker, (0, 0))

    def lease(self, worker: str, speed: float | None = None) -> Lease:
        """The next shards for ``worker`` (reporting ``speed`` samples/s when it knows it), up to its bound."""
        if speed is not None:
            if not math.isfinite(speed) or speed <= 0:
                raise ValueError(f"speed must be a positive number, not {speed!r}")
            self._speeds[worker] = speed
        bound = self.bound(worker)
        cap = self.cap(worker)
        straggler = self._straggler(worker)
        count, records = self.held(worker)
        out: list[Shard] = []
        slow = False  # the lease was cut by the worker's speed
        while count < cap:
            if not self._todo:
                self._queue_next_epoch()
                if not self._todo:
                    break
            head = self._todo[0]
            size = self._share(straggler, head.size)
            if count and records + size > bound:
                slow = True
                break
            shard = self._todo.popleft()
            if size < shard.size:
                rest = Shard(self._new_id(), shard.epoch, shard.start + size, shard.end, shard.attempts)
                shard = replace(shard, end=shard.start + size)
                self._todo.appendleft(rest)
            self._doing[shard.shard_id] = (worker, shard)
            out.append(shard)
            count, records = count + 1, records + size
        if slow:
            cap = max(min(self.config.start_hold, self.config.max_hold), count)  # count <= cap
        self._caps[worker] = cap
        if count >= cap and not slow:
            self._capped.add(worker)
        else:
            self._capped.discard(worker)
        if out:
            self._held[worker] = (count, records)
            return Lease(LeaseStatus.SHARD, tuple(out))
        return Lease(LeaseStatus.WAIT) if self._doing else Lease(LeaseStatus.END)

    def _release(self, worker: str, shard: Shard) -> None:
        count, records = self._held.pop(worker, (1, shard.size))
        if count > 1:
            self._held[worker] = (count - 1, records - shard.size)

    def done(self, worker: str, shard_id: int) -> DoneOutcome:
        held = self._doing.get(shard_id)
        if held is None or held[0] != worker:
            return DoneOutcome.STALE
        del self._doing[shard_id]
        shard = held[1]
        self._release(worker, shard)
        self.ledger.record(LedgerEntry(shard.epoch, shard.start, shard.end, worker))
        return DoneOutcome.ACCEPTED

    def fail(self, worker: str, shard_id: int) -> DoneOutcome:
        """The worker could not process the shard: back to TODO (or ``failed`` past the cap)."""
        held = self._doing.get(shard_id)
        if held is None or held[0] != worker:
            return DoneOutcome.STALE
        del self._doing[shard_id]
        self._release(worker, held[1])
        self._requeue(held[1])
        return DoneOutcome.ACCEPTED

    # -- progress ------------------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._epoch >= self.config.epochs - 1 and not self._todo and not self._doing

    def epoch_complete(self, epoch: int) -> bool:
        """No shard of ``epoch`` is queued or held any more (it may have failed shards)."""
        if epoch > self._epoch:
            return False
        return not any(s.epoch == epoch for s in self._todo) and not any(
            s.epoch == epoch for _, s in self._doing.values()
        )

    @property
    def failed(self) -> tuple[Shard, ...]:
        return tuple(self._failed)

    def counts(self) -> dict[str, int]:
        return {"epoch": self._epoch, "todo": len(self._todo), "doing": len(self._doing), "failed": len(self._failed)}

    # -- checkpoint ----------------------------------------------------------------------------------------------

    def checkpoint(self) -> ShardState:
        return ShardState(
            epoch=self._epoch,
            next_shard_id=self._next_id,
            todo=tuple(self._todo),
            doing=tuple(sorted(self._doing.values(), key=lambda ws: ws[1].shard_id)),
            failed=tuple(self._failed),
            ledger=self.ledger.entries,
        )

    def _restore(self, state: ShardState) -> None:
        """DOING first: the shards that were in flight at the checkpoint are served before TODO's (no attempt is
        counted against them: their workers were not lost, the master was)."""
        self._epoch = state.epoch
        self._next_id = state.next_shard_id
        self._todo = deque([s for _, s in state.doing] + list(state.todo))
        self._failed = list(state.failed)
        self.ledger = SampleLedger(self.config.num_samples, state.ledger)

    # -- internals -----------------------------------------------------------------------------------------------

    def _forget(self, worker: str) -> None:
        """Drop what the manager learnt of ``worker``: its speed and its shard cap."""
        self._speeds.pop(worker, None)
        self._caps.pop(worker, None)
        self._capped.discard(worker)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _queue_next_epoch(self) -> None:
        if self._epoch >= self.config.epochs - 1:
            return
        self._epoch += 1
        c = self.config
        order = list(range(c.shards_per_epoch))
        random.Random(f"{c.seed}:{self._epoch}").shuffle(order)
        for k in order:
            start = k * c.shard_size
            self._todo.append(Shard(self._new_id(), self._epoch, start, min(start + c.shard_size, c.num_samples)))

    def _requeue(self, shard: Shard) -> Shard | None:
        """``shard`` back at the head of TODO with one attempt more (returned), or into ``failed`` (None)."""
        shard = replace(shard, attempts=shard.attempts + 1)
        if shard.attempts > self.config.max_retries:
            self._failed.append(shard)
            return None
        self._todo.appendleft(shard)
        return shard

    def _straggler(self, worker: str) -> tuple[float, float] | None:
        """``(speed, median)`` if ``worker`` is a straggler (§5.4: slower than ``straggler_ratio`` times the median
        speed), else None; taken once per lease, the speeds do not change during one."""
        speed = self._speeds.get(worker)
        if speed is None or len(self._speeds) < 2:
            return None
        median = statistics.median(self._speeds.values())
        return None if speed >= self.config.straggler_ratio * median else (speed, median)

    def _share(self, straggler: tuple[float, float] | None, size: int) -> int:
        """The records of a ``size`` shard that a worker gets: all of it, or less if it is a straggler."""
        if straggler is None:
            return size
        speed, median = straggler
        return min(size, max(self.config.min_split, math.ceil(size * speed / median)))
