"""The one module that reads environment variables.

Everything else in hpc-elastic receives these values as arguments or through the frozen
:class:`Environment` built here, so that library code stays testable and free of hidden inputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GPFS_ROOT = Path("/tmp/hpc-elastic/gpfs")  # noqa: S108 - the dev cluster's stand-in for GPFS
DEFAULT_SLURM_TIMEOUT_S = 30.0
SLURM_BACKENDS = ("auto", "cli", "pyslurm")


@dataclass(frozen=True)
class Environment:
    """Settings that come from the process environment."""

    gpfs_root: Path = DEFAULT_GPFS_ROOT
    slurm_backend: str = "auto"
    slurm_timeout_s: float = DEFAULT_SLURM_TIMEOUT_S
    slurm_conf: Path | None = None
    profile_dir: Path | None = None
    est_spec: Path | None = None
    est_rank: int | None = None


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def _rank(raw: str | None) -> int | None:
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"HPC_ELASTIC_EST_RANK must be a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"HPC_ELASTIC_EST_RANK must be a non-negative integer, got {raw!r}")
    return value


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Build an :class:`Environment` from ``environ`` (``os.environ`` when omitted).

    Recognised variables:

    - ``HPC_ELASTIC_GPFS``: directory standing for the site's shared filesystem.
    - ``HPC_ELASTIC_SLURM_BACKEND``: ``auto`` (default), ``cli`` or ``pyslurm``.
    - ``HPC_ELASTIC_SLURM_TIMEOUT``: seconds one Slurm command may take (default 30).
    - ``HPC_ELASTIC_PROFILES``: directory of model profiles (default: ``profiles/`` of the source checkout).
    - ``HPC_ELASTIC_EST_SPEC``: run spec of an EST job process (set by ``hpc_elastic.est.launch``).
    - ``HPC_ELASTIC_EST_RANK``: process rank of that job (gloo launches; MPI and Horovod know their own).
    - ``SLURM_CONF``: Slurm's own variable, read only to report which configuration is in use.
    """
    env = os.environ if environ is None else environ
    backend = env.get("HPC_ELASTIC_SLURM_BACKEND", "auto").strip().lower() or "auto"
    if backend not in SLURM_BACKENDS:
        raise ValueError(f"HPC_ELASTIC_SLURM_BACKEND must be one of {', '.join(SLURM_BACKENDS)}, got {backend!r}")
    timeout_raw = env.get("HPC_ELASTIC_SLURM_TIMEOUT")
    timeout = (
        DEFAULT_SLURM_TIMEOUT_S if timeout_raw is None else _positive_float("HPC_ELASTIC_SLURM_TIMEOUT", timeout_raw)
    )
    gpfs = env.get("HPC_ELASTIC_GPFS")
    conf = env.get("SLURM_CONF")
    return Environment(
        gpfs_root=Path(gpfs) if gpfs else DEFAULT_GPFS_ROOT,
        slurm_backend=backend,
        slurm_timeout_s=timeout,
        slurm_conf=Path(conf) if conf else None,
        profile_dir=Path(env["HPC_ELASTIC_PROFILES"]) if env.get("HPC_ELASTIC_PROFILES") else None,
        est_spec=Path(env["HPC_ELASTIC_EST_SPEC"]) if env.get("HPC_ELASTIC_EST_SPEC") else None,
        est_rank=_rank(env.get("HPC_ELASTIC_EST_RANK")),
    )


def child_environment(overrides: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: this process's environment with ``overrides`` applied."""
    base = dict(os.environ if environ is None else environ)
    base.update(overrides)
    return base
