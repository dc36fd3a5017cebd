"""Fixtures for tests against the local dev cluster (``scripts/dev-cluster up``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TypeVar

import pytest

from hpc_elastic.env import Environment, read_environment
from hpc_elastic.files import wait_for_lock
from hpc_elastic.slurm import CliSlurm, JobState, RetryPolicy, Runner, SlurmError, connect
from hpc_elastic.slurm.parse import parse_key_values
from slurm_plugin.scenario import cancel_active
from tests.conftest import REPO, require_cluster

T = TypeVar("T")
DEV_CLUSTER = REPO / "scripts" / "dev-cluster"


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 90.0, every_s: float = 0.5) -> T:
    """Poll ``probe`` until it returns a truthy value; fail the test (not hang) after ``timeout_s``, with what the
    cluster showed then (:func:`cluster_snapshot`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{cluster_snapshot()}")
        time.sleep(every_s)


SNAPSHOT = (
    ["squeue", "--all", "--noheader", "--format=%i %j %u %T %r %b %N"],
    ["sinfo", "--Node", "--noheader", "--format=%N %P %T %G %E"],
    ["scontrol", "--oneliner", "show", "reservation"],
)


def cluster_snapshot() -> str:
    """The queue (with each waiting job's reason), the nodes' states and the reservations: why a job a test
    waits for does not start (a node drained or held, a job left running by an earlier test)."""
    parts = []
    for argv in SNAPSHOT:
        try:
            out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=20)
            text = (out.stdout + out.stderr).strip()
        except (OSError, subprocess.SubprocessError) as exc:
            text = str(exc)
        parts.append(f"$ {' '.join(argv)}\n{text}")
    return "\n".join([*parts, *running_outputs()])


def running_outputs(lines: int = 12) -> list[str]:
    """The last ``lines`` lines of each running job's output file: whether a job a test waits on is training,
    stuck or dying (an empty list when scontrol does not answer). scontrol, not squeue: squeue leaves ``%j`` and
    ``%x`` in the path unexpanded."""
    try:
        out = subprocess.run(
            ["scontrol", "--oneliner", "show", "job"], check=False, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return []
    tails = []
    for row in out.stdout.splitlines():
        fields = parse_key_values(row)
        if fields.get("JobState") != "RUNNING" or "StdOut" not in fields:
            continue
        path = fields["StdOut"]
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as exc:
            text = str(exc)
        tails.append(f"$ tail -n {lines} {path}  # job {fields.get('JobId')}\n" + "\n".join(text.splitlines()[-lines:]))
    return tails


TEST_ROOT_NAME = "tests"  # every test job writes its output under <gpfs_root>/tests/<lane>/
SESSION_WAIT_S = 1800.0
#: The lane a test session runs (``scripts/test-lanes`` sets it). Two lanes share the cluster at once: ``cpu`` runs
#: the tests marked ``cpu_lane`` (their jobs use the ``cpu`` partition's nodes only), ``gpu`` every other test but
#: the ``disruptive`` ones. A session without a lane runs any test and has the cluster to itself.
LANE_ENV = "HPC_ELASTIC_TEST_LANE"
LANES = ("cpu", "gpu")


def session_lane() -> str | None:
    lane = os.environ.get(LANE_ENV) or None
    if lane is not None and lane not in LANES:
        raise pytest.UsageError(f"{LANE_ENV} must be one of {', '.join(LANES)}, got {lane!r}")
    return lane


def lane_of(node: pytest.Item | pytest.Collector) -> str:
    """The lane of a test (or of a module's tests): ``cpu`` when marked ``cpu_lane``, else ``gpu``."""
    return "cpu" if node.get_closest_marker("cpu_lane") is not None else "gpu"


def root_of(node: pytest.Item | pytest.Collector) -> Path:
    """Where the jobs of a test (or of a module's fixtures) write: ``<gpfs_root>/tests/<its lane>/``."""
    root = read_environment().gpfs_root / TEST_ROOT_NAME / lane_of(node)
    root.mkdir(parents=True, exist_ok=True)
    return root


def jobs_writing_under(root: Path) -> list[int]:
    """Jobs whose standard output lies under ``root``: at a session's start, those left by an earlier test session
    that was killed before its fixtures could cancel them (slurmctld keeps them across a cluster restart); after a
    refused submission with ``--ckpt-root=root``, a job it should not have submitted (another lane's jobs write
    elsewhere)."""
    out = subprocess.run(
        ["squeue", "--noheader", "--Format=JobID:20,STDOUT:1000"],
        check=True,
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    stale = []
    for line in out.splitlines():
        fields = line.split(None, 1)
        if len(fields) == 2 and Path(fields[1].strip()).is_relative_to(root):
            stale.append(int(fields[0].split("_")[0]))
    return sorted(set(stale))


def _take(lock: IO[str], how: int) -> None:
    if not wait_for_lock(lock, how, SESSION_WAIT_S):
        pytest.fail(f"another test session held {lock.name} for {SESSION_WAIT_S:.0f}s")


@pytest.fixture(scope="session", autouse=True)
def cluster_to_ourselves() -> Iterator[None]:
    """One test session at a time on the dev cluster, or one per lane, starting without stale test jobs.

    Tests count GPUs: a second session on the same cluster (or a blocker left running by a killed one) starves
    the first. The locks are ``flock``s on the shared filesystem; they go with the process that holds them. A
    session without a lane holds ``.session.lock`` alone; a lane's session shares it with the other lane's and
    holds ``.lane-<lane>.lock`` alone. Each cancels the stale jobs under the part of the test root it holds."""
    lane = session_lane()
    test_root = read_environment().gpfs_root / TEST_ROOT_NAME
    test_root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        _take(held.enter_context((test_root / ".session.lock").open("a")), fcntl.LOCK_SH if lane else fcntl.LOCK_EX)
        if lane is not None:
            _take(held.enter_context((test_root / f".lane-{lane}.lock").open("a")), fcntl.LOCK_EX)
        root = test_root / lane if lane is not None else test_root
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            stale = jobs_writing_under(root)
            if stale:
                subprocess.run(["scancel", *map(str, stale)], check=False, timeout=20)
                deadline = time.monotonic() + 120.0
                while jobs_writing_under(root) and time.monotonic() < deadline:
                    time.sleep(1.0)
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A lane's session runs only its own tests: another lane's would share nodes with it, a disruptive one would
    stop Slurm under both. Checked before any fixture of the test is set up."""
    lane = session_lane()
    if lane is None:
        return
    if item.get_closest_marker("disruptive") is not None:
        pytest.fail(f"a disruptive test runs only in a session without a lane (unset {LANE_ENV})")
    if lane_of(item) != lane:
        pytest.fail(f"a {lane_of(item)}-lane test in the {lane} lane's session")


@pytest.fixture(scope="session")
def slurm(cluster_to_ourselves: None) -> CliSlurm:
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
def lane_root(request: pytest.FixtureRequest) -> Path:
    """The test's part of the test root on the shared filesystem (:func:`root_of`)."""
    return root_of(request.node)


@pytest.fixture
def workdir(lane_root: Path) -> Path:
    """A fresh directory on the shared filesystem (the GPFS stand-in), visible to every node."""
    path = lane_root / uuid.uuid4().hex[:12]
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def submitted(slurm: CliSlurm) -> Iterator[list[int]]:
    """Job ids a test submits: those still active are cancelled when it ends, and it waits until they ended."""
    ids: list[int] = []
    yield ids
    left = cancel_active(slurm, ids)
    assert not left, f"jobs {left} still active 120 s after their cancel{chr(10)}{cluster_snapshot()}"


@pytest.fixture
def cleanup(submitted: list[int]) -> list[int]:
    """``submitted``, by the name the runtime stories use."""
    return submitted


def hpc_submit(workdir: Path, script: Path, *options: str, args: tuple[str, ...] = ()) -> int:
    """``hpc-elastic submit SCRIPT OPTIONS -- ARGS`` with job directories under ``workdir``; the job id."""
    out = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "submit", str(script), f"--ckpt-root={workdir}", *options, "--", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return int(out.stdout.strip())


def stop_controller(slurm: CliSlurm) -> None:
    """Stop slurmctld once no job is completing. A step that ends while the controller is away cannot report
    its end; past UnkillableStepTimeout its node is drained ("Kill task failed") for the tests that follow."""
    wait_for(
        "no job completing",
        lambda: not any(job.state is JobState.COMPLETING for job in slurm.jobs()),
        timeout_s=120,
    )
    subprocess.run([str(DEV_CLUSTER), "stop", "slurmctld"], check=True, capture_output=True, timeout=60)


def processes_with(*markers: str) -> list[int]:
    """Processes of this host whose environment holds every one of ``markers`` (``NAME=value`` entries)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(marker.encode() in environ for marker in markers):
            found.append(int(entry.name))
    return found
