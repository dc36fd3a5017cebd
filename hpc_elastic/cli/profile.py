"""``hpc-elastic profile``: measure and inspect model profiles (the README's "Profiles").

``run`` measures skew (Tiresias §3.3), throughput, Γ(x) and the memory limit x^o (LB-BSP §3.1, §3.3.1) of a
MODEL (``package.module:factory``, protocol in :mod:`hpc_elastic.models`) and writes ``profiles/<name>.json``;
``list``, ``show`` and ``plot`` read them back through :mod:`hpc_elastic.profile.store`.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from hpc_elastic.cli.group import Group
from hpc_elastic.env import read_environment
from hpc_elastic.files import check_output_dir, dirs_kept_on_success
from hpc_elastic.plotting import image_path, pyplot, save
from hpc_elastic.profile.measure import ProfileRequest, run_profile
from hpc_elastic.profile.memory import format_size, parse_size
from hpc_elastic.profile.options import parse_batch_sizes, parse_device, parse_model_spec, parse_positive_ints
from hpc_elastic.profile.schema import Profile, StepClock
from hpc_elastic.profile.store import (
    default_profile_dir,
    list_profiles,
    load_profile,
    profile_to_json,
    save_profile,
)
from hpc_elastic.profile.submit import (
    DEFAULT_TIME_LIMIT,
    SubmitRequest,
    build_sbatch_argv,
    job_script,
    profile_job_command,
    remote_run_args,
    sbatch_options,
)
from hpc_elastic.slurm import connect

_DIR_OPTION = click.option(
    "--profiles-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Profile directory (default: $HPC_ELASTIC_PROFILES, else profiles/ of the source checkout).",
)


def _directory(profiles_dir: Path | None) -> Path:
    return profiles_dir if profiles_dir is not None else default_profile_dir()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def describe(profile: Profile) -> list[str]:
    """Human-readable summary of a profile, one fact per line."""
    model, device = profile.model, profile.device
    skews = ", ".join(f"{entry.skew:.2f} (K={entry.shards})" for entry in model.shard_skew)
    largest = max(model.tensors, key=lambda tensor: tensor.bytes)
    lines = [
        f"profile {profile.name}",
        f"  model    {model.spec}: {model.num_parameters:,} parameters in {len(model.tensors)} tensors "
        f"({format_size(model.parameter_bytes)})",
        f"  skew     largest tensor {largest.name} {list(largest.shape)} = {model.largest_tensor_share:.1%} of the "
        f"model; round-robin shard skew {skews}",
        f"  device   {device.type} ({device.kind.value}: {device.name}; {device.cpu_count} CPUs, "
        f"{device.torch_threads} torch threads; torch {device.torch_version})",
    ]
    measurement = profile.measurement
    lines.append(
        f"  measured {measurement.created_at.isoformat(timespec='seconds')}: {measurement.warmup} warm-up + "
        f"{measurement.repeats} repeats x {measurement.iters} steps per batch size, {measurement.optimizer}, "
        f"{measurement.clock.value} clock"
    )
    if measurement.load_average_start is not None and measurement.load_average_end is not None:
        lines.append(
            f"           host load average {measurement.load_average_start:.2f} at the start, "
            f"{measurement.load_average_end:.2f} at the end ({device.cpu_count} CPUs)"
        )
    if profile.gamma is not None:
        gamma = profile.gamma
        knee = "none in the measured range" if gamma.saturation_batch is None else f"x^s = {gamma.saturation_batch}"
        lines.append(
            f"  Γ(x)     Γ(0) = {_ms(gamma.launch_overhead_s)}, {_ms(gamma.per_sample_s)}/sample, saturation {knee} "
            f"(rms fit error {gamma.rms_relative_error:.1%})"
        )
    best = profile.best_point
    lines.append(
        f"  best     {best.samples_per_s:,.0f} samples/s ({best.batches_per_s:.3g} batches/s) "
        f"at batch {best.batch_size}"
    )
    limit = profile.memory_limit
    if limit is None:
        lines.append("  memory   not measured")
    elif limit.batch_size is None:
        lines.append(f"  memory   not even batch 1 fits under {format_size(limit.cap_bytes)}")
    else:
        bound = (
            f"(the search stopped at --max-batch {limit.max_batch})"
            if limit.capped
            else f"(batch {limit.first_failing_batch} did not fit)"
        )
        relation = ">=" if limit.capped else "="
        lines.append(
            f"  memory   x^o {relation} {limit.batch_size} under a {format_size(limit.cap_bytes)} cap "
            f"({limit.method.value}) {bound}"
        )
    return lines


def describe_points(profile: Profile) -> list[str]:
    """The measured Γ(x) points as a table."""
    header = ("batch", "Γ(x) median", "min", "max", "batches/s", "samples/s", "peak mem")
    widths = (7, 12, 10, 10, 10, 11, 11)
    lines = ["  " + " ".join(title.rjust(width) for title, width in zip(header, widths, strict=True))]
    for point in profile.points:
        peak = format_size(point.peak_memory_bytes) if point.peak_memory_bytes is not None else "-"
        lines.append(
            f"  {point.batch_size:>7} {_ms(point.step_time_s):>12} {_ms(point.step_time_min_s):>10} "
            f"{_ms(point.step_time_max_s):>10} {point.batches_per_s:>10.3g} {point.samples_per_s:>11,.0f} {peak:>11}"
        )
    return lines


@click.group("profile", cls=Group)
def profile() -> None:
    """Profile models: skew, throughput, the Γ(x) batch-size curve and the memory limit."""


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    console = Console(stderr=True)
    if not console.is_terminal:  # no bar, and no stray blank line, when stderr is a file or a pipe
        yield None
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        yield bar


@profile.command("run", short_help="Measure a profile of MODEL (or --submit it as a Slurm job).")
@click.argument("model")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:INDEX.")
@click.option(
    "--batch-sizes",
    default="auto",
    show_default=True,
    help="Comma-separated batch sizes, or auto: powers of two up to min(memory limit, --max-batch).",
)
@click.option("--iters", type=int, default=3, show_default=True, help="Timed steps per repeat.")
@click.option(
    "--warmup",
    type=int,
    default=2,
    show_default=True,
    help="Untimed steps before a batch size's first repeat (1 before later ones).",
)
@click.option(
    "--repeats",
    type=int,
    default=5,
    show_default=True,
    help="Repeats per batch size, interleaved over batch sizes (median, min, max).",
)
@click.option("--max-batch", type=int, default=1024, show_default=True, help="Largest batch the memory search tries.")
@click.option("--memory-cap", default=None, help="Memory cap, e.g. 4GiB (default: half the free RAM; all GPU memory).")
@click.option("--no-memory-limit", is_flag=True, help="Skip the memory-limit search.")
@click.option("--ps-shards", default="2,4,8", show_default=True, help="Parameter-server shard counts K for skew.")
@click.option("--name", default=None, help="Profile name (default: MODEL@DEVICE-TYPE).")
@click.option("--device-type", default=None, help="Device type key (default: from the CPU model or GPU name).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--clock",
    type=click.Choice([clock.value for clock in StepClock]),
    default=StepClock.WALL.value,
    show_default=True,
    help="wall, or process: CPU time of the profiler (CPU only; for shared hosts, best with --threads 1).",
)
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: torch's, one per core).")
@_DIR_OPTION
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--submit", is_flag=True, help="Run this profile as a Slurm job instead of here.")
@click.option("--partition", default=None, help="Slurm partition for --submit.")
@click.option("--gpu-type", default=None, help="GPU type (gres) for --submit; profiles on cuda.")
@click.option("--time-limit", default=DEFAULT_TIME_LIMIT, show_default=True, help="Job time limit for --submit.")
def run_command(  # noqa: PLR0917 - click passes every option as an argument
    model: str,
    device: str,
    batch_sizes: str,
    iters: int,
    warmup: int,
    repeats: int,
    max_batch: int,
    memory_cap: str | None,
    no_memory_limit: bool,
    ps_shards: str,
    name: str | None,
    device_type: str | None,
    seed: int,
    clock: str,
    threads: int | None,
    profiles_dir: Path | None,
    quiet: bool,
    submit: bool,
    partition: str | None,
    gpu_type: str | None,
    time_limit: str,
) -> None:
    """Profile MODEL: package.module:factory, or a training script path/to/train.py[:factory] (default factory
    profile_model), whose factory returns (nn.Module, sample_batch[, loss_fn]); see hpc_elastic.models."""
    parsed = parse_model_spec(model)
    device_spec = parse_device(device)
    sizes = parse_batch_sizes(batch_sizes)
    shards = parse_positive_ints(ps_shards, "--ps-shards")
    cap = parse_size(memory_cap) if memory_cap is not None else None
    # checked here for both ways: a submitted job would fail on what the local run refuses
    request = ProfileRequest(
        model_spec=model,
        device=parse_device("cuda") if submit and gpu_type is not None else device_spec,
        batch_sizes=sizes,
        iters=iters,
        warmup=warmup,
        repeats=repeats,
        max_batch=max_batch,
        memory_cap_bytes=cap,
        measure_memory=not no_memory_limit,
        shard_counts=shards,
        name=name,
        device_type=device_type,
        seed=seed,
        threads=threads,
        clock=StepClock(clock),
    )
    if submit:
        if parsed.script is not None and not Path(parsed.script).expanduser().is_file():
            raise ValueError(f"MODEL {model!r}: no script {parsed.script}")
        if parsed.module is not None and importlib.util.find_spec(parsed.module.split(".")[0]) is None:
            raise ValueError(f"MODEL {model!r}: no module {parsed.module.split('.')[0]!r} to import")
        forwarded: list[tuple[str, str | None]] = [
            (flag, str(value))
            for flag, value in (
                ("--device", device if gpu_type is None and device != "cpu" else None),
                ("--batch-sizes", batch_sizes),
                ("--iters", iters),
                ("--warmup", warmup),
                ("--repeats", repeats),
                ("--max-batch", max_batch),
                ("--memory-cap", memory_cap),
                ("--ps-shards", ps_shards),
                ("--name", name),
                ("--device-type", device_type if gpu_type is None else None),
                ("--seed", seed),
                ("--threads", threads),
                ("--clock", clock if clock != StepClock.WALL.value else None),
            )
            if value is not None
        ]
        if no_memory_limit:
            forwarded.append(("--no-memory-limit", None))
        if parsed.script is not None:  # the job may start elsewhere: give it the script's absolute path
            script = str(Path(parsed.script).expanduser().resolve())
            model = script if parsed.text == parsed.script else f"{script}:{parsed.factory}"
        _submit(
            model,
            partition=partition,
            gpu_type=gpu_type,
            time_limit=time_limit,
            directory=_directory(profiles_dir),
            forwarded=forwarded,
        )
        return
    if partition is not None or gpu_type is not None:
        raise click.UsageError("--partition and --gpu-type go with --submit")
    check_output_dir(_directory(profiles_dir), "--profiles-dir")  # before the measurement, not when it is saved
    with _progress_bar(not quiet) as bar:
        task = bar.add_task(f"profiling {model}", total=None) if bar is not None else None

        def progress(description: str, done: int, total: int | None) -> None:
            if bar is not None:
                bar.update(task, description=description, completed=done, total=total)

        result = run_profile(request, progress)
    path = save_profile(result, _directory(profiles_dir))
    click.echo(f"wrote {path}")
    for line in describe(result):
        click.echo(line)


def _submit(
    model: str,
    *,
    partition: str | None,
    gpu_type: str | None,
    time_limit: str,
    directory: Path,
    forwarded: list[tuple[str, str | None]],
) -> None:
    """Build the profile job (the same ``profile run`` with the same options) and hand it to the Slurm adapter."""
    if partition is None:
        raise click.UsageError("--submit needs --partition")
    options = [*forwarded, ("--profiles-dir", str(directory.resolve())), ("--quiet", None)]
    logs = directory.resolve() / "logs"
    request = SubmitRequest(
        partition=partition,
        gpu_type=gpu_type,
        run_args=remote_run_args(model, gpu_type=gpu_type, options=options),
        job_name=f"profile-{parse_model_spec(model).name}"[:64],
        output=str(logs / "profile-%j.out"),
        time_limit=time_limit,
        program=(sys.executable, "-m", "hpc_elastic"),
    )
    client = connect(read_environment())
    with dirs_kept_on_success(logs):  # sbatch does not create the directory of --output; gone if it refuses
        job_id = client.submit(options=sbatch_options(request), script_text=job_script(request))
    click.echo(f"submitted profile job {job_id}: {shlex.join(build_sbatch_argv(request))}")
    click.echo(f"  runs: {shlex.join(profile_job_command(request))}")
    click.echo(f"  log:  {request.output.replace('%j', str(job_id)) if request.output else '(Slurm default)'}")


@profile.command("list")
@_DIR_OPTION
def list_command(profiles_dir: Path | None) -> None:
    """List the profiles."""
    directory = _directory(profiles_dir)
    profiles = list_profiles(directory)
    if not profiles:
        click.echo(f"no profiles in {directory}")
        return
    rows = [("NAME", "MODEL", "DEVICE TYPE", "PARAMS", "LARGEST", "SKEW K=4", "BEST SAMPLES/S", "X^O", "MEASURED")]
    for item in profiles:
        limit = item.memory_limit
        x_o = "-" if limit is None or limit.batch_size is None else f"{'>=' if limit.capped else ''}{limit.batch_size}"
        best = item.best_point
        rows.append(
            (
                item.name,
                item.model.name,
                item.device.type,
                f"{item.model.num_parameters:,}",
                f"{item.model.largest_tensor_share:.1%}",
                f"{item.model.skew_for(4):.2f}",
                f"{best.samples_per_s:,.0f} @{best.batch_size}",
                x_o,
                item.measurement.created_at.date().isoformat(),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


@profile.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the profile's JSON.")
@_DIR_OPTION
def show_command(name: str, as_json: bool, profiles_dir: Path | None) -> None:
    """Show profile NAME (a name, a model name or a path to a .json file)."""
    item = load_profile(name, _directory(profiles_dir))
    if as_json:
        click.echo(profile_to_json(item), nl=False)
        return
    for line in [*describe(item), *describe_points(item)]:
        click.echo(line)


@profile.command("plot", short_help="Plot Γ(x) of a profile with its memory limit.")
@click.argument("name")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Image file (default NAME.png).",
)
@_DIR_OPTION
def plot_command(name: str, output: Path | None, profiles_dir: Path | None) -> None:
    """Plot Γ(x) of profile NAME with its fit, saturation point and memory limit."""
    item = load_profile(name, _directory(profiles_dir))
    target = image_path(output if output is not None else Path(f"{item.name}.png"), "--output")
    plot_profile(item, target)
    click.echo(f"wrote {target}")


def plot_profile(item: Profile, target: Path) -> None:
    """Draw Γ(x) (median with min-max bars), the fitted hinge, x^s and x^o, and samples/s to ``target``."""
    plt = pyplot()
    batches = [point.batch_size for point in item.points]
    times = [point.step_time_s * 1e3 for point in item.points]
    low = [(point.step_time_s - point.step_time_min_s) * 1e3 for point in item.points]
    high = [(point.step_time_max_s - point.step_time_s) * 1e3 for point in item.points]
    figure, axis = plt.subplots(figsize=(8, 5))
    axis.errorbar(batches, times, yerr=[low, high], fmt="o", color="tab:blue", capsize=3, label="Γ(x) median (min-max)")
    limit = item.memory_limit
    right = max(batches)
    if limit is not None and limit.batch_size is not None:
        right = max(right, limit.batch_size)
    if item.gamma is not None:
        gamma = item.gamma
        fit = gamma.to_fit()
        xs = [min(batches) * (right * 1.2 / min(batches)) ** (i / 200) for i in range(201)]
        axis.plot(
            xs,
            [fit.predict(x) * 1e3 for x in xs],
            "--",
            color="tab:gray",
            label=f"fit: Γ(0) = {_ms(gamma.launch_overhead_s)}, {_ms(gamma.per_sample_s)}/sample",
        )
        if gamma.saturation_batch is not None:
            axis.axvline(
                gamma.saturation_batch, color="tab:green", linestyle=":", label=f"x^s = {gamma.saturation_batch}"
            )
    if limit is not None and limit.batch_size is not None:
        relation = "≥" if limit.capped else "="
        axis.axvline(
            limit.batch_size,
            color="tab:red",
            label=f"memory limit x^o {relation} {limit.batch_size} ({format_size(limit.cap_bytes)} cap)",
        )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("batch size x")
    axis.set_ylabel("step time Γ(x) [ms]  (forward + backward + optimizer)")
    speed = axis.twinx()
    speed.plot(
        batches,
        [point.samples_per_s for point in item.points],
        "s-",
        color="tab:orange",
        alpha=0.5,
        label="throughput C (samples/s)",
    )
    speed.set_ylabel("throughput [samples/s]", color="tab:orange")
    axis.set_title(
        f"{item.name}\nlargest tensor {item.model.largest_tensor_share:.1%}, skew {item.model.skew_for(4):.2f} (K=4)"
    )
    axis.grid(True, which="both", alpha=0.3)
    handles, labels = axis.get_legend_handles_labels()
    speed_handles, speed_labels = speed.get_legend_handles_labels()
    axis.legend(handles + speed_handles, labels + speed_labels, loc="upper left", fontsize="small")
    figure.tight_layout()
    save(figure, target, dpi=110)
