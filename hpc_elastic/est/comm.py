"""The process group an EST job reduces its gradients over: torch.distributed (gloo, nccl), MPI through
mpi4py, or Horovod.

The group itself — opening it, rank and size, barrier, object allgather — is the library's
:class:`hpc_elastic.collective.Collective`.  The deterministic allreduce (EasyScale §3.3, D1) needs one thing
that protocol does not offer: an in-place ``SUM``/``MAX`` allreduce of an integer (or, for D0, fp32) tensor.
This module adds exactly that, per backend, and bundles it with the collective in :class:`Communicator`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import torch

from hpc_elastic.collective import (
    Collective,
    HorovodCollective,
    LocalCollective,
    MPICollective,
    TorchCollective,
    import_mpi,
)
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.backends import CommBackend


class ReduceOp(StrEnum):
    SUM = "sum"
    MAX = "max"


TensorAllreduce = Callable[[torch.Tensor, ReduceOp], None]


def _no_exchange(tensor: torch.Tensor, op: ReduceOp) -> None:
    return None  # a group of one: the local value is the reduced value


class Communicator:
    """A :class:`~hpc_elastic.collective.Collective` plus an in-place tensor allreduce on the same group."""

    def __init__(self, backend: CommBackend, collective: Collective, allreduce: TensorAllreduce) -> None:
        self.backend = backend
        self.collective = collective
        self._allreduce = allreduce

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def size(self) -> int:
        return self.collective.world_size

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """In-place allreduce of a contiguous tensor (int64, uint8 or float32) over every process."""
        if not tensor.is_contiguous():
            raise ValueError("allreduce_ needs a contiguous tensor")
        self._allreduce(tensor, ReduceOp(op))

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.collective.allgather_object(obj)

    def barrier(self) -> None:
        self.collective.barrier()

    def close(self) -> None:
        self.collective.close()


def local_communicator() -> Communicator:
    """One process, nothing to exchange."""
    return Communicator(CommBackend.LOCAL, LocalCollective(), _no_exchange)


def _torch_allreduce() -> TensorAllreduce:
    import torch.distributed as dist

    ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}

    def allreduce(tensor: torch.Tensor, op: ReduceOp) -> None:
        dist.all_reduce(tensor, op=ops[op])

    return allreduce


def _mpi_allreduce(comm: Any) -> TensorAllreduce:
    mpi = import_mpi()
    ops = {ReduceOp.SUM: mpi.SUM, ReduceOp.MAX: mpi.MAX}

    def allreduce(tensor: torch.Tensor, op: ReduceOp) -> None:
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        comm.Allreduce(mpi.IN_PLACE, host.numpy(), op=ops[op])
        if host is not tensor:
            tensor.copy_(host)

    return allreduce


def _horovod_allreduce() -> TensorAllreduce:
    hvd = importlib.import_module("horovod.torch")
    ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MAX: hvd.Max}
    native = (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)

    def allreduce(tensor: torch.Tensor, op: ReduceOp) -> None:
        if tensor.dtype in native:
            hvd.allreduce_(tensor, op=ops[op])
            return
        # Horovod has no uint8 allreduce (the chunk top bins): widen, reduce, narrow (exact for MAX)
        wide = tensor.to(torch.int32)
        hvd.allreduce_(wide, op=ops[op])
        tensor.copy_(wide)

    return allreduce


def _rendezvous(init_method: str | None) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> ``(HOST, PORT)`` for :class:`~hpc_elastic.collective.TorchCollective`."""
    if init_method is None:
        raise HpcElasticError("torch.distributed is not initialised and no init_method (tcp://HOST:PORT) was given")
    parts = urlsplit(init_method)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
    return parts.hostname, port


def make_communicator(
    backend: CommBackend | str,
    *,
    rank: int | None = None,
    size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> Communicator:
    """Open the process group of ``backend`` (rank and size come from MPI/Horovod for those backends; gloo
    and nccl rendezvous at ``init_method`` unless torch.distributed is already initialised)."""
    b = CommBackend.parse(backend)
    if b is CommBackend.LOCAL:
        return local_communicator()
    comm: Communicator
    if b in (CommBackend.GLOO, CommBackend.NCCL):
        import torch.distributed as dist

        if dist.is_initialized():
            rank, size = int(dist.get_rank()), int(dist.get_world_size())
            addr, port = "127.0.0.1", 0  # unused: the existing group is taken as it is
        else:
            if rank is None or size is None:
                raise HpcElasticError("torch.distributed is not initialised and no rank/size was given")
            addr, port = _rendezvous(init_method)
        coll = TorchCollective(
            rank=rank,
            world_size=size,
            master_addr=addr,
            master_port=port,
            device="cuda" if b is CommBackend.NCCL else "cpu",  # TorchCollective opens nccl for a CUDA device
            timeout_s=timeout_s,
        )
        comm = Communicator(b, coll, _torch_allreduce())
    elif b is CommBackend.MPI:
        world = import_mpi().COMM_WORLD
        comm = Communicator(b, MPICollective(world), _mpi_allreduce(world))
    else:
        comm = Communicator(b, HorovodCollective(), _horovod_allreduce())
    if size is not None and comm.size != size:
        raise HpcElasticError(f"{b.value} started {comm.size} processes, the job expects {size}")
    return comm
