"""Submitting a training job: a :class:`SubmitSpec` from a script and its options, checked against the cluster,
rendered as the batch script and given to sbatch.  One path for ``hpc-elastic submit`` and library callers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import hpc_elastic
from hpc_elastic.env import Environment
from hpc_elastic.files import dirs_kept_on_success
from hpc_elastic.launch.batch import render_batch_script
from hpc_elastic.launch.spec import (
    Mode,
    SubmitSpec,
    check_gpu_type,
    check_ps_fits,
    explicit_options,
    merge_layers,
    parse_directives,
    parse_sbatch_lines,
)
from hpc_elastic.profile import ProfileError, default_profile_dir, load_profile
from hpc_elastic.slurm import SlurmClient


def wrapper_argv(python: str) -> list[str]:
    """How the batch script starts the wrapper: ``wrappers/hpc-elastic-run`` of this checkout when present,
    else the same entry point as a module of the installed package."""
    script = Path(hpc_elastic.__file__).resolve().parent.parent / "wrappers" / "hpc-elastic-run"
    return [python, str(script)] if script.is_file() else [python, "-m", "hpc_elastic.launch.run"]


def build_spec(
    script: Path | None, args: tuple[str, ...], options: Mapping[str, Any], env: Environment, python: str
) -> SubmitSpec:
    """The job ``script`` asks for: its ``#SBATCH`` lines, overridden by its ``#HPC-ELASTIC`` directives, overridden
    by ``options`` (unset ones are None; ``extra``: other sbatch options), on top of the defaults of this
    environment; ``--profile`` resolved to the site's full name. ``ValueError`` naming the bad value (a script line
    by its number). In ps mode (``options["mode"]``) ``script`` is optional: a JSON file of the PS job's settings."""
    explicit = explicit_options(list(options.items()))
    ps_mode = explicit.get("mode") is not None and Mode.parse(str(explicit["mode"])) is Mode.PS
    if script is not None and not script.is_file():
        raise ValueError(f"no such {'PS job settings file' if ps_mode else 'training script'}: {script}")
    if ps_mode:
        settings = script.read_text(errors="replace") if script is not None else None
        base = SubmitSpec(script=None, args=tuple(args), ckpt_root=env.gpfs_root / "jobs", python=python)
        spec = merge_layers(base, {**explicit, "ps_config": settings})
        return replace(spec, job_name=spec.job_name or (script.stem if script is not None else None))
    if script is None:
        raise ValueError("no training script given")
    text = script.read_text(errors="replace")
    base = SubmitSpec(script=script.resolve(), args=tuple(args), ckpt_root=env.gpfs_root / "jobs", python=python)
    sbatch, sbatch_extra = parse_sbatch_lines(text)
    layers = ({**sbatch, "extra": sbatch_extra}, parse_directives(text), explicit)
    return resolve_profile(merge_layers(base, *layers), env)


def batch_script(spec: SubmitSpec) -> str:
    """The batch script of ``spec``, starting the wrapper with the spec's Python."""
    return render_batch_script(spec, wrapper_argv(spec.python))


def submit_spec(spec: SubmitSpec, slurm: SlurmClient) -> int:
    """Check ``spec`` against the cluster, create its checkpoint root and submit it; the job id."""
    check_against_cluster(spec, slurm)
    script = batch_script(spec)  # (renders the marker, which checks its counts) before anything is made
    with dirs_kept_on_success(spec.ckpt_root):  # the job's output goes there: made before sbatch, gone if it refuses
        return slurm.submit(script_text=script)


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
    """What only the cluster can tell: ``--account`` must be an account of Slurm's accounting (sbatch itself takes
    any account where the site does not enforce associations, and charges the user's default one),
    ``--gpu-type`` a type of the job's partitions, and a ps-mode job must fit its partitions' cores
    (``ValueError``)."""
    if spec.account is not None:
        accounts = slurm.accounts()
        if spec.account.lower() not in accounts:
            raise ValueError(f"--account {spec.account!r}: Slurm's accounting has no such account")
    if spec.mode is Mode.PS:
        partitions = slurm.partitions()
        cores: dict[str, list[int]] = {p.name: [] for p in partitions}
        for node in slurm.nodes():
            for part in node.partitions:
                cores.setdefault(part, []).append(node.cpus)
        default = next((p.name for p in partitions if p.default), None)
        check_ps_fits(spec, {name: tuple(c) for name, c in cores.items()}, default)
    if spec.gpu_type is None:
        return
    partitions = slurm.partitions()
    types: dict[str, set[str]] = {p.name: set() for p in partitions}
    for node in slurm.nodes():
        for part in node.partitions:
            types.setdefault(part, set()).update(t for t, count in node.gpus.by_type if count > 0 and t)
    default = next((p.name for p in partitions if p.default), None)
    check_gpu_type(spec, {name: frozenset(t) for name, t in types.items()}, default)
