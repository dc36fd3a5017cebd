"""The wrapper's decisions: why a job stops, whether it is requeued, how workers are started."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend
from hpc_elastic.env import JobEnvironment, read_job_environment, tasks_per_node_total
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.jobdir import JobDir, StopNotice, StopReason, StopRequest
from hpc_elastic.launch import run
from hpc_elastic.launch.supervisor import Supervisor, WrapperConfig, job_dir_of, job_ref_of, parse_wrapper_args
from hpc_elastic.launch.workers import Launcher, WorkerStep, worker_argv, worker_environment
from hpc_elastic.slurm import JobRef
from hpc_elastic.slurm.errors import SlurmCommandError
from hpc_elastic.slurm.parse import parse_squeue_json
from hpc_elastic.slurm.types import Job, JobState
from tests.conftest import DATA

SLURM_DATA = DATA / "slurm-22.05"


def test_worker_argv() -> None:
    torch = WorkerStep(("python", "t.py"), ntasks=4, num_ests=8, job_dir=Path("/gpfs/j"), gpus_per_task=1)
    assert worker_argv(torch) == [
        "srun",
        "--ntasks=4",
        "--unbuffered",
        "--gpus-per-task=1",
        "--kill-on-bad-exit=1",
        "python",
        "t.py",
    ]
    mpi = WorkerStep(("python", "t.py"), ntasks=2, num_ests=2, job_dir=Path("/j"), backend=Backend.MPI)
    assert "--mpi=pmix" in worker_argv(mpi)
    mpirun = WorkerStep(
        ("python", "t.py"), ntasks=3, num_ests=3, job_dir=Path("/j"), backend=Backend.MPI, launcher=Launcher.MPIRUN
    )
    argv = worker_argv(mpirun)
    assert argv[0].endswith("mpirun") and argv[argv.index("-np") + 1] == "3" and argv[-2:] == ["python", "t.py"]
    assert "tcp,self" in argv  # shared memory transport segfaults across fake nodes
    local = WorkerStep(("python", "t.py"), ntasks=2, num_ests=4, job_dir=Path("/j"), launcher=Launcher.LOCAL)
    assert worker_argv(local) == ["python", "t.py"]  # each rank runs the command itself
    local_mpi = WorkerStep(
        ("python", "t.py"), ntasks=2, num_ests=4, job_dir=Path("/j"), backend=Backend.MPI, launcher=Launcher.LOCAL
    )
    argv = worker_argv(local_mpi, exports=["HPC_ELASTIC_JOB_DIR"])
    assert argv[argv.index("-x") + 1] == "HPC_ELASTIC_JOB_DIR" and "tcp,self" not in argv
    with pytest.raises(ValueError, match="3 worker processes for 2 logical workers: M must not exceed N"):
        WorkerStep(("python",), ntasks=3, num_ests=2, job_dir=Path("/j"))


def test_worker_environment_is_the_runtimes_contract() -> None:
    step = WorkerStep(
        ("python",),
        ntasks=3,
        num_ests=8,
        job_dir=Path("/gpfs/j"),
        backend=Backend.HOROVOD,
        level=DeterminismLevel.D2,
        balance=BalanceMode.LBBSP,
        node_gpu_types=(("node1", "a100"), ("node3", "v100")),
        restart_count=2,
        attempt=1,
    )
    env = worker_environment(step, 4242)
    assert env["HPC_ELASTIC_WORKERS"] == "8" and env["HPC_ELASTIC_WORLD_SIZE"] == "3"
    assert env["HPC_ELASTIC_BACKEND"] == "horovod" and env["HPC_ELASTIC_LEVEL"] == "d2"
    assert env["HPC_ELASTIC_GPU_TYPES"] == "node1:a100,node3:v100" and env["MASTER_PORT"] == "4242"
    assert (env["HPC_ELASTIC_RESTART_COUNT"], env["HPC_ELASTIC_ATTEMPT"], env["OMP_NUM_THREADS"]) == ("2", "1", "1")
    parsed = read_job_environment({**env, "SLURMD_NODENAME": "node3"})
    assert parsed.level is DeterminismLevel.D2 and dict(parsed.node_gpu_types)["node3"] == "v100"
    assert env["HPC_ELASTIC_BALANCE"] == "lbbsp" and parsed.balance is BalanceMode.LBBSP
    assert (parsed.restart_count, parsed.attempt) == (2, 1)
    # the wrapper's reading wins over a stale SLURM_RESTART_COUNT the worker inherited
    assert read_job_environment({**env, "SLURM_RESTART_COUNT": "0"}).restart_count == 2
    assert read_job_environment({"SLURM_RESTART_COUNT": "3"}).restart_count == 3


def test_parse_wrapper_args() -> None:
    config = parse_wrapper_args(
        [
            "--ckpt-root=/gpfs/jobs",
            "--backend=mpi",
            "--workers=8",
            "--grace=30",
            "--level=d2",
            "--balance=est",
            "--max-requeues=3",
            "--",
            "python",
            "train.py",
            "--lr",
            "1",
        ]
    )
    assert config.ckpt_root == Path("/gpfs/jobs") and config.backend is Backend.MPI and config.workers == 8
    assert config.level is DeterminismLevel.D2 and config.balance is BalanceMode.EST
    assert config.grace_s == 30 and config.max_requeues == 3 and config.command == ("python", "train.py", "--lr", "1")
    with pytest.raises(ValueError, match="usage"):
        parse_wrapper_args(["--ckpt-root=/x", "python"])
    with pytest.raises(ValueError, match="--ckpt-root=DIR is required"):
        parse_wrapper_args(["--", "python"])
    with pytest.raises(ValueError, match="unknown or incomplete option '--colour=red'"):
        parse_wrapper_args(["--ckpt-root=/x", "--colour=red", "--", "python"])
    with pytest.raises(ValueError, match="no worker command"):
        parse_wrapper_args(["--ckpt-root=/x", "--"])
    with pytest.raises(ValueError, match="--max-requeues must be between 0 and 1000, got -1"):
        parse_wrapper_args(["--ckpt-root=/x", "--max-requeues=-1", "--", "python"])
    with pytest.raises(ValueError, match="unknown or incomplete option '--requeue-on-timelimit'"):
        parse_wrapper_args(["--ckpt-root=/x", "--requeue-on-timelimit", "--", "python"])
    with pytest.raises(ValueError, match="starts workers with srun or mpirun inside an allocation"):
        parse_wrapper_args(["--ckpt-root=/x", "--launcher=local", "--", "python"])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--workers=-1", "--workers must be between 1 and 16384, got -1"),
        ("--workers=99999999999999999999", "--workers must be between 1 and 16384"),
        ("--workers=2.5", "bad --workers '2.5': not a whole number"),
        ("--grace=inf", "--grace must be between 1 and 3600 seconds, got inf"),
        ("--grace=nan", "--grace must be between 1 and 3600 seconds, got nan"),
        ("--grace=soon", "bad --grace 'soon': not a number"),
        ("--max-restarts=101", "--max-restarts must be between 0 and 100, got 101"),
        ("--max-requeues=1001", "--max-requeues must be between 0 and 1000, got 1001"),
        ("--ckpt-root=jobs", "--ckpt-root must be an absolute path on the shared filesystem, got 'jobs'"),
        ("--ckpt-root=/gpfs/a\nb", "--ckpt-root must not contain spaces, quotes or backslashes"),
    ],
)
def test_the_wrapper_refuses_bad_options_before_it_asks_slurm(
    option: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_slurm(*_: object) -> None:
        raise AssertionError("Slurm asked before the options were checked")

    monkeypatch.setattr(run, "connect", no_slurm)
    monkeypatch.setattr(run, "read_job_environment", no_slurm)
    root = option.removeprefix("--ckpt-root=") if option.startswith("--ckpt-root=") else "/gpfs/jobs"
    options = [] if option.startswith("--ckpt-root=") else [option]
    assert run.main([f"--ckpt-root={root}", *options, "--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hpc-elastic-run: error: {message}"), err


def test_the_wrapper_help_is_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hpc-elastic-run --ckpt-root=DIR") and "--mode=ps" in out
    assert run.main(["--mode=ps", "-h"]) == 0 and "--workers-range=A:B" in capsys.readouterr().out


def test_job_directory_is_stable_across_requeues() -> None:
    job = JobEnvironment(job_id=42, job_name="train", restart_count=3)
    assert job_dir_of(Path("/gpfs/jobs"), job) == JobDir(Path("/gpfs/jobs/train-42"))
    with pytest.raises(ValueError, match="SLURM_JOB_ID is not set"):
        job_dir_of(Path("/gpfs/jobs"), JobEnvironment())


def test_each_array_task_has_its_own_job_directory_across_requeues() -> None:
    """A task's own SLURM_JOB_ID is its own, but its directory and its requeue use <array>_<task>."""
    task = read_job_environment(
        {"SLURM_JOB_ID": "512", "SLURM_JOB_NAME": "train", "SLURM_ARRAY_JOB_ID": "510", "SLURM_ARRAY_TASK_ID": "1"}
    )
    assert (task.job_id, task.array_job_id, task.array_task_id) == (512, 510, 1)
    assert job_dir_of(Path("/gpfs/jobs"), task) == JobDir(Path("/gpfs/jobs/train-510_1"))
    assert job_ref_of(task) == JobRef(510, 1) and str(job_ref_of(task)) == "510_1"
    plain = read_job_environment({"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train"})
    assert plain.array_task_id is None and job_ref_of(plain) == JobRef(42)


def test_job_environment_from_srun_and_mpirun_variables() -> None:
    srun = read_job_environment(
        {
            "SLURM_JOB_ID": "7",
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "CUDA_VISIBLE_DEVICES": "3",
            "SLURM_GPUS_PER_TASK": "a100:1",
            "SLURM_RESTART_COUNT": "2",
            "HPC_ELASTIC_JOB_DIR": "/gpfs/jobs/t-7",
            "HPC_ELASTIC_WORKERS": "8",
            "HPC_ELASTIC_BACKEND": "mpi",
        }
    )
    assert (srun.job_id, srun.rank, srun.world_size, srun.local_rank) == (7, 2, 4, 1)
    assert srun.gpus == ("3",) and srun.gpus_per_task == 1 and srun.restart_count == 2
    assert srun.job_dir == Path("/gpfs/jobs/t-7") and srun.workers == 8 and srun.backend is Backend.MPI
    ompi = read_job_environment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (ompi.rank, ompi.world_size) == (1, 2)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        read_job_environment({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"})
    with pytest.raises(ValueError, match="HPC_ELASTIC_BACKEND: backend must be one of"):
        read_job_environment({"HPC_ELASTIC_BACKEND": "nccl"})
    with pytest.raises(ValueError, match="SLURM_PROCID must be an integer"):
        read_job_environment({"SLURM_PROCID": "x"})


# ------------------------------------------------------------------ the control loop, with real worker processes

ATTEMPT_LOG = "import os, sys; open(sys.argv[1], 'a').write(os.environ['HPC_ELASTIC_ATTEMPT'] + '\\n'); "


class NoSlurm:
    """The wrapper must not call Slurm when no stop was requested (but to read its job's time limit: none)."""

    def requeue(self, job_ids: list[int]) -> None:
        raise AssertionError(f"unexpected requeue of {job_ids}")

    def job(self, job_id: int) -> object:
        return type("Job", (), {"admin_comment": "", "start_time": None, "time_limit_s": None})()


def supervise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, max_restarts: int
) -> tuple[int, list[str], Supervisor]:
    log = tmp_path / "attempts.log"
    command = (sys.executable, "-c", ATTEMPT_LOG + body, str(log))
    monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
    config = WrapperConfig(tmp_path / "jobs", command, max_restarts=max_restarts, kill_timeout_s=2)
    supervisor = Supervisor(config, JobEnvironment(job_id=5, job_name="t"), NoSlurm())  # type: ignore[arg-type]
    supervisor.prepare()
    code = supervisor.run()
    return code, log.read_text().split(), supervisor


def test_a_failed_worker_step_is_restarted_in_the_allocation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Attempt 0 dies as a worker killed with -9 would (exit 137); attempt 1 succeeds.
    body = "sys.exit(137 if os.environ['HPC_ELASTIC_ATTEMPT'] == '0' else 0)"
    code, attempts, _ = supervise(tmp_path, monkeypatch, body, max_restarts=2)
    assert code == 0 and attempts == ["0", "1"]


def test_the_restart_budget_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, attempts, _ = supervise(tmp_path, monkeypatch, "sys.exit(3)", max_restarts=1)
    assert code == 3 and attempts == ["0", "1"]
    code, attempts, _ = supervise(tmp_path / "b", monkeypatch, "sys.exit(0)", max_restarts=1)
    assert code == 0 and attempts == ["0"]


def test_a_new_incarnation_sets_aside_the_previous_stop_and_ack(tmp_path: Path) -> None:
    config = WrapperConfig(tmp_path, ("true",))
    supervisor = Supervisor(config, JobEnvironment(job_id=9, job_name="j"), NoSlurm(), clock=lambda: 1000.0)  # type: ignore[arg-type]
    control = tmp_path / "j-9" / "control"
    control.mkdir(parents=True)
    (control / "stop").write_text(StopRequest(StopReason.PREEMPT, 900.0).to_json())
    (control / "ack.json").write_text('{"job_id": 9}')
    supervisor.prepare()
    assert sorted(p.name for p in control.iterdir()) == ["ack.json.handled-1000", "stop.handled-1000"]
    assert supervisor.job_dir.read_stop() is None and supervisor.job_dir.read_ack() is None


class NoticeSlurm:
    """A job whose AdminComment holds the scheduler daemon's notice (or Slurm's answer fails)."""

    def __init__(self, admin_comment: str, limit_s: int | None = None) -> None:
        self.admin_comment = admin_comment
        self.limit_s = limit_s

    def job(self, job_id: int) -> object:
        start = datetime.fromtimestamp(1000.0 - 3000, tz=UTC)
        return type(
            "Job", (), {"admin_comment": self.admin_comment, "start_time": start, "time_limit_s": self.limit_s}
        )()


@pytest.mark.parametrize(
    ("comment", "restarts", "limit_s", "reason"),
    [
        (StopNotice(StopReason.RESIZE, 990.0, 2).encode(), 2, None, StopReason.RESIZE),
        # a notice of an earlier incarnation is not this signal's: near the time limit, it is the time limit
        (StopNotice(StopReason.RESIZE, 990.0, 1).encode(), 2, 3060, StopReason.TIMELIMIT),
        ("", 2, None, StopReason.PREEMPT),
        ("hpc-elastic-stop:reason=nap,at=1,restarts=2", 2, None, StopReason.PREEMPT),
    ],
)
def test_the_daemons_reason_comes_from_the_admin_comment(
    tmp_path: Path, comment: str, restarts: int, limit_s: int | None, reason: StopReason
) -> None:
    job = JobEnvironment(job_id=9, job_name="j", restart_count=restarts)
    slurm = NoticeSlurm(comment, limit_s)
    supervisor = Supervisor(WrapperConfig(tmp_path, ("true",)), job, slurm, clock=lambda: 1000.0)  # type: ignore[arg-type]
    supervisor.prepare()
    supervisor._usr1 = True
    assert supervisor._take_stop_request() == (reason, 1000.0)
    assert supervisor.job_dir.read_stop() == StopRequest(reason, 1000.0)  # what the workers see


def test_mpirun_inside_an_allocation_takes_open_mpis_rank() -> None:
    # The batch step's SLURM_PROCID=0 is inherited by every process mpirun starts.
    env = read_job_environment(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}
    )
    assert (env.rank, env.world_size) == (2, 4)


class RecordingSlurm:
    """Records requeues; the job has no time limit, so a USR1 is a preemption."""

    def __init__(self) -> None:
        self.requeued: list[int | JobRef] = []

    def requeue(self, job_ids: list[int | JobRef]) -> None:
        self.requeued += job_ids

    def job(self, job_id: int) -> object:
        return type("Job", (), {"admin_comment": "", "start_time": None, "time_limit_s": None})()


PREEMPTED_WORKER = """
import json, os, pathlib, signal, sys, time
log, control = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
os.kill(os.getppid(), signal.SIGUSR1)  # the preemption signal reaches the wrapper
while not (control / "stop").exists():
    time.sleep(0.05)
ack = {"job_id": 5, "restart_count": 0, "step": 7, "checkpoint": "/ckpt", "written_at": time.time()}
(control / ".ack.tmp").write_text(json.dumps(ack))
os.replace(control / ".ack.tmp", control / "ack.json")
time.sleep(60)  # a slow teardown after the acknowledgement
log.write_text("exited by itself")
"""


@pytest.mark.parametrize(
    ("job", "leaf", "ref"),
    [
        (JobEnvironment(job_id=5, job_name="t"), "t-5", JobRef(5)),
        # the array task whose own job id is the array's: requeued as 5_3, never as 5 (every task of the array)
        (JobEnvironment(job_id=5, job_name="t", array_job_id=5, array_task_id=3), "t-5_3", JobRef(5, 3)),
    ],
)
def test_a_preemption_is_requeued_once_acknowledged_without_waiting_for_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: JobEnvironment, leaf: str, ref: JobRef
) -> None:
    log, control = tmp_path / "worker.log", tmp_path / "jobs" / leaf / "control"
    command = (sys.executable, "-c", PREEMPTED_WORKER, str(log), str(control))
    monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
    slurm = RecordingSlurm()
    config = WrapperConfig(tmp_path / "jobs", command, kill_timeout_s=2)
    supervisor = Supervisor(config, job, slurm)  # type: ignore[arg-type]
    supervisor.prepare()
    assert supervisor.run() == 0 and slurm.requeued == [ref]
    request = supervisor.job_dir.read_stop()
    assert request is not None and request.reason is StopReason.PREEMPT
    assert not log.exists()  # the worker was stopped, not waited for


FINISHING_WORKER = """
import os, signal, sys, time
os.kill(os.getppid(), signal.SIGUSR1)  # the signal comes as the training ends
time.sleep(0.5)  # the wrapper asks for a stop; these workers have finished and exit without acknowledging it
sys.exit(0)
"""


def test_workers_that_finish_before_acknowledging_a_stop_end_the_job_without_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = (sys.executable, "-c", FINISHING_WORKER)
    monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
    slurm = RecordingSlurm()
    config = WrapperConfig(tmp_path / "jobs", command, kill_timeout_s=2)
    supervisor = Supervisor(config, JobEnvironment(job_id=5, job_name="t"), slurm)  # type: ignore[arg-type]
    supervisor.prepare()
    assert supervisor.run() == 0 and slurm.requeued == []  # done: a requeue would run a finished job again
    request = supervisor.job_dir.read_stop()
    assert request is not None and request.reason is StopReason.PREEMPT  # the stop was asked for


@pytest.mark.parametrize(
    ("raw", "total"), [("4", 4), ("2(x2),1", 5), ("1(x3)", 3), ("", None), ("x", None), ("0", None)]
)
def test_tasks_per_node_total(raw: str, total: int | None) -> None:
    assert tasks_per_node_total(raw) == total


def test_a_resized_allocation_wins_over_the_submissions_task_count() -> None:
    # What a batch step sees after the plugin set NumTasks=4 on a job submitted with 2 tasks (dev cluster).
    env = read_job_environment({"SLURM_JOB_ID": "105", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "4"})
    assert (env.world_size, env.allocated_tasks) == (2, 4)
    assert read_job_environment({}).allocated_tasks is None


SCHEDULER_STOPPED_WORKER = """
import json, os, pathlib, sys, time
control = pathlib.Path(sys.argv[2])
while not (control / "stop").exists():
    time.sleep(0.05)
ack = {"job_id": 5, "restart_count": 0, "step": 3, "checkpoint": "/ckpt", "written_at": time.time()}
(control / ".ack.tmp").write_text(json.dumps(ack))
os.replace(control / ".ack.tmp", control / "ack.json")
"""


def test_a_stop_at_a_chosen_step_written_before_the_run_stands_and_is_requeued_without_a_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify-determinism --submit writes a stop for a step before the job runs: prepare() keeps it (no checkpoint
    has acknowledged it), the workers stop there and acknowledge, and the wrapper requeues without any USR1."""
    job_dir = JobDir(tmp_path / "jobs" / "t-5").prepare()
    job_dir.request_stop(StopRequest(StopReason.RESIZE, time.time(), at_step=3))
    killed = job_dir.control / ".ack.json.tmp-42-00000000000000ff"  # a write a kill interrupted, an hour ago
    killed.write_bytes(b"{")
    os.utime(killed, (time.time() - 3600,) * 2)
    command = (sys.executable, "-c", SCHEDULER_STOPPED_WORKER, "-", str(job_dir.control))
    monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
    slurm = RecordingSlurm()
    supervisor = Supervisor(WrapperConfig(tmp_path / "jobs", command), JobEnvironment(job_id=5, job_name="t"), slurm)  # type: ignore[arg-type]
    supervisor.prepare()
    assert not killed.exists()
    assert supervisor.run() == 0  # no USR1 ever arrives here
    assert slurm.requeued == [JobRef(5)]
    request = job_dir.read_stop()
    assert request is not None and (request.reason, request.at_step) == (StopReason.RESIZE, 3)  # not rewritten


# ------------------------------------------------------------------ stops the wrapper learns of from Slurm

SIGTERM_WORKER = """
import json, os, pathlib, sys, time
control = pathlib.Path(sys.argv[2])
time.sleep(0.5)  # the workers got SIGTERM (Slurm signals the steps, not the wrapper) and checkpoint on their own
ack = {"job_id": JOB, "restart_count": 0, "step": 4, "checkpoint": "/ckpt", "written_at": time.time(),
       "reason": "sigterm"}
(control / ".ack.tmp").write_text(json.dumps(ack))
os.replace(control / ".ack.tmp", control / "ack.json")
"""


class CapturedSlurm(RecordingSlurm):
    """Slurm's answer is ``squeue --json`` captured on the dev cluster while the job was being stopped (None: no
    answer)."""

    def __init__(self, fixture: str | None) -> None:
        super().__init__()
        self.fixture = fixture

    def job(self, job_id: int) -> Job:
        if self.fixture is None:
            raise SlurmCommandError(["squeue"], 1, "", "slurm_load_jobs error: Socket timed out")
        (job,) = parse_squeue_json((SLURM_DATA / self.fixture).read_text())
        return job


@pytest.mark.parametrize(
    ("fixture", "job_id", "requeued"),
    [
        ("squeue_preempt_grace.json", 522, True),  # Slurm's preemption, in its GraceTime: requeue at once
        ("squeue_cancel.json", 523, False),  # a user's scancel: the job ends CANCELLED
        ("squeue_node_failed.json", 525, False),  # Slurm requeued it itself
        (None, 522, True),  # no answer: a requeue from the fresh checkpoint is the safe guess
    ],
)
def test_a_checkpoint_on_the_workers_own_sigterm_is_requeued_only_for_a_preemption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture: str | None, job_id: int, requeued: bool
) -> None:
    control = tmp_path / "jobs" / f"t-{job_id}" / "control"
    command = (sys.executable, "-c", SIGTERM_WORKER.replace("JOB", str(job_id)), "-", str(control))
    monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
    slurm = CapturedSlurm(fixture)
    config = WrapperConfig(tmp_path / "jobs", command, kill_timeout_s=2)
    supervisor = Supervisor(config, JobEnvironment(job_id=job_id, job_name="t"), slurm)  # type: ignore[arg-type]
    supervisor.prepare()
    assert supervisor.run() == 0
    assert slurm.requeued == ([JobRef(job_id)] if requeued else [])
    assert supervisor.job_dir.read_stop() is None  # the wrapper requested nothing


TIMELIMIT_WORKER = """
import json, os, pathlib, signal, sys, time
control = pathlib.Path(sys.argv[2])
os.kill(os.getppid(), signal.SIGUSR1)  # Slurm's --signal=B:USR1@grace
while not (control / "stop").exists():
    time.sleep(0.05)
ack = {"job_id": 5, "restart_count": int(sys.argv[3]), "step": 9, "checkpoint": "/ckpt", "written_at": time.time()}
(control / ".ack.tmp").write_text(json.dumps(ack))
os.replace(control / ".ack.tmp", control / "ack.json")
if sys.argv[4] == "kill":
    os.kill(os.getppid(), signal.SIGTERM)  # Slurm's TERM at the time limit
"""


class NearTheLimit(RecordingSlurm):
    def job(self, job_id: int) -> Job:
        start = datetime.fromtimestamp(time.time() - 3550, tz=UTC)  # a 1-hour job, 50 s left
        return Job(job_id, "t", "u", JobState.RUNNING, start_time=start, time_limit_s=3600)


def test_the_time_limit_is_requeued_within_the_budget_then_ends_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def incarnation(restarts: int, then: str) -> tuple[int, list[int | JobRef]]:
        control = tmp_path / "jobs" / "t-5" / "control"
        command = (sys.executable, "-c", TIMELIMIT_WORKER, "-", str(control), str(restarts), then)
        monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
        slurm = NearTheLimit()
        job = JobEnvironment(job_id=5, job_name="t", restart_count=restarts)
        supervisor = Supervisor(WrapperConfig(tmp_path / "jobs", command, max_requeues=2, kill_timeout_s=2), job, slurm)  # type: ignore[arg-type]
        supervisor.prepare()
        return supervisor.run(), slurm.requeued

    job_dir = JobDir(tmp_path / "jobs" / "t-5")
    assert incarnation(0, "exit") == (0, [JobRef(5)])
    assert incarnation(3, "exit") == (0, [JobRef(5)])  # a preemption or two may come between: they do not count
    assert job_dir.timelimit_requeues() == (0, 3)
    assert incarnation(4, "kill") == (128 + signal.SIGTERM, [])  # spent: the job waits for Slurm's TERM (TIMEOUT)
    assert job_dir.timelimit_requeues() == (0, 3)


def test_a_lost_time_limit_warning_stops_the_workers_at_the_limit_less_the_grace_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slurm's USR1 came before the wrapper could hold it (lost): 50 s are left of the hour, the grace is 120 s
    control = tmp_path / "jobs" / "t-5" / "control"
    worker = TIMELIMIT_WORKER.replace("os.kill(os.getppid(), signal.SIGUSR1)", "pass")
    command = (sys.executable, "-c", worker, "-", str(control), "0", "exit")
    monkeypatch.setattr("hpc_elastic.launch.workers.worker_argv", lambda step, exports=(): command)
    slurm = NearTheLimit()
    config = WrapperConfig(tmp_path / "jobs", command, max_requeues=1, kill_timeout_s=2)
    supervisor = Supervisor(config, JobEnvironment(job_id=5, job_name="t"), slurm)  # type: ignore[arg-type]
    supervisor.prepare()
    assert supervisor.run() == 0
    assert slurm.requeued == [JobRef(5)]
    assert JobDir(tmp_path / "jobs" / "t-5").timelimit_requeues() == (0,)
