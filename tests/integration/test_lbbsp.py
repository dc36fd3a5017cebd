"""EST mode on the dev cluster: ``hpc-elastic submit --balance est`` of the bundled example with 4 worker processes
(one srun step) for N = 8 ESTs on the CPU partition, one process slowed by a CPU quota.  The balancer must move ESTs
off the slowed process (read from the job's log and its RESULT) and the final parameters must equal those of the same
job run unslowed with ``--balance none`` (no EST ever moves there).

How the process is slowed, in order of preference (the test prints which it used):
1. cgroup v1: a group under ``/sys/fs/cgroup/cpu`` with ``cpu.cfs_quota_us`` = 5 ms per 100 ms period, the worker's
   pid written to its ``cgroup.procs`` (this machine, as root) while it still imports. A quota binds only a process
   that asks for more CPU than it grants. With the example's default width (32) an EST took ~1 ms of CPU per step:
   the slowed process's steps often fit in a period's 5 ms, and on a loaded machine (CI runs three test sessions at
   once, the reference job beside this one) the other processes' readings were as slow, so Alg. 2 saw noise,
   switched to its fine phase and at times moved nothing in 60 steps. ``--hidden 1024`` makes an EST ~7 ms of CPU per
   step (measured here), more than the quota grants even with one EST: measured with three busy loops beside the
   test (5 runs), the slowed process read 209-277 ms per step against 20.7-28.4 ms, and the first reading pair moved
   an EST off it;
2. cgroup v2: the same with ``cpu.max`` = ``5000 100000`` in a group of the unified hierarchy;
3. neither writable: no quota at all, the example's own ``--slow-rank 3 --slow-ms 60`` (a sleep inside each EST of
   rank 3).  Only the first two are a CPU quota; the third still exercises the balancer and the hand-over."""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.slurm import CliSlurm
from tests.conftest import REPO
from tests.integration.conftest import hpc_submit, processes_with, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cpu_lane]
EXAMPLE = REPO / "hpc_elastic" / "est" / "example.py"
COMMON = ("--gpus=0", "--procs=4", "--workers=8", "--partition=cpu")
ARGS = ("--steps=60", "--dataset-size=1024", "--batch-size=32", "--hidden=1024", "--loader-workers=0")
SLOWED = 3
V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US, QUOTA_US = 100_000, 5_000


@dataclass
class Quota:
    """A CPU-quota cgroup the test made (``kind``: ``v1`` or ``v2``), to put a process in."""

    kind: str
    path: Path

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone already
                parent.write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def make_quota() -> Quota | None:
    """A cgroup limited to 5 % of one CPU, or None when neither hierarchy is writable here."""
    name = f"hpc-elastic-test-{uuid.uuid4().hex[:8]}"
    if (V1 / "cpu.cfs_quota_us").exists() and os.access(V1, os.W_OK):
        path = V1 / name
        with contextlib.suppress(OSError):
            path.mkdir()
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
            return Quota("v1", path)
        with contextlib.suppress(OSError):
            path.rmdir()
    if (V2 / "cgroup.controllers").exists() and os.access(V2, os.W_OK):
        path = V2 / name
        with contextlib.suppress(OSError):
            path.mkdir()
            (path / "cpu.max").write_text(f"{QUOTA_US} {PERIOD_US}")
            return Quota("v2", path)
        with contextlib.suppress(OSError):
            path.rmdir()
    return None


@pytest.fixture
def quota() -> Iterator[Quota | None]:
    made = make_quota()
    yield made
    if made is not None:
        made.remove()


def result_of(output: Path) -> dict[str, Any] | None:
    try:
        text = output.read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"^RESULT (\{.*\})$", text, re.MULTILINE)
    return json.loads(found[1]) if found else None


def worker_pid(job_dir: Path, rank: int) -> int | None:
    for pid in processes_with(f"HPC_ELASTIC_JOB_DIR={job_dir}", f"SLURM_PROCID={rank}"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("python"):
                return pid
    return None


def test_est_mode_moves_ests_off_a_cpu_limited_worker_and_keeps_the_bits(
    slurm: CliSlurm, workdir: Path, cleanup: list[int], quota: Quota | None
) -> None:
    slowing = () if quota is not None else (f"--slow-rank={SLOWED}", "--slow-ms=60")
    how = f"a cgroup {quota.kind} CPU quota of {100 * QUOTA_US // PERIOD_US} %" if quota else "a sleep"
    print(f"slowing rank {SLOWED} by {how}")
    reference = hpc_submit(workdir, EXAMPLE, *COMMON, "--balance=none", "--job-name=it-lb-ref", args=ARGS)
    cleanup.append(reference)
    balanced = hpc_submit(workdir, EXAMPLE, *COMMON, "--balance=est", "--job-name=it-lb-est", args=(*ARGS, *slowing))
    cleanup.append(balanced)
    if quota is not None:
        pid = wait_for("worker rank 3 of the EST-mode job", lambda: worker_pid(workdir / f"it-lb-est-{balanced}", 3))
        quota.add(pid)

    out = workdir / f"it-lb-est-{balanced}.out"
    result = wait_for("the EST-mode job's result", lambda: result_of(out), timeout_s=300)
    expected = wait_for("the reference job's result", lambda: result_of(workdir / f"it-lb-ref-{reference}.out"), 300)
    log = out.read_text(errors="replace")
    moves = re.findall(
        r"balance est: step (\d+): EST ([\d,]+) from process (\d) to (\d); .*\(ms per step: ([\d., ]+)\)", log
    )
    print(f"EST mode: {len(moves)} moves {moves}; final placement {result['placement']}")

    assert (result["balance"], result["world_size"], result["num_workers"]) == ("est", 4, 8)
    assert expected["balance"] == "none" and expected["rebalances"] == []
    assert moves and moves[0][2] == str(SLOWED), moves  # the first move takes an EST off the slowed process
    for _, _, source, dest, readings in moves:  # each move: from the slowest process of its readings to the fastest
        ms = [float(x) for x in readings.split(",")]  # logged to 0.1 ms: two processes can tie there
        assert (ms[int(source)], ms[int(dest)]) == (max(ms), min(ms)), (source, dest, readings)
    assert [m[0] for m in moves] == [str(step) for step, _ in result["rebalances"]]
    assert result["step"] == 60 and result["params_sha256"] == expected["params_sha256"]
    assert result["state_sha256"] == expected["state_sha256"]
