"""``hpc-elastic scale JOBID --workers N --ps M``: ask a running ps-mode job to set its numbers of workers and of
parameter servers. The request goes into the job's directory (:meth:`hpc_elastic.jobdir.JobDir.request_scale`),
where the job's wrapper (:mod:`hpc_elastic.ps.allocation`) applies it with new ``srun`` steps inside the allocation
and answers in ``control/scale-reply.json``. Checked here first, nothing written otherwise: the job is this user's,
running, a ps-mode job (its marker's ranges), and the sizes within its ranges."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.jobdir import JobDir, ScaleRequest, find_job_dir
from hpc_elastic.launch.spec import decode_marker
from hpc_elastic.slurm.client import SlurmClient
from hpc_elastic.slurm.types import JobState


@dataclass(frozen=True)
class ScaleConfig:
    job_id: int
    workers: int | None
    ps: int | None
    roots: tuple[Path, ...]

    def __post_init__(self) -> None:
        if self.job_id < 1:
            raise ValueError(f"job id must be positive, got {self.job_id}")
        if self.workers is None and self.ps is None:
            raise ValueError("give --workers, --ps or both")
        for what, value in (("--workers", self.workers), ("--ps", self.ps)):
            if value is not None and value < 1:
                raise ValueError(f"{what} must be at least 1, got {value}")


def request_scale(slurm: SlurmClient, config: ScaleConfig, *, uid: int, now: float) -> JobDir:
    """Write the scale request into the job's directory after the checks above (``ValueError`` naming what is
    wrong, nothing written); the job's directory."""
    job = slurm.job(config.job_id)
    if job.user_id is not None and job.user_id != uid:
        raise ValueError(f"job {config.job_id} is {job.user}'s, not yours")
    if job.state is not JobState.RUNNING:
        raise ValueError(f"job {config.job_id} is {job.state.value}: only a running job scales")
    marker = decode_marker(job.comment)
    if marker is None or marker.ps is None:
        raise ValueError(f"job {config.job_id} is not a ps-mode job (hpc-elastic submit --mode ps)")
    marker.ps.check_scale(config.workers, config.ps)
    job_dir = find_job_dir(config.roots, job.name, job.job_id, uid)
    if job_dir is None:
        raise ValueError(f"no directory of job {config.job_id} of yours under {', '.join(map(str, config.roots))}")
    job_dir.request_scale(ScaleRequest(config.workers, config.ps, now))
    return job_dir
