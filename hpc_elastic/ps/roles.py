"""The commands of ``python -m hpc_elastic.ps`` that need no torch: the ``ps`` and ``master`` processes of a PS-mode
job, and ``local``, which runs a whole job on this machine and prints the master's final status as JSON (the
``worker`` command lives with the worker, :mod:`hpc_elastic.ps.worker`)."""

from __future__ import annotations

import json
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click

from hpc_elastic.ps import checkpoint, rpc
from hpc_elastic.ps.config import PsJobConfig, settings_object
from hpc_elastic.ps.job import NODE_NAME, PsJob, PsLauncher, exit_on_signal, write_address
from hpc_elastic.ps.master import LIVENESS_S, Master
from hpc_elastic.ps.server import ParameterServer


def parse_config(text: str) -> PsJobConfig:
    return PsJobConfig.from_json(settings_object(text, "--config"))


def _serve(name: str, handlers: dict[str, rpc.Handler], run_dir: Path, bind: str, stopped: threading.Event) -> None:
    """Serve ``handlers`` on a free port of ``bind`` (an address, or :data:`NODE_NAME`: this node's host name) until
    ``stopped`` is set; the address goes to ``run_dir/<name>.addr``."""
    host = socket.gethostname() if bind == NODE_NAME else bind
    server, port = rpc.serve(handlers, host=host)
    write_address(run_dir, name, rpc.address(host, port))
    stopped.wait()
    server.stop(grace=1).wait()


#: the address a server role listens on (the PS and the master)
_BIND = click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    help=f"the address to listen on ({NODE_NAME!r}: this node's host name)",
)


@click.command("ps")
@click.option("--config", "config_json", required=True)
@click.option("--index", type=int, required=True)
@click.option("--run-dir", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True)
@_BIND
@click.option("--num-ps", type=int, default=None, help="the number of PS it is one of (default: the config's)")
@click.option("--name", default=None, help="its process name, of its address file (default: ps<index>)")
@click.option("--restore-from", type=click.Path(path_type=Path), default=None, help="a checkpoint root")
def ps_command(
    *,
    config_json: str,
    index: int,
    run_dir: Path,
    bind: str,
    num_ps: int | None,
    name: str | None,
    restore_from: Path | None,
) -> None:
    """A parameter server."""
    config = parse_config(config_json)
    server = ParameterServer(config, index, config.num_ps if num_ps is None else num_ps)
    if restore_from is not None:
        where = checkpoint.latest(restore_from)
        if where is None:
            raise ValueError(f"no checkpoint to restore in {restore_from}")
        server.load(checkpoint.read_partitions(where))
    stopped = threading.Event()

    def stop(header: dict[str, Any], arrays: Any) -> rpc.Reply:
        stopped.set()
        return {}, {}

    _serve(name or f"ps{index}", {**server.handlers(), "stop": stop}, run_dir, bind, stopped)


@click.command("master")
@click.option("--config", "config_json", required=True)
@click.option("--ps", "ps_addresses", required=True, help="the PS addresses, comma-separated, in index order")
@click.option("--run-dir", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True)
@_BIND
@click.option("--checkpoint-dir", type=click.Path(path_type=Path), default=None)
@click.option("--checkpoint-every", type=int, default=0, help="checkpoint after every N shards done (0: on request)")
@click.option(
    "--restore",
    is_flag=True,
    help="continue from the latest checkpoint in --checkpoint-dir, the PS put back to its parameters",
)
@click.option(
    "--liveness",
    type=float,
    default=LIVENESS_S,
    show_default=True,
    help="seconds without a call after which a worker is declared lost",
)
def master_command(
    *,
    config_json: str,
    ps_addresses: str,
    run_dir: Path,
    bind: str,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    restore: bool,
    liveness: float,
) -> None:
    """The job master (Data Shard Manager)."""
    config = parse_config(config_json)
    master = Master(config, ps_addresses.split(","), checkpoint_dir, checkpoint_every, restore, liveness_s=liveness)
    if restore:
        master.restore_ps()
    master.watch()
    _serve("master", master.handlers(), run_dir, bind, master.stopped)


@click.command("local")
@click.option("--ps", "num_ps", type=int, default=2, show_default=True)
@click.option("--workers", "num_workers", type=int, default=3, show_default=True)
@click.option("--samples", "num_samples", type=int, default=4096, show_default=True)
@click.option("--shard-size", type=int, default=128, show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--epochs", type=int, default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--lr", type=float, default=0.05, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), default=None, help="logs and addresses (default: temp)")
@click.option(
    "--launcher",
    type=click.Choice([x.value for x in PsLauncher]),
    default="local",
    show_default=True,
    help="plain processes, or one srun step each (inside an allocation; --run-dir then on a shared filesystem)",
)
def local_command(
    *,
    num_ps: int,
    num_workers: int,
    num_samples: int,
    shard_size: int,
    batch_size: int,
    epochs: int,
    seed: int,
    lr: float,
    run_dir: Path | None,
    launcher: str,
) -> None:
    """Run a whole PS job (on this machine, or as srun steps of this allocation); print the master's final status
    as JSON."""
    config = PsJobConfig(
        num_ps=num_ps,
        num_workers=num_workers,
        num_samples=num_samples,
        shard_size=shard_size,
        batch_size=batch_size,
        epochs=epochs,
        seed=seed,
        lr=lr,
    )
    if num_workers < 1:
        raise ValueError(f"--workers must be at least 1, not {num_workers}")
    previous = {sig: signal.signal(sig, exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:  # a TERM (a timeout, a cancel) stops the job's processes too
        with tempfile.TemporaryDirectory(prefix="hpc-elastic-ps-") as tmp:
            t0 = time.monotonic()
            with PsJob(config, run_dir or Path(tmp), launcher=PsLauncher(launcher)) as job:
                status = job.wait()
            status["seconds"] = round(time.monotonic() - t0, 2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo(json.dumps(status))
