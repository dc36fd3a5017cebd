"""The process group of a job: a :class:`~hpc_elastic.collective.Collective` plus the in-place tensor allreduce and
the range exchanges the deterministic allreduce needs (EasyScale §3.3, D1), on torch.distributed (gloo on the CPU,
NCCL on CUDA), MPI through mpi4py, or Horovod.

:func:`open_communicator` is the one place a job's process group is opened.  The exchange patterns themselves
(owner round, ring) live in :mod:`hpc_elastic.est.exchange`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from hpc_elastic.collective import DEFAULT_TIMEOUT_S, Backend, Collective, LocalCollective
from hpc_elastic.est.exchange import OwnerExchange, ScatterGather, mpi_p2p, owner_exchange, torch_p2p, torch_ring
from hpc_elastic.est.groups import HorovodCollective, MPICollective, TorchCollective, import_mpi


class ReduceOp(StrEnum):
    SUM = "sum"
    MAX = "max"


TensorAllreduce = Callable[[torch.Tensor, ReduceOp], None]


def _no_exchange(tensor: torch.Tensor, op: ReduceOp) -> None:
    return None  # a group of one: the local value is the reduced value


class Communicator:
    """A :class:`~hpc_elastic.collective.Collective` plus an in-place tensor allreduce on the same group."""

    def __init__(
        self,
        backend: Backend | None,
        collective: Collective,
        allreduce: TensorAllreduce,
        scatter_gather: ScatterGather | None = None,
        owner_exchange: OwnerExchange | None = None,
    ) -> None:
        #: None for a process on its own (no process group)
        self.backend = backend
        self.collective = collective
        self._allreduce = allreduce
        #: reduce-scatter + allgather over ranges, where the backend has them on CPU tensors (None: allreduce only)
        self.scatter_gather = scatter_gather
        #: every process's copy of each range to the range's owner and the owners' results back (two all-to-alls,
        #: pipelined by pieces), on CPU tensors: with one EST per process the reducer sends raw fp32 this way and
        #: forms the exact integers where they are added (4 + 4 bytes per element).  None: not on this backend
        self.owner_exchange = owner_exchange

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

    def allreduce_only(self) -> Communicator:
        """The same group without the reduce-scatter and the owner exchange: the path of Horovod and NCCL (for
        comparisons)."""
        return Communicator(self.backend, self.collective, self._allreduce)

    def barrier(self) -> None:
        self.collective.barrier()

    def close(self) -> None:
        self.collective.close()


def local_communicator() -> Communicator:
    """One process, nothing to exchange."""
    return Communicator(None, LocalCollective(), _no_exchange)


def _torch_allreduce() -> TensorAllreduce:
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


def communicator_of(backend: Backend, collective: Collective) -> Communicator:
    """The communicator over an open ``collective`` of ``backend`` (Horovod elastic re-forms its group in place)."""
    if collective.world_size == 1:
        return Communicator(backend, collective, _no_exchange)
    if isinstance(collective, TorchCollective):
        if collective.device.type == "cuda":  # NCCL keeps the allreduce path: the exchanges are written for CPU tensors
            return Communicator(backend, collective, _torch_allreduce())
        return Communicator(backend, collective, _torch_allreduce(), torch_ring(), owner_exchange(torch_p2p()))
    if isinstance(collective, MPICollective):
        world = collective.comm
        # Open MPI's Reduce_scatter with per-rank counts plus Allgatherv measured 2x slower than its int64 Allreduce
        # (bench/allreduce.py --backend mpi: 493 ms vs 250 ms for 64 MB over 4 ranks): no ring over MPI; its
        # point-to-point messages carry the owner exchange
        return Communicator(backend, collective, _mpi_allreduce(world), None, owner_exchange(mpi_p2p(world)))
    if isinstance(collective, HorovodCollective):  # no point-to-point messages in Horovod's API
        return Communicator(backend, collective, _horovod_allreduce())
    raise ValueError(f"no tensor allreduce for a {type(collective).__name__}")


def open_communicator(
    backend: Backend | str,
    *,
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Communicator:
    """Open the process group of ``backend``: torch.distributed (gloo on the CPU, NCCL for a CUDA ``device``; the
    rendezvous at ``master_addr:master_port`` as ``rank`` of ``world_size``), MPI through mpi4py or Horovod, which
    know the rank and size of the process themselves (``rank`` and ``world_size`` are not used for them:
    ``horovodrun`` and ``mpirun`` tell the processes nothing the job environment reads)."""
    b = Backend.parse(backend)
    coll: Collective
    if b is Backend.TORCH and world_size == 1:  # nothing to exchange: no process group, no threads
        coll = LocalCollective()
    elif b is Backend.TORCH:
        coll = TorchCollective(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
            timeout_s=timeout_s,
        )
    elif b is Backend.MPI:
        coll = MPICollective()
    else:
        coll = HorovodCollective()
    return communicator_of(b, coll)
