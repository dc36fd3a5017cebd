"""hpc-elastic: elastic, preemptible and bitwise-reproducible deep-learning training on Slurm."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hpc_elastic.jobs import Job, JobFailed, RemoteError, submit
    from hpc_elastic.session import Session

__all__ = ["Job", "JobFailed", "RemoteError", "__version__", "init", "submit"]

#: the Python API (:mod:`hpc_elastic.jobs`), imported on first use: ``import hpc_elastic`` stays cheap for the
#: command-line tools, the scheduler daemon and the workers
_LAZY = {
    "submit": "hpc_elastic.jobs",
    "Job": "hpc_elastic.jobs",
    "JobFailed": "hpc_elastic.jobs",
    "RemoteError": "hpc_elastic.jobs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpc_elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def init(**kwargs: Any) -> Session:
    """Entry point of a training script: ``Session.from_environment(**kwargs)`` (see :mod:`hpc_elastic.session`).

    The session module (and torch with it) is imported on the first call, so that ``import hpc_elastic`` stays
    cheap for the command-line tools and the scheduler daemon."""
    session: Any = importlib.import_module("hpc_elastic.session")
    result: Session = session.Session.from_environment(**kwargs)
    return result
