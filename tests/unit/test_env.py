from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpc_elastic.env import DEFAULT_GPFS_ROOT, child_environment, read_environment, read_job_environment


def test_defaults_and_overrides() -> None:
    env = read_environment({})
    assert env.gpfs_root == DEFAULT_GPFS_ROOT and env.slurm_backend == "auto" and env.slurm_timeout_s == 30.0
    env = read_environment(
        {
            "HPC_ELASTIC_GPFS": "/gpfs/x",
            "HPC_ELASTIC_SLURM_BACKEND": "CLI",
            "HPC_ELASTIC_SLURM_TIMEOUT": "5",
            "SLURM_CONF": "/etc/slurm/slurm.conf",
        }
    )
    assert env.gpfs_root == Path("/gpfs/x") and env.slurm_backend == "cli" and env.slurm_timeout_s == 5.0
    assert env.slurm_conf == Path("/etc/slurm/slurm.conf")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("HPC_ELASTIC_SLURM_BACKEND", "rest", "must be one of auto, cli, pyslurm, got 'rest'"),
        ("HPC_ELASTIC_SLURM_TIMEOUT", "soon", "must be a number of seconds, got 'soon'"),
        ("HPC_ELASTIC_SLURM_TIMEOUT", "-1", "must be a number of seconds in (0, 86400], got '-1'"),
        ("HPC_ELASTIC_SLURM_TIMEOUT", "1e400", "must be a number of seconds in (0, 86400], got '1e400'"),
        ("HPC_ELASTIC_SLURM_TIMEOUT", "nan", "must be a number of seconds in (0, 86400], got 'nan'"),
        ("HPC_ELASTIC_SLURM_TIMEOUT", "1e12", "must be a number of seconds in (0, 86400], got '1e12'"),
    ],
)
def test_bad_values(key: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        read_environment({key: value})


def test_child_environment() -> None:
    assert child_environment({"TZ": "UTC"}, {"A": "1", "TZ": "x"}) == {"A": "1", "TZ": "UTC"}


def test_the_allocations_memory_on_the_node() -> None:
    assert read_job_environment({"SLURM_MEM_PER_NODE": "8000"}).mem_on_node_mb == 8000
    per_cpu = {"SLURM_MEM_PER_CPU": "2560", "SLURM_CPUS_ON_NODE": "4"}
    assert read_job_environment(per_cpu).mem_on_node_mb == 10240
    assert read_job_environment({"SLURM_MEM_PER_CPU": "2560"}).mem_on_node_mb is None
    with pytest.raises(ValueError, match="SLURM_MEM_PER_NODE must be an integer"):
        read_job_environment({"SLURM_MEM_PER_NODE": "lots"})
