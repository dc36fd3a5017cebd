"""The Slurm adapter: the one subpackage that talks to Slurm.

- :mod:`~hpc_elastic.slurm.types`: frozen dataclasses (:class:`Job`, :class:`Node`, :class:`Partition`).
- :mod:`~hpc_elastic.slurm.parse`: pure parsers of Slurm's JSON and text output.
- :mod:`~hpc_elastic.slurm.commands`: pure argv builders.
- :mod:`~hpc_elastic.slurm.runner`: runs commands (the only ``subprocess`` user), typed errors, backoff.
- :mod:`~hpc_elastic.slurm.client`: the :class:`SlurmClient` protocol and its CLI / pyslurm backends.
"""

from hpc_elastic.slurm.client import CliSlurm, PyslurmSlurm, SlurmClient, connect
from hpc_elastic.slurm.commands import JobAction
from hpc_elastic.slurm.errors import (
    JobNotFound,
    PermissionDenied,
    SlurmCommandError,
    SlurmError,
    SlurmParseError,
    SlurmUnavailable,
)
from hpc_elastic.slurm.runner import RetryPolicy, Runner
from hpc_elastic.slurm.types import GpuCounts, Job, JobRef, JobState, Node, NodeState, Partition, PartitionState, Step

__all__ = [
    "CliSlurm",
    "GpuCounts",
    "Job",
    "JobAction",
    "JobNotFound",
    "JobRef",
    "JobState",
    "Node",
    "NodeState",
    "Partition",
    "PartitionState",
    "PermissionDenied",
    "PyslurmSlurm",
    "RetryPolicy",
    "Runner",
    "SlurmClient",
    "SlurmCommandError",
    "SlurmError",
    "SlurmParseError",
    "SlurmUnavailable",
    "Step",
    "connect",
]
