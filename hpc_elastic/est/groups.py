"""The process groups of the backends, behind :class:`hpc_elastic.collective.Collective`:

- :class:`TorchCollective`: ``torch.distributed`` (gloo on CPU, NCCL when the process uses a CUDA device);
- :class:`MPICollective`: MPI through mpi4py (``MPI.COMM_WORLD`` unless given another communicator);
- :class:`HorovodCollective`: ``horovod.torch``.

mpi4py and Horovod are imported when their group is opened (they need not be installed otherwise).
:func:`hpc_elastic.est.comm.open_communicator` is the one place a job opens them.
"""

from __future__ import annotations

import datetime as _dt
import importlib
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from hpc_elastic.collective import DEFAULT_TIMEOUT_S, FixedGroup, check_int, check_root
from hpc_elastic.errors import HpcElasticError

T = TypeVar("T")


def _import_before_init_process_group() -> None:
    """Import ``torch.distributed.nn`` while no default process group exists.

    Its ``functional`` module has defaults like ``group=group.WORLD``, evaluated at import: imported after
    ``init_process_group`` they hold the default group for the life of the process, so ``destroy_process_group``
    cannot free it and gloo's worker threads outlive :meth:`TorchCollective.close`.  torch imports that module
    lazily (the first ``torch.optim`` optimizer pulls in ``torch._dynamo``, which imports it), i.e. after our
    ``init_process_group``.  A gloo thread still alive at interpreter exit may be releasing the last collective's
    tensors, which needs the GIL; a thread that asks for the GIL during finalization is ended by
    ``pthread_exit``, whose forced unwind through ``ProcessGroupGloo::runLoop`` calls ``std::terminate``: the
    worker had printed its result and then died of SIGABRT ("terminate called without an active exception").
    Seen about once in 450 one-process runs here; with the import first, ``close`` joins those threads."""
    importlib.import_module("torch.distributed.nn")


class TorchCollective(FixedGroup):
    """``torch.distributed``.  Opens the default process group unless one is already initialised (then it only
    uses it, and :meth:`close` leaves it alone)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        device: torch.device | str = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._torch = torch
        self._dist = dist
        self.device = torch.device(device)
        self._owned = False
        if not dist.is_initialized():
            if world_size < 1 or not 0 <= rank < world_size:
                raise ValueError(f"rank {rank} is outside a world of {world_size}")
            _import_before_init_process_group()
            pg_backend = "nccl" if self.device.type == "cuda" else "gloo"
            timeout = _dt.timedelta(seconds=timeout_s)
            if world_size == 1:  # no rendezvous (and no port) needed for a group of one
                store = HashStore()
                dist.init_process_group(pg_backend, store=store, rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(
                    pg_backend,
                    init_method=f"tcp://{master_addr}:{master_port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )
            self._owned = True
        self._rank = int(dist.get_rank())
        self._world = int(dist.get_world_size())
        if (self._rank, self._world) != (rank, world_size):
            raise HpcElasticError(
                f"torch.distributed says rank {self._rank} of {self._world}, the job environment rank {rank} of "
                f"{world_size}"
            )

    def barrier(self) -> None:
        self._dist.barrier()

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        check_root(root, self._world)
        box: list[Any] = [obj]
        self._dist.broadcast_object_list(box, src=root, device=self.device)
        result: T = box[0]
        return result

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        check_root(root, self._world)
        out: list[Any] | None = [None] * self._world if self._rank == root else None
        self._dist.gather_object(obj, out, dst=root)
        return out

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._world
        self._dist.all_gather_object(out, obj)
        return out

    def allreduce_max_int(self, value: int) -> int:
        t = self._torch.tensor([check_int(value)], dtype=self._torch.int64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return int(t.item())

    def allgather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            raise ValueError("allgather_tensor needs a tensor with at least one dimension")
        src = tensor.contiguous()
        parts = [self._torch.empty_like(src) for _ in range(self._world)]
        self._dist.all_gather(parts, src)
        return self._torch.cat(parts, dim=0)

    def close(self) -> None:
        if self._owned and self._dist.is_initialized():
            self._dist.destroy_process_group()
            self._owned = False


def import_mpi() -> Any:
    """``mpi4py.MPI``, or a clear error when it is missing."""
    try:
        return importlib.import_module("mpi4py.MPI")
    except ImportError as exc:
        raise HpcElasticError(f"the mpi backend needs mpi4py (pip install mpi4py): {exc}") from exc


class MPICollective(FixedGroup):
    """MPI through mpi4py."""

    def __init__(self, comm: Any = None) -> None:
        mpi = import_mpi()
        self._mpi = mpi
        self._comm = comm if comm is not None else mpi.COMM_WORLD
        self._rank = int(self._comm.Get_rank())
        self._world = int(self._comm.Get_size())

    def barrier(self) -> None:
        self._comm.Barrier()

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        result: T = self._comm.bcast(obj, root=check_root(root, self._world))
        return result

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = self._comm.gather(obj, root=check_root(root, self._world))
        return None if out is None else list(out)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def allreduce_max_int(self, value: int) -> int:
        return int(self._comm.allreduce(check_int(value), op=self._mpi.MAX))

    def allgather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            raise ValueError("allgather_tensor needs a tensor with at least one dimension")
        host = tensor.detach().to("cpu").contiguous()
        send = host.reshape(-1).view(torch.uint8).numpy()  # bytes of any dtype (bfloat16 too)
        recv = torch.empty(self._world * send.size, dtype=torch.uint8)
        self._comm.Allgather(send, recv.numpy())
        out = recv.view(host.dtype).reshape(self._world * host.shape[0], *host.shape[1:])
        return out.to(tensor.device)

    @property
    def comm(self) -> Any:
        """The mpi4py communicator."""
        return self._comm

    def local_rank(self) -> int:
        """This process's rank among the processes of its node (collective)."""
        node = self._comm.Split_type(self._mpi.COMM_TYPE_SHARED)
        try:
            return int(node.Get_rank())
        finally:
            node.Free()

    def close(self) -> None:
        return None  # MPI is finalised by mpi4py at exit


class HorovodCollective(FixedGroup):
    """Horovod's PyTorch API (``hvd.init()`` is called if needed).  Only runs where Horovod is installed."""

    def __init__(self) -> None:
        try:
            hvd = importlib.import_module("horovod.torch")
        except ImportError as exc:
            raise HpcElasticError(f"the horovod backend needs Horovod built with PyTorch support: {exc}") from exc
        hvd.init()
        self._hvd = hvd
        self._torch = torch
        self._rank = int(hvd.rank())
        self._world = int(hvd.size())

    def barrier(self) -> None:
        self._hvd.barrier()

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        # an explicit name: Horovod's default is the object's type, which differs between root and the others
        result: T = self._hvd.broadcast_object(obj, root_rank=check_root(root, self._world), name="hpc_elastic.bcast")
        return result

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        check_root(root, self._world)
        everything = self.allgather_object(obj)
        return everything if self._rank == root else None

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self._hvd.allgather_object(obj, name="hpc_elastic.allgather_object"))

    def allreduce_max_int(self, value: int) -> int:
        t = self._torch.tensor([check_int(value)], dtype=self._torch.int64)
        out = self._hvd.allreduce(t, op=self._hvd.Max)
        return int(out.item())

    def allgather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            raise ValueError("allgather_tensor needs a tensor with at least one dimension")
        # as bytes: Horovod's CPU allgather refuses some dtypes (bfloat16), bytes are exact for all
        src = tensor.contiguous()
        raw = src.reshape(src.shape[0], -1).view(self._torch.uint8)
        out: torch.Tensor = self._hvd.allgather(raw, name="hpc_elastic.allgather_tensor")
        return out.view(src.dtype).reshape(-1, *src.shape[1:])

    def local_rank(self) -> int:
        return int(self._hvd.local_rank())

    def close(self) -> None:
        return None  # Horovod shuts down at exit (hvd.shutdown() would break a later hvd.init in the same process)
