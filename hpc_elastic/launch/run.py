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


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hpc-elastic-run %(levelname)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
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
