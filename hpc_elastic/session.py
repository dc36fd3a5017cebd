"""The entry point of a training script: where this process stands in the job, and its side of the wrapper's
control protocol.

Typical use (the same script on the torch, mpi and horovod backends)::

    import hpc_elastic
    from hpc_elastic.data import ElasticSampler

    session = hpc_elastic.init()                        # reads the job environment, opens the process group
    sampler = ElasticSampler(len(dataset), batch_size, seed=0)
    state = session.state(model=model, optimizer=opt, sampler=sampler)
    state.restore()                                     # newest valid checkpoint, if any
    while state.step < total_steps:
        if session.should_stop():                       # the wrapper asked: same answer on every rank
            session.checkpoint_and_acknowledge(state)   # commit, then rank 0 writes control/ack.json
            return 0                                    # the wrapper requeues the job
        for w in session.workers:                       # the logical workers this process runs
            batch = sampler.indices(w, session.num_workers) ...
        ...
        sampler.advance(session.num_workers)
        state.step += 1
        if state.step % every == 0:
            state.commit()

Rank, world size and local rank come from :func:`hpc_elastic.env.read_job_environment` for the torch backend and
from MPI / Horovod themselves for those backends (they know best how they launched their processes).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hpc_elastic.checkpoint import DEFAULT_KEEP, CheckpointStore, SaveMode
from hpc_elastic.checkpoint.fs import atomic_write_bytes
from hpc_elastic.checkpoint.store import DEFAULT_COMMIT_TIMEOUT_S
from hpc_elastic.collective import (
    DEFAULT_TIMEOUT_S,
    Backend,
    Collective,
    HorovodCollective,
    LocalCollective,
    MPICollective,
    open_collective,
)
from hpc_elastic.control import ACK_FILE, CONTROL_DIR, STOP_FILE, Ack, StopRequest, parse_stop_lenient
from hpc_elastic.data.sampler import ElasticSampler
from hpc_elastic.env import JobEnvironment, read_job_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.state import State, Stateful
from hpc_elastic.workers import WorkerAssignment

if TYPE_CHECKING:
    import torch

CHECKPOINT_DIR = "checkpoints"


def choose_device(local_rank: int, requested: str | None = None) -> torch.device:
    """``requested`` if given; else ``cuda:i`` when CUDA works (``i = 0`` when the process sees one device, its
    local rank modulo the count when it sees several), else the CPU.  Selects the CUDA device for the process."""
    import torch

    if requested is not None:
        device = torch.device(requested)
    elif torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        device = torch.device("cuda", 0 if count == 1 else local_rank % count)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class Session:
    """This process's place in an elastic job (see the module docstring)."""

    def __init__(
        self,
        job: JobEnvironment,
        collective: Collective,
        *,
        device: torch.device | str = "cpu",
        local_rank: int | None = None,
        num_workers: int | None = None,
        job_dir: Path | str | None = None,
        keep: int = DEFAULT_KEEP,
        save_mode: SaveMode | str = SaveMode.SYNC,
        commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
        stop_check_every: int = 1,
    ) -> None:
        import torch

        if isinstance(stop_check_every, bool) or not isinstance(stop_check_every, int) or stop_check_every < 1:
            raise ValueError(f"stop_check_every must be a positive integer, got {stop_check_every!r}")
        self.job = job
        self.collective = collective
        self.device = torch.device(device)
        self.backend = Backend(job.backend)
        self.local_rank = job.local_rank if local_rank is None else local_rank
        n = num_workers if num_workers is not None else job.workers
        self.assignment = WorkerAssignment(
            n if n is not None else collective.world_size, collective.world_size, collective.rank
        )
        resolved = Path(job_dir) if job_dir is not None else job.job_dir
        self.job_dir: Path | None = resolved.resolve() if resolved is not None else None
        self.save_mode = SaveMode(save_mode)
        self._store: CheckpointStore | None = None
        self._keep = keep
        self._commit_timeout_s = commit_timeout_s
        self._stop_every = stop_check_every
        self._stop_calls = 0
        self._stop: StopRequest | None = None
        self._closed = False

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        device: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> Session:
        """Read the job environment (:func:`hpc_elastic.env.read_job_environment`) and open the backend's process
        group: torch.distributed (gloo on CPU, nccl on CUDA; rendezvous at MASTER_ADDR:MASTER_PORT), MPI through
        mpi4py, or Horovod.  ``kwargs`` go to :class:`Session` (``num_workers``, ``job_dir``, ``keep``, ...)."""
        job = read_job_environment(environ)
        backend = Backend(job.backend)
        local_rank: int | None = None
        if backend is Backend.TORCH:
            dev = choose_device(job.local_rank, device)
            coll: Collective = open_collective(
                backend,
                rank=job.rank,
                world_size=job.world_size,
                master_addr=job.master_addr,
                master_port=job.master_port,
                device=dev,
                timeout_s=timeout_s,
            )
        else:
            opened = open_collective(backend, rank=job.rank, world_size=job.world_size)
            if isinstance(opened, MPICollective | HorovodCollective):
                local_rank = opened.local_rank()
            coll = opened
            dev = choose_device(job.local_rank if local_rank is None else local_rank, device)
        try:
            return cls(job, coll, device=dev, local_rank=local_rank, **kwargs)
        except BaseException:
            coll.close()
            raise

    @classmethod
    def local(cls, job_dir: Path | str | None = None, **kwargs: Any) -> Session:
        """A one-process session with no process group (tests, notebooks)."""
        return cls(JobEnvironment(job_dir=Path(job_dir) if job_dir else None), LocalCollective(), **kwargs)

    # -- where this process stands --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def world_size(self) -> int:
        return self.collective.world_size

    @property
    def is_root(self) -> bool:
        return self.collective.rank == 0

    @property
    def devices(self) -> tuple[str, ...]:
        """The GPUs Slurm gave this process (``CUDA_VISIBLE_DEVICES``), as ids."""
        return self.job.gpus

    @property
    def num_workers(self) -> int:
        """N, the logical workers of the job (``HPC_ELASTIC_WORKERS``; the world size when unset)."""
        return self.assignment.num_workers

    @property
    def workers(self) -> range:
        """The logical worker ids this process runs: the contiguous block ``[rank*N/M, (rank+1)*N/M)``."""
        return self.assignment.workers

    @property
    def restart_count(self) -> int:
        return self.job.restart_count

    def _require_job_dir(self) -> Path:
        if self.job_dir is None:
            raise HpcElasticError("no job directory: HPC_ELASTIC_JOB_DIR is not set (run under hpc-elastic-run)")
        return self.job_dir

    @property
    def control_dir(self) -> Path:
        return self._require_job_dir() / CONTROL_DIR

    @property
    def checkpoint_dir(self) -> Path:
        return self._require_job_dir() / CHECKPOINT_DIR

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            self._store = CheckpointStore(
                self.checkpoint_dir, self.collective, keep=self._keep, commit_timeout_s=self._commit_timeout_s
            )
        return self._store

    def rebind(self, collective: Collective) -> None:
        """Go on in a new process group of the same job (Horovod elastic re-forms its group inside the running
        processes when workers leave or join): this process's rank and world size, its logical workers (N does not
        change) and the checkpoint store follow ``collective``.  Only between steps, with no checkpoint in flight."""
        if self._store is not None and self._store.pending is not None:
            raise HpcElasticError("cannot change the process group while an asynchronous checkpoint is in flight")
        self.assignment = WorkerAssignment(self.assignment.num_workers, collective.world_size, collective.rank)
        self.collective = collective
        self._store = None

    # -- stop / acknowledge ---------------------------------------------------------------------------------

    def _read_stop(self) -> StopRequest | None:
        if self.job_dir is None:
            return None
        try:
            text = (self.job_dir / CONTROL_DIR / STOP_FILE).read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError):
            text = ""  # present but unreadable: still a request to stop
        return parse_stop_lenient(text)

    def should_stop(self) -> bool:
        """Whether the job must checkpoint and exit now.  Collective: call it at every mini-batch boundary on
        every rank; a rank that sees ``control/stop`` makes all ranks return ``True`` at the same call.  With
        ``stop_check_every=k`` the file is looked at (and ranks agree) only every k-th call."""
        if self._stop is not None:
            return True
        self._stop_calls += 1
        if (self._stop_calls - 1) % self._stop_every:
            return False
        local = self._read_stop()
        if self.collective.allreduce_max_int(0 if local is None else 1) == 0:
            return False
        self._stop = local if local is not None else parse_stop_lenient("")
        return True

    @property
    def stop_request(self) -> StopRequest | None:
        """The request :meth:`should_stop` acted on (reason ``unknown`` on a rank that had not seen the file)."""
        return self._stop

    def acknowledge(self, step: int, checkpoint: Path | str) -> Ack | None:
        """Rank 0 writes ``control/ack.json`` atomically; return the ack there, ``None`` on other ranks.  Call it
        once the checkpoint of ``step`` is committed (:meth:`checkpoint_and_acknowledge` does both)."""
        if not self.is_root:
            return None
        ack = Ack(self.job.job_id, self.job.restart_count, step, Path(checkpoint).resolve(), time.time())
        control = self.control_dir
        control.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(control / ACK_FILE, ack.to_json().encode())
        return ack

    def checkpoint_and_acknowledge(self, state: State) -> Path:
        """Commit ``state`` synchronously (unless its current step is already committed), then acknowledge.
        Collective.  Return the checkpoint's directory."""
        path = state.commit_if_needed()
        self.acknowledge(state.step, path)
        return path

    # -- state, reductions ----------------------------------------------------------------------------------

    def state(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        sampler: ElasticSampler | None = None,
        extras: Mapping[str, Any] | None = None,
        mode: SaveMode | str | None = None,
    ) -> State:
        """A :class:`~hpc_elastic.state.State` that commits into this job's checkpoint directory."""
        meta = {"job_id": self.job.job_id, "restart_count": self.job.restart_count, "backend": self.backend.value}
        return State(
            self.store,
            self.assignment,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
            extras=extras,
            mode=mode or self.save_mode,
            meta=meta,
        )

    def sum_over_workers(self, local: torch.Tensor) -> torch.Tensor:
        """Sum over all N logical workers of per-worker tensors, bitwise independent of the number of processes.

        ``local`` has one row per logical worker of this process (``local[i]`` belongs to ``self.workers[i]``).
        The rows of all processes are gathered exactly (in logical-worker order, thanks to the contiguous
        assignment) and added one after the other from worker 0 to N-1: the same additions in the same order
        whatever M is."""
        k = len(self.workers)
        if local.dim() < 1 or local.shape[0] != k:
            raise ValueError(f"local must have one row per logical worker of this process ({k}), got {local.shape}")
        rows = self.collective.allgather_tensor(local)
        total = rows[0].clone()
        for i in range(1, rows.shape[0]):
            total += rows[i]
        return total

    def barrier(self) -> None:
        self.collective.barrier()

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish an asynchronous checkpoint in flight and release the process group (collective)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._store is not None:
                self._store.wait()
        finally:
            self.collective.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # a rank failing alone must not block in a collective: release what we can and let it propagate
            self._closed = True
            self.collective.close()


def init(**kwargs: Any) -> Session:
    """``Session.from_environment(**kwargs)``: the entry point of a training script."""
    return Session.from_environment(**kwargs)
