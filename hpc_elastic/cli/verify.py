"""``hpc-elastic verify-determinism``: run a training script with N ESTs under several process counts (and resized
mid-run) and check that the final states are bitwise identical.

A thin layer over :mod:`hpc_elastic.verify` (options -> :class:`VerifyConfig` -> :func:`run_verification`); the
exit code is 0 when every run ends in the reference's state, 1 on a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import click

from hpc_elastic.collective import Backend
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.verify import VerifyConfig, run_verification


@click.command("verify-determinism", context_settings={"ignore_unknown_options": True})
@click.argument("script", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--workers", "-n", type=int, default=VerifyConfig.workers, show_default=True, help="N, the ESTs (logical workers)."
)
@click.option("--procs", default=VerifyConfig.procs, show_default=True, help="Process counts M to run, e.g. 1,2,4.")
@click.option(
    "--backend", type=click.Choice([b.value for b in Backend]), default=VerifyConfig.backend.value, show_default=True
)
@click.option(
    "--steps", type=int, default=VerifyConfig.steps, show_default=True, help="Global steps of every run (--steps K)."
)
@click.option("--resize-at", type=int, default=None, help="Also stop each run at this step, go on with the next M.")
@click.option(
    "--level",
    type=click.Choice([lvl.value for lvl in DeterminismLevel]),
    default=VerifyConfig.level.value,
    show_default=True,
)
@click.option(
    "--timeout", type=float, default=VerifyConfig.timeout_s, show_default=True, help="Seconds one run may take."
)
@click.option("--submit", is_flag=True, help="Run every case as a Slurm job through the wrapper (not locally).")
@click.option("--partition", default=None, help="With --submit: the partition (GPU partitions: one GPU per process).")
@click.option("--gpu-type", default=None, help="With --submit: the GPU type.")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep every run's job directory here (checkpoints, logs).",
)
def verify_determinism(
    *,
    script: Path | None,
    args: tuple[str, ...],
    workers: int,
    procs: str,
    backend: str,
    steps: int,
    resize_at: int | None,
    level: str,
    timeout: float,
    submit: bool,
    partition: str | None,
    gpu_type: str | None,
    workdir: Path | None,
) -> None:
    """Run SCRIPT (default: the bundled example with dropout, BatchNorm and an augmenting loader) as
    ``SCRIPT --steps K ARGS`` with N ESTs on each M of --procs, print the sha256 of the final parameters of every
    run, and exit 0 only when all final states match.  ARGS follow ``--`` (``-- --loader-workers 1`` passes them
    to the bundled example)."""
    if script is not None and str(script).startswith("-"):  # `verify-determinism -- --opt` : the bundled example's
        script, args = None, (str(script), *args)
    config = VerifyConfig(
        script=script,
        args=args,
        workers=workers,
        procs=procs,
        backend=Backend.parse(backend),
        steps=steps,
        resize_at=resize_at,
        level=DeterminismLevel.parse(level),
        timeout_s=timeout,
        submit=submit,
        partition=partition,
        gpu_type=gpu_type,
        workdir=workdir,
    )
    report = run_verification(config, click.echo)
    bad = report.mismatches
    if bad:
        click.echo(
            f"MISMATCH: {len(bad)} of {len(report.outcomes)} runs differ from the reference ({report.reference.label})"
        )
        raise click.exceptions.Exit(1)
    click.echo(f"OK: all {len(report.outcomes)} runs ended in bitwise-identical states")
