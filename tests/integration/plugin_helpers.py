"""Helpers shared by the hpc-elastic-sched integration tests: a test-scoped daemon configuration, ``--once``, and
the states of a job as the tests poll for them."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpc_elastic.slurm import CliSlurm, Job, JobState, SlurmError

# the resize stories' daemon configuration is the library's (make demo's second act writes it too)
from slurm_plugin.grow_story import write_config, write_resize_config

__all__ = ["MARK", "ended", "job_of", "run_once", "running", "write_config", "write_resize_config"]

#: The job comment ``hpc-elastic submit`` writes, for plain ``sbatch`` jobs that the daemon must manage
#: (4 logical workers, not elastic, no job directory: preempted without a checkpoint).
MARK = "hpc-elastic:v=1,workers=4,min=4,max=4,unit=gpu,backend=torch,gpu_type=a100"


def run_once(config: Path, *flags: str) -> dict[str, Any]:
    """``hpc-elastic-sched --once``; the state document it wrote ({} when it wrote none)."""
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli", "--config", str(config), "--once", *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    state = config.parent / "state" / "state.json"
    doc: dict[str, Any] = json.loads(state.read_text()) if state.exists() else {}
    return doc


def job_of(slurm: CliSlurm, job_id: int) -> Job | None:
    """The job as squeue shows it now; None once squeue has forgotten it (or did not answer)."""
    with contextlib.suppress(SlurmError):
        found = slurm.jobs([job_id])
        return found[0] if found else None
    return None


def running(slurm: CliSlurm, job_id: int, restarts: int | None = None) -> Job | None:
    """The job while it runs (after ``restarts`` requeues when given), else None."""
    job = job_of(slurm, job_id)
    # RUNNING only: a job being requeued passes through COMPLETING with its old allocation and the new count
    if job is None or job.state is not JobState.RUNNING or (restarts is not None and job.restart_count != restarts):
        return None
    return job


def ended(slurm: CliSlurm, job_id: int) -> Job | None:
    """The job once it is no longer pending, running or completing, else None."""
    job = job_of(slurm, job_id)
    return job if job is not None and not job.state.is_active else None
