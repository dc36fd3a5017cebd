"""hpc-elastic: elastic, preemptible and bitwise-reproducible deep-learning training on Slurm."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hpc_elastic.session import Session


def init(**kwargs: Any) -> Session:
    """Entry point of a training script: ``Session.from_environment(**kwargs)`` (see :mod:`hpc_elastic.session`).

    The session module (and torch with it) is imported on the first call, so that ``import hpc_elastic`` stays
    cheap for the command-line tools and the scheduler daemon."""
    session: Any = importlib.import_module("hpc_elastic.session")
    result: Session = session.Session.from_environment(**kwargs)
    return result
