"""``hpc-elastic submit SCRIPT [-- ARGS]``: write the batch script and submit it with sbatch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import click

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend
from hpc_elastic.env import read_environment
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.spec import Mode, sbatch_arg
from hpc_elastic.launch.submission import batch_script, build_spec, submit_spec
from hpc_elastic.slurm import connect


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("script", type=click.Path(path_type=Path, dir_okay=False), required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--gpus", type=int, help="GPUs now (one worker process each); 0 for a CPU job.")
@click.option("--min-gpus", type=int, help="Fewest GPUs the scheduler may shrink the job to.")
@click.option("--max-gpus", type=int, help="Most GPUs the scheduler may grow the job to.")
@click.option("--gpu-type", help="GPU type (gres type), e.g. a100.")
@click.option("--procs", type=int, help="Worker processes of a CPU job.")
@click.option("--cpus-per-worker", type=int, help="CPU cores per worker process.")
@click.option("--nodes", type=int, help="Nodes (default: Slurm decides).")
@click.option("--partition", help="Slurm partition.")
@click.option("--time", help="Time limit (Slurm format, e.g. 2:00:00).")
@click.option("--backend", type=click.Choice([b.value for b in Backend]), help="Distributed backend.")
@click.option("--workers", type=int, help="Logical workers N (ESTs; default: GPUs). Any GPU count up to N runs them.")
@click.option(
    "--level",
    type=click.Choice([lvl.value for lvl in DeterminismLevel]),
    help="Determinism level (default d1: same bits on any number of GPUs of one type; d2: across types too).",
)
@click.option(
    "--balance",
    metavar="|".join(m.value for m in BalanceMode),
    help="How processes share the work: est (faster processes run more ESTs, same bits; the default where there "
    "are more ESTs than processes, at d1/d2), lbbsp (LB-BSP's per-worker batch sizes; no bitwise promise), none.",
)
@click.option("--ckpt-root", type=click.Path(path_type=Path), help="Job directories on the shared filesystem.")
@click.option("--profile", help="Model profile name (profiles/).")
@click.option("--job-name", help="Job name (default: the script's name).")
@click.option("--grace", "grace_s", type=int, help="Seconds between the stop signal and the kill.")
@click.option("--max-restarts", type=int, help="Restarts of a failed worker step inside the allocation (default 2).")
@click.option("--account", "-A", help="Slurm account to charge.")
@click.option("--qos", "-q", help="Quality of service.")
@click.option("--mem", help="Memory per node (Slurm size: 4096, 500M, 16G); excludes --mem-per-gpu/--mem-per-cpu.")
@click.option("--mem-per-gpu", help="Memory per GPU (Slurm size).")
@click.option("--mem-per-cpu", help="Memory per CPU core (Slurm size).")
@click.option("--constraint", "-C", help="Node features, e.g. a100 or 'ib&a100'.")
@click.option("--exclusive", is_flag=True, default=None, help="Whole nodes, shared with no other job.")
@click.option("--reservation", help="Slurm reservation.")
@click.option("--dependency", "-d", help="Start after other jobs: afterok:123[:124], afterany:..., singleton.")
@click.option("--mail-type", help="When to mail: a comma list of BEGIN, END, FAIL, REQUEUE, ALL, ...")
@click.option("--mail-user", help="Who gets the mail (default: the submitting user).")
@click.option("--array", "-a", help="A job array, e.g. 0-3, 1,3,5 or 0-15%4: one job (and job directory) per task.")
@click.option(
    "--sbatch-arg",
    "extra",
    multiple=True,
    help="Another sbatch option, e.g. --sbatch-arg=--begin=now+1hour (repeatable; options hpc-elastic sets refused).",
)
@click.option(
    "--max-requeues", type=int, help="Requeues at the time limit (--time), each from a checkpoint (default 0)."
)
@click.option(
    "--mode",
    metavar="|".join(m.value for m in Mode),
    help="est: a training script on EasyScale threads (default); ps: a parameter-server job (job master, PS and "
    "workers as job steps on a CPU partition; SCRIPT, if given, is a JSON file of its settings).",
)
@click.option("--workers-range", help="ps mode: fewest and most workers, A:B.")
@click.option("--ps-range", help="ps mode: fewest and most parameter servers, C:D.")
@click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing.")
def submit(script: Path | None, args: tuple[str, ...], dry_run: bool, **options: object) -> None:
    """Submit SCRIPT (with ARGS after --) as an elastic, preemptible training job; prints the job id. With
    --mode ps: a parameter-server job, SCRIPT optional (a JSON file of the job's settings)."""
    env = read_environment()
    extra = options.pop("extra")  # click gives a tuple of strings for a multiple option
    options["extra"] = tuple(sbatch_arg(str(arg)) for arg in cast("tuple[object, ...]", extra)) or None
    spec = build_spec(script, tuple(args), options, env, sys.executable)
    if dry_run:
        click.echo(batch_script(spec), nl=False)
        return
    click.echo(submit_spec(spec, connect(env)))
