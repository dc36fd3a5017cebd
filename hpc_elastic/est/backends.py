"""Names of the process-group backends an EST job can reduce over (no heavy imports here)."""

from __future__ import annotations

from enum import StrEnum

from hpc_elastic.est.choices import parse_choice


class CommBackend(StrEnum):
    LOCAL = "local"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    HOROVOD = "horovod"

    @classmethod
    def parse(cls, value: str | CommBackend) -> CommBackend:
        return parse_choice(cls, value, "backend")
