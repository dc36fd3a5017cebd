"""The elastic state of a job (pure): Slurm's record (captured from the dev cluster) + the job directory + now."""

from __future__ import annotations

from pathlib import Path

from hpc_elastic.cli.jobs import describe, jobs_table
from hpc_elastic.jobdir import CheckpointRecord, PastStop, Progress, StopReason, StopRequest
from hpc_elastic.jobstatus import JobReadings, elastic_status
from hpc_elastic.slurm.parse import parse_sacct_text, parse_squeue_json
from hpc_elastic.slurm.types import Job, JobState

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm-22.05"
# squeue --json of job 548 (hpc_elastic.submit of a function: --gpus 2 --max-gpus 4 --workers 4 on a100), while it
# ran with the daemon's stop notice in its AdminComment, and once requeued by its wrapper after USR1
RUNNING = DATA / "squeue_elastic_running.json"
REQUEUED = DATA / "squeue_elastic_requeued.json"
NOTICE_AT = 1795497408.778


def record(path: Path) -> Job:
    (job,) = parse_squeue_json(path.read_text())
    return job


def progress(step: int, at: float, rate: float | None = 17.5, restarts: int = 0, attempt: int = 0) -> Progress:
    return Progress(step, at, rate, 2, restarts, attempt, ("a100",))


CHECKPOINTS = (
    CheckpointRecord(440, NOTICE_AT - 2.0, 61042, 2),
    CheckpointRecord(420, NOTICE_AT - 3.0, 61042, 2),
)


def test_a_running_job_shows_n_m_gpu_types_step_rate_checkpoints_and_the_plugin_notice() -> None:
    job = record(RUNNING)
    readings = JobReadings(Path("/gpfs/jobs/capture-548"), progress(445, NOTICE_AT - 1.0), CHECKPOINTS)
    status = elastic_status(job, readings, NOTICE_AT + 1.0)
    assert (status.job_id, status.name, status.state) == (548, "capture", JobState.RUNNING)
    assert (status.workers, status.elastic_range, status.unit) == (4, (2, 4), "gpu")
    assert (status.processes, dict(status.gpus), status.gpu_types, status.nodes) == (
        2,
        {"a100": 2},
        ("a100",),
        ("node1",),
    )
    assert (status.step, status.steps_per_s, status.progress_age_s) == (445, 17.5, 2.0)
    assert [(c.step, c.age_s, c.size_bytes) for c in status.checkpoints] == [(440, 3.0, 61042), (420, 4.0, 61042)]
    assert status.plugin_action is not None and status.plugin_action.reason == "resize"
    assert status.plugin_action.age_s is not None and abs(status.plugin_action.age_s - 1.0) < 1e-6
    assert (status.requeues, status.restarts, status.stops, status.stop_pending) == (0, 0, (), None)
    assert not status.finished
    doc = status.to_dict()
    assert (doc["workers"], doc["processes"], doc["gpu_types"], doc["step"]) == (4, 2, ["a100"], 445)
    assert doc["checkpoints"][0] == {"step": 440, "age_s": 3.0, "size_bytes": 61042, "world_size": 2}


def test_a_stop_the_running_job_acts_on_is_pending() -> None:
    stop = StopRequest(StopReason.RESIZE, NOTICE_AT, None)
    status = elastic_status(record(RUNNING), JobReadings(stop=stop), NOTICE_AT + 0.5)
    assert status.stop_pending is not None and (status.stop_pending.reason, status.stop_pending.age_s) == (
        "resize",
        0.5,
    )
    assert status.stops == ()


def test_a_requeued_job_counts_its_requeues_with_the_reasons_of_its_stops() -> None:
    job = record(REQUEUED)
    earlier = PastStop(StopRequest(StopReason.PREEMPT, NOTICE_AT - 100.0), NOTICE_AT - 60.0)
    last = StopRequest(StopReason.RESIZE, NOTICE_AT)
    readings = JobReadings(progress=progress(520, NOTICE_AT + 2.0), past_stops=(earlier,), stop=last)
    status = elastic_status(job, readings, NOTICE_AT + 10.0)
    assert status.state is JobState.PENDING and status.requeues == 1
    assert [s.reason for s in status.stops] == ["preempt", "resize"]  # the last one ended the run before the requeue
    assert status.stop_pending is None
    assert status.processes == 2  # the last run's, as recorded: Slurm allocates nothing while it waits
    assert status.gpus == {} and status.nodes == ()
    assert status.steps_per_s is None  # the record belongs to the incarnation before the requeue
    assert status.step == 520 and status.pending_reason == "BeginTime"


def test_restarts_in_the_allocation_come_from_the_current_runs_record() -> None:
    readings = JobReadings(progress=progress(30, NOTICE_AT, attempt=2))
    assert elastic_status(record(RUNNING), readings, NOTICE_AT).restarts == 2
    old = JobReadings(progress=progress(30, NOTICE_AT, restarts=0, attempt=2))
    assert elastic_status(record(REQUEUED), old, NOTICE_AT).restarts == 0


def test_without_a_job_directory_the_step_is_unknown_and_the_last_checkpoint_stands_in() -> None:
    job = record(RUNNING)
    assert elastic_status(job, JobReadings(), NOTICE_AT).step is None
    assert elastic_status(job, JobReadings(checkpoints=CHECKPOINTS), NOTICE_AT).step == 440


def test_a_job_without_a_marker_has_no_elastic_range() -> None:
    (plain, *_) = parse_squeue_json((DATA / "squeue.json").read_text())
    status = elastic_status(plain, JobReadings(), NOTICE_AT)
    assert (status.workers, status.elastic_range, status.plugin_action) == (None, None, None)
    assert describe(status)[1] == "  not an hpc-elastic job (no marker in its comment)"


def test_describe_and_the_table_show_what_the_status_holds() -> None:
    readings = JobReadings(Path("/gpfs/jobs/capture-548"), progress(445, NOTICE_AT - 1.0), CHECKPOINTS)
    status = elastic_status(record(RUNNING), readings, NOTICE_AT + 1.0)
    text = "\n".join(describe(status))
    assert "logical workers N=4, GPUs M=2 on a100:2 (node1), elastic range 2-4" in text
    assert "step 445, 17.50 steps/s (recorded 2s ago)" in text
    assert "checkpoints: step 440 (3s ago, 61.0 KB, M=2), step 420 (4s ago, 61.0 KB, M=2)" in text
    assert "scheduler's last action: resize 1s ago" in text
    table = jobs_table([status])
    assert table.row_count == 1 and [c.header for c in table.columns][:5] == ["job", "name", "state", "N", "M"]


def test_a_checkpoint_newer_than_the_progress_record_gives_the_step() -> None:
    readings = JobReadings(progress=progress(430, NOTICE_AT - 5.0), checkpoints=CHECKPOINTS)
    assert elastic_status(record(RUNNING), readings, NOTICE_AT).step == 440


def test_a_finished_job_known_only_to_sacct_takes_n_and_m_from_its_last_record() -> None:
    # sacct keeps no job comment on the dev cluster (no AccountingStoreFlags=job_comment): the marker is gone
    (finished,) = [j for j in parse_sacct_text((DATA / "sacct_parsable2.txt").read_text()) if j.job_id == 2]
    assert finished.comment == "" and finished.state is JobState.COMPLETED
    record_ = Progress(150, NOTICE_AT, 8.9, 2, 0, 0, ("cpu",), workers=4)
    status = elastic_status(finished, JobReadings(progress=record_), NOTICE_AT + 5.0)
    assert (status.workers, status.processes, status.step, status.elastic_range) == (4, 2, 150, None)
    assert status.finished and status.elapsed_s == 60
    assert "logical workers N=4, processes M=2" in "\n".join(describe(status))
