"""MPI worker for the wrapper's tests: allreduce of the ranks over mpi4py, written by rank 0."""

from __future__ import annotations

import sys

from mpi4py import MPI

from hpc_elastic.env import read_job_environment


def main() -> int:
    comm = MPI.COMM_WORLD
    job = read_job_environment()
    total = comm.allreduce(comm.Get_rank(), op=MPI.SUM)
    if comm.Get_rank() == 0 and job.job_dir is not None:
        (job.job_dir / "mpi.txt").write_text(f"size={comm.Get_size()} sum={total} env_rank={job.rank}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
