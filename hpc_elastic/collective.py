"""The few collective operations the checkpoint library and the session need, over any backend: the backend type
and the :class:`Collective` protocol — a barrier, broadcast/gather/allgather of small picklable objects, an integer
MAX allreduce and an exact tensor allgather — with :class:`LocalCollective` (one process, nothing to exchange).

The process groups of the backends (torch.distributed, MPI, Horovod) are in :mod:`hpc_elastic.est.groups`;
nothing here imports torch, mpi4py or Horovod, so the command-line tools and the scheduler daemon stay light.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from hpc_elastic.choices import parse_choice

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 1800.0  # seconds a collective may wait for the other processes


class Backend(StrEnum):
    """How the worker processes of a job talk to each other: the one backend type of the library (``hpc-elastic
    submit --backend``, ``HPC_ELASTIC_BACKEND``, ``verify-determinism --backend``).  ``torch`` is torch.distributed:
    gloo on the CPU, NCCL on CUDA devices."""

    TORCH = "torch"
    MPI = "mpi"
    HOROVOD = "horovod"

    @classmethod
    def parse(cls, value: str | Backend) -> Backend:
        """The backend named by ``value`` (case and blanks ignored); ``ValueError`` naming the bad value."""
        return parse_choice(cls, value, "backend")


@runtime_checkable
class Collective(Protocol):
    """A group of ``world_size`` processes, this one being ``rank``.  Every method is collective: all ranks call
    it in the same order (from the same thread: none of the backends allows collectives from two threads)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def barrier(self) -> None: ...

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        """``root``'s ``obj`` on every rank (small picklable objects)."""
        ...

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on ``root``; ``None`` elsewhere."""
        ...

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order, on every rank."""
        ...

    def allreduce_max_int(self, value: int) -> int:
        """The largest ``value`` over all ranks."""
        ...

    def allgather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape and dtype everywhere) concatenated along dim 0 in rank order.
        Bytes are moved, never combined: the result is exact."""
        ...

    def close(self) -> None:
        """Release what this object opened (nothing when the group belongs to someone else)."""
        ...


def check_root(root: int, world_size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world_size:
        raise ValueError(f"root must be in [0, {world_size}), got {root!r}")
    return root


def check_int(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"allreduce_max_int needs an int, got {value!r}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"allreduce_max_int needs a 64-bit int, got {value!r}")
    return value


class FixedGroup:
    """Rank and size of a process group, fixed when it is opened."""

    _rank: int
    _world: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world


class LocalCollective:
    """A group of one process."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        return None

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        check_root(root, 1)
        return obj

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        check_root(root, 1)
        return [obj]

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def allreduce_max_int(self, value: int) -> int:
        return check_int(value)

    def allgather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            raise ValueError("allgather_tensor needs a tensor with at least one dimension")
        return tensor.clone()

    def close(self) -> None:
        return None


def horovod_available() -> bool:
    """Whether ``horovod.torch`` imports here."""
    try:
        importlib.import_module("horovod.torch")
    except ImportError:
        return False
    return True
