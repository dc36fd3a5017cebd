"""Process-group adapters the EST runtime reduces gradients over: torch.distributed (gloo, nccl), MPI
through mpi4py, and Horovod.  Only integer ``SUM``/``MAX`` and fp32 ``SUM`` allreduces are needed."""

from __future__ import annotations

import datetime as _dt
import importlib
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.backends import CommBackend


class ReduceOp(StrEnum):
    SUM = "sum"
    MAX = "max"


class Communicator(ABC):
    """A group of ``size`` processes; this one is ``rank``."""

    backend: CommBackend
    rank: int
    size: int

    @abstractmethod
    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """In-place allreduce of a contiguous tensor (int64/uint8/float32)."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for most backends
        """Release the group (no-op where the library owns it)."""


class LocalCommunicator(Communicator):
    """One process, nothing to exchange."""

    def __init__(self) -> None:
        self.backend = CommBackend.LOCAL
        self.rank = 0
        self.size = 1

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        ReduceOp(op)

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


class TorchDistCommunicator(Communicator):
    """``torch.distributed`` (gloo on CPU, nccl on GPU)."""

    def __init__(
        self,
        backend: CommBackend,
        rank: int | None = None,
        size: int | None = None,
        init_method: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        import torch.distributed as dist

        if backend not in (CommBackend.GLOO, CommBackend.NCCL):
            raise ValueError(f"torch.distributed backend must be gloo or nccl, got {backend.value!r}")
        self._dist = dist
        self._owned = False
        if not dist.is_initialized():
            if rank is None or size is None or init_method is None:
                raise HpcElasticError("torch.distributed is not initialised and no rank/size/init_method was given")
            dist.init_process_group(
                backend.value,
                init_method=init_method,
                rank=rank,
                world_size=size,
                timeout=_dt.timedelta(seconds=timeout_s),
            )
            self._owned = True
        self.backend = backend
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        self._dist.all_reduce(tensor, op=self._ops[ReduceOp(op)])

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        if self._owned and self._dist.is_initialized():
            self._dist.destroy_process_group()
            self._owned = False


def _import_mpi() -> Any:
    try:
        return importlib.import_module("mpi4py.MPI")
    except ImportError as exc:
        raise HpcElasticError(f"the mpi backend needs mpi4py (pip install 'hpc-elastic[mpi]'): {exc}") from exc


class MPICommunicator(Communicator):
    """MPI through mpi4py (``MPI.COMM_WORLD`` unless another communicator is given)."""

    def __init__(self, comm: Any = None) -> None:
        mpi = _import_mpi()
        self._mpi = mpi
        self._comm = comm if comm is not None else mpi.COMM_WORLD
        self.backend = CommBackend.MPI
        self.rank = int(self._comm.Get_rank())
        self.size = int(self._comm.Get_size())
        self._ops = {ReduceOp.SUM: mpi.SUM, ReduceOp.MAX: mpi.MAX}

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if not tensor.is_contiguous():
            raise ValueError("allreduce_ needs a contiguous tensor")
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        array: np.ndarray[Any, Any] = host.numpy()
        self._comm.Allreduce(self._mpi.IN_PLACE, array, op=self._ops[ReduceOp(op)])
        if host is not tensor:
            tensor.copy_(host)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def barrier(self) -> None:
        self._comm.Barrier()


def horovod_available() -> bool:
    try:
        importlib.import_module("horovod.torch")
    except ImportError:
        return False
    return True


class HorovodCommunicator(Communicator):
    """Horovod (``horovod.torch``) over its MPI or Gloo controller; integer SUM and MAX allreduces."""

    def __init__(self) -> None:
        try:
            hvd = importlib.import_module("horovod.torch")
        except ImportError as exc:
            raise HpcElasticError(f"the horovod backend needs Horovod installed with PyTorch support: {exc}") from exc
        hvd.init()
        self._hvd = hvd
        self.backend = CommBackend.HOROVOD
        self.rank = int(hvd.rank())
        self.size = int(hvd.size())
        self._ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MAX: hvd.Max}

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if tensor.dtype in (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64):
            self._hvd.allreduce_(tensor, op=self._ops[ReduceOp(op)])
            return
        # Horovod has no uint8 allreduce (the chunk top bins): widen, reduce, narrow (exact for MAX)
        wide = tensor.to(torch.int32)
        self._hvd.allreduce_(wide, op=self._ops[ReduceOp(op)])
        tensor.copy_(wide)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self._hvd.allgather_object(obj))

    def barrier(self) -> None:
        self._hvd.barrier()


def make_communicator(
    backend: CommBackend | str,
    *,
    rank: int | None = None,
    size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> Communicator:
    """Open the process group of ``backend`` (rank and size come from MPI/Horovod for those backends)."""
    b = CommBackend.parse(backend)
    if b is CommBackend.LOCAL:
        return LocalCommunicator()
    if b in (CommBackend.GLOO, CommBackend.NCCL):
        return TorchDistCommunicator(b, rank=rank, size=size, init_method=init_method, timeout_s=timeout_s)
    if b is CommBackend.MPI:
        comm: Communicator = MPICommunicator()
    else:
        comm = HorovodCommunicator()
    if size is not None and comm.size != size:
        raise HpcElasticError(f"{b.value} started {comm.size} processes, the job expects {size}")
    return comm
