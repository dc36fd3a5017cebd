"""The body of a ps-mode batch job (``hpc-elastic-run --mode=ps ...``, written by ``hpc-elastic submit --mode ps``):
inside the allocation it starts the job master, the parameter servers and the workers, each as a job step of its
own (:class:`hpc_elastic.ps.job.PsJob` with the ``srun`` launcher), watches them until training ends and leaves the
master's final status in the job directory (``<job dir>/ps/status.json``, and on stdout, the job's output).

The job directory is the one of every hpc-elastic job (:class:`hpc_elastic.jobdir.JobDir`): the processes' logs and
addresses in ``ps/``, the PS job's checkpoints in ``checkpoints/``, taken every :data:`CHECKPOINT_EVERY` shards
done, from which a lost parameter server is recovered in the running job.

    hpc-elastic-run --mode=ps --ckpt-root=DIR --workers-range=A:B --ps-range=C:D [--cpus-per-worker=N]
                    [--grace=S] [--ps-config=JSON]

The allocation holds room for the job master, D PS and B workers, N cores each. With fixed sizes (``A == B`` and
``C == D``) the job runs C parameter servers and B workers. With a range to choose from, DLRover's Brain chooses
(:class:`hpc_elastic.ps.brain_agent.BrainAgent`, beside the job master): it starts the job with its sample plan,
then applies its optimize and adjust plans as new steps, never beyond the ``(B + D) · N`` cores of the allocation
that the master does not hold, each process of at most N cores (the allocation's task size, so that a step always
fits a node of it); its steps go into the status (``brain``). Exit status: 0 when training finished with every
sample counted exactly once per epoch, 1 otherwise.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_elastic.env import read_job_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.files import atomic_write_bytes
from hpc_elastic.jobdir import JobDir
from hpc_elastic.launch.spec import parse_range, ps_job_config
from hpc_elastic.policy.brain import JobLimits, Range
from hpc_elastic.ps.brain_agent import BrainAgent
from hpc_elastic.ps.config import STEP_MEM_MB_PER_CPU, PsJobConfig
from hpc_elastic.ps.job import PsJob, PsLauncher

#: the PS job checkpoints parameters, queues and ledger after every this many shards done
CHECKPOINT_EVERY = 8
#: the wrapper waits this long for training to end (the job's time limit ends it first)
WAIT_S = 7 * 24 * 3600.0
#: seconds Brain lets a plan warm up, then reads it over
BRAIN_WINDOW_S = 2.0


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

    @property
    def cores(self) -> int:
        """The cores of the allocation beside the job master's."""
        return (self.workers_range[1] + self.ps_range[1]) * self.cpus_per_worker

    def brain(self) -> BrainAgent | None:
        """Brain for a job with sizes to choose (a range of workers or of PS), else None."""
        (w_lo, w_hi), (p_lo, p_hi) = self.workers_range, self.ps_range
        if w_lo == w_hi and p_lo == p_hi:
            return None
        config = self.job_config()
        steps = config.epochs * -(-config.num_samples // config.batch_size)
        limits = JobLimits(c_total=self.cores, workers=Range(w_lo, w_hi), ps=Range(p_lo, p_hi), total_steps=steps)
        return BrainAgent(
            limits,
            cores=self.cores,
            cores_per_node=self.cpus_per_worker,
            mem_per_node_mb=STEP_MEM_MB_PER_CPU * self.cpus_per_worker,
            window_s=BRAIN_WINDOW_S,
        )


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
    job_config, ps_cpus = config.job_config(), None
    agent = config.brain()
    if agent is not None:
        first = agent.initial_plan()
        job_config, ps_cpus = replace(job_config, num_ps=first.num_ps, num_workers=0), first.ps_cores[0]
    with PsJob(
        job_config,
        job_dir.ps,
        checkpoint_dir=job_dir.checkpoints,
        checkpoint_every=CHECKPOINT_EVERY,
        launcher=PsLauncher.SRUN,
        cpus_per_process=config.cpus_per_worker,
        ps_cpus=ps_cpus,
    ) as ps_job:
        if agent is not None:
            try:
                agent.run(ps_job)
            except (ValueError, HpcElasticError) as exc:  # Brain cannot go on here: train on with what runs
                print(f"hpc-elastic-run: Brain stopped: {exc}", file=sys.stderr, flush=True)
                if not ps_job.workers:
                    ps_job.add_worker()
        status = ps_job.wait(timeout=WAIT_S)
    if agent is not None:
        status["brain"] = agent.report()
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
