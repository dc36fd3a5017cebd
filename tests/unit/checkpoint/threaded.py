"""A test double of the ``Collective`` protocol: M ranks as M threads of one process.

Every operation is built on one exact ``allgather_object`` (a barrier-protected shared list), so multi-rank logic
of the checkpoint store and the session's control protocol can be tested in milliseconds; the real backends are
tested with real processes elsewhere (the runtime's ESTs switch process-wide RNG states: threads share them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hpc_elastic.est.comm import Communicator, ReduceOp

T = TypeVar("T")
R = TypeVar("R")


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size


class ThreadCollective:
    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.size

    def allgather_object(self, obj: Any) -> list[Any]:
        g = self._group
        g.barrier.wait()
        g.slots[self._rank] = obj
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def barrier(self) -> None:
        self.allgather_object(None)

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        result: T = self.allgather_object(obj)[root]
        return result

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = self.allgather_object(obj)
        return out if self._rank == root else None

    def allreduce_max_int(self, value: int) -> int:
        return int(max(self.allgather_object(value)))

    def allgather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.clone() for t in self.allgather_object(tensor.detach())], dim=0)

    def close(self) -> None:
        return None


def run_ranks(size: int, fn: Callable[[ThreadCollective], R]) -> list[R]:
    """Run ``fn`` on ``size`` threaded ranks; return the results in rank order (re-raise the first failure)."""
    group = _Group(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCollective(group, rank))
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


def threaded_communicator(coll: ThreadCollective) -> Communicator:
    """A :class:`~hpc_elastic.est.comm.Communicator` over threaded ranks: the tensor allreduce as an exact gather
    and a sum (or max) in rank order."""

    def allreduce(tensor: torch.Tensor, op: ReduceOp) -> None:
        parts = coll.allgather_object(tensor.detach().clone())
        out = parts[0].clone()
        for part in parts[1:]:
            out = out + part if op is ReduceOp.SUM else torch.maximum(out, part)
        tensor.copy_(out)

    return Communicator(None, coll, allreduce)
