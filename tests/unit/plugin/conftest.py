"""Inputs built from output captured on the dev cluster (tests/data/slurm-22.05), parsed by the adapter."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from hpc_elastic.slurm import Job, Node
from hpc_elastic.slurm.parse import parse_sinfo_json, parse_squeue_json
from slurm_plugin.config import PluginConfig, parse_config

MARK = "hpc-elastic:v=1,workers={n},min={n},max={n},unit=gpu,backend=torch,gpu_type=a100"


def marked(job: Job, *, elastic_min: int | None = None) -> Job:
    n = job.gpu_count
    comment = MARK.format(n=n)
    if elastic_min is not None:
        comment = comment.replace(f"min={n}", f"min={elastic_min}")
    return replace(job, comment=comment)


@pytest.fixture
def busy(slurm_data: Path) -> tuple[list[Job], list[Node]]:
    """Job 24 runs on all 8 a100 GPUs (node1, node2), job 25 waits for one; both marked as managed."""
    jobs = parse_squeue_json((slurm_data / "squeue_pending.json").read_text())
    nodes = parse_sinfo_json((slurm_data / "sinfo_busy.json").read_text())
    return [marked(j) if j.job_id in (24, 25) else j for j in jobs], nodes


def start_of(jobs: list[Job], job_id: int) -> datetime:
    start = next(j for j in jobs if j.job_id == job_id).start_time
    assert start is not None
    return start


def at(moment: datetime, seconds: float) -> float:
    return (moment + timedelta(seconds=seconds)).timestamp()


def config(tmp_path: Path, **sections: object) -> PluginConfig:
    return parse_config({"state_dir": str(tmp_path), "ckpt_roots": [str(tmp_path / "jobs")], **sections})
