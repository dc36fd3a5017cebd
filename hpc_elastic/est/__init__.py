"""EasyScaleThreads (ESTs) and the deterministic allreduce: bitwise-identical data-parallel training on any
number of processes (issue 6; EasyScale, SC'23, §3.2-3.3).

Entry points (imported lazily: ``import hpc_elastic.est`` loads neither torch nor the C extension):

- :class:`ESTRuntime`, :class:`ESTConfig`: run this process's ESTs of a job;
- :func:`job_from_environment`, :class:`RunSpec`, :class:`ESTJob`: the launcher/script contract;
- :func:`launch`, :func:`start`: start M local processes (gloo, mpi, horovod);
- :class:`Placement`, :func:`plan_buckets`: pure planning (EST-to-process map, gradient buckets);
- :class:`DeterminismLevel`, :func:`apply_determinism`, :func:`seed_everything`;
- :func:`scan_model`, :func:`to_d2`, :class:`DetLinear`: D2;
- :func:`reference_allreduce`: the NumPy definition of the deterministic sum;
- :func:`checkpoint_at`, :func:`read_state`: EST checkpoints (on :mod:`hpc_elastic.checkpoint`'s store).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ESTRuntime": "hpc_elastic.est.runtime",
    "ESTConfig": "hpc_elastic.est.runtime",
    "params_sha256": "hpc_elastic.est.runtime",
    "RunSpec": "hpc_elastic.est.job",
    "ESTJob": "hpc_elastic.est.job",
    "job_from_environment": "hpc_elastic.est.job",
    "job_from_spec": "hpc_elastic.est.job",
    "launch": "hpc_elastic.est.launch",
    "start": "hpc_elastic.est.launch",
    "Placement": "hpc_elastic.est.plan",
    "plan_buckets": "hpc_elastic.est.plan",
    "BucketLayout": "hpc_elastic.est.plan",
    "DeterminismLevel": "hpc_elastic.est.levels",
    "apply_determinism": "hpc_elastic.est.levels",
    "seed_everything": "hpc_elastic.est.levels",
    "CommBackend": "hpc_elastic.est.backends",
    "make_communicator": "hpc_elastic.est.comm",
    "ESTContext": "hpc_elastic.est.context",
    "DataPlan": "hpc_elastic.est.data",
    "ESTLoader": "hpc_elastic.est.data",
    "CheckpointStore": "hpc_elastic.checkpoint",
    "checkpoint_at": "hpc_elastic.est.checkpoint",
    "read_state": "hpc_elastic.est.checkpoint",
    "scan_model": "hpc_elastic.est.d2",
    "to_d2": "hpc_elastic.est.d2",
    "DetLinear": "hpc_elastic.est.d2",
    "reference_allreduce": "hpc_elastic.est.detsum",
}

__all__ = [
    "BucketLayout",
    "CheckpointStore",
    "CommBackend",
    "DataPlan",
    "DetLinear",
    "DeterminismLevel",
    "ESTConfig",
    "ESTContext",
    "ESTJob",
    "ESTLoader",
    "ESTRuntime",
    "Placement",
    "RunSpec",
    "apply_determinism",
    "checkpoint_at",
    "job_from_environment",
    "job_from_spec",
    "launch",
    "make_communicator",
    "params_sha256",
    "plan_buckets",
    "read_state",
    "reference_allreduce",
    "scan_model",
    "seed_everything",
    "start",
    "to_d2",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpc_elastic.est' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
