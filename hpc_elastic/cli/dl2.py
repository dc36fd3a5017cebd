"""``hpc-elastic dl2``: train DL²'s policy in the slot simulator, and evaluate a model file against the baselines.

A thin layer over :mod:`hpc_elastic.dl2.train` (options -> :class:`TrainConfig` -> :func:`train`), its Slurm
adapter :mod:`hpc_elastic.dl2.sacct` (``--teacher sacct``) and :mod:`hpc_elastic.dl2.evaluate` (options ->
:class:`EvalConfig` -> :func:`evaluate_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from hpc_elastic.dl2.evaluate import EvalConfig, evaluate_model
from hpc_elastic.dl2.plot import plot_curve
from hpc_elastic.dl2.sacct import SacctTeacher, train_on_history
from hpc_elastic.dl2.train import Teacher, TrainConfig, TrainResult, save_model, train
from hpc_elastic.files import check_output_file
from hpc_elastic.plotting import image_path
from hpc_elastic.policy.slot_registry import SLOT_POLICY_NAMES
from hpc_elastic.sim.ps_jobs import Arrival, Catalogue, parse_servers


@click.group()
def dl2() -> None:
    """DL² (deep-RL slot scheduler): train a policy, evaluate a model file."""


def _summary(result: TrainResult) -> dict[str, object]:
    best = result.best
    teacher = result.config.bootstrap if result.teacher is None else result.teacher["teacher"]
    return {
        "teacher": teacher,
        "supervised_samples": result.supervised.samples,
        "supervised_skipped_slots": result.supervised.skipped_slots,
        "train_match": result.supervised.train_match,
        "held_out_match": result.supervised.held_out_match,
        "temperature": result.supervised.temperature,
        "drf_validation_jct_s": result.drf_validation_jct,
        "supervised_validation_jct_s": result.supervised_jct,
        "best_validation_jct_s": best.avg_jct,
        "best_update": best.update,
        "updates": result.curve[-1].update,
    }


@dl2.command("train")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Model file to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--jobs", type=int, default=TrainConfig.jobs, show_default=True, help="Jobs per training trace.")
@click.option("--traces", type=int, default=TrainConfig.traces, show_default=True, help="Training traces.")
@click.option("--validation-jobs", type=int, default=TrainConfig.validation_jobs, show_default=True)
@click.option("--load", type=float, default=TrainConfig.load, show_default=True, help="Generator load.")
@click.option("--servers", default="16x4x16", show_default=True, help="Servers as NxGxC.")
@click.option(
    "--catalogue",
    type=click.Choice([c.value for c in Catalogue]),
    default=TrainConfig.catalogue,
    show_default=True,
    help="Job types: DL² Table 1's (GPU servers) or the ps-mode model (cpu, with --servers 2x0x8).",
)
@click.option("--max-jobs", type=int, default=TrainConfig.max_jobs, show_default=True, help="J: jobs per inference.")
@click.option("--supervised-epochs", type=int, default=TrainConfig.supervised_epochs, show_default=True)
@click.option("--rl-episodes", type=int, default=TrainConfig.rl_episodes, show_default=True)
@click.option("--eval-every", type=int, default=TrainConfig.eval_every, show_default=True, help="Updates.")
@click.option(
    "--immediate",
    type=float,
    default=TrainConfig.immediate,
    show_default=True,
    help="Weight of each inference's own share of the slot's reward in its advantage (0: the slot's alone).",
)
@click.option(
    "--online-confidence",
    type=float,
    default=TrainConfig.online_confidence,
    show_default=True,
    help="Mean probability of the supervised policy's greedy action when the online phase starts (1: untempered).",
)
@click.option("--plot", "plot", type=click.Path(path_type=Path), default=None, help="Training-curve PNG.")
@click.option(
    "--teacher",
    default=Teacher.DRF.value,
    show_default=True,
    help="drf or optimus (their decisions in the simulator) or sacct (Slurm's, from its accounting).",
)
@click.option("--since", default=None, help="--teacher sacct: history from this ISO date or time (UTC).")
@click.option("--until", default=None, help="--teacher sacct: history up to this ISO date or time (default: now).")
@click.option("--partition", default=None, help="--teacher sacct: the CPU partition (default: the PS-mode jobs').")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def train_command(  # noqa: PLR0917 - click passes every option as an argument
    out: Path,
    seed: int,
    jobs: int,
    traces: int,
    validation_jobs: int,
    load: float,
    servers: str,
    catalogue: str,
    max_jobs: int,
    supervised_epochs: int,
    rl_episodes: int,
    eval_every: int,
    immediate: float,
    online_confidence: float,
    plot: Path | None,
    teacher: str,
    since: str | None,
    until: str | None,
    partition: str | None,
    as_json: bool,
) -> None:
    """Supervised bootstrap from DRF (``--teacher optimus``: the Optimus-like policy; ``--teacher sacct``: Slurm's
    history), then online actor-critic, in the slot simulator; writes the model file."""
    kind = Teacher.parse(teacher)
    sacct: SacctTeacher | None = None
    if kind is Teacher.SACCT:
        sacct = SacctTeacher.parse(since, until, partition)
    elif since is not None or until is not None or partition is not None:
        raise ValueError("--since, --until and --partition go with --teacher sacct")
    cluster = parse_servers(servers)
    if len(set(cluster.gpus)) != 1 or len(set(cluster.cpus)) != 1:
        raise ValueError(f"--servers {servers!r}: training takes one server kind (NxGxC)")
    config = TrainConfig(
        seed=seed,
        jobs=jobs,
        traces=traces,
        validation_jobs=validation_jobs,
        load=load,
        servers=(len(cluster.gpus), cluster.gpus[0], cluster.cpus[0]),
        catalogue=catalogue,
        bootstrap=Teacher.DRF if kind is Teacher.SACCT else kind,
        max_jobs=max_jobs,
        supervised_epochs=supervised_epochs,
        rl_episodes=rl_episodes,
        eval_every=eval_every,
        immediate=immediate,
        online_confidence=online_confidence,
    )
    check_output_file(out, "--out")
    if plot is not None:
        image_path(plot, "--plot")
    say = None if as_json else click.echo
    result = train(config, progress=say) if sacct is None else train_on_history(sacct, config, progress=say)
    save_model(out, result)
    if plot is not None:
        plot_curve(plot, result.supervised.losses, result.curve, result.drf_validation_jct)
    summary = _summary(result)
    if as_json:
        click.echo(json.dumps(summary))
        return
    for key, value in summary.items():
        click.echo(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")


@dl2.command("evaluate")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--jobs", type=int, default=200, show_default=True)
@click.option("--load", type=float, default=TrainConfig.load, show_default=True)
@click.option("--arrival", type=click.Choice([a.value for a in Arrival]), default=Arrival.DIURNAL.value)
@click.option("--variation", type=float, default=0.0, show_default=True, help="Speed variation (§6.4).")
@click.option("--policy", "policies", multiple=True, help="Baselines (default: all slot policies).")
@click.option("--plot", "plot", type=click.Path(path_type=Path), default=None, help="The model's training curve.")
@click.option("--json", "as_json", is_flag=True)
def evaluate_command(  # noqa: PLR0917 - click passes every option as an argument
    model: Path,
    seed: int,
    jobs: int,
    load: float,
    arrival: str,
    variation: float,
    policies: tuple[str, ...],
    plot: Path | None,
    as_json: bool,
) -> None:
    """Average JCT of a model file's policy against the slot baselines on a generated trace."""
    config = EvalConfig(model, seed, jobs, load, Arrival(arrival), variation, policies or SLOT_POLICY_NAMES, plot)
    if plot is not None:
        image_path(plot, "--plot")
    jct = evaluate_model(config)
    ratios = {name: value / jct["dl2"] for name, value in jct.items() if name != "dl2"}
    if as_json:
        click.echo(json.dumps({"avg_jct_slots": jct, "ratio_vs_dl2": ratios}))
        return
    click.echo(f"seed {seed}, {jobs} jobs, load {load:g}, {arrival}, variation {variation:g}")
    for name, value in jct.items():
        ratio = f"  ({ratios[name]:.3f}x dl2)" if name in ratios else ""
        click.echo(f"{name:>22}: {value:.3f} slots{ratio}")
