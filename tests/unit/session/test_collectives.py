"""Every Collective method on two real processes, for torch.distributed (gloo), MPI (mpi4py) and Horovod."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.session.launch import horovod_unavailable_reason, launch, mpi_unavailable_reason

PROBE = Path(__file__).with_name("collective_probe.py")
MPI_REASON = mpi_unavailable_reason()
HVD_REASON = horovod_unavailable_reason()


def expected(rank: int) -> dict[str, Any]:
    m = 2
    return {
        "rank": rank,
        "world": m,
        "bcast_root0": {"from": 0, "kind": "dict"},
        "bcast_last": [1, "x"],
        "gather_last": ["rank0", {"r": 1}] if rank == 1 else None,
        "allgather": [[0, "t"], [1, "t"]],
        "max": 100,
        "max_negative": -(2**40),
        "tensor": [[0.5, 0.0], [1.5, 7.0], [10.5, -1.0], [11.5, 7.0]],
        "tensor_dtype": "torch.float32",
        "bf16": [[0.25, 0.25, 0.25], [1.25, 1.25, 1.25]],
    }


def probe(backend: str, tmp_path: Path) -> None:
    run = launch(backend, 2, tmp_path / "job", [], workers=2, logs=tmp_path, script=PROBE)
    codes = run.wait()
    assert codes == [0] * len(codes), "\n".join(run.outputs)
    docs = [json.loads((tmp_path / "job" / f"probe-{r}.json").read_text()) for r in range(2)]
    for doc in docs:
        # JSON turns tuples into lists; compare in that form
        assert doc == json.loads(json.dumps(expected(doc["rank"])))


def test_torch_gloo(tmp_path: Path) -> None:
    probe("torch", tmp_path)


@pytest.mark.skipif(MPI_REASON is not None, reason=f"MPI unavailable: {MPI_REASON}")
def test_mpi(tmp_path: Path) -> None:
    probe("mpi", tmp_path)


@pytest.mark.skipif(HVD_REASON is not None, reason=str(HVD_REASON))
def test_horovod(tmp_path: Path) -> None:
    probe("horovod", tmp_path)
