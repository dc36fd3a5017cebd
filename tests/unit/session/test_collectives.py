"""Every Collective method on two real processes, for torch.distributed (gloo), MPI (mpi4py) and Horovod."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.session.launch import HVD_REASON, MPI_REASON, REPO, launch

PROBE = Path(__file__).with_name("collective_probe.py")


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
    assert run.wait() == 0, "\n".join(run.outputs)
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


CLOSE_PROBE = """
import json, os, sys, time
import torch
from hpc_elastic.est.groups import TorchCollective

def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except FileNotFoundError:  # a thread that just ended
            pass
    return sorted(n for n in names if "gloo" in n)

def gloo_threads_after_close():
    # a joined thread can still be listed for a moment while the kernel finishes its exit; a group that was not
    # freed keeps its threads until the process ends
    deadline = time.monotonic() + 10
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return gloo_threads()

def gloo_threads_opened():
    # the group's threads name themselves once they run: on a loaded machine that can come a moment after init
    deadline = time.monotonic() + 10
    while not gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return gloo_threads()

coll = TorchCollective(rank=0, world_size=1)
opened = gloo_threads_opened()
model = torch.nn.Linear(3, 1)
torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo, hence torch.distributed.nn
coll.allgather_tensor(torch.ones(1, 3))
coll.close()
print(json.dumps({"opened": opened, "after_close": gloo_threads_after_close()}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to list the process's threads")
def test_torch_close_joins_gloo_threads_even_after_torch_dynamo_is_imported() -> None:
    """close() must really free the default group: a gloo thread left alive at interpreter exit can abort the
    process (see collective._import_before_init_process_group)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "HPC_ELASTIC_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-c", CLOSE_PROBE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["opened"], "no gloo thread seen while the group was open: the probe cannot tell anything"
    assert doc["after_close"] == [], doc
