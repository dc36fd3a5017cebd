"""Names of the process-group backends an EST job can reduce over (no heavy imports here)."""

from __future__ import annotations

from enum import StrEnum


class CommBackend(StrEnum):
    LOCAL = "local"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    HOROVOD = "horovod"

    @classmethod
    def parse(cls, value: str | CommBackend) -> CommBackend:
        if isinstance(value, CommBackend):
            return value
        text = str(value).strip().lower()
        for b in cls:
            if b.value == text:
                return b
        raise ValueError(f"backend must be one of {', '.join(b.value for b in cls)}, got {value!r}")
