"""sbatch parity of ``hpc-elastic submit`` on the real dev cluster: sbatch accepts every golden batch script, bad
input is one line and exit code 2 with nothing submitted, and a job array runs one job directory per task, a
requeued task resuming from its own checkpoint."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm, Job
from tests.conftest import DATA
from tests.integration.conftest import hpc_submit, jobs_writing_under, wait_for

pytestmark = pytest.mark.integration
STEPPER = DATA / "workers" / "stepper.py"
RESERVATION = "hpc-elastic-test"  # the one tests/data/golden/sbatch_options.sbatch names


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def reservation() -> Iterator[str]:
    """A reservation for the golden script, alive only while the test runs (sbatch --test-only refuses one that
    has not started: "Invalid time specified"). It lasts well past the script's ``--begin=now+1hour``: one that ends
    before the job may begin is "Requested reservation is invalid", as a 60-minute one is a second after it is made."""
    made = run(
        "scontrol", "create", "reservation", f"ReservationName={RESERVATION}", "Users=root", "Nodes=node1,node2",
        "StartTime=now", "Duration=180", "Flags=IGNORE_JOBS",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    try:
        yield RESERVATION
    finally:
        run("scontrol", "delete", f"ReservationName={RESERVATION}")


def test_sbatch_test_only_accepts_every_golden_script(slurm: CliSlurm) -> None:
    assert {"root"} <= slurm.accounts()  # the account and QOS the golden scripts name exist here
    goldens = sorted((DATA / "golden").glob("*.sbatch"))
    assert len(goldens) >= 5
    # the reservation holds the a100 nodes while it exists: the scripts that do not name it are tested without it
    named = [g for g in goldens if f"--reservation={RESERVATION}" in g.read_text()]
    assert named
    for golden in [g for g in goldens if g not in named]:
        check_test_only(golden)
    with reservation():
        for golden in named:
            check_test_only(golden)


def check_test_only(golden: Path) -> None:
    out = run("sbatch", "--test-only", str(golden))
    assert out.returncode == 0, f"{golden.name}: {out.stderr.strip()}"
    assert "to start at" in out.stderr


def submit_cli(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "submit", str(STEPPER), *options],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # the dev cluster does not enforce associations: sbatch itself would charge the default account
        (("--account=no-such-account",), "hpc-elastic: error: --account 'no-such-account': Slurm's accounting has"),
        # sbatch's own refusal, passed through as one line
        (
            ("--reservation=no-such-reservation",),
            "hpc-elastic: error: sbatch: sbatch: error: Batch job submission failed: Requested reservation is invalid",
        ),
        (("--sbatch-arg=--gres=gpu:2",), "hpc-elastic: error: sbatch option --gres is refused"),
        (("--array=0-1", "--gpus=1", "--max-gpus=2"), "hpc-elastic: error: --array needs a fixed size"),
    ],
)
@pytest.mark.cpu_lane
def test_bad_input_is_one_line_exit_2_and_submits_nothing(
    slurm: CliSlurm, workdir: Path, options: tuple[str, ...], message: str
) -> None:
    out = submit_cli(f"--ckpt-root={workdir}", "--gpus=0", "--partition=cpu", *options)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(message), out.stderr
    assert out.stdout == ""
    assert jobs_writing_under(workdir) == []


def array_task(slurm: CliSlurm, array_id: int, task: int) -> Job | None:
    return next((j for j in slurm.jobs() if j.array_job_id == array_id and j.array_task_id == task), None)


def restarts(slurm: CliSlurm, array_id: int, task: int) -> int | None:
    job = array_task(slurm, array_id, task)
    return None if job is None else job.restart_count


@pytest.mark.cpu_lane
def test_array_tasks_have_their_own_job_directories_and_a_requeued_task_resumes(
    slurm: CliSlurm, workdir: Path, submitted: list[int]
) -> None:
    array_id = hpc_submit(
        workdir, STEPPER, "--gpus=0", "--procs=1", "--partition=cpu", "--array=0-1", "--job-name=it-arr", args=("400",)
    )
    submitted.append(array_id)  # scancel of the array's id cancels every task
    dirs = [workdir / f"it-arr-{array_id}_{task}" for task in (0, 1)]
    wait_for("both tasks to start", lambda: all(lines(d / "starts.log") for d in dirs), timeout_s=180)
    first = array_task(slurm, array_id, 1)
    assert first is not None and first.restart_count == 0

    # the checkpoint signal to task 1 alone; its wrapper checkpoints and requeues it as <array>_1
    signalled = run("scancel", "--signal=USR1", "--batch", f"{array_id}_1")
    assert signalled.returncode == 0, signalled.stderr
    wait_for("task 1's acknowledgement", (dirs[1] / "control" / "ack.json").exists)
    wait_for("task 1's requeue", lambda: restarts(slurm, array_id, 1) == 1)
    wait_for("task 1's second start", lambda: len(lines(dirs[1] / "starts.log")) == 2, timeout_s=150)
    resumed = lines(dirs[1] / "starts.log")[1]
    assert "restart=1" in resumed and int(resumed.split("step=")[1].split()[0]) > 0  # from its own checkpoint
    wait_for("task 1 to finish", (dirs[1] / "done").exists, timeout_s=150)
    wait_for("task 0 to finish", (dirs[0] / "done").exists, timeout_s=150)
    assert lines(dirs[0] / "starts.log")[0].startswith("rank=0/1 restart=0")
    assert len(lines(dirs[0] / "starts.log")) == 1  # task 0 ran once: the requeue of task 1 left it alone
    assert int((dirs[1] / "done").read_text()) == 400
    assert sorted(p.name for p in workdir.iterdir() if p.is_dir()) == [d.name for d in dirs]
