"""``hpc-elastic submit SCRIPT [-- ARGS]``: write the batch script and submit it with sbatch."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import click

import hpc_elastic
from hpc_elastic.collective import Backend
from hpc_elastic.env import Environment, read_environment
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.batch import render_batch_script
from hpc_elastic.launch.spec import SubmitSpec, check_gpu_type, explicit_options, merge, parse_directives
from hpc_elastic.profile import ProfileError, default_profile_dir, load_profile
from hpc_elastic.slurm import SlurmClient, connect


def wrapper_argv(python: str) -> list[str]:
    """How the batch script starts the wrapper: ``wrappers/hpc-elastic-run`` of this checkout when present,
    else the same entry point as a module of the installed package."""
    script = Path(hpc_elastic.__file__).resolve().parent.parent / "wrappers" / "hpc-elastic-run"
    return [python, str(script)] if script.is_file() else [python, "-m", "hpc_elastic.launch.run"]


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("script", type=click.Path(path_type=Path, dir_okay=False))
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
@click.option("--ckpt-root", type=click.Path(path_type=Path), help="Job directories on the shared filesystem.")
@click.option("--profile", help="Model profile name (profiles/).")
@click.option("--job-name", help="Job name (default: the script's name).")
@click.option("--grace", "grace_s", type=int, help="Seconds between the stop signal and the kill.")
@click.option("--max-restarts", type=int, help="Restarts of a failed worker step inside the allocation (default 2).")
@click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing.")
def submit(script: Path, args: tuple[str, ...], dry_run: bool, **options: object) -> None:
    """Submit SCRIPT (with ARGS after --) as an elastic, preemptible training job; prints the job id."""
    if not script.is_file():
        raise ValueError(f"no such training script: {script}")
    env = read_environment()
    text = script.read_text(errors="replace")
    base = SubmitSpec(
        script=script.resolve(), args=tuple(args), ckpt_root=env.gpfs_root / "jobs", python=sys.executable
    )
    spec = resolve_profile(merge(parse_directives(text), explicit_options(list(options.items())), base), env)
    batch = render_batch_script(spec, wrapper_argv(spec.python))
    if dry_run:
        click.echo(batch, nl=False)
        return
    slurm = connect(env)
    check_against_cluster(spec, slurm)
    spec.ckpt_root.mkdir(parents=True, exist_ok=True)
    job_id = slurm.submit(script_text=batch)
    click.echo(job_id)


def resolve_profile(spec: SubmitSpec, env: Environment) -> SubmitSpec:
    """``--profile`` as the site's profile name (``vgg_like`` -> ``vgg_like@cpu-amd-epyc`` when unique): the
    scheduler looks a job's profile up by that exact name only. ``ValueError`` when there is no such profile."""
    if spec.profile is None:
        return spec
    try:
        profile = load_profile(spec.profile, default_profile_dir(env))
    except ProfileError as exc:
        raise ValueError(f"--profile: {exc}") from None
    return replace(spec, profile=profile.name)


def check_against_cluster(spec: SubmitSpec, slurm: SlurmClient) -> None:
    """What only the cluster can tell: ``--gpu-type`` must be a type of the job's partitions (``ValueError``)."""
    if spec.gpu_type is None:
        return
    partitions = slurm.partitions()
    types: dict[str, set[str]] = {p.name: set() for p in partitions}
    for node in slurm.nodes():
        for part in node.partitions:
            types.setdefault(part, set()).update(t for t, count in node.gpus.by_type if count > 0 and t)
    default = next((p.name for p in partitions if p.default), None)
    check_gpu_type(spec, {name: frozenset(t) for name, t in types.items()}, default)
