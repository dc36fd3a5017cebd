"""The EST runtime: N logical workers over M processes (EasyScale §3.2).

A training script written for N data-parallel workers runs unchanged in its numerics on any M <= N
processes: each process executes its ESTs in turn at every global step, switching contexts at mini-batch
boundaries, then all processes reduce the N gradient contributions exactly (D1) and apply the shared
optimizer.  Typical use::

    rt = ESTRuntime(model, optimizer, ESTConfig(num_ests=4, seed=0), comm=comm, placement=placement)
    rt.attach_data(dataset, batch_size=8, num_workers=2)
    rt.restore()                                   # continue from the latest checkpoint, if any
    while rt.step < total_steps:
        for est in rt.local_steps():               # switches EST contexts in and out
            x, y = rt.next_batch()
            loss_fn(model(x), y).backward()
        rt.finish_step()                           # exact allreduce, optimizer step, checkpoint if due
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hpc_elastic.checkpoint import Checkpoint
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.checkpoint import ESTState, load_latest_state, open_store, read_state, save_state
from hpc_elastic.est.comm import Communicator, local_communicator
from hpc_elastic.est.context import ESTContext, RNGState
from hpc_elastic.est.data import DataPlan, ESTLoader
from hpc_elastic.est.detsum import DEFAULT_CHUNK, MAX_ESTS, bin_width
from hpc_elastic.est.levels import DeterminismLevel, apply_determinism
from hpc_elastic.est.plan import DEFAULT_BUCKET_ELEMENTS, BucketLayout, Placement, plan_buckets
from hpc_elastic.est.reducer import GradientReducer, TensorKernels


def _positive(name: str, value: object, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class ESTConfig:
    """What a job fixes at submit time (the N of its hyper-parameters) plus runtime knobs."""

    num_ests: int
    seed: int = 0
    level: DeterminismLevel = DeterminismLevel.D1
    chunk: int = DEFAULT_CHUNK
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    intra_op_threads: int = 1
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_steps: tuple[int, ...] = ()
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        _positive("num_ests", self.num_ests)
        if self.num_ests > MAX_ESTS:
            raise ValueError(f"num_ests must be <= {MAX_ESTS}, got {self.num_ests}")
        _positive("seed", self.seed, zero_ok=True)
        object.__setattr__(self, "level", DeterminismLevel.parse(self.level))
        _positive("chunk", self.chunk)
        _positive("bucket_elements", self.bucket_elements)
        _positive("intra_op_threads", self.intra_op_threads)
        _positive("checkpoint_every", self.checkpoint_every, zero_ok=True)
        _positive("keep_checkpoints", self.keep_checkpoints)
        for step in self.checkpoint_steps:
            _positive("checkpoint step", step)
        if (self.checkpoint_every or self.checkpoint_steps) and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every/checkpoint_steps need a checkpoint_dir")


def _digest_tensor(h: Any, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def params_sha256(names: Sequence[str], params: Sequence[torch.Tensor]) -> str:
    """sha256 of parameters (name, dtype, shape and raw bytes, in order)."""
    h = hashlib.sha256()
    for n, p in zip(names, params, strict=True):
        _digest_tensor(h, n, p)
    return h.hexdigest()


class ESTRuntime:
    """Runs this process's ESTs of a job and keeps them bitwise in step with the fixed-N run."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ESTConfig,
        *,
        comm: Communicator | None = None,
        placement: Placement | None = None,
        lr_scheduler: Any = None,
        kernels: TensorKernels | None = None,
    ) -> None:
        self.config = config
        self.comm = comm if comm is not None else local_communicator()
        self.placement = placement if placement is not None else Placement.contiguous(config.num_ests, self.comm.size)
        if self.placement.num_ests != config.num_ests:
            raise ValueError(f"placement has {self.placement.num_ests} ESTs, the job has {config.num_ests}")
        if self.placement.num_procs != self.comm.size:
            raise ValueError(f"placement is for {self.placement.num_procs} processes, the group has {self.comm.size}")
        apply_determinism(config.level, config.intra_op_threads)
        if config.level is DeterminismLevel.D2:
            from hpc_elastic.est.d2 import scan_model, to_d2

            to_d2(model)
            report = scan_model(model)
            if not report.holds:
                raise HpcElasticError(f"D2 does not hold for this model: {report.first_problem()}")
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.layout: BucketLayout = plan_buckets([p.numel() for p in self.params], config.bucket_elements, config.chunk)
        self.reducer = GradientReducer(
            self.params,
            self.layout,
            num_ests=config.num_ests,
            comm=self.comm,
            level=config.level,
            kernels=kernels,
            max_local_ests=self.placement.max_local_ests,
        )
        self._buffers = dict(model.named_buffers())
        self.local_ests = self.placement.local_ests(self.comm.rank)
        self.contexts = {v: ESTContext.initial(v, config.seed, self._buffers) for v in self.local_ests}
        self.step = 0
        self.last_checkpoint_step: int | None = None
        self._active: ESTContext | None = None
        self._ran: list[int] = []
        self._loader: ESTLoader | None = None
        self.data_plan: DataPlan | None = None
        self.store = (
            open_store(config.checkpoint_dir, self.comm.collective, keep=config.keep_checkpoints)
            if config.checkpoint_dir
            else None
        )

    # ------------------------------------------------------------------ context switching

    @property
    def active(self) -> ESTContext | None:
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
        ctx.rng.restore()
        self._load_buffers(ctx)
        self.reducer.attach_grads()
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

    def local_steps(self) -> Iterator[ESTContext]:
        """Iterate over this process's ESTs for the current global step, each one switched in."""
        for v in self.local_ests:
            with self.activate(v) as ctx:
                yield ctx

    def finish_step(self) -> None:
        """End of a global step: reduce the N contributions, step the optimizer (and LR scheduler), maybe
        checkpoint."""
        if self._active is not None:
            raise RuntimeError(f"finish_step() inside EST {self._active.vrank}")
        if sorted(self._ran) != list(self.local_ests):
            missing = sorted(set(self.local_ests) - set(self._ran))
            raise RuntimeError(f"step {self.step}: ESTs {missing} of this process did not run")
        self.reducer.reduce()
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.reducer.zero()
        self._ran = []
        self.step += 1
        every = self.config.checkpoint_every
        if (every and self.step % every == 0) or self.step in self.config.checkpoint_steps:
            self.save_checkpoint()

    # ------------------------------------------------------------------ data

    def attach_data(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_workers: int = 0,
        collate_fn: Any = None,
        shuffle: bool = True,
        stop_step: int | None = None,
    ) -> DataPlan:
        """Serve ``dataset`` to the ESTs: ``batch_size`` per EST, one shared loader with ``num_workers``."""
        self.data_plan = DataPlan(len(dataset), self.config.num_ests, batch_size, self.config.seed, shuffle)
        if self._loader is not None:
            self._loader.close()
        self._loader = ESTLoader(
            dataset,
            self.data_plan,
            self.local_ests,
            num_workers=num_workers,
            collate_fn=collate_fn,
            stop_cursor=stop_step,
        )
        return self.data_plan

    def next_batch(self) -> Any:
        """The active EST's next mini-batch."""
        ctx = self._active
        if ctx is None:
            raise RuntimeError("next_batch() outside an EST (use local_steps() or activate())")
        if self._loader is None:
            raise RuntimeError("no dataset attached (call attach_data())")
        batch = self._loader.get(ctx.vrank, ctx.cursor)
        ctx.cursor += 1
        return batch

    # ------------------------------------------------------------------ checkpoints

    def _meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "num_ests": c.num_ests,
            "seed": c.seed,
            "level": c.level.value,
            "width": bin_width(c.num_ests),
            "layout": self.layout.to_json(),
            "param_names": list(self.param_names),
        }

    def save_checkpoint(self) -> Path:
        """Write every EST context plus the shared state for the current step (collective); return the
        committed checkpoint directory."""
        if self.store is None:
            raise HpcElasticError("no checkpoint_dir configured")
        if self._active is not None or self._ran:
            raise RuntimeError("checkpoints are taken between global steps")
        shared = None
        if self.comm.rank == 0:
            shared = {
                "step": self.step,
                "params": [p.detach().cpu().clone() for p in self.params],
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            }
        contexts = {v: self.contexts[v].to_state() for v in self.local_ests}
        meta = {**self._meta(), "placement": list(self.placement.owner), "procs": self.comm.size}
        path = save_state(self.store, self.step, contexts, shared, meta)
        self.last_checkpoint_step = self.step
        return path

    def _check_state(self, state: ESTState) -> None:
        """Refuse a checkpoint this job cannot continue from (same seed, level, layout, parameters)."""
        meta = state.meta
        mine = self._meta()
        for key in ("seed", "level", "width", "layout", "param_names"):
            if meta.get(key) != mine[key]:
                raise ValueError(
                    f"checkpoint {state.source} was written with {key}={meta.get(key)!r}, now {mine[key]!r}"
                )
        saved = state.shared["params"]
        if len(saved) != len(self.params):
            raise ValueError(f"checkpoint {state.source} has {len(saved)} parameters, the model {len(self.params)}")
        for name, p, t in zip(self.param_names, self.params, saved, strict=True):
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"parameter {name} has shape {tuple(t.shape)} in the checkpoint, {tuple(p.shape)} now")
        for v, ctx in state.contexts.items():
            if set(ctx.get("buffers", {})) != set(self._buffers):
                raise ValueError(f"checkpoint {state.source}: the buffers of EST {v} do not fit this model")

    def restore(self, checkpoint: Checkpoint | None = None, *, root: Path | str | None = None) -> bool:
        """Continue from ``checkpoint``, or else from the newest loadable checkpoint under ``root`` (default:
        ``checkpoint_dir``; collective, a damaged checkpoint is skipped on every process).  ``False`` when
        there is none.  The checkpoint may come from any number of processes and any placement."""
        n = self.config.num_ests
        if checkpoint is not None:
            state = read_state(checkpoint, self.local_ests, n)
            self._check_state(state)
        else:
            store = self.store if root is None else open_store(root, self.comm.collective)
            if store is None:
                raise HpcElasticError("restore() needs a checkpoint, a root or a checkpoint_dir")
            found = load_latest_state(store, self.local_ests, n, self._check_state)
            if found is None:
                return False
            state = found
        with torch.no_grad():
            for p, saved in zip(self.params, state.shared["params"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(state.shared["optimizer"])
        if self.lr_scheduler is not None and state.shared["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state.shared["lr_scheduler"])
        for v in self.local_ests:
            ctx = ESTContext.from_state(state.contexts[v])
            if ctx.vrank != v:
                raise HpcElasticError(f"checkpoint {state.source}: the context saved for EST {v} is EST {ctx.vrank}'s")
            self.contexts[v] = ctx
        self.step = int(state.shared["step"])
        self.last_checkpoint_step = self.step
        self.reducer.zero()
        self._ran = []
        if self._loader is not None:
            self._loader.close()
        return True

    # ------------------------------------------------------------------ fingerprints

    def params_sha256(self) -> str:
        return params_sha256(self.param_names, self.params)

    def state_sha256(self) -> str:
        """sha256 of parameters, optimizer state and every EST context (RNG states, cursor, buffers);
        collective, same value on every process."""
        local: dict[int, str] = {}
        for v in self.local_ests:
            ctx = self.contexts[v]
            h = hashlib.sha256()
            for name in sorted(ctx.buffers):
                _digest_tensor(h, name, ctx.buffers[name])
            _digest_tensor(h, "rng.torch", ctx.rng.torch_cpu)
            _digest_tensor(h, "rng.numpy", ctx.rng.numpy["keys"])
            h.update(repr((ctx.rng.python, ctx.rng.numpy["pos"], ctx.cursor)).encode())
            local[v] = h.hexdigest()
        per_est: dict[int, str] = {}
        for part in self.comm.allgather_object(local):
            per_est.update(part)
        h = hashlib.sha256(self.params_sha256().encode())
        for name, value in _flatten("optimizer", self.optimizer.state_dict()["state"]):
            _digest_tensor(h, name, value)
        for v in range(self.config.num_ests):
            h.update(per_est[v].encode())
        return h.hexdigest()

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()


def _flatten(prefix: str, obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            yield from _flatten(f"{prefix}.{k}", obj[k])
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(f"{prefix}.{i}", v)
    elif isinstance(obj, (int, float, bool, np.number)):
        yield prefix, torch.tensor(float(obj), dtype=torch.float64)
