"""The one training runtime: N EasyScale threads (ESTs) of a data-parallel job on this process, and the state
that commits and restores them (EasyScale §3.2-3.3; Horovod's ``State`` protocol).

A job is written for N logical workers (ESTs, the data-parallel degree its hyper-parameters assume) and runs on
whatever M <= N processes it has now.  Each process runs its ESTs in turn at every global step, switching each
EST's whole context in and out at mini-batch boundaries: RNG states (Python, NumPy, torch CPU and CUDA), module
buffers (BatchNorm statistics), its data cursor, its gradient contribution and its ``extra`` values.  Parameters,
optimizer state and the data-loader workers are shared.  At the end of the step the N gradient contributions are
summed by the deterministic allreduce (:mod:`hpc_elastic.est.reducer`), so the parameters are the same bits for
every M, every EST placement, every restart and resize::

    session = hpc_elastic.init()
    model = Net().to(session.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = session.state(model, optimizer, data=dataset, batch_size=32, loader_workers=2)
    state.restore()                              # the newest valid checkpoint, if any
    while state.step < steps:
        if session.should_stop():
            session.checkpoint_and_acknowledge(state)
            break
        for x, y in state.batches():             # one mini-batch per EST of this process, its context switched in
            F.cross_entropy(model(x), y).backward()
        state.finish_step()                      # the exact mean of the N gradients, then the optimizer step
        if state.step % 100 == 0:
            state.commit()                       # every EST's context and the shared state, atomically

A checkpoint holds every EST's context plus one copy of the shared state (:mod:`hpc_elastic.est.checkpoint`); a
restart on another M redistributes the ESTs and continues bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import default_collate

from hpc_elastic.balance.sampler import BalancedSampler
from hpc_elastic.balance.speeds import capability_by_type
from hpc_elastic.balancer import ESTBalanceConfig, ESTBalancer, PaperBalancer, PaperConfig, StepTimer
from hpc_elastic.checkpoint import Checkpoint, CheckpointStore, SaveMode
from hpc_elastic.checkpoint.tree import check_loadable, to_host
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.checkpoint import (
    ESTState,
    combine_digests,
    digest_tree,
    load_latest_state,
    params_sha256,
    save_state,
    without_params,
)
from hpc_elastic.est.comm import Communicator, local_communicator
from hpc_elastic.est.context import ESTContext, RNGState
from hpc_elastic.est.d2 import D2Status, optimizer_to_d2, scan_model, scan_optimizer, to_d2
from hpc_elastic.est.data import DataPlan, ESTLoader
from hpc_elastic.est.detsum import DEFAULT_CHUNK, MAX_ESTS, bin_width
from hpc_elastic.est.kernels import TensorKernels
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.plan import DEFAULT_BUCKET_ELEMENTS, BucketLayout, Placement, plan_buckets
from hpc_elastic.est.reducer import GradientReducer


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def _int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class RuntimeConfig:
    """What a job fixes for its whole life: N, the seed of the ESTs' streams, the determinism level and the
    layout of the exact sum (a checkpoint written with other values is refused)."""

    num_ests: int
    seed: int = 0
    level: DeterminismLevel = DeterminismLevel.D1
    chunk: int = DEFAULT_CHUNK
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS

    def __post_init__(self) -> None:
        _int("num_ests", self.num_ests, 1)
        if self.num_ests > MAX_ESTS:
            raise ValueError(f"num_ests must be <= {MAX_ESTS}, got {self.num_ests}")
        _int("seed", self.seed, 0)
        object.__setattr__(self, "level", DeterminismLevel.parse(self.level))
        _int("chunk", self.chunk, 1)
        _int("bucket_elements", self.bucket_elements, 1)


class State:
    """This process's ESTs of a job and the state checkpoints commit and restarts restore (see the module
    docstring).  Built by :meth:`hpc_elastic.session.Session.state`; ``comm``, ``placement`` and ``store`` are the
    session's.  Every method that touches other processes is collective: all ranks call it at the same step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: RuntimeConfig,
        *,
        comm: Communicator | None = None,
        placement: Placement | None = None,
        store: CheckpointStore | None = None,
        scheduler: Stateful | None = None,
        extras: Mapping[str, Any] | None = None,
        mode: SaveMode | str = SaveMode.SYNC,
        device_types: Sequence[str] = (),
        meta: Mapping[str, Any] | None = None,
        kernels: TensorKernels | None = None,
        on_step: Callable[[int], None] | None = None,
        balance: ESTBalanceConfig | None = None,
        paper: PaperConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        device_type: str | None = None,
    ) -> None:
        """``balance``: move ESTs between the processes by their speed (EST mode, :mod:`hpc_elastic.balancer`);
        ``paper``: LB-BSP's paper mode instead (one EST per process, x_i samples each; set by the data plan);
        ``clock``: what times the ESTs for either and for the telemetry; ``device_type``: this process's device
        type in the telemetry (default: the device's kind, ``cpu`` or ``cuda``)."""
        self.config = config
        #: called with the new step at the end of every :meth:`finish_step` (the session's progress record)
        self._on_step = on_step
        self.comm = comm if comm is not None else local_communicator()
        self.placement = placement if placement is not None else Placement.contiguous(config.num_ests, self.comm.size)
        self._check_placement(self.placement)
        try:
            self.mode = SaveMode(mode)
        except ValueError:
            raise ValueError(f"mode must be sync or async, got {mode!r}") from None
        if config.level is DeterminismLevel.D2:
            to_d2(model)
            report = scan_model(model)
            if not report.holds:
                raise HpcElasticError(f"D2 does not hold for this model: {report.first_problem()}")
            finding = scan_optimizer(optimizer_to_d2(optimizer))
            if finding.status is not D2Status.COVERED:
                raise HpcElasticError(f"D2 does not hold for this optimizer ({finding.kind}): {finding.note}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.store = store
        self.extras: dict[str, Any] = dict(extras or {})
        #: the device types this run trains on (all processes), recorded in checkpoints
        self.device_types = tuple(sorted(set(device_types)))
        self._meta = dict(meta or {})
        _refuse_in_place_parameters(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        #: the parameters frozen when the State was built (a frozen body, an EMA teacher): not reduced, but synced
        #: at the start and checkpointed with the trainable ones
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.frozen_names = [n for n, _ in frozen]
        self.frozen = [p for _, p in frozen]
        self._buffers = dict(model.named_buffers())
        self._kernels = kernels
        self.layout: BucketLayout = plan_buckets([p.numel() for p in self.params], config.bucket_elements, config.chunk)
        self._sync_initial()
        self.reducer = self._reducer()
        self.contexts = {v: ESTContext.initial(v, config.seed, self._buffers) for v in self.local_ests}
        self.step = 0
        #: the newest checkpoint committed (or, asynchronously, being committed) and its step
        self.last_checkpoint: Path | None = None
        self.last_step: int | None = None
        self._active: ESTContext | None = None
        self._ran: list[int] = []
        self._loader: ESTLoader | None = None
        self._data: tuple[Any, int, int, Any, bool] | None = None
        self.data_plan: DataPlan | None = None
        #: the data of the checkpoint restored (:func:`_data_meta`), which a data plan attached later must match
        self._restored_data: list[Any] | None = None
        self._clock = clock
        self._busy_s = 0.0  # time inside this process's ESTs in the current step
        self._balance = balance
        self._device_type = device_type or self.reducer.device.type
        #: the windows of steps the balancer decides on and the telemetry is measured over
        self.timer = self._timer()
        #: the observed capability per device type (:func:`hpc_elastic.balance.speeds.capability_by_type`) of the
        #: last window of steps, the job's telemetry (empty until a window is complete; not measured in paper mode)
        self.capability: tuple[tuple[str, float], ...] = ()
        #: EST mode's balancer (None: the placement changes only through :meth:`rebalance` and :meth:`rebind`)
        self.balancer = self._balancer() if balance is not None else None
        #: placements switched to by :meth:`rebalance`, with the step they took effect at
        self.rebalances: list[tuple[int, Placement]] = []
        if paper is not None and (balance is not None or self.placement.max_local_ests != 1):
            raise ValueError("paper mode runs one worker per process: one EST on each, and no EST balancer")
        self._paper_config = paper
        #: paper mode's batch sizes and sample stream (built with the data plan)
        self.paper: PaperBalancer | None = None

    # ------------------------------------------------------------------ the group and its ESTs

    def _check_placement(self, placement: Placement) -> None:
        if placement.num_ests != self.config.num_ests:
            raise ValueError(f"placement has {placement.num_ests} ESTs, the job has {self.config.num_ests}")
        if placement.num_procs != self.comm.size:
            raise ValueError(f"placement is for {placement.num_procs} processes, the group has {self.comm.size}")

    def _timer(self) -> StepTimer:
        every = (self._balance or ESTBalanceConfig()).every
        return StepTimer(self.comm, every, self._device_type)

    def _balancer(self) -> ESTBalancer:
        return ESTBalancer(self.placement, self._balance, rank=self.comm.rank)

    def _reducer(self) -> GradientReducer:
        return GradientReducer(
            self.params,
            self.layout,
            num_ests=self.config.num_ests,
            comm=self.comm,
            level=self.config.level,
            kernels=self._kernels,
            max_local_ests=self.placement.max_local_ests,
        )

    @property
    def num_ests(self) -> int:
        return self.config.num_ests

    @property
    def local_ests(self) -> tuple[int, ...]:
        """The ESTs (virtual ranks) this process runs, in the order it runs them."""
        return self.placement.local_ests(self.comm.rank)

    def _sync_initial(self) -> None:
        """Make every process start from rank 0's parameters and buffers, as DDP does at construction: the digests
        are compared first, so a job that seeded its model identically everywhere moves no tensor."""
        if self.comm.size == 1:
            return
        mine = digest_tree([self.params, self.frozen, list(self._buffers.values())])
        if len(set(self.comm.allgather_object(mine))) == 1:
            return
        coll = self.comm.collective
        tensors = [*self.params, *self.frozen, *self._buffers.values()]
        mine_or_none = [t.detach().cpu() for t in tensors] if coll.rank == 0 else []
        values: list[torch.Tensor] = coll.broadcast_object(mine_or_none)
        with torch.no_grad():
            for t, v in zip(tensors, values, strict=True):
                t.copy_(v)

    # ------------------------------------------------------------------ context switching (EasyScale §3.2)

    @property
    def active(self) -> ESTContext | None:
        """The EST switched in now, if any."""
        return self._active

    def _load_buffers(self, ctx: ESTContext) -> None:
        with torch.no_grad():
            for name, buf in self._buffers.items():
                buf.copy_(ctx.buffers[name])

    def _save_buffers(self, ctx: ESTContext) -> None:
        with torch.no_grad():
            for name, buf in self._buffers.items():
                ctx.buffers[name].copy_(buf)

    @contextmanager
    def activate(self, vrank: int) -> Iterator[ESTContext]:
        """Run EST ``vrank`` inside the ``with`` block: its RNG states and buffers are switched in, and on
        normal exit its gradient is handed to the reducer and its context saved."""
        if self._active is not None:
            raise RuntimeError(f"EST {self._active.vrank} is still active; ESTs do not nest")
        if vrank not in self.contexts:
            raise ValueError(f"EST {vrank} does not run on process {self.comm.rank} (local: {list(self.local_ests)})")
        if vrank in self._ran:
            raise RuntimeError(f"EST {vrank} already ran in step {self.step}")
        ctx = self.contexts[vrank]
        started = self._clock()
        ctx.rng.restore()
        self._load_buffers(ctx)
        self.reducer.switch_in()
        self._active = ctx
        try:
            yield ctx
        except BaseException:
            self._active = None
            raise
        # the EST's generators are saved at the switch-out, so whatever the process draws between ESTs
        # (nothing in a well-formed step) cannot shift an EST's stream
        ctx.rng = RNGState.capture(previous=ctx.rng)
        self._save_buffers(ctx)
        self._active = None
        self.reducer.deposit()
        self._ran.append(vrank)
        self._busy_s += self._clock() - started

    def _show_first_est(self) -> None:
        """Leave the module with the buffers of this process's lowest EST between steps: on the process that runs
        EST 0 (rank 0 under contiguous placements) the live model is EST 0's, whatever M, so what a script
        evaluates or saves from it does not depend on how many processes trained it."""
        if self._buffers:
            self._load_buffers(self.contexts[min(self.local_ests)])

    def local_steps(self) -> Iterator[ESTContext]:
        """This process's ESTs for the current global step, each one switched in while the loop body runs."""
        for v in self.local_ests:
            with self.activate(v) as ctx:
                yield ctx

    def batches(self) -> Iterator[Any]:
        """The next mini-batch of each of this process's ESTs (:meth:`next_batch`), each EST switched in while the
        loop body runs its forward and backward."""
        for _ in self.local_steps():
            yield self.next_batch()

    def finish_step(self) -> None:
        """End of a global step: the exact mean of the N EST gradients (D1/D2), the optimizer and LR-scheduler
        steps.  Collective."""
        if self._active is not None:
            raise RuntimeError(f"finish_step() inside EST {self._active.vrank}")
        if sorted(self._ran) != sorted(self.local_ests):
            missing = sorted(set(self.local_ests) - set(self._ran))
            raise RuntimeError(f"step {self.step}: ESTs {missing} of this process did not run")
        self._check_trainable()
        if self.paper is not None:  # Eq. 7: n·x_i/X before the mean of the n gradients
            self.reducer.flat_grad.mul_(self.paper.factor())
        self.reducer.reduce()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()  # type: ignore[attr-defined]
        self.reducer.zero()
        self._ran = []
        self.step += 1
        busy, self._busy_s = self._busy_s, 0.0
        if self.paper is not None:
            self.paper.finish(busy)
        else:
            window = self.timer.add(busy, len(self.local_ests), self.reducer.device)
            if window is not None:
                self.capability = capability_by_type(window.processes)
                if self.balancer is not None:
                    moved = self.balancer.observe(self.step, window.workers, self.placement)
                    if moved is not None:
                        self.rebalance(moved)
        self._show_first_est()
        if self._on_step is not None:
            self._on_step(self.step)

    def _check_trainable(self) -> None:
        """The reducer sums the gradients of the parameters that were trainable when the State was built: one
        frozen or unfrozen since would be stepped from this process's own gradients (or none), and the processes'
        copies would part."""
        for name, p in zip(self.param_names, self.params, strict=True):
            if not p.requires_grad:
                raise HpcElasticError(
                    f"parameter {name} was trainable when the State was built and is frozen now: build the State "
                    "with the parameters it trains (keep requires_grad, and hold it with lr=0 or a zero gradient)"
                )
        for name, p in zip(self.frozen_names, self.frozen, strict=True):
            if p.requires_grad:
                raise HpcElasticError(
                    f"parameter {name} was frozen when the State was built and requires a gradient now: its gradient "
                    "would not be reduced; build the State with the parameters it trains (unfreeze before, or keep "
                    "it trainable and hold it with lr=0 or a zero gradient)"
                )

    # ------------------------------------------------------------------ data (EasyScale §3.2, data workers)

    def attach_data(
        self,
        dataset: Any,
        batch_size: int,
        *,
        loader_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
    ) -> DataPlan:
        """Serve ``dataset`` to the ESTs: ``batch_size`` samples per EST and step, one shared loader with
        ``loader_workers`` processes, augmentation seeded per (EST, mini-batch)."""
        self._check_data(len(dataset), batch_size, shuffle)
        self._data = (dataset, batch_size, loader_workers, collate_fn, shuffle)
        self.data_plan = DataPlan(len(dataset), self.config.num_ests, batch_size, self.config.seed, shuffle)
        self._open_paper(len(dataset), batch_size, shuffle)
        self._open_loader()
        return self.data_plan

    def _open_paper(self, dataset_len: int, batch_size: int, shuffle: bool) -> None:
        """Paper mode: X = N · ``batch_size`` samples per iteration, split into the x_i (collective)."""
        if self._paper_config is None:
            return
        sampler = BalancedSampler(dataset_len, self.config.seed, shuffle)
        total = self.config.num_ests * batch_size
        self.paper = PaperBalancer(self.comm, sampler, total, self.reducer.device, self._paper_config)

    def _open_loader(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None
        if self._data is None or self.data_plan is None or self.paper is not None:
            return
        dataset, _, workers, collate_fn, _ = self._data
        self._loader = ESTLoader(dataset, self.data_plan, self.local_ests, num_workers=workers, collate_fn=collate_fn)

    def next_batch(self) -> Any:
        """The active EST's next mini-batch: the collated samples from the attached dataset, or, with a data plan
        and no dataset (:meth:`plan_data`), the tuple of dataset indices for the script to load itself."""
        ctx = self._require_active("next_batch()")
        if self.data_plan is None:
            raise RuntimeError("no data (pass data= to session.state(), or call attach_data() or plan_data())")
        if self.paper is not None:  # this process's x_i samples, loaded here (the loader's workers are ESTs')
            indices = self.paper.indices()
            ctx.cursor += 1
            if self._data is None:
                return indices
            dataset, _, _, collate_fn, _ = self._data
            return (collate_fn or default_collate)([dataset[i] for i in indices])
        batch = (
            self._loader.get(ctx.vrank, ctx.cursor)
            if self._loader is not None
            else self.data_plan.request(ctx.vrank, ctx.cursor).indices
        )
        ctx.cursor += 1
        return batch

    def plan_data(self, dataset_len: int, batch_size: int, *, shuffle: bool = True) -> DataPlan:
        """A data plan without a loader: :meth:`batches` then yields each EST's dataset indices, and the script
        loads the samples itself (in-memory tensors, say)."""
        self._check_data(dataset_len, batch_size, shuffle)
        self._data = None
        if self._loader is not None:
            self._loader.close()
            self._loader = None
        self.data_plan = DataPlan(dataset_len, self.config.num_ests, batch_size, self.config.seed, shuffle)
        self._open_paper(dataset_len, batch_size, shuffle)
        return self.data_plan

    def _check_data(self, dataset_len: int, batch_size: int, shuffle: bool) -> None:
        """A data plan attached after a restore must be the checkpoint's: another one is another sample stream."""
        _refuse_other_data(self.last_checkpoint, self._restored_data, _data_meta(dataset_len, batch_size, shuffle))

    @property
    def epoch(self) -> int:
        """The epoch of the next step (every EST reads one mini-batch per step)."""
        if self.paper is not None:
            return self.paper.position.epoch
        return 0 if self.data_plan is None else self.data_plan.position(self.step)[0]

    def _require_active(self, what: str) -> ESTContext:
        if self._active is None:
            raise RuntimeError(f"{what} outside an EST (use batches(), local_steps() or activate())")
        return self._active

    # ------------------------------------------------------------------ checkpoints

    def _job_meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "num_ests": c.num_ests,
            "seed": c.seed,
            "level": c.level.value,
            "width": bin_width(c.num_ests),
            "layout": self.layout.to_json(),
            "param_names": list(self.param_names),
            "frozen_names": list(self.frozen_names),
            "optimizer": type(self.optimizer).__name__,
            "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "data": (
                _data_meta(self.data_plan.dataset_len, self.data_plan.batch_size, self.data_plan.shuffle)
                if self.data_plan is not None
                else None
            ),
        }

    def replicated(self) -> dict[str, Any]:
        """The state every process holds alike (step, parameters, optimizer, scheduler, extras), as references to
        the live tensors: copy it to keep it."""
        return {
            "step": self.step,
            "params": [p.detach() for p in self.params],
            "frozen": [p.detach() for p in self.frozen],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "extras": self.extras,
            **({"lbbsp": self.paper.to_json()} if self.paper is not None else {}),
        }

    def load_replicated(self, shared: Mapping[str, Any]) -> None:
        """Set the replicated state from :meth:`replicated`'s form."""
        _copy_saved(self.param_names, self.params, shared["params"], "parameters")
        frozen = shared.get("frozen")  # absent in checkpoints written before frozen parameters were kept
        if frozen is not None:
            _copy_saved(self.frozen_names, self.frozen, frozen, "frozen parameters")
        self.optimizer.load_state_dict(shared["optimizer"])
        if self.scheduler is not None and shared.get("scheduler") is not None:
            self.scheduler.load_state_dict(shared["scheduler"])
        self.extras = dict(shared.get("extras") or {})
        if self.paper is not None:
            saved_paper = shared.get("lbbsp")
            if saved_paper is None:
                raise HpcElasticError("the checkpoint has no sampler state: it was not written in paper mode")
            self.paper.load(saved_paper)
        self.step = int(shared["step"])
        self.reducer.zero()
        self._ran = []
        self._busy_s = 0.0

    def commit(self, *, mode: SaveMode | str | None = None) -> Path:
        """Checkpoint every EST's context and the shared state at this step (collective, between steps).  Return
        the checkpoint's directory; an asynchronous commit is complete once :meth:`wait` (or the next commit)
        returns."""
        store = self._require_store()
        if self._active is not None or self._ran:
            raise RuntimeError("checkpoints are taken between global steps")
        check_loadable(self.extras, "state.extras")
        self._check_replicas()
        shared = self.replicated() if self.comm.rank == 0 else None
        contexts = {v: self.contexts[v].to_state() for v in self.local_ests}
        meta = {
            **self._meta,
            **self._job_meta(),
            "step": self.step,
            "epoch": self.epoch,
            "placement": list(self.placement.owner),
            "procs": self.comm.size,
            "device_types": list(self.device_types),
        }
        path = save_state(store, self.step, contexts, shared, meta, mode=SaveMode(mode or self.mode))
        self.last_checkpoint, self.last_step = path, self.step
        return path

    def _check_replicas(self) -> None:
        """Every process holds the same parameters (D1/D2 step them from one reduced gradient; a checkpoint keeps
        process 0's): a difference means something changed them outside the optimizer on some processes only (a
        forward, a hook, the script), and continuing would train on copies that have parted. Collective."""
        if self.comm.size == 1 or self.config.level is DeterminismLevel.D0:
            return
        digests = self.comm.allgather_object(digest_tree([self.params, self.frozen]))
        parted = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if parted:
            raise HpcElasticError(
                f"step {self.step}: the parameters of process(es) {parted} differ from process 0's: something changed "
                "them outside the optimizer on some processes only (a forward, a hook or the script); not committed"
            )

    def wait(self) -> Path | None:
        """Finish an asynchronous commit in flight (collective)."""
        return self.store.wait() if self.store is not None else None

    def commit_if_needed(self) -> Path:
        """The checkpoint of the current step: the last one when it is already at this step (restored, or
        committed without a step since), else a new synchronous commit.  Used when stopping."""
        store = self._require_store()
        if self.last_checkpoint is not None and self.last_step == self.step:
            store.wait()
            return self.last_checkpoint
        path = self.commit(mode=SaveMode.SYNC)
        store.wait()
        return path

    def _require_store(self) -> CheckpointStore:
        if self.store is None:
            raise HpcElasticError("no checkpoint directory: HPC_ELASTIC_JOB_DIR is not set (run under hpc-elastic-run)")
        return self.store

    def _check_state(self, state: ESTState) -> None:
        """Refuse a checkpoint this job cannot continue from (same seed, level, layout, parameters; the same device
        types unless the job runs at D2)."""
        meta = state.meta
        mine = self._job_meta()
        for key in ("seed", "level", "width", "layout", "param_names"):
            if meta.get(key) != mine[key]:
                raise ValueError(
                    f"checkpoint {state.source} was written with {key}={meta.get(key)!r}, now {mine[key]!r}"
                )
        # recorded since frozen parameters, optimizer, scheduler and data are kept: older checkpoints lack them
        for key in ("frozen_names", "optimizer", "scheduler"):
            if key in meta and meta[key] != mine[key]:
                raise HpcElasticError(
                    f"checkpoint {state.source} was written with {key}={meta[key]!r}, now {mine[key]!r}"
                )
        _refuse_other_data(state.source, meta.get("data"), mine["data"])
        saved_types = tuple(meta.get("device_types") or ())
        if (
            self.config.level is not DeterminismLevel.D2
            and saved_types
            and self.device_types
            and saved_types != self.device_types
        ):
            raise HpcElasticError(
                f"checkpoint {state.source} was trained on {'+'.join(saved_types)}, this run has "
                f"{'+'.join(self.device_types)}: at level {self.config.level.value} the bits depend on the device "
                "type (only D2 may move across types)"
            )
        for v, ctx in state.contexts.items():
            if set(ctx.get("buffers", {})) != set(self._buffers):
                raise ValueError(f"checkpoint {state.source}: the buffers of EST {v} do not fit this model")

    def restore(self) -> Checkpoint | None:
        """Continue from the newest checkpoint every process can read (collective; a damaged one is skipped on
        every process); ``None``, the state untouched, when there is none.  The checkpoint may come from any
        number of processes and any placement."""
        store = self._require_store()
        found = load_latest_state(store, self.local_ests, self.config.num_ests, self._check_state)
        if found is None:
            return None
        ckpt, state = found
        self._restored_data = state.meta.get("data")
        self.load_replicated(state.shared)
        for v in self.local_ests:
            ctx = ESTContext.from_state(state.contexts[v])
            if ctx.vrank != v:
                raise HpcElasticError(f"checkpoint {state.source}: the context saved for EST {v} is EST {ctx.vrank}'s")
            self.contexts[v] = ctx
        self.last_checkpoint, self.last_step = ckpt.path, ckpt.step
        self._show_first_est()
        self._open_loader()
        return ckpt

    # ------------------------------------------------------------------ a new process group (Horovod elastic)

    def local_contexts(self) -> dict[int, dict[str, Any]]:
        """This process's EST contexts, as host copies (:meth:`rebind` takes them back)."""
        return {v: to_host(self.contexts[v].to_state()) for v in self.local_ests}

    def rebind(
        self,
        comm: Communicator,
        placement: Placement,
        contexts: Mapping[int, Mapping[str, Any]],
        store: CheckpointStore | None,
    ) -> None:
        """Go on in a new process group of the same job: this process now runs ``placement``'s ESTs for
        ``comm``'s rank, whose contexts ``contexts`` must hold.  Only between steps, no checkpoint in flight."""
        if self._active is not None or self._ran:
            raise RuntimeError("the process group can change only between global steps")
        if self.store is not None and self.store.pending is not None:
            raise HpcElasticError("cannot change the process group while an asynchronous checkpoint is in flight")
        old = self.comm, self.placement
        self.comm, self.placement = comm, placement
        try:
            self._check_placement(placement)
            missing = [v for v in self.local_ests if v not in contexts]
            if missing:
                raise ValueError(f"no context for ESTs {missing}")
        except ValueError:
            self.comm, self.placement = old
            raise
        self.contexts = {v: ESTContext.from_state(contexts[v]) for v in self.local_ests}
        self._show_first_est()
        self.store = store
        self.reducer = self._reducer()
        self._open_loader()
        self.timer = self._timer()  # new processes: the readings start again
        if self._balance is not None:
            self.balancer = self._balancer()

    # ------------------------------------------------------------------ ESTs moving inside the group (EST mode)

    def rebalance(self, placement: Placement) -> None:
        """Run ``placement``'s ESTs from the next step on, in the same process group (collective, between global
        steps; every process passes the same placement).  The contexts of the ESTs that change process are handed
        over as host copies through the communicator, the reducer is planned again for the new most ESTs per
        process and the loader restarts on this process's new ESTs.  The sum of the N gradients does not depend on
        the placement (D1/D2), so neither do the trained parameters.  An asynchronous checkpoint in flight is
        finished first."""
        if self._active is not None or self._ran:
            raise RuntimeError("ESTs move only between global steps")
        self._check_placement(placement)
        if placement == self.placement:
            return
        if self.store is not None and self.store.pending is not None:
            self.store.wait()
        rank = self.comm.rank
        outgoing = {v: to_host(self.contexts[v].to_state()) for v in self.local_ests if placement.owner[v] != rank}
        received: dict[int, Mapping[str, Any]] = {}
        for owner, sent in self.comm.allgather_object((placement.owner, outgoing)):
            if tuple(owner) != placement.owner:
                raise HpcElasticError(f"rebalance: processes disagree on the placement ({owner} vs {placement.owner})")
            received.update(sent)
        contexts: dict[int, ESTContext] = {}
        for v in placement.local_ests(rank):
            if v in self.contexts:
                contexts[v] = self.contexts[v]
            elif v in received:
                contexts[v] = ESTContext.from_state(received[v])
            else:
                raise HpcElasticError(f"rebalance: no process handed over the context of EST {v}")
        self.placement = placement
        self.contexts = contexts
        self._show_first_est()
        self.reducer = self._reducer()
        self._open_loader()
        self.rebalances.append((self.step, placement))
        if self.balancer is None or self.balancer.state.sizes != placement.counts():  # moved by hand
            self.timer = self._timer()  # the readings start again
            if self.balancer is not None:
                self.balancer = self._balancer()

    # ------------------------------------------------------------------ fingerprints

    def params_sha256(self) -> str:
        return params_sha256(self.param_names, self.params)

    def state_sha256(self) -> str:
        """sha256 of parameters, optimizer and scheduler state, extras and every EST's context (RNG states, cursor,
        buffers): collective, the same on every process, and equal to the fingerprint of a checkpoint of this
        state (:func:`hpc_elastic.est.checkpoint.fingerprint`)."""
        local = {v: digest_tree(self.contexts[v].to_state()) for v in self.local_ests}
        per_est: dict[int, str] = {}
        for part in self.comm.allgather_object(local):
            per_est.update(part)
        shared = without_params(self.replicated())
        return combine_digests(self.params_sha256(), digest_tree(shared), [per_est[v] for v in range(self.num_ests)])

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None


def _refuse_in_place_parameters(model: nn.Module) -> None:
    """Refuse the modules that change a parameter in their forward, outside the optimizer: an ``nn.Embedding``
    with ``max_norm`` renormalises, in place, the rows the batch looks up, so each process would change only the
    rows its own ESTs read and the processes' copies would part."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.max_norm is not None:
            raise HpcElasticError(
                f"{type(module).__name__} at '{path or '<root>'}' has max_norm={module.max_norm}: it renormalises "
                "its weight in place in every forward, outside the optimizer, so the processes' copies would part; "
                "renormalise in the loss or after the optimizer step instead"
            )


def _copy_saved(names: Sequence[str], params: Sequence[torch.Tensor], saved: Sequence[Any], what: str) -> None:
    """Set ``params`` from a checkpoint's tensors, refusing another count or shape."""
    if len(saved) != len(params):
        raise ValueError(f"the state has {len(saved)} {what}, the model {len(params)}")
    with torch.no_grad():
        for name, p, t in zip(names, params, saved, strict=True):
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"parameter {name} has shape {tuple(t.shape)} in the state, {tuple(p.shape)} now")
            p.copy_(t)


def _refuse_other_data(source: object, saved: Any, now: Any) -> None:
    """A checkpoint trained on another sample stream (:func:`_data_meta`; None: not recorded, or no plan yet)."""
    if saved is not None and now is not None and saved != now:
        raise HpcElasticError(
            f"checkpoint {source} was trained on {_describe_data(saved)}, now {_describe_data(now)}: another sample "
            "stream"
        )


def _data_meta(dataset_len: int, batch_size: int, shuffle: bool) -> list[Any]:
    return [int(dataset_len), int(batch_size), bool(shuffle)]


def _describe_data(data: Any) -> str:
    try:
        length, batch, shuffle = data
    except (TypeError, ValueError):
        return repr(data)
    return f"{length} samples, batch {batch} per EST, {'shuffled' if shuffle else 'in order'}"
