"""The contract between a launcher and a training script: a JSON run spec named by the environment.

A launcher (``hpc_elastic.est.launch`` today, the Slurm launcher later) writes a :class:`RunSpec` and
starts the processes with ``HPC_ELASTIC_EST_SPEC`` (and ``HPC_ELASTIC_EST_RANK`` for gloo); the script
calls :func:`job_from_environment` and gets the process group, the EST placement and the run settings.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpc_elastic.checkpoint.fs import atomic_write_bytes
from hpc_elastic.env import read_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.backends import CommBackend
from hpc_elastic.est.checkpoint import checkpoint_at
from hpc_elastic.est.comm import Communicator, make_communicator
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.plan import Placement
from hpc_elastic.est.runtime import ESTConfig, ESTRuntime, params_sha256


class RunSpec(BaseModel):
    """One launch of an EST job (or of its plain-DDP baseline) on ``procs`` processes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: CommBackend
    num_ests: int = Field(ge=1)
    procs: int = Field(ge=1)
    placement: list[int] | None = None  # owner process of each EST; None: contiguous blocks
    steps: int = Field(ge=0)  # run until this global step (a resumed run continues from its checkpoint)
    seed: int = Field(default=0, ge=0)
    level: DeterminismLevel = DeterminismLevel.D1
    checkpoint_dir: str | None = None
    checkpoint_every: int = Field(default=0, ge=0)
    checkpoint_steps: list[int] = Field(default_factory=list)  # also checkpoint after these global steps
    resume: bool = False  # continue from a checkpoint: resume_from (default checkpoint_dir), at resume_step
    resume_from: str | None = None
    resume_step: int | None = Field(default=None, ge=0)  # None: the latest checkpoint
    result_path: str
    params_path: str | None = None
    init_method: str | None = None  # gloo/nccl rendezvous, e.g. tcp://127.0.0.1:29500
    timeout_s: float = Field(default=600.0, gt=0)
    options: dict[str, Any] = Field(default_factory=dict)

    def resolved_placement(self) -> Placement:
        if self.placement is None:
            return Placement.contiguous(self.num_ests, self.procs)
        placement = Placement(tuple(self.placement), self.procs)
        if placement.num_ests != self.num_ests:
            raise ValueError(f"placement lists {placement.num_ests} ESTs, num_ests is {self.num_ests}")
        return placement

    def write(self, path: Path) -> Path:
        atomic_write_bytes(path, self.model_dump_json(indent=1).encode())
        return path

    @classmethod
    def read(cls, path: Path) -> RunSpec:
        try:
            return cls.model_validate_json(path.read_text())
        except OSError as exc:
            raise HpcElasticError(f"cannot read run spec {path}: {exc.strerror}") from exc
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(f"run spec {path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


@dataclass
class ESTJob:
    """What a training process gets from its launcher."""

    spec: RunSpec
    comm: Communicator
    placement: Placement
    started: float = field(default_factory=time.monotonic)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.spec.options)

    def config(self) -> ESTConfig:
        s = self.spec
        return ESTConfig(
            num_ests=s.num_ests,
            seed=s.seed,
            level=s.level,
            checkpoint_dir=Path(s.checkpoint_dir) if s.checkpoint_dir else None,
            checkpoint_every=s.checkpoint_every,
            checkpoint_steps=tuple(s.checkpoint_steps),
            intra_op_threads=int(s.options.get("intra_op_threads", 1)),
        )

    def runtime(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> ESTRuntime:
        """The EST runtime of this process; resumes from the latest checkpoint when the spec says so."""
        rt = ESTRuntime(
            model, optimizer, self.config(), comm=self.comm, placement=self.placement, lr_scheduler=lr_scheduler
        )
        if self.spec.resume:
            root = self.spec.resume_from or self.spec.checkpoint_dir
            if root is None:
                raise ValueError("resume needs resume_from or checkpoint_dir")
            if self.spec.resume_step is None:
                if not rt.restore(root=root):
                    raise HpcElasticError(f"resume requested but {root} holds no checkpoint")
            else:
                rt.restore(checkpoint_at(root, self.spec.resume_step))
        return rt

    def report(
        self,
        runtime: ESTRuntime | None = None,
        *,
        named_params: Sequence[tuple[str, torch.Tensor]] | None = None,
        step: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write the run's result (rank 0): sha256 of the final parameters (and of the whole EST state when
        a runtime is given), plus the parameters themselves when the spec asks for ``params_path``."""
        if runtime is not None:
            names, params = runtime.param_names, [p.detach() for p in runtime.params]
            state = runtime.state_sha256()
            step = runtime.step
        elif named_params is not None:
            names = [n for n, _ in named_params]
            params = [p.detach() for _, p in named_params]
            state = None
        else:
            raise ValueError("report() needs a runtime or named_params")
        result: dict[str, Any] = {
            "param_sha256": params_sha256(names, params),
            "state_sha256": state,
            "step": step,
            "procs": self.spec.procs,
            "num_ests": self.spec.num_ests,
            "backend": self.spec.backend.value,
            "level": self.spec.level.value,
            "placement": list(self.placement.owner),
            "wall_s": round(time.monotonic() - self.started, 3),
            **dict(extra or {}),
        }
        if self.comm.rank == 0:
            if self.spec.params_path:
                buf = {n: p.cpu().clone() for n, p in zip(names, params, strict=True)}
                path = Path(self.spec.params_path)
                data = io.BytesIO()
                torch.save(buf, data)
                atomic_write_bytes(path, data.getvalue())
                result["params_sha256_file"] = hashlib.sha256(data.getvalue()).hexdigest()
            atomic_write_bytes(Path(self.spec.result_path), json.dumps(result, sort_keys=True).encode())
        return result

    def close(self) -> None:
        self.comm.close()


def job_from_spec(spec: RunSpec, rank: int | None = None) -> ESTJob:
    placement = spec.resolved_placement()
    comm = make_communicator(
        spec.backend, rank=rank, size=spec.procs, init_method=spec.init_method, timeout_s=spec.timeout_s
    )
    if comm.size != spec.procs:
        raise HpcElasticError(f"the process group has {comm.size} processes, the spec {spec.procs}")
    return ESTJob(spec, comm, placement)


def job_from_environment(environ: Mapping[str, str] | None = None) -> ESTJob:
    """The job of a process started by an hpc-elastic launcher."""
    env = read_environment(environ)
    if env.est_spec is None:
        raise HpcElasticError("not started by an hpc-elastic launcher: HPC_ELASTIC_EST_SPEC is not set")
    spec = RunSpec.read(env.est_spec)
    if spec.backend in (CommBackend.GLOO, CommBackend.NCCL) and env.est_rank is None:
        raise HpcElasticError(f"backend {spec.backend.value} needs HPC_ELASTIC_EST_RANK")
    return job_from_spec(spec, env.est_rank)
