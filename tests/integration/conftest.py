"""Fixtures for tests against the local dev cluster (``scripts/dev-cluster up``)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from hpc_elastic.env import Environment, read_environment
from hpc_elastic.slurm import CliSlurm, RetryPolicy, Runner, SlurmError, connect
from tests.conftest import REPO, require_cluster

T = TypeVar("T")
DEV_CLUSTER = REPO / "scripts" / "dev-cluster"


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 90.0, every_s: float = 0.5) -> T:
    """Poll ``probe`` until it returns a truthy value; fail the test (not hang) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


@pytest.fixture(scope="session")
def slurm() -> CliSlurm:
    client = connect(Environment(slurm_backend="cli"), Runner(timeout_s=20.0, retry=RetryPolicy(3, 0.5, 2.0)))
    try:
        client.ping()
        client.nodes()
    except SlurmError as exc:
        message = f"no dev cluster answers ({exc}); run scripts/dev-cluster up"
        if require_cluster():
            pytest.fail(message)
        pytest.skip(message)
    return client


@pytest.fixture
def workdir() -> Path:
    """A fresh directory on the shared filesystem (the GPFS stand-in), visible to every node."""
    path = read_environment().gpfs_root / "tests" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def submitted(slurm: CliSlurm) -> Iterator[list[int]]:
    """Job ids a test submits; they are cancelled when it ends."""
    ids: list[int] = []
    yield ids
    if ids:
        with contextlib.suppress(SlurmError):
            slurm.cancel(ids)
