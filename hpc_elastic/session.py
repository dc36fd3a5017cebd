"""Where this process stands in an elastic job, and its side of the wrapper's control protocol.

``hpc_elastic.init()`` reads the job environment (:func:`hpc_elastic.env.read_job_environment`), fixes the
determinism level and the seed, opens the backend's process group and places the job's N logical workers
(EasyScale threads, ESTs) on its M processes: any M with 1 <= M <= N, the first ``N % M`` processes running one EST
more.  :meth:`Session.state` then builds the one training runtime (:class:`hpc_elastic.state.State`)::

    session = hpc_elastic.init()
    state = session.state(model, optimizer, data=dataset, batch_size=32)
    state.restore()
    while state.step < steps:
        if session.should_stop():                       # the wrapper asked, or SIGTERM: the same answer on every rank
            session.checkpoint_and_acknowledge(state)   # commit, then rank 0 writes control/ack.json
            break                                       # the wrapper requeues the job
        for x, y in state.batches():
            loss_fn(model(x), y).backward()
        state.finish_step()
    session.close()

Inside a Slurm job under the wrapper, ``SIGTERM`` is a stop too: Slurm's own preemption sends it to the job's steps
(the workers), not to the wrapper, and gives them its GraceTime; the workers checkpoint at the next boundary and
rank 0 acknowledges with reason ``sigterm`` (the wrapper then asks Slurm why).  A cancel or the time limit itself
sends it as well: the checkpoint may be cut short by Slurm's ``KILL``, which costs nothing (commits are atomic).

Rank, world size and local rank come from the job environment for the torch backend and from MPI / Horovod
themselves for those backends (they know best how they launched their processes).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from hpc_elastic.balance.mode import BalanceMode, resolve_balance
from hpc_elastic.balancer import ESTBalanceConfig, PaperConfig
from hpc_elastic.checkpoint import DEFAULT_KEEP, CheckpointStore, SaveMode
from hpc_elastic.checkpoint.store import DEFAULT_COMMIT_TIMEOUT_S
from hpc_elastic.collective import DEFAULT_TIMEOUT_S
from hpc_elastic.env import JobEnvironment, read_job_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.comm import Communicator, local_communicator, open_communicator
from hpc_elastic.est.determinism import apply_determinism, seed_everything
from hpc_elastic.est.groups import HorovodCollective, MPICollective
from hpc_elastic.est.kernels import TensorKernels
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.plan import Placement
from hpc_elastic.files import UnsafeFile
from hpc_elastic.jobdir import Ack, JobDir, Progress, StopReason, StopRequest, next_progress
from hpc_elastic.state import RuntimeConfig, State, Stateful

log = logging.getLogger(__name__)


def choose_device(local_rank: int, requested: str | None = None) -> torch.device:
    """``requested`` if given; else ``cuda:i`` when CUDA works (``i = 0`` when the process sees one device, its
    local rank modulo the count when it sees several), else the CPU.  Selects the CUDA device for the process."""
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


def device_type_of(job: JobEnvironment, device: torch.device) -> str:
    """The device type this process trains on, as far as determinism is concerned: the GPU type Slurm gave its
    node (the wrapper passes them), else the CUDA device's name, else ``cpu``."""
    types = dict(job.node_gpu_types)
    if job.node_name in types:
        return types[job.node_name]
    if len(set(types.values())) == 1:
        return next(iter(types.values()))
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


class Session:
    """This process's place in an elastic job (see the module docstring)."""

    def __init__(
        self,
        job: JobEnvironment,
        comm: Communicator,
        *,
        device: torch.device | str = "cpu",
        num_workers: int | None = None,
        seed: int = 0,
        level: DeterminismLevel | str | None = None,
        job_dir: Path | str | None = None,
        keep: int = DEFAULT_KEEP,
        save_mode: SaveMode | str = SaveMode.SYNC,
        commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
        stop_check_every: int = 1,
        local_rank: int | None = None,
        intra_op_threads: int = 1,
        balance: BalanceMode | str | None = None,
        balance_config: ESTBalanceConfig | None = None,
    ) -> None:
        """``balance``: ``none``, ``est`` or ``lbbsp`` (default: the job environment's, else ``est`` where N > M
        at D1/D2, see :func:`hpc_elastic.balance.mode.resolve_balance`); ``balance_config``: EST mode's cadence."""
        if isinstance(stop_check_every, bool) or not isinstance(stop_check_every, int) or stop_check_every < 1:
            raise ValueError(f"stop_check_every must be a positive integer, got {stop_check_every!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.job = job
        self.comm = comm
        self.device = torch.device(device)
        self.backend = comm.backend if comm.backend is not None else job.backend
        self.local_rank = job.local_rank if local_rank is None else local_rank
        chosen = level if level is not None else job.level
        self.level = DeterminismLevel.parse(chosen) if chosen is not None else DeterminismLevel.D1
        self.seed = seed
        n = num_workers if num_workers is not None else job.workers
        self.placement = Placement.contiguous(n if n is not None else comm.size, comm.size)
        requested = BalanceMode.parse(balance) if balance is not None else job.balance
        #: how this job balances its processes (:class:`~hpc_elastic.balance.mode.BalanceMode`)
        self.balance = resolve_balance(requested, self.placement.num_ests, comm.size, self.level)
        self._balance_config = balance_config if balance_config is not None else ESTBalanceConfig()
        if self.balance is BalanceMode.LBBSP:
            if self.placement.num_ests != comm.size:
                raise ValueError(
                    f"balance mode lbbsp runs one worker per process: the job has {self.placement.num_ests} logical "
                    f"workers on {comm.size} processes (submit with --workers equal to the process count)"
                )
            if comm.rank == 0:
                log.warning(
                    "balance lbbsp (LB-BSP paper mode): batch sizes follow the measured speeds, so bitwise identity "
                    "of the trained parameters is not promised in this mode"
                )
        resolved = Path(job_dir) if job_dir is not None else job.job_dir
        #: the job directory (checkpoints, the control files), None without one
        self.job_dir: JobDir | None = JobDir(resolved.resolve()) if resolved is not None else None
        self.save_mode = SaveMode(save_mode)
        self._keep = keep
        self._commit_timeout_s = commit_timeout_s
        self._stop_every = stop_check_every
        self._stop_calls = 0
        self._stop: StopRequest | None = None
        #: when SIGTERM came (None: it did not, or this session does not take it as a stop)
        self._terminated_at: float | None = None
        self._previous_sigterm: Any = None
        self._state: State | None = None
        self._store: CheckpointStore | None = None
        self._progress: Progress | None = None
        self._closed = False
        # D0 for every level: deterministic algorithms, a fixed intra-op thread count; then identical seeds
        apply_determinism(self.level, intra_op_threads)
        seed_everything(seed)
        mine = device_type_of(job, self.device)
        #: this process's device type (a100, v100, cpu, ...): its name in the job's telemetry
        self.device_type = mine
        #: the device types of every process of this run (sorted, distinct)
        self.device_types = tuple(sorted(set(comm.allgather_object(mine))))
        if len(self.device_types) > 1:
            self.placement = self._placement_by_capability()

    def _placement_by_capability(self) -> Placement:
        """On several device types: ESTs per process by the capability C_i per type the job observed in its last
        run (its progress record, EasyScale §3.4 Eq. 1d: more ESTs on faster devices), a type it has not run on at
        the mean of those it has; even blocks when it observed none (every rank gets rank 0's reading)."""
        seen: dict[str, float] = {}
        if self.is_root and self.job_dir is not None:
            progress = self.job_dir.read_progress()
            seen = dict(progress.capability) if progress is not None else {}
        observed: dict[str, float] = self.comm.allgather_object(seen)[0]
        kinds = self.comm.allgather_object(self.device_type)
        if not observed:
            return self.placement
        mean = sum(observed.values()) / len(observed)
        caps = [float(observed.get(kind, mean)) for kind in kinds]
        placement = Placement.by_capability(self.placement.num_ests, caps)
        log.info("ESTs per process by the observed capability per device type: %s", list(placement.counts()))
        return placement

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        device: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> Session:
        """Read the job environment and open the backend's process group: torch.distributed (gloo on the CPU, NCCL
        on CUDA; rendezvous at MASTER_ADDR:MASTER_PORT), MPI through mpi4py, or Horovod.  ``kwargs`` go to
        :class:`Session` (``num_workers``, ``seed``, ``level``, ``keep``, ...)."""
        job = read_job_environment(environ)
        dev = choose_device(job.local_rank, device)
        comm = open_communicator(
            job.backend,
            rank=job.rank,
            world_size=job.world_size,
            master_addr=job.master_addr,
            master_port=job.master_port,
            device=dev,
            timeout_s=timeout_s,
        )
        local_rank: int | None = None
        if isinstance(comm.collective, MPICollective | HorovodCollective):
            local_rank = comm.collective.local_rank()
            if device is None and dev.type == "cuda":
                dev = choose_device(local_rank)
        try:
            session = cls(job, comm, device=dev, local_rank=local_rank, **kwargs)
        except BaseException:
            comm.close()
            raise
        if job.job_id is not None and job.job_dir is not None and threading.current_thread() is threading.main_thread():
            # under the wrapper in a Slurm job (module docstring); close() gives the signal its old handler back
            session._previous_sigterm = signal.signal(signal.SIGTERM, session._on_sigterm)
        return session

    @classmethod
    def local(cls, job_dir: Path | str | None = None, **kwargs: Any) -> Session:
        """A one-process session with no process group (tests, notebooks)."""
        return cls(JobEnvironment(job_dir=Path(job_dir) if job_dir else None), local_communicator(), **kwargs)

    # -- where this process stands --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    @property
    def is_root(self) -> bool:
        return self.comm.rank == 0

    @property
    def devices(self) -> tuple[str, ...]:
        """The GPUs Slurm gave this process (``CUDA_VISIBLE_DEVICES``), as ids."""
        return self.job.gpus

    @property
    def num_workers(self) -> int:
        """N, the logical workers (ESTs) of the job (``HPC_ELASTIC_WORKERS``; the world size when unset)."""
        return self.placement.num_ests

    @property
    def workers(self) -> tuple[int, ...]:
        """The ESTs this process runs now: a contiguous block of virtual ranks until EST mode moves some
        (:meth:`hpc_elastic.state.State.rebalance`)."""
        if self._state is not None:
            return self._state.local_ests
        return self.placement.local_ests(self.comm.rank)

    @property
    def restart_count(self) -> int:
        return self.job.restart_count

    def _require_job_dir(self) -> JobDir:
        if self.job_dir is None:
            raise HpcElasticError("no job directory: HPC_ELASTIC_JOB_DIR is not set (run under hpc-elastic-run)")
        return self.job_dir

    def checkpoint_store(self) -> CheckpointStore | None:
        """The checkpoint store of the job directory (None without one)."""
        if self.job_dir is None:
            return None
        if self._store is None:
            self._store = CheckpointStore(
                self.job_dir.checkpoints,
                self.comm.collective,
                keep=self._keep,
                commit_timeout_s=self._commit_timeout_s,
            )
        return self._store

    def rebind(self, comm: Communicator) -> None:
        """Go on in a new process group of the same job (Horovod elastic re-forms its group inside the running
        processes when workers leave or join): rank, world size and this process's ESTs follow ``comm`` (N does not
        change); the state built by :meth:`state` follows with :meth:`State.rebind`."""
        if self._store is not None and self._store.pending is not None:
            raise HpcElasticError("cannot change the process group while an asynchronous checkpoint is in flight")
        self.placement = Placement.contiguous(self.placement.num_ests, comm.size)
        self.comm = comm
        self._store = None

    # -- the runtime ----------------------------------------------------------------------------------------

    def state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Stateful | None = None,
        data: Any = None,
        batch_size: int | None = None,
        loader_workers: int = 0,
        collate_fn: Any = None,
        shuffle: bool = True,
        extras: Mapping[str, Any] | None = None,
        mode: SaveMode | str | None = None,
        kernels: TensorKernels | None = None,
    ) -> State:
        """The training runtime of this process: this job's ESTs on ``model`` and ``optimizer``, checkpoints in the
        job directory (see :class:`hpc_elastic.state.State`).  With ``data`` (a map-style dataset) and
        ``batch_size`` each EST reads its own mini-batches through one shared loader of ``loader_workers``
        processes.  At D0 and D1 every process must train on one device type (D2 alone may mix types)."""
        if len(self.device_types) > 1 and self.level is not DeterminismLevel.D2:
            raise HpcElasticError(
                f"this run's processes train on {'+'.join(self.device_types)}: at level {self.level.value} the bits "
                "depend on the device type; pin one GPU type, or run at d2 if the model scanner allows it"
            )
        state = State(
            model,
            optimizer,
            RuntimeConfig(num_ests=self.num_workers, seed=self.seed, level=self.level),
            comm=self.comm,
            placement=self.placement,
            store=self.checkpoint_store(),
            scheduler=scheduler,
            extras=extras,
            mode=mode or self.save_mode,
            device_types=self.device_types,
            meta={"job_id": self.job.job_id, "restart_count": self.job.restart_count, "backend": self.backend.value},
            kernels=kernels,
            on_step=self._record_progress if self.is_root and self.job_dir is not None else None,
            balance=self._balance_config if self.balance is BalanceMode.EST else None,
            paper=PaperConfig() if self.balance is BalanceMode.LBBSP else None,
            device_type=self.device_type,
        )
        if data is not None:
            if batch_size is None:
                raise ValueError("data= needs batch_size= (mini-batch of each EST)")
            state.attach_data(data, batch_size, loader_workers=loader_workers, collate_fn=collate_fn, shuffle=shuffle)
        self._state = state
        return state

    # -- progress -------------------------------------------------------------------------------------------

    def _record_progress(self, step: int, *, final: bool = False) -> None:
        """Rank 0: rewrite ``control/progress.json`` (at most every few seconds, and at the end of the run:
        :func:`hpc_elastic.jobdir.next_progress`).  A failed write is logged, never fatal: progress is for the people
        watching the job."""
        if self.job_dir is None:
            return
        progress = next_progress(
            self._progress,
            step=step,
            now=time.time(),
            force=final,
            world_size=self.world_size,
            restart_count=self.job.restart_count,
            attempt=self.job.attempt,
            device_types=self.device_types,
            workers=self.num_workers,
            capability=self._state.capability if self._state is not None else (),
            # a State at D2 exists only when the model scanner covered every operator of the model
            d2=self._state is not None and self._state.config.level is DeterminismLevel.D2,
        )
        if progress is None:
            return
        try:
            if not self.job_dir.control.is_dir():  # a run without the wrapper, which prepares it
                self.job_dir.prepare()
            self.job_dir.record_progress(progress)
        except (OSError, UnsafeFile) as exc:
            log.warning("cannot record progress in %s: %s", self.job_dir.progress_path, exc)
            return
        self._progress = progress

    # -- stop / acknowledge ---------------------------------------------------------------------------------

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._terminated_at is None:
            self._terminated_at = time.time()

    def _read_stop(self) -> StopRequest | None:
        if self._terminated_at is not None:
            return StopRequest(StopReason.SIGTERM, self._terminated_at)
        if self.job_dir is None:
            return None
        request = self.job_dir.read_stop()
        step = self._state.step if self._state is not None else None
        if request is not None and request.at_step is not None and step is not None and step < request.at_step:
            return None  # a stop at a later step
        return request

    def should_stop(self) -> bool:
        """Whether the job must checkpoint and exit now.  Collective: call it at every mini-batch boundary on
        every rank; a rank that sees ``control/stop`` (or got ``SIGTERM``, see the module docstring) makes all ranks
        return ``True`` at the same call.  With
        ``stop_check_every=k`` the file is looked at (and ranks agree) only every k-th call."""
        if self._stop is not None:
            return True
        self._stop_calls += 1
        if (self._stop_calls - 1) % self._stop_every:
            return False
        local = self._read_stop()
        if self.comm.collective.allreduce_max_int(0 if local is None else 1) == 0:
            return False
        if local is None:  # another rank saw the file first: it is there now, read it for its reason
            local = self._read_stop()
        self._stop = local if local is not None else StopRequest(StopReason.UNKNOWN, None)
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
        reason = self._stop.reason if self._stop is not None else None
        ack = Ack(self.job.job_id, self.job.restart_count, step, Path(checkpoint).resolve(), time.time(), reason)
        job_dir = self._require_job_dir()
        if not job_dir.control.is_dir():  # a run without the wrapper, which prepares it
            job_dir.prepare()
        job_dir.acknowledge(ack)
        return ack

    def checkpoint_and_acknowledge(self, state: State) -> Path:
        """Commit ``state`` synchronously (unless its current step is already committed), then acknowledge.
        Collective.  Return the checkpoint's directory."""
        path = state.commit_if_needed()
        self.acknowledge(state.step, path)
        return path

    def barrier(self) -> None:
        self.comm.barrier()

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish an asynchronous checkpoint in flight, stop the data loader and release the process group
        (collective)."""
        if self._closed:
            return
        self._closed = True
        self._restore_sigterm()
        try:
            if self._state is not None:
                if self.is_root:
                    self._record_progress(self._state.step, final=True)
                self._state.close()
            if self._store is not None:
                self._store.wait()
        finally:
            self.comm.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # a rank failing alone must not block in a collective: release what we can and let it propagate
            self._closed = True
            self._restore_sigterm()
            self.comm.close()


def init(**kwargs: Any) -> Session:
    """``Session.from_environment(**kwargs)``: the entry point of a training script."""
    return Session.from_environment(**kwargs)
