"""``hpc-elastic-sched``: run the scheduler daemon (its view of the managed jobs: ``hpc-elastic queue``).

    hpc-elastic-sched --config site-config/hpc-elastic.toml [--once] [--dry-run]

Exit codes: 0 ok, 1 Slurm unreachable past the restart budget, 2 bad configuration, 3 (``--once``) the pass
was skipped because Slurm's answers were partial, 4 another daemon holds the lock.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import click

from hpc_elastic.cli.group import Command
from hpc_elastic.env import Environment, read_environment
from hpc_elastic.launch.spec import JobMarker
from hpc_elastic.profile import ProfileError, ProfileNotFound, default_profile_dir, placement_skew, site_profile
from hpc_elastic.profile.schema import Profile, slugify
from hpc_elastic.slurm import RetryPolicy, Runner, SlurmError, connect
from slurm_plugin.config import ConfigError, PluginConfig, load_config
from slurm_plugin.daemon import CapabilityLookup, Daemon, DaemonLocked, SkewLookup, StopRequested, state_lock
from slurm_plugin.easyscale import Capability, profiled_rates
from slurm_plugin.metrics import Metrics
from slurm_plugin.store import Store, StoreUnavailable

log = logging.getLogger("hpc-elastic-sched")


def profile_skew(environment: Environment) -> SkewLookup:
    """Skew S_J from the job's profile: the largest tensor's share of the model (Tiresias §3.3, Table 6), the
    scale PACKLIMIT is on; unknown profile -> not skewed (None)."""
    directory = default_profile_dir(environment)

    def lookup(marker: JobMarker, gpus: int) -> float | None:
        if not marker.profile:
            return None
        try:
            return placement_skew(marker.profile, directory)
        except (ProfileError, ValueError, OSError) as exc:
            log.debug("no skew for profile %s: %s", marker.profile, exc)
            return None

    return lookup


def profile_capability(directory: Path) -> CapabilityLookup:
    """The profiled throughput per GPU type of the model of the profile a job's marker names (EasyScale §3.4's
    C_i before observation, :func:`~slurm_plugin.easyscale.profiled_rates`): the site profiles
    ``<model>@<type>`` of ``directory``, read by name only as hostile input
    (:func:`~hpc_elastic.profile.site_profile`: no link, at most 1 MiB, the strict schema). A type without a
    profile has no rate; a file that does not parse, or is not a profile of that model on that type, counts as
    none and is said once in the log (again only when what is wrong with it changes). Never raises."""
    warned: set[str] = set()

    def warn(message: str) -> None:
        if message not in warned:
            warned.add(message)
            log.warning("%s: C_i estimated without it", message)

    def read(name: str) -> Profile | None:
        try:
            return site_profile(name, directory)
        except ProfileNotFound:
            return None
        except (ProfileError, ValueError) as exc:  # a bad name or file
            warn(f"profile {name!r} refused: {exc}")
        return None

    def lookup(name: str, types: tuple[str, ...]) -> Capability:
        named = read(name)
        if named is None:
            return ()
        model = named.model
        found: dict[str, Profile] = {}
        for gpu_type in types:
            try:
                file_name = f"{model.name}@{slugify(gpu_type)}"
            except ValueError:
                continue
            profile = named if named.name == file_name else read(file_name)
            if profile is None:
                continue
            if (
                profile.model.name != model.name
                or profile.model.num_parameters != model.num_parameters
                or profile.device.type != slugify(gpu_type)
            ):
                warn(f"profile {file_name!r} is not of model {model.name!r} on {gpu_type!r}")
                continue
            found[gpu_type] = profile
        try:
            rates = profiled_rates(found)
        except ValueError as exc:
            warn(f"profiles of {model.name!r}: {exc}")
            return ()
        return tuple(sorted(rates.items()))

    return lookup


def _load(path: Path) -> PluginConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        click.echo(f"hpc-elastic-sched: {exc}", err=True)
        sys.exit(2)


@click.command(cls=Command, prog="hpc-elastic-sched", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(path_type=Path), required=True, help="TOML configuration")
@click.option("--once", is_flag=True, help="run one pass and exit")
@click.option("--dry-run", is_flag=True, help="log the actions a pass would take; change nothing")
@click.option("--no-metrics", is_flag=True, help="do not serve Prometheus metrics")
@click.option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def main(*, config_path: Path, once: bool, dry_run: bool, no_metrics: bool, log_level: str) -> None:
    """Tiresias scheduling for Slurm: order, checkpointed preemption, placement, elastic size."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    config = _load(config_path)
    try:
        environment = read_environment()
        # Slurm's version decides the backend; asked before the state database is opened, which stays untouched
        client = connect(environment, Runner(timeout_s=environment.slurm_timeout_s, retry=RetryPolicy()))
        store = Store(config.state_dir, read_only=dry_run)
    except (ValueError, StoreUnavailable, SlurmError) as exc:  # SlurmError: Slurm down or its commands missing
        click.echo(f"hpc-elastic-sched: {' '.join(str(exc).split())}", err=True)
        sys.exit(2)
    metrics = Metrics()
    if config.metrics.enabled and not no_metrics and not once:
        metrics.serve(config.metrics.address, config.metrics.port)
    daemon = Daemon(
        config,
        client,
        store,
        clock=time.time,
        sleep=time.sleep,
        monotonic=time.monotonic,
        dry_run=dry_run,
        metrics=metrics,
        skew_lookup=profile_skew(environment),
        capability_lookup=profile_capability(default_profile_dir(environment)),
    )
    for number in (signal.SIGTERM, signal.SIGINT):  # finish the pass in progress, then exit 0
        signal.signal(number, lambda _number, _frame: daemon.request_stop())
    try:
        if dry_run:
            code = daemon.run(once=once)
        else:
            with state_lock(config.state_dir):
                code = daemon.run(once=once)
    except DaemonLocked as exc:
        click.echo(f"hpc-elastic-sched: {exc}", err=True)
        code = 4
    except StopRequested:  # before the first pass
        code = 0
    finally:
        store.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
