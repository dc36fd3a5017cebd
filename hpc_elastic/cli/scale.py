"""``hpc-elastic scale``: set a running ps-mode job's numbers of workers and parameter servers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from hpc_elastic.jobs import default_roots
from hpc_elastic.launch.scale import ScaleConfig, request_scale
from hpc_elastic.slurm import connect


@click.command("scale")
@click.argument("job_id", type=int)
@click.option("--workers", type=int, help="The number of workers to run (within the job's --workers-range).")
@click.option("--ps", type=int, help="The number of parameter servers to run (within the job's --ps-range).")
@click.option(
    "--ckpt-root",
    "ckpt_roots",
    multiple=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Where to look for the job's directory (repeatable; default: submit's default checkpoint root).",
)
def scale(job_id: int, workers: int | None, ps: int | None, ckpt_roots: tuple[Path, ...]) -> None:
    """Ask running ps-mode job JOB_ID to run WORKERS workers and PS parameter servers (new srun steps inside its
    allocation); its wrapper answers in the job directory's control/scale-reply.json."""
    config = ScaleConfig(job_id, workers, ps, default_roots(ckpt_roots))
    job_dir = request_scale(connect(), config, uid=os.getuid(), now=time.time())
    click.echo(f"scale request written to {job_dir.scale_path}")
