"""Horovod's elastic mode (hpc_elastic.hvd_elastic) with real processes under ``horovodrun``.

The example trainer runs with ``--horovod-elastic`` on two processes; once its first durable checkpoint (step 10)
exists, either the host-discovery script reports one slot fewer (Horovod removes a worker at the next commit) or
one worker is killed with SIGKILL (the survivor's collective fails mid-step; it goes back to its last in-memory
commit).  Either way the survivor goes on alone, without a restart.  N = 2 logical workers throughout: the final
parameters must be the bits of the uninterrupted one-process run, every (step, logical worker) pair trained on the
same samples (exactly once after a removal; the step in flight is done again after a kill).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.comm import local_communicator
from hpc_elastic.est.plan import Placement
from hpc_elastic.session import Session
from tests.unit.session.launch import EXAMPLE, HVD_REASON, base_env, launch, read_traces

N = 2
ARGS = ["--steps", "40", "--dataset", "48", "--batch", "4"]


def horovodrun() -> str:
    found = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    if not Path(found).exists():
        pytest.skip("horovodrun not found")
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[tuple[int, int], list[int]]]:
    """The uninterrupted one-process run (MPI backend, one process under mpirun; any backend gives these bits):
    final sha256 and the samples of every (step, logical worker)."""
    if HVD_REASON is not None:
        pytest.skip(HVD_REASON)
    work = tmp_path_factory.mktemp("reference")
    trace = work / "trace"
    run = launch("mpi", 1, work / "job", [*ARGS, "--trace", str(trace)], workers=N, logs=work)
    assert run.wait() == 0, "\n".join(run.outputs)
    plan = {(r["step"], r["worker"]): r["indices"] for r in read_traces(trace)}
    return str(run.result()["sha256"]), plan


def run_elastic(tmp_path: Path, hosts: str, on_first_checkpoint: Callable[[Path, Path], object]) -> tuple[str, Path]:
    """train_mlp --horovod-elastic under horovodrun on ``hosts`` (the discovery script's answer, changeable through
    the file passed to the callback); ``on_first_checkpoint(job_dir, hosts_file)`` runs once step 10 is durable.
    Returns horovodrun's output and the job directory."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    job = tmp_path / "job"

    def watch() -> None:
        deadline = time.monotonic() + 150
        while not (job / "checkpoints" / "ckpt-000000000010").is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        on_first_checkpoint(job, hosts_file)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    argv = [
        horovodrun(),
        *("-np", "2", "--min-np", "1", "--max-np", "2"),
        *("--host-discovery-script", str(discover), "--network-interface", "lo", "--gloo"),
        *(sys.executable, str(EXAMPLE), *ARGS, "--step-delay", "0.2", "--ckpt-every", "10", "--horovod-elastic"),
        *("--trace", str(tmp_path / "trace"), "--result", str(tmp_path / "result.json")),
    ]
    env = {**base_env(), "HPC_ELASTIC_JOB_DIR": str(job), "HPC_ELASTIC_WORKERS": str(N)}
    env["HPC_ELASTIC_BACKEND"] = "horovod"
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
    watcher.join(timeout=5)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    return log, job


def check_result(tmp_path: Path, job: Path, sha256: str) -> None:
    got: dict[str, Any] = json.loads((tmp_path / "result.json").read_text())
    assert (got["step"], got["stopped"], got["world_size"], got["membership_changes"]) == (40, False, 1, 1), got
    assert got["sha256"] == sha256
    for step in (10, 20, 30):  # the durable checkpoints, before and after the change
        assert (job / "checkpoints" / f"ckpt-{step:012d}").is_dir()


@pytest.mark.skipif(HVD_REASON is not None, reason=str(HVD_REASON))
def test_worker_removed_mid_run_the_survivor_goes_on_with_the_same_bits(
    tmp_path: Path, reference: tuple[str, dict[tuple[int, int], list[int]]]
) -> None:
    sha256, plan = reference
    log, job = run_elastic(tmp_path, "localhost:2\n", lambda _job, hosts: hosts.write_text("localhost:1\n"))
    assert "has been removed from elastic job" in log  # Horovod took a worker away mid-run
    check_result(tmp_path, job, sha256)
    records = read_traces(tmp_path / "trace")
    pairs = Counter((r["step"], r["worker"]) for r in records)
    assert set(pairs) == set(plan) and set(pairs.values()) == {1}  # no step lost, none done twice
    assert all(r["indices"] == plan[(r["step"], r["worker"])] for r in records)


def second_local_host() -> str:
    """This machine's host name, when it resolves to a local address: a second 'host' that Horovod starts
    locally (a failed host is blacklisted, so the survivor must sit on another one)."""
    network = importlib.import_module("horovod.runner.util.network")  # Horovod is optional: not at the top
    name = socket.gethostname()
    if name == "localhost" or network.resolve_host_address(name) not in network.get_local_host_addresses():
        pytest.skip(f"the host name {name!r} does not resolve to a local address")
    return name


@pytest.mark.skipif(HVD_REASON is not None, reason=str(HVD_REASON))
def test_worker_killed_mid_run_the_survivor_rolls_back_and_goes_on_with_the_same_bits(
    tmp_path: Path, reference: tuple[str, dict[tuple[int, int], list[int]]]
) -> None:
    other = second_local_host()
    sha256, plan = reference
    killed: list[int] = []

    def kill_the_other(job: Path, _hosts: Path) -> None:
        time.sleep(0.5)  # mid-step, after the commit of step 10
        markers = (f"HOROVOD_HOSTNAME={other}".encode(), f"HPC_ELASTIC_JOB_DIR={job}".encode())
        for entry in Path("/proc").iterdir():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
            except OSError:
                continue
            if all(m in environ for m in markers):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))

    log, job = run_elastic(tmp_path, f"localhost:1\n{other}:1\n", kill_the_other)
    assert killed, log
    check_result(tmp_path, job, sha256)
    records = read_traces(tmp_path / "trace")
    pairs = Counter((r["step"], r["worker"]) for r in records)
    assert set(pairs) == set(plan)  # no step lost
    redone = {step for (step, _), count in pairs.items() if count > 1}
    assert len(redone) <= 1 and all(step > 10 for step in redone)  # only the step in flight, after the last commit
    assert all(r["indices"] == plan[(r["step"], r["worker"])] for r in records)


def test_rebind_follows_the_new_group_and_refuses_what_would_lose_state(tmp_path: Path) -> None:
    session = Session.local(tmp_path, num_workers=2)
    model = torch.nn.Linear(2, 1)
    state = session.state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.contexts[0].extra["rng"] = 7
    contexts = state.local_contexts()
    store = CheckpointStore(tmp_path / "other", session.comm.collective)
    comm = local_communicator()
    with pytest.raises(ValueError, match=r"no context for ESTs \[1\]"):
        state.rebind(comm, Placement.contiguous(2, 1), {0: contexts[0]}, store)
    with pytest.raises(ValueError, match="placement has 4 ESTs, the job has 2"):
        state.rebind(comm, Placement.contiguous(4, 1), contexts, store)
    assert state.comm is session.comm  # a refused rebind changes nothing
    state.rebind(comm, Placement.contiguous(2, 1), contexts, store)
    assert state.contexts[0].extra == {"rng": 7} and state.store is store and state.comm is comm

    session.rebind(comm)
    assert (session.rank, session.world_size, list(session.workers)) == (0, 1, [0, 1])
    assert session.checkpoint_store() is not store  # a new store on the new group

    busy = Session.local(tmp_path / "async", num_workers=2)
    busy_state = busy.state(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="async")
    busy_state.commit()  # in flight until wait()
    with pytest.raises(HpcElasticError, match="in flight"):
        busy.rebind(comm)
    busy.close()
