"""Entry point of ``wrappers/hpc-elastic-run`` (also ``python -m hpc_elastic.launch.run``)."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence

from hpc_elastic.env import read_environment, read_job_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.launch.supervisor import Supervisor, parse_wrapper_args
from hpc_elastic.slurm import connect

USAGE = """\
usage: hpc-elastic-run --ckpt-root=DIR [--backend=torch|mpi|horovod] [--workers=N] [--level=d0|d1|d2]
                       [--balance=none|est|lbbsp] [--grace=S] [--launcher=srun|mpirun] [--max-restarts=N]
                       [--max-requeues=N] -- COMMAND [ARGS...]
       hpc-elastic-run --mode=ps --ckpt-root=DIR --workers-range=A:B --ps-range=C:D [--cpus-per-worker=N]
                       [--grace=S] [--max-requeues=N] [--ps-config=JSON]

The body of an hpc-elastic batch script, run inside the Slurm allocation: starts the workers (with --mode=ps the
job master, the parameter servers and the workers), supervises them, and turns Slurm's signals into checkpoint,
requeue and resume."""


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hpc-elastic-run %(levelname)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    options = args[: args.index("--")] if "--" in args else args
    if "-h" in options or "--help" in options:
        print(USAGE)
        return 0
    if args[:1] == ["--mode=ps"]:  # a parameter-server job (hpc-elastic submit --mode ps)
        # through importlib: PS mode needs grpcio (extra ps), which a training job's environment may not have
        allocation = importlib.import_module("hpc_elastic.ps.allocation")
        code: int = allocation.main(args)
        return code
    try:
        config = parse_wrapper_args(args)
        job = read_job_environment()
        slurm = connect(read_environment())
        supervisor = Supervisor(config, job, slurm)
        supervisor.prepare()  # a job directory someone else made, or can write into, stops here
    except (ValueError, HpcElasticError) as exc:
        print(f"hpc-elastic-run: error: {exc}", file=sys.stderr)
        return 2
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
