"""Horovod's elastic mode (hpc_elastic.hvd_elastic) with real processes under ``horovodrun``.

The example trainer runs with ``--horovod-elastic`` on two slots of this host; once its first durable checkpoint
(step 10) exists, the host-discovery script reports one slot, Horovod removes a worker and the survivor goes on
alone, without a restart.  N = 2 logical workers throughout: the final parameters must be the bits of the
uninterrupted one-process run, every (step, logical worker) pair trained exactly once on the same samples.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.collective import LocalCollective
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.session import Session
from hpc_elastic.workers import WorkerAssignment
from tests.unit.session.launch import EXAMPLE, base_env, horovod_unavailable_reason, launch, read_traces

N = 2
ARGS = ["--steps", "40", "--dataset", "44", "--batch", "4"]
HVD_REASON = horovod_unavailable_reason()


def horovodrun() -> str:
    found = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    if not Path(found).exists():
        pytest.skip("horovodrun not found")
    return found


@pytest.mark.skipif(HVD_REASON is not None, reason=str(HVD_REASON))
def test_worker_removed_mid_run_the_survivor_goes_on_with_the_same_bits(tmp_path: Path) -> None:
    ref_trace = tmp_path / "ref-trace"
    ref_run = launch("torch", 1, tmp_path / "ref", [*ARGS, "--trace", str(ref_trace)], workers=N, logs=tmp_path)
    assert ref_run.wait() == [0], "\n".join(ref_run.outputs)
    reference = ref_run.result()
    plan = {(r["step"], r["worker"]): r["indices"] for r in read_traces(ref_trace)}

    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    job, trace, result = tmp_path / "job", tmp_path / "trace", tmp_path / "result.json"
    first_checkpoint = job / "checkpoints" / "ckpt-000000000010"

    def remove_a_slot() -> None:
        deadline = time.monotonic() + 150
        while not first_checkpoint.is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        hosts.write_text("localhost:1\n")

    shrink = threading.Thread(target=remove_a_slot, daemon=True)
    shrink.start()
    argv = [
        horovodrun(),
        *("-np", "2", "--min-np", "1", "--max-np", "2"),
        *("--host-discovery-script", str(discover), "--network-interface", "lo", "--gloo"),
        *(sys.executable, str(EXAMPLE), *ARGS, "--step-delay", "0.2", "--ckpt-every", "10"),
        *("--horovod-elastic", "--trace", str(trace), "--result", str(result)),
    ]
    env = base_env(job, N, "horovod")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
    shrink.join(timeout=5)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "has been removed from elastic job" in log  # Horovod took a worker away mid-run

    got: dict[str, Any] = json.loads(result.read_text())
    assert (got["step"], got["stopped"], got["world_size"], got["membership_changes"]) == (40, False, 1, 1), got
    assert got["sha256"] == reference["sha256"]
    records = read_traces(trace)
    pairs = Counter((r["step"], r["worker"]) for r in records)
    assert set(pairs) == set(plan) and set(pairs.values()) == {1}  # no step lost, none done twice
    assert all(r["indices"] == plan[(r["step"], r["worker"])] for r in records)
    assert first_checkpoint.is_dir() and (job / "checkpoints" / "ckpt-000000000030").is_dir()  # durable ones too


def test_rebind_follows_the_new_group_and_refuses_what_would_lose_state(tmp_path: Path) -> None:
    session = Session.local(tmp_path, num_workers=2)
    state = session.state()
    state.workers[0]["rng"] = 7
    store = CheckpointStore(tmp_path / "other", LocalCollective())
    with pytest.raises(ValueError, match="no context for logical workers"):
        state.rebind(store, WorkerAssignment(2, 1, 0), {0: {"rng": 7}})
    with pytest.raises(ValueError, match="must not change"):
        state.rebind(store, WorkerAssignment(4, 1, 0), {w: {} for w in range(4)})
    with pytest.raises(ValueError, match="rank 0 of 2"):
        state.rebind(store, WorkerAssignment(2, 2, 0), {0: {}, 1: {}})
    state.rebind(store, WorkerAssignment(2, 1, 0), {0: {"rng": 7}, 1: {"rng": 8}})
    assert state.workers == {0: {"rng": 7}, 1: {"rng": 8}} and state.store is store

    session.rebind(LocalCollective())
    assert (session.rank, session.world_size, list(session.workers)) == (0, 1, [0, 1])
    assert session.store is not store  # a new store on the new group

    busy = Session.local(tmp_path / "async", num_workers=2)
    busy.state(mode="async").commit()  # in flight until wait()
    with pytest.raises(HpcElasticError, match="in flight"):
        busy.rebind(LocalCollective())
    busy.close()
