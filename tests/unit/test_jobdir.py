"""The job directory and its stop/ack protocol where users may plant links, FIFOs, huge files and forged acks."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from hpc_elastic import files
from hpc_elastic.checkpoint.layout import FileEntry, Manifest
from hpc_elastic.files import UnsafeFile, atomic_write_bytes, read_owned
from hpc_elastic.jobdir import (
    ACK_CLOCK_SLACK_S,
    MAX_CONTROL_BYTES,
    MAX_REPORTED_COUNT,
    PROGRESS_EVERY_S,
    Ack,
    CheckpointRecord,
    JobDir,
    Progress,
    ScaleReply,
    ScaleRequest,
    StopNotice,
    StopReason,
    StopRequest,
    ack_answers,
    call_path,
    find_job_dir,
    leaf_name,
    next_progress,
    output_path,
    parse_ack,
    parse_progress,
    read_tail,
    write_call,
)

ME = os.getuid()
OTHER = 65534  # nobody
needs_root = pytest.mark.skipif(ME != 0, reason="giving a file to another user needs root")


def ack(written_at: float, restarts: int = 0, job_id: int = 7) -> Ack:
    return Ack(job_id, restarts, 40, Path("/ckpt/ckpt-000000000040"), written_at)


def test_prepare_makes_the_tree_with_its_modes(tmp_path: Path) -> None:
    job = JobDir.of(tmp_path / "jobs", "train", 7).prepare()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (job.path, job.control, job.checkpoints, job.logs)}
    assert modes == {"train-7": 0o711, "control": 0o755, "checkpoints": 0o700, "logs": 0o700}
    assert job.prepare() == job  # again: the same checks pass


@needs_root
def test_the_wrapper_refuses_a_job_directory_someone_else_made(tmp_path: Path) -> None:
    """A pre-existing directory of another uid may hold a planted stop file that kills the workers unsaved."""
    planted = tmp_path / "train-7"
    (planted / "control").mkdir(parents=True)
    (planted / "control" / "stop").write_text('{"reason": "preempt", "requested_at": 1}')
    os.chown(planted, OTHER, OTHER)
    with pytest.raises(UnsafeFile, match="belongs to uid"):
        JobDir.of(tmp_path, "train", 7).prepare()


def test_the_wrapper_refuses_a_world_writable_or_linked_job_directory(tmp_path: Path) -> None:
    (tmp_path / "train-7").mkdir(mode=0o777)
    os.chmod(tmp_path / "train-7", 0o777)
    with pytest.raises(UnsafeFile, match="writable"):
        JobDir.of(tmp_path, "train", 7).prepare()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "train-8").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFile, match="symbolic link"):
        JobDir.of(tmp_path, "train", 8).prepare()
    assert not (tmp_path / "elsewhere" / "control").exists()  # refused before anything was made through the link


def test_job_names_cannot_leave_the_root() -> None:
    for bad in ("../x", "a/b", ".hidden", "", "x\ny", "x\x00"):
        with pytest.raises(ValueError, match="cannot name a job directory"):
            leaf_name(bad, 1)
    with pytest.raises(ValueError, match="positive integer"):
        leaf_name("x", 0)


def test_atomic_write_never_follows_a_planted_temp_name_or_link(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious")
    control = tmp_path / "control"
    control.mkdir()
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old predictable temp names, all planted
        (control / f".stop.{pid}.tmp").symlink_to(target)
    (control / "stop").symlink_to(target)
    atomic_write_bytes(control / "stop", b"new")
    assert target.read_text() == "precious"
    assert not (control / "stop").is_symlink() and (control / "stop").read_bytes() == b"new"


def test_a_read_takes_the_whole_file_in_chunks_up_to_its_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 * files.READ_CHUNK + 17)
    (tmp_path / "big").write_bytes(data)
    assert read_owned(tmp_path, ["big"], limit=len(data)) == data  # exactly at the limit
    reads: list[int] = []
    real_read = os.read

    def short_read(fd: int, n: int) -> bytes:  # a filesystem that returns less than asked
        reads.append(n)
        return real_read(fd, min(n, 4096))

    monkeypatch.setattr(os, "read", short_read)
    assert read_owned(tmp_path, ["big"], limit=len(data) + 5) == data
    assert len(reads) > len(data) // 4096 and max(reads) <= files.READ_CHUNK
    with pytest.raises(UnsafeFile, match="more than"):
        read_owned(tmp_path, ["big"], limit=len(data) - 1)


def test_reads_refuse_links_fifos_devices_and_huge_files(tmp_path: Path) -> None:
    job = JobDir.of(tmp_path, "train", 7).prepare()
    (job.control / "ack.json").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeFile, match="symbolic link"):
        read_owned(job.path, ["control", "ack.json"], limit=MAX_CONTROL_BYTES)
    assert job.read_ack() is None
    (job.control / "ack.json").unlink()
    os.mkfifo(job.control / "ack.json")  # opened without blocking: refused at once, not waited on
    assert job.read_ack() is None and job.read_ack_as(ME) is None
    (job.control / "ack.json").unlink()
    (job.control / "ack.json").write_bytes(b" " * (MAX_CONTROL_BYTES + 1))
    with pytest.raises(UnsafeFile, match="more than"):
        read_owned(job.path, ["control", "ack.json"], limit=MAX_CONTROL_BYTES)
    (job.control / "stop").symlink_to("/dev/zero")
    assert job.read_stop() == StopRequest(StopReason.UNKNOWN, None)  # a planted stop still stops: with a checkpoint


@needs_root
def test_the_daemon_reads_an_ack_only_through_the_jobs_own_files(tmp_path: Path) -> None:
    job = JobDir.of(tmp_path, "train", 7).prepare()
    job.acknowledge(ack(100.0))
    assert job.read_ack_as(ME) == ack(100.0)
    assert job.read_ack_as(OTHER) is None  # the directory is not that user's
    os.chown(job.ack_path, OTHER, OTHER)
    assert job.read_ack_as(ME) is None  # a file given by another user is not the job's word


@needs_root
def test_a_directory_linked_to_another_users_job_is_not_found(tmp_path: Path) -> None:
    """A job named like another user's job, its directory a link to that one, must not stop that job."""
    victim = JobDir.of(tmp_path / "a", "train", 7).prepare()
    os.chown(victim.path, OTHER, OTHER)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train-7").symlink_to(victim.path)
    assert find_job_dir([tmp_path / "b", tmp_path / "a"], "train", 7, ME) is None
    assert find_job_dir([tmp_path / "b", tmp_path / "a"], "train", 7, OTHER) == victim
    assert find_job_dir([tmp_path / "a"], "../a/train", 7, OTHER) is None


@pytest.mark.parametrize(
    ("written_at", "restarts", "job_id", "counts"),
    [
        (1000.0, 0, 7, True),
        (1000.0 - ACK_CLOCK_SLACK_S, 0, 7, True),
        (990.0, 0, 7, False),  # before the stop: an older stop's ack
        (2000.0, 0, 7, True),
        (2000.0 + ACK_CLOCK_SLACK_S + 1, 0, 7, False),  # from the future: forged, it would keep the GPUs for good
        (1500.0, 1, 7, False),  # another incarnation
        (1500.0, 0, 8, False),  # another job
    ],
)
def test_an_ack_counts_only_inside_the_stop_window(written_at: float, restarts: int, job_id: int, counts: bool) -> None:
    got = ack_answers(ack(written_at, restarts, job_id), job_id=7, restart_count=0, requested_at=1000.0, now=2000.0)
    assert got is counts


def test_infinite_or_nan_ack_times_are_refused() -> None:
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="written_at"):
            ack(bad)


def test_the_stop_notice_round_trips_and_refuses_anything_else() -> None:
    notice = StopNotice(StopReason.PREEMPT, 1700000000.25, 2)
    assert StopNotice.decode(notice.encode()) == notice
    for text in ("", "hpc-elastic-stop:reason=preempt", "hpc-elastic-stop:reason=bogus,at=1,restarts=0", "x" * 9999):
        assert StopNotice.decode(text) is None


# ------------------------------------------------------------------------------ progress, listings, outcome


def test_progress_round_trips_and_a_bad_record_reads_as_none(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-7").prepare()
    assert job.read_progress() is None
    record = Progress(120, 1766400000.5, 3.25, 4, 1, 2, ("a100",))
    job.record_progress(record)
    assert job.read_progress() == record
    assert parse_progress(record.to_json()) == record
    job.progress_path.write_text('{"step": -1}')
    assert job.read_progress() is None
    job.progress_path.unlink()
    os.mkfifo(job.progress_path)  # never waited on
    assert job.read_progress() is None


def test_progress_carries_the_observed_capability_and_the_daemon_reads_it_as_the_owner(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-8").prepare()
    record = Progress(40, 1766400000.5, 2.0, 3, 0, 0, ("a100", "v100"), 8, (("v100", 5.0), ("a100", 35.0)))
    assert record.capability == (("a100", 35.0), ("v100", 5.0))  # sorted by type
    job.record_progress(record)
    assert job.read_progress_as(ME) == record == parse_progress(record.to_json())
    assert job.read_progress_as(OTHER) is None  # not that user's directory
    for hostile in ('[["a100", NaN]]', '[["a100", -1]]', '{"a100": 3}', '[["a100", 1e400]]'):
        job.progress_path.write_text(record.to_json().replace('[["a100", 35.0], ["v100", 5.0]]', hostile))
        assert hostile in job.progress_path.read_text()
        assert job.read_progress_as(ME) is None
    job.progress_path.write_text(record.to_json()[:-2] + " " * MAX_CONTROL_BYTES + "}\n")  # too long to read
    assert job.read_progress_as(ME) is None
    # counts and rates whose products would overflow the daemon's arithmetic, and nesting past the decoder's depth
    big = "9" * 400
    for old, new in (
        ('"workers": 8', f'"workers": {big}'),
        ('"world_size": 3', f'"world_size": {big}'),
        ('"steps_per_s": 2.0', '"steps_per_s": 1e308'),
        ('"workers": 8', '"workers": 1048577'),
    ):
        job.progress_path.write_text(record.to_json().replace(old, new))
        assert new in job.progress_path.read_text()
        assert job.read_progress_as(ME) is None
    job.progress_path.write_text("[" * 3000)
    assert job.read_progress_as(ME) is None
    job.progress_path.write_text(record.to_json().replace('"workers": 8', f'"workers": {MAX_REPORTED_COUNT}'))
    assert job.read_progress_as(ME) == replace(record, workers=MAX_REPORTED_COUNT)


def test_progress_says_whether_the_run_is_at_d2_and_only_a_json_boolean_counts(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-9").prepare()
    record = Progress(40, 1766400000.5, 2.0, 5, 1, 0, ("a100", "v100"), 8, (("a100", 3.0),), True)
    job.record_progress(record)
    assert job.read_progress_as(ME) == record and '"d2": true' in record.to_json()
    assert parse_progress(record.to_json().replace(', "d2": true', "")).d2 is False  # older records
    for hostile in ('"yes"', "1", "null", '["d2"]'):
        job.progress_path.write_text(record.to_json().replace('"d2": true', f'"d2": {hostile}'))
        assert job.read_progress_as(ME) is None


def test_a_ps_jobs_progress_carries_its_ps_and_epochs_and_the_daemon_reads_its_scale_state(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "ps-10").prepare()
    record = Progress(12, 1766400000.5, None, 3, 0, 0, ps=2, epochs_done=1.0, epochs_total=4.0)
    job.record_progress(record)
    assert job.read_progress_as(ME) == record == parse_progress(record.to_json())
    assert parse_progress(record.to_json().replace(', "ps": 2', "")).ps is None  # a data-parallel job's
    for bad in ('"epochs_done": 5.0', '"epochs_done": -1.0', '"epochs_done": null', '"epochs_done": "1"'):
        job.progress_path.write_text(record.to_json().replace('"epochs_done": 1.0', bad))
        assert job.read_progress_as(ME) is None
    assert not job.scale_requested() and job.read_scale_reply_as(ME) is None
    job.request_scale(ScaleRequest(2, 1, 1766400001.0))
    assert job.scale_requested()
    job.take_scale(1766400002)
    assert not job.scale_requested()
    reply = ScaleReply(1766400001.0, True, "applied: 2 workers, 1 PS", 2, 1, 1766400003.0)
    job.reply_scale(reply)
    assert job.read_scale_reply_as(ME) == reply and job.read_scale_reply_as(OTHER) is None


def test_progress_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="progress step"):
        Progress(-1, 1.0, None, 1, 0, 0)
    with pytest.raises(ValueError, match="world_size"):
        Progress(1, 1.0, None, 0, 0, 0)
    with pytest.raises(ValueError, match="device_types"):
        Progress(1, 1.0, None, 1, 0, 0, ("",))
    with pytest.raises(ValueError, match="lacks 'attempt'"):
        parse_progress('{"step": 1, "written_at": 1.0, "world_size": 1, "restart_count": 0}')


def test_next_progress_is_rate_limited_and_measures_the_rate_since_the_last_record() -> None:
    def after(previous: Progress | None, step: int, now: float, force: bool = False) -> Progress | None:
        return next_progress(previous, step=step, now=now, world_size=2, restart_count=0, attempt=0, force=force)

    first = after(None, 1, 1000.0)
    assert first is not None and first.steps_per_s is None and first.world_size == 2
    assert after(first, 5, 1000.0 + PROGRESS_EVERY_S - 0.1) is None
    second = after(first, 41, 1000.0 + 2 * PROGRESS_EVERY_S)
    assert second is not None and second.steps_per_s == 40 / (2 * PROGRESS_EVERY_S)
    # at the end of a run: written at once; over too short a window the previous rate stays
    final = after(second, 42, second.written_at + 0.1, force=True)
    assert final is not None and (final.step, final.steps_per_s) == (42, second.steps_per_s)


def write_checkpoint(root: Path, step: int, sizes: list[int], created_at: float, world: int = 2) -> None:
    files = {f"shard-{r:05d}.pt": FileEntry("0" * 64, size) for r, size in enumerate(sizes)}
    (root / f"ckpt-{step:012d}").mkdir(parents=True)
    (root / f"ckpt-{step:012d}" / "MANIFEST.json").write_text(Manifest(step, world, created_at, files).to_json())


def test_checkpoints_are_listed_newest_first_from_their_manifests(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-7").prepare()
    assert job.list_checkpoints() == ()
    write_checkpoint(job.checkpoints, 20, [100, 200], 1766400020.0)
    write_checkpoint(job.checkpoints, 40, [100, 250], 1766400040.0)
    (job.checkpoints / "ckpt-000000000060").mkdir()  # no manifest: not a checkpoint
    (job.checkpoints / ".tmp-ckpt-000000000080-abc").mkdir()
    (job.checkpoints / "ckpt-000000000050").symlink_to(job.checkpoints / "ckpt-000000000040")
    assert job.list_checkpoints() == (
        CheckpointRecord(40, 1766400040.0, 350, 2),
        CheckpointRecord(20, 1766400020.0, 300, 2),
    )


def test_past_stops_are_the_set_aside_requests_oldest_first(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-7").prepare()
    job.request_stop(StopRequest(StopReason.PREEMPT, 1766400000.0))
    job.set_aside(1766400010)
    job.request_stop(StopRequest(StopReason.RESIZE, 1766400100.0, 40))
    job.set_aside(1766400110)
    (job.control / "stop.handled-1766400200").write_text("{half")  # unreadable: still a stop, reason unknown
    (job.control / "stop.handled-x").write_text("{}")  # not one of ours
    stops = job.past_stops()
    assert [(s.request.reason, s.request.at_step, s.set_aside_at) for s in stops] == [
        (StopReason.PREEMPT, None, 1766400010.0),
        (StopReason.RESIZE, 40, 1766400110.0),
        (StopReason.UNKNOWN, None, 1766400200.0),
    ]


def test_the_result_is_private_and_read_bounded(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-7").prepare()
    assert job.read_result(limit=100) is None
    job.write_result(b"x" * 50)
    assert stat.S_IMODE(job.result_path.stat().st_mode) == 0o600
    assert job.read_result(limit=100) == b"x" * 50
    with pytest.raises(UnsafeFile, match="more than the 10"):
        job.read_result(limit=10)


def test_calls_wait_in_a_private_directory_under_the_root(tmp_path: Path) -> None:
    first, second = call_path(tmp_path / "jobs"), call_path(tmp_path / "jobs")
    assert first.parent == second.parent == tmp_path / "jobs" / "calls" and first != second
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    write_call(first, b"call")
    assert first.read_bytes() == b"call" and stat.S_IMODE(first.stat().st_mode) == 0o600


def test_the_output_tail_is_the_end_of_the_file(tmp_path: Path) -> None:
    out = output_path(tmp_path, "train", 7)
    assert out == tmp_path / "train-7.out"
    with pytest.raises(FileNotFoundError):
        read_tail(out, 10)
    out.write_text("0123456789abcdef")
    assert read_tail(out, 6) == "abcdef" and read_tail(out, 100) == "0123456789abcdef"


def test_progress_records_without_n_still_parse() -> None:
    old = '{"step": 3, "written_at": 1.0, "steps_per_s": null, "world_size": 1, "restart_count": 0, "attempt": 0}'
    assert parse_progress(old).workers is None
    with pytest.raises(ValueError, match="progress workers"):
        Progress(1, 1.0, None, 1, 0, 0, workers=0)


def test_the_time_limit_requeue_record(tmp_path: Path) -> None:
    job_dir = JobDir(tmp_path / "j-7").prepare()
    assert job_dir.timelimit_requeues() == ()
    assert job_dir.record_timelimit_requeue(2) == (2,)
    assert job_dir.record_timelimit_requeue(0) == (0, 2)
    assert job_dir.record_timelimit_requeue(2) == (0, 2)  # the same incarnation counts once
    assert json.loads(job_dir.requeues_path.read_text()) == {"restarts": [0, 2]}
    job_dir.requeues_path.write_text('{"restarts": "many"}')
    with pytest.raises(ValueError, match="needs a list 'restarts', got 'many'"):
        job_dir.timelimit_requeues()
    job_dir.requeues_path.write_text('{"restarts": [-1]}')
    with pytest.raises(ValueError, match="requeued restart count must be a non-negative integer, got -1"):
        job_dir.timelimit_requeues()


def test_an_ack_may_name_the_stop_it_answers() -> None:
    said = Ack(7, 0, 3, Path("/c"), 100.0, StopReason.SIGTERM)
    assert parse_ack(said.to_json()) == said and json.loads(said.to_json())["reason"] == "sigterm"
    silent = Ack(7, 0, 3, Path("/c"), 100.0)
    assert "reason" not in json.loads(silent.to_json()) and parse_ack(silent.to_json()).reason is None
    with pytest.raises(ValueError, match="stop reason must be one of"):
        parse_ack(said.to_json().replace("sigterm", "nap"))


def test_an_ack_of_a_rank_0_that_stopped_on_the_other_ranks_word_is_read(tmp_path: Path) -> None:
    """Rank 0 acknowledges with reason ``unknown`` when another rank saw the stop file first; the wrapper must still
    read that acknowledgement (refusing it made a resize end the job as if training had finished)."""
    job_dir = JobDir(tmp_path / "job")
    job_dir.prepare()
    ack = Ack(7, 0, 3, tmp_path / "ckpt", 100.0, StopReason.UNKNOWN)
    job_dir.acknowledge(ack)
    assert job_dir.read_ack() == parse_ack(ack.to_json()) == ack
