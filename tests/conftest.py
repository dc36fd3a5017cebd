"""Shared pytest configuration.

Integration tests (``-m integration``) run against the local dev cluster brought up by
``scripts/dev-cluster up``. Where no cluster answers they skip with the reason, unless
``HPC_ELASTIC_REQUIRE_CLUSTER=1`` (set by ``make test`` and CI), where they fail instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_elastic.collective import Backend
from hpc_elastic.launch.workers import unavailable_reason

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that stop Slurm daemons run last, so that they cannot disturb the others.
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)


@pytest.fixture(scope="session")
def slurm_data() -> Path:
    return DATA / "slurm-22.05"


def require_cluster() -> bool:
    return os.environ.get("HPC_ELASTIC_REQUIRE_CLUSTER") == "1"


def require_horovod() -> None:
    """Skip when Horovod is not installed (``scripts/build-horovod`` builds it), unless
    ``HPC_ELASTIC_REQUIRE_HOROVOD=1`` (set by ``make test``): then its absence is a failure."""
    reason = unavailable_reason(Backend.HOROVOD)
    if reason is not None:
        message = f"Horovod cannot run here: {reason}"
        if os.environ.get("HPC_ELASTIC_REQUIRE_HOROVOD") == "1":
            pytest.fail(message)
        pytest.skip(message)
