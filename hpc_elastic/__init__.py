"""hpc-elastic: elastic, preemptible and bitwise-reproducible deep-learning training on Slurm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hpc_elastic.session import Session


def init(**kwargs: Any) -> Session:
    """Entry point of a training script: ``Session.from_environment(**kwargs)`` (see :mod:`hpc_elastic.session`)."""
    from hpc_elastic.session import Session

    return Session.from_environment(**kwargs)
