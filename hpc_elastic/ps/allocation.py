"""The body of a ps-mode batch job (``hpc-elastic-run --mode=ps ...``, written by ``hpc-elastic submit --mode ps``):
inside the allocation it starts the job master, the parameter servers and the workers, each as a job step of its
own (:class:`hpc_elastic.ps.job.PsJob` with the ``srun`` launcher), watches them until training ends and leaves the
master's final status in the job directory (``<job dir>/ps/status.json``, and on stdout, the job's output).

The job directory is the one of every hpc-elastic job (:class:`hpc_elastic.jobdir.JobDir`): the processes' logs and
addresses in ``ps/``, the PS job's checkpoints in ``checkpoints/``, taken every :data:`CHECKPOINT_EVERY` shards
done, from which a lost parameter server is recovered in the running job.

    hpc-elastic-run --mode=ps --ckpt-root=DIR --workers-range=A:B --ps-range=C:D [--cpus-per-worker=N]
                    [--grace=S] [--ps-config=JSON]

The job starts with C parameter servers and B workers; the allocation holds room for the job master, D PS and B
workers. Exit status: 0 when training finished with every sample counted exactly once per epoch, 1 otherwise.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_elastic.env import read_job_environment
from hpc_elastic.files import atomic_write_bytes
from hpc_elastic.jobdir import JobDir
from hpc_elastic.launch.spec import parse_range, ps_job_config
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.job import PsJob, PsLauncher

#: the PS job checkpoints parameters, queues and ledger after every this many shards done
CHECKPOINT_EVERY = 8
#: the wrapper waits this long for training to end (the job's time limit ends it first)
WAIT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class PsWrapperConfig:
    ckpt_root: Path
    workers_range: tuple[int, int]
    ps_range: tuple[int, int]
    cpus_per_worker: int = 1
    grace_s: float = 120.0
    settings: str | None = None

    def job_config(self) -> PsJobConfig:
        return ps_job_config(self.settings, self.ps_range[0], self.workers_range[1])


def parse_args(argv: Sequence[str]) -> PsWrapperConfig:
    """The wrapper's ps-mode options (``--mode=ps`` first); ``ValueError`` naming a bad or missing one."""
    if not argv or argv[0] != "--mode=ps":
        raise ValueError("usage: hpc-elastic-run --mode=ps --ckpt-root=DIR --workers-range=A:B --ps-range=C:D ...")
    values: dict[str, Any] = {}
    for option in argv[1:]:
        key, _, value = option.partition("=")
        if key == "--ckpt-root" and value:
            values["ckpt_root"] = Path(value)
        elif key == "--workers-range" and value:
            values["workers_range"] = parse_range(value, key)
        elif key == "--ps-range" and value:
            values["ps_range"] = parse_range(value, key)
        elif key == "--cpus-per-worker" and value.isdigit() and int(value) >= 1:
            values["cpus_per_worker"] = int(value)
        elif key == "--grace" and value:
            values["grace_s"] = float(value)
        elif key == "--ps-config" and value:
            values["settings"] = value
        else:
            raise ValueError(f"hpc-elastic-run: unknown or incomplete option {option!r}")
    missing = [o for o, k in (("--ckpt-root", "ckpt_root"), ("--workers-range", "workers_range"),
                              ("--ps-range", "ps_range")) if k not in values]  # fmt: skip
    if missing:
        raise ValueError(f"hpc-elastic-run --mode=ps: {missing[0]} is required")
    config = PsWrapperConfig(**values)
    config.job_config()  # the settings' own checks
    return config


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run(config: PsWrapperConfig) -> int:
    """Run the PS job in this allocation; the exit status (see the module's docstring)."""
    job = read_job_environment()
    if job.job_id is None:
        raise ValueError("hpc-elastic-run --mode=ps runs inside a Slurm allocation (no SLURM_JOB_ID)")
    job_dir = JobDir.of(config.ckpt_root, job.job_name or "ps", job.job_id, job.array_task_id).prepare()
    signal.signal(signal.SIGTERM, _terminate)  # a cancel or the time limit: stop the steps on the way out
    with PsJob(
        config.job_config(),
        job_dir.ps,
        checkpoint_dir=job_dir.checkpoints,
        checkpoint_every=CHECKPOINT_EVERY,
        launcher=PsLauncher.SRUN,
        cpus_per_process=config.cpus_per_worker,
    ) as ps_job:
        status = ps_job.wait(timeout=WAIT_S)
    text = json.dumps(status)
    atomic_write_bytes(job_dir.ps / "status.json", text.encode())
    print(text, flush=True)
    good = status["finished"] and all(e["exactly_once"] for e in status["epochs"])
    return 0 if good else 1


def main(argv: Sequence[str]) -> int:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        print(f"hpc-elastic-run: error: {exc}", file=sys.stderr)
        return 2
    return run(config)
