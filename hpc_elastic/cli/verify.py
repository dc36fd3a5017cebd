"""``hpc-elastic verify-determinism``: run a training script under several process counts and check that
the final parameters are bitwise identical (issue 6, §5)."""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hpc_elastic.est.backends import CommBackend
from hpc_elastic.est.levels import DeterminismLevel

DEFAULT_PROCS = "1,2,4"


def parse_procs(text: str, workers: int) -> list[int]:
    out: list[int] = []
    for raw in text.split(","):
        tok = raw.strip()
        if not tok:
            continue
        try:
            m = int(tok)
        except ValueError:
            raise ValueError(f"--procs must be a comma-separated list of integers, got {text!r}") from None
        if not 1 <= m <= workers:
            raise ValueError(f"--procs value {m} is outside [1, {workers}] (M processes for N={workers} workers)")
        out.append(m)
    if not out:
        raise ValueError(f"--procs lists no process count: {text!r}")
    return out


def parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option must look like key=value, got {pair!r}")
        try:
            opts[key.strip()] = json.loads(raw)
        except ValueError:
            opts[key.strip()] = raw
    return opts


@dataclass(frozen=True)
class Outcome:
    label: str
    procs: str
    param_sha256: str
    state_sha256: str | None
    wall_s: float


@click.command("verify-determinism")
@click.argument("script", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--workers", "-n", type=int, default=4, show_default=True, help="N, the number of ESTs of the job.")
@click.option("--procs", default=DEFAULT_PROCS, show_default=True, help="Process counts M to run, e.g. 1,2,4.")
@click.option(
    "--backend",
    type=click.Choice([CommBackend.GLOO.value, CommBackend.MPI.value, CommBackend.HOROVOD.value]),
    default=CommBackend.GLOO.value,
    show_default=True,
)
@click.option("--steps", type=int, default=8, show_default=True, help="Global steps K of every run.")
@click.option(
    "--resize-at",
    type=int,
    default=None,
    help="Also resume each run's checkpoint of this step on the next M of --procs.",
)
@click.option(
    "--level",
    type=click.Choice([lvl.value for lvl in DeterminismLevel]),
    default=DeterminismLevel.D1.value,
    show_default=True,
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--option", "-o", "options", multiple=True, help="key=value passed to the script (repeatable).")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds one run may take.")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep every run here (specs, logs, results, final parameters).",
)
def verify_determinism(
    *,
    script: Path | None,
    workers: int,
    procs: str,
    backend: str,
    steps: int,
    resize_at: int | None,
    level: str,
    seed: int,
    options: tuple[str, ...],
    timeout: float,
    workdir: Path | None,
) -> None:
    """Run SCRIPT (default: the bundled example with dropout, BatchNorm and a shuffling DataLoader) with
    N ESTs on each M of --procs and print the sha256 of the final parameters of every run.  Exit 0 only
    when all runs match."""
    from hpc_elastic.errors import HpcElasticError
    from hpc_elastic.est.job import RunSpec
    from hpc_elastic.est.launch import free_port, launch

    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if resize_at is not None and not 0 < resize_at < steps:
        raise ValueError(f"--resize-at must be in [1, {steps - 1}] for --steps {steps}, got {resize_at}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    if script is not None and not script.is_file():
        raise ValueError(f"training script {script} does not exist")
    counts = parse_procs(procs, workers)
    opts = parse_options(options)
    be = CommBackend.parse(backend)
    lvl = DeterminismLevel.parse(level)
    root = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="hpc-elastic-verify-"))
    root.mkdir(parents=True, exist_ok=True)

    def spec(name: str, m: int, **kw: Any) -> RunSpec:
        return RunSpec(
            backend=be,
            num_ests=workers,
            procs=m,
            steps=steps,
            seed=seed,
            level=lvl,
            result_path=str(root / f"{name}.result.json"),
            params_path=str(root / f"{name}.params.pt") if workdir is not None else None,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            timeout_s=timeout,
            options=opts,
            **kw,
        )

    outcomes: list[Outcome] = []

    def record(label: str, shown: str, result: dict[str, Any] | None, wall: float) -> None:
        if result is None:
            raise HpcElasticError(f"run {label} wrote no result")
        outcomes.append(Outcome(label, shown, str(result["param_sha256"]), result.get("state_sha256"), wall))
        ref = outcomes[0]
        o = outcomes[-1]
        verdict = "reference" if len(outcomes) == 1 else ("match" if _same(ref, o) else "MISMATCH")
        click.echo(
            f"{o.label:<18} {o.procs:>6}  {be.value:<7} {lvl.value}  {o.param_sha256}  {verdict}  ({o.wall_s:.1f} s)"
        )

    click.echo(
        f"verify-determinism: N={workers} ESTs, procs {','.join(map(str, counts))}, {steps} steps, workdir {root}"
    )
    click.echo(f"{'run':<18} {'procs':>6}  {'backend':<7} lvl {'sha256 of final parameters':<64}  verdict")
    try:
        for m in counts:
            name = f"fixed-m{m}"
            kw: dict[str, Any] = {}
            if resize_at is not None:  # keep the state at the resize step for the resumed runs below
                kw = {"checkpoint_dir": str(root / f"{name}.ckpt"), "checkpoint_steps": [resize_at]}
            r = launch(spec(name, m, **kw), root, script, name=name)
            record(f"fixed M={m}", str(m), r.result, r.wall_s)
        if resize_at is not None:
            # checkpoint at step K on M processes (the fixed run above), continue on the next M of the list
            pairs = list(itertools.pairwise(counts)) or [(counts[0], counts[0])]
            for m, m2 in pairs:
                name = f"resize-m{m}-m{m2}"
                kw = {"resume": True, "resume_from": str(root / f"fixed-m{m}.ckpt"), "resume_step": resize_at}
                r = launch(spec(name, m2, **kw), root, script, name=name)
                record(f"resize@{resize_at} {m}->{m2}", f"{m}->{m2}", r.result, r.wall_s)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    bad = [o for o in outcomes[1:] if not _same(outcomes[0], o)]
    if bad:
        click.echo(f"MISMATCH: {len(bad)} of {len(outcomes)} runs differ from the reference ({outcomes[0].label})")
        raise click.exceptions.Exit(1)
    click.echo(f"OK: all {len(outcomes)} runs produced bitwise-identical parameters")


def _same(a: Outcome, b: Outcome) -> bool:
    if a.param_sha256 != b.param_sha256:
        return False
    return a.state_sha256 is None or b.state_sha256 is None or a.state_sha256 == b.state_sha256
