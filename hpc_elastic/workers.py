"""Which logical workers a process runs (pure logic).

A job is designed for ``N`` logical workers (the global data-parallel degree, ``HPC_ELASTIC_WORKERS``) and runs on
``M`` worker processes, where ``M`` may change at every restart.  Process ``r`` owns the contiguous block of logical
worker ids ``[r * N/M, (r + 1) * N/M)``.  Contiguous blocks keep the ids of a process adjacent, so gathering every
process's rows in rank order lists all logical workers in id order — the order a deterministic reduction sums in.

Only ``1 <= M <= N`` with ``N % M == 0`` is supported: an uneven split would give some processes more work each step
(the whole job waits for the slowest) and is refused with a ``ValueError`` rather than silently slowing the job down.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerAssignment:
    """``num_workers`` logical workers over ``world_size`` processes; this process is ``rank``."""

    num_workers: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        for name in ("num_workers", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.world_size > self.num_workers:
            raise ValueError(
                f"world_size={self.world_size} processes is more than num_workers={self.num_workers} logical workers"
            )
        if self.num_workers % self.world_size:
            raise ValueError(
                f"num_workers={self.num_workers} logical workers do not split evenly over world_size="
                f"{self.world_size} processes (N must be a multiple of M)"
            )

    @property
    def per_process(self) -> int:
        return self.num_workers // self.world_size

    @property
    def workers(self) -> range:
        """The logical worker ids this process owns, in increasing order."""
        return range(self.rank * self.per_process, (self.rank + 1) * self.per_process)

    def owner(self, worker: int) -> int:
        """The rank that owns logical worker ``worker``."""
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker!r}")
        return worker // self.per_process


def valid_world_sizes(num_workers: int) -> list[int]:
    """Process counts a job of ``num_workers`` logical workers can run on (the divisors of ``num_workers``)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    return [m for m in range(1, num_workers + 1) if num_workers % m == 0]
