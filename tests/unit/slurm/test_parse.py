"""Parsers fed with output captured from the real dev cluster (Slurm 22.05.8) and newer-version shapes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from hpc_elastic.slurm import parse
from hpc_elastic.slurm.errors import SlurmParseError
from hpc_elastic.slurm.types import GpuCounts, JobRef, JobState, NodeState, PartitionState


def read(data: Path, name: str) -> str:
    return (data / name).read_text()


def test_squeue_json_running_and_pending_jobs(slurm_data: Path) -> None:
    jobs = {j.job_id: j for j in parse.parse_squeue_json(read(slurm_data, "squeue.json"))}
    gpu = jobs[1]
    assert gpu.state is JobState.RUNNING
    assert gpu.name == "gputest" and gpu.user == "root" and gpu.partition == "gpu"
    assert gpu.gpus == GpuCounts.of({"a100": 2}) and gpu.gpu_count == 2
    assert gpu.nodes == ("node1",) and gpu.node_count == 1
    assert gpu.start_time == datetime.fromtimestamp(1795355318, tz=UTC)
    assert gpu.time_limit_s is None and gpu.memory_mb == 256 and gpu.requeue is True
    two = jobs[2]
    assert two.nodes == ("node5", "node6") and two.gpu_count == 0 and two.cpus == 2 and two.tasks == 2
    assert jobs[3].comment == "hpc-elastic:test" and jobs[3].gpus.as_dict() == {"v100": 8}
    pending = jobs[4]
    assert pending.state is JobState.PENDING and pending.pending_reason == "Resources"
    assert pending.start_time is None and pending.nodes == ()
    assert pending.time_limit_s == 600 and pending.gpus.as_dict() == {"v100": 8}
    done = jobs[5]
    assert done.state is JobState.COMPLETED and done.exit_code == 0 and done.end_time is not None


def test_squeue_json_after_requeue_counts_restart(slurm_data: Path) -> None:
    jobs = {j.job_id: j for j in parse.parse_squeue_json(read(slurm_data, "squeue_after_requeue.json"))}
    requeued = jobs[1]
    assert requeued.state is JobState.PENDING
    assert requeued.pending_reason == "BeginTime"
    assert requeued.restart_count == 1
    assert requeued.nodes == ()


def test_squeue_text_fallback(slurm_data: Path) -> None:
    jobs = {j.name: j for j in parse.parse_squeue_text(read(slurm_data, "squeue_text.txt")) if j.name != "arr"}
    fill = jobs["fill|a100"]  # '|' in name and comment: the fields are separated by \x1f
    assert fill.comment == "hpc-elastic:managed|x" and fill.state is JobState.RUNNING
    assert fill.nodes == ("node1", "node2") and fill.gpus.as_dict() == {"a100": 8}
    assert fill.start_time == datetime(2026, 11, 22, 14, 3, 18, tzinfo=UTC)
    waiter = jobs["waiter"]
    assert waiter.state is JobState.PENDING and waiter.priority == 250 and waiter.time_limit_s == 300
    assert waiter.nodes == () and waiter.start_time is None and waiter.pending_reason == ""
    assert jobs["requeued"].state is JobState.PENDING and jobs["requeued"].comment == ""
    tasks = sorted(
        (j.array_task_id, j.array_job_id, j.job_id)
        for j in parse.parse_squeue_text(read(slurm_data, "squeue_text.txt"))
        if j.name == "arr"
    )
    assert tasks == [(0, 26, 28), (1, 26, 26)]  # the first task listed carries the array's id
    assert fill.array_job_id is None and fill.time_limit_s is None  # UNLIMITED


def test_squeue_text_rejects_wrong_field_count() -> None:
    with pytest.raises(SlurmParseError, match="line 1: expected"):
        parse.parse_squeue_text("1\x1fonly-two\n")


def test_sinfo_json_nodes(slurm_data: Path) -> None:
    nodes = {n.name: n for n in parse.parse_sinfo_json(read(slurm_data, "sinfo.json"))}
    assert sorted(nodes) == [f"node{i}" for i in range(1, 7)]
    node1 = nodes["node1"]
    assert node1.state is NodeState.MIXED and node1.cpus == 8 and node1.memory_mb == 16000
    assert node1.gpus.as_dict() == {"a100": 4}
    assert node1.gpus_allocated.as_dict() == {"a100": 2} and node1.gpus_free.as_dict() == {"a100": 2}
    assert node1.partitions == ("gpu", "gpu-a100") and node1.features == ("a100",) and node1.available
    assert nodes["node3"].gpus_free.total == 0
    assert nodes["node5"].gpus.total == 0 and nodes["node5"].partitions == ("cpu",)


def test_scontrol_nodes_text_agrees_with_sinfo_json(slurm_data: Path) -> None:
    text = {n.name: n for n in parse.parse_scontrol_nodes(read(slurm_data, "scontrol_show_node_busy.txt"))}
    js = {n.name: n for n in parse.parse_sinfo_json(read(slurm_data, "sinfo_busy.json"))}
    assert set(text) == set(js)
    for name, node in text.items():
        assert node.gpus == js[name].gpus
        assert node.gpus_allocated == js[name].gpus_allocated, name
        assert node.cpus == js[name].cpus and node.partitions == js[name].partitions
        assert node.state == js[name].state


def test_partitions(slurm_data: Path) -> None:
    parts = {p.name: p for p in parse.parse_scontrol_partitions(read(slurm_data, "scontrol_show_partition.txt"))}
    assert list(parts) == ["gpu", "gpu-a100", "gpu-v100", "cpu"]
    assert parts["gpu"].default and not parts["cpu"].default
    assert parts["gpu"].nodes == ("node1", "node2", "node3", "node4")
    assert parts["cpu"].state is PartitionState.UP and parts["cpu"].max_time_s is None
    assert parts["gpu"].preempt_mode == "REQUEUE" and parts["gpu"].total_cpus == 32


def test_sacct_json_keeps_each_requeue(slurm_data: Path) -> None:
    jobs = parse.parse_sacct_json(read(slurm_data, "sacct.json"))
    runs_of_1 = [j for j in jobs if j.job_id == 1]
    assert [j.state for j in runs_of_1] == [JobState.REQUEUED, JobState.COMPLETED]
    assert [j.elapsed_s for j in runs_of_1] == [14, 60]
    assert all(j.gpus.as_dict() == {"a100": 2} for j in runs_of_1)
    big = next(j for j in jobs if j.job_id == 3)
    assert big.state is JobState.COMPLETED and big.nodes == ("node3", "node4") and big.gpu_count == 8
    assert big.exit_code == 0 and big.cpus == 2


def test_sacct_text_agrees_with_json(slurm_data: Path) -> None:
    text = parse.parse_sacct_text(read(slurm_data, "sacct_parsable2.txt"))
    by_id: dict[int, list[JobState]] = {}
    for job in text:
        by_id.setdefault(job.job_id, []).append(job.state)
    assert by_id[1][:2] == [JobState.REQUEUED, JobState.COMPLETED]
    first = text[0]
    assert first.start_time == datetime(2026, 11, 22, 13, 48, 38, tzinfo=UTC) and first.elapsed_s == 14
    assert first.gpus.as_dict() == {"a100": 2} and first.memory_mb == 256


def test_sacct_text_skips_steps_and_keeps_pipes_in_comment() -> None:
    fields = [
        "12",
        "12",
        "n",
        "u",
        "COMPLETED",
        "p",
        "a",
        "1",
        "1",
        "1",
        "2",
        "60",
        "node1",
        "1",
        "cpu=1,gres/gpu=1",
        "",
        "1",
        "5",
        "0:15",
        "None",
        "1",
        "100M",
        "a|b",
    ]
    step = ["12.batch", *fields[1:]]
    jobs = parse.parse_sacct_text("|".join(fields) + "\n" + "|".join(step) + "\n")
    assert len(jobs) == 1
    assert jobs[0].comment == "a|b" and jobs[0].signal == 15 and jobs[0].gpus.as_dict() == {"": 1}
    assert jobs[0].time_limit_s == 3600


def test_newer_version_shapes() -> None:
    """Slurm 23.02+ wraps numbers in {set, infinite, number} and states in lists."""
    record = {
        "job_id": 42,
        "name": "x",
        "user_name": "alice",
        "job_state": ["RUNNING"],
        "submit_time": {"set": True, "infinite": False, "number": 1700000000},
        "start_time": {"set": True, "infinite": False, "number": 1700000100},
        "end_time": {"set": True, "infinite": False, "number": 0},
        "time_limit": {"set": True, "infinite": True, "number": 0},
        "priority": {"set": True, "infinite": False, "number": 77},
        "nodes": "gpu[01-02]",
        "node_count": {"set": True, "infinite": False, "number": 2},
        "tres_alloc_str": "cpu=4,gres/gpu=8,gres/gpu:h100=8",
        "memory_per_node": {"set": True, "infinite": False, "number": 1000},
        "exit_code": {"status": ["SUCCESS"], "return_code": {"set": True, "number": 0}},
        "state_reason": "None",
    }
    job = parse.parse_squeue_json(json.dumps({"jobs": [record]}))[0]
    assert job.state is JobState.RUNNING and job.priority == 77 and job.time_limit_s is None
    assert job.nodes == ("gpu01", "gpu02") and job.gpus.as_dict() == {"h100": 8} and job.memory_mb == 2000
    node = {
        "name": "n1",
        "state": ["IDLE", "DRAIN"],
        "cpus": 4,
        "gres": "gpu:h100:8(S:0-1)",
        "gres_used": "gpu:h100:0(IDX:N/A)",
        "partitions": ["p"],
        "reason": {"description": "maint"},
    }
    parsed = parse.parse_sinfo_json(json.dumps({"nodes": [node]}))[0]
    assert parsed.state is NodeState.IDLE and "DRAIN" in parsed.flags and not parsed.available
    assert parsed.gpus_free.as_dict() == {"h100": 8} and parsed.reason == "maint"
    sacct = {
        "job_id": 5,
        "state": {"current": ["COMPLETED"], "reason": "None"},
        "time": {"start": 10, "end": 20, "elapsed": 10, "limit": {"set": True, "number": 5}},
    }
    hist = parse.parse_sacct_json(json.dumps({"jobs": [sacct]}))[0]
    assert hist.state is JobState.COMPLETED and hist.time_limit_s == 300 and hist.elapsed_s == 10


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node[1-3,7]", ("node1", "node2", "node3", "node7")),
        ("gpu[08-10],cpu1", ("gpu08", "gpu09", "gpu10", "cpu1")),
        ("rack[1-2]n[1-2]", ("rack1n1", "rack1n2", "rack2n1", "rack2n2")),
        ("", ()),
        ("(null)", ()),
    ],
)
def test_hostlist_expand(text: str, names: tuple[str, ...]) -> None:
    assert parse.expand_hostlist(text) == names


def test_hostlist_roundtrip_and_errors() -> None:
    names = ("node1", "node2", "node3", "node7", "gpu08", "gpu09", "login")
    assert parse.compress_hostlist(names) == "login,node[1-3,7],gpu[08-09]"
    assert set(parse.expand_hostlist(parse.compress_hostlist(names))) == set(names)
    with pytest.raises(SlurmParseError, match="unbalanced"):
        parse.expand_hostlist("node[1-2")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("UNLIMITED", None), ("10", 600), ("5:00", 300), ("1:02:03", 3723), ("2-00", 172800), ("1-01:00:00", 90000)],
)
def test_durations(text: str, seconds: int | None) -> None:
    assert parse.duration_s(text) == seconds


def test_gres_and_tres() -> None:
    assert parse.gpus_from_gres("gpu:a100:4,gpu:v100:2(S:0)").as_dict() == {"a100": 4, "v100": 2}
    assert parse.gpus_from_gres("gres:gpu:2").as_dict() == {"": 2}
    assert parse.gpus_from_gres("(null)").total == 0
    assert parse.gpus_from_tres(parse.parse_tres("gres/gpu=3,gres/gpu:a100=2")).as_dict() == {"": 1, "a100": 2}
    assert parse.memory_mb("16G") == 16384 and parse.memory_mb("256Mc") == 256 and parse.memory_mb("x") is None


def test_sbatch_and_sprio(slurm_data: Path) -> None:
    assert parse.parse_sbatch_parsable("123\n") == 123
    assert parse.parse_sbatch_parsable("77;cluster\n") == 77
    with pytest.raises(SlurmParseError, match="no job id"):
        parse.parse_sbatch_parsable("sbatch: error: something\n")
    assert parse.parse_sprio_site_factors(read(slurm_data, "sprio.txt")) == {25: 250}


def test_not_json_is_a_parse_error() -> None:
    with pytest.raises(SlurmParseError, match="not JSON"):
        parse.parse_squeue_json("squeue: error: ...")


def test_job_state_spellings() -> None:
    assert parse.job_state("CANCELLED by 0") is JobState.CANCELLED
    assert parse.job_state(["PENDING", "REQUEUED"]) is JobState.PENDING
    assert JobState.parse("PD") is JobState.PENDING and JobState.parse("bogus") is JobState.UNKNOWN
    # squeue's job_state of a requeued job whose reservation had ended (dev cluster): pending, held
    held = JobState.parse("RESV_DEL_HOLD")
    assert held is JobState.parse("RD") is JobState.RESV_DEL_HOLD and held.is_pending and held.is_active
    assert NodeState.parse("mix") is NodeState.MIXED and NodeState.parse("idle*") is NodeState.IDLE


def test_squeue_of_a_job_array_pending_then_running(slurm_data: Path) -> None:
    """Captured on the dev cluster: ``sbatch --array=0-3`` (job 510) while pending (one record, ``510_[0-3]``,
    task ids "0-3") and running (one record per task, task 3 keeping the array's own job id 510)."""
    for name in ("squeue_array_pending.json", "squeue_text_array_pending.txt"):
        text = (slurm_data / name).read_text()
        jobs = parse.parse_squeue_json(text) if name.endswith(".json") else parse.parse_squeue_text(text)
        (pending,) = [j for j in jobs if j.job_id == 510]
        assert pending.state is JobState.PENDING and pending.array_task_id is None
        assert pending.ref == JobRef(510)
    for name in ("squeue_array_running.json", "squeue_text_array_running.txt"):
        text = (slurm_data / name).read_text()
        jobs = parse.parse_squeue_json(text) if name.endswith(".json") else parse.parse_squeue_text(text)
        tasks = sorted((j.array_task_id, j.job_id) for j in jobs if j.array_job_id == 510)
        assert tasks == [(0, 511), (1, 512), (2, 513), (3, 510)]
        assert {str(j.ref) for j in jobs if j.array_job_id == 510} == {"510_0", "510_1", "510_2", "510_3"}


FIXTURES = Path(__file__).parents[2] / "fixtures"


def test_sacct_steps_tell_a_step_killed_over_its_memory_from_one_killed_or_crashed() -> None:
    # captured on the dev cluster (jobacct_gather/linux, OverMemoryKill): step 0 took 400 MiB of its 200, step 1 was
    # killed with scancel --signal=KILL, step 2 exited 3, step 3 finished
    steps = parse.parse_sacct_steps((FIXTURES / "sacct_steps_oom_22.05.txt").read_text())
    by_id = {s.step_id: s for s in steps}
    assert list(by_id) == ["batch", "0", "1", "2", "3"]  # the job's own line skipped
    oom, killed, crashed, done = by_id["0"], by_id["1"], by_id["2"], by_id["3"]
    assert oom.name == "w0" and oom.state is JobState.CANCELLED and oom.signal == 9
    assert oom.mem_mb == 200 and oom.max_rss_mb == pytest.approx(423076 / 1024)
    assert oom.out_of_memory and oom.number == 0
    assert killed.signal == 9 and killed.mem_mb == 200 and not killed.out_of_memory
    assert crashed.state is JobState.FAILED and crashed.exit_code == 3 and crashed.max_rss_mb is None
    assert not crashed.out_of_memory and not done.out_of_memory and done.state is JobState.COMPLETED
    assert by_id["batch"].number is None and by_id["batch"].mem_mb == 1000


def test_sacct_steps_out_of_memory_state_and_bad_lines() -> None:
    (step,) = parse.parse_sacct_steps("12.4|w3|OUT_OF_MEMORY|0:125||cpu=1,mem=1G,node=1\n")
    assert step.out_of_memory and step.mem_mb == 1024 and step.max_rss_mb is None and step.job_id == 12
    with pytest.raises(SlurmParseError, match="expected 6 fields"):
        parse.parse_sacct_steps("12.4|w3|COMPLETED\n")
    with pytest.raises(SlurmParseError, match="bad step id"):
        parse.parse_sacct_steps("x.4|w3|COMPLETED|0:0||\n")


@pytest.mark.parametrize(
    ("text", "mib"), [("423076K", 423076 / 1024), ("12M", 12.0), ("1.5G", 1536.0), ("1048576", 1.0), ("", None)]
)
def test_size_mib(text: str, mib: float | None) -> None:
    assert parse.size_mib(text) == (pytest.approx(mib) if mib is not None else None)


def test_sacct_text_of_names_with_newlines_and_pipes_and_the_reading_without_user_text(slurm_data: Path) -> None:
    """Captured on the dev cluster: job names with a newline and a ``|`` (1386), \\x1e (1387), and bytes sacct
    printed as ``?``. With names, the newline splits job 1386's record in two; without the fields a user writes
    every record reads right, with empty names and comments."""
    with pytest.raises(SlurmParseError, match="sacct line 1: expected 23 fields"):
        parse.parse_sacct_text(read(slurm_data, "sacct_parsable2_hostile_names.txt"))
    jobs = parse.parse_sacct_text(read(slurm_data, "sacct_parsable2_no_user_text.txt"), user_text=False)
    assert [j.job_id for j in jobs] == [1386, 1387, 1388, 1389, 1391]
    assert all(j.name == "" and j.comment == "" and j.user == "root" for j in jobs)
    assert [j.state for j in jobs] == [JobState.COMPLETED] * 4 + [JobState.FAILED]
    assert jobs[-1].exit_code == 3 and jobs[0].elapsed_s == 1
    assert parse.sacct_text_fields(user_text=False) == tuple(
        f for f in parse.SACCT_TEXT_FIELDS if f not in {"JobName", "Comment"}
    )


def test_text_records_end_at_newlines_only() -> None:
    """A name with \\x1e, \\x0c or \\u2028 (str.splitlines would end a record there) stays in its field."""
    names = [name for name, _ in parse.SQUEUE_TEXT_FIELDS]
    for odd in ("rs\x1ename", "ff\x0cname", "ls\u2028x", "nel\x85x"):
        row = {name: "" for name in names} | {"job_id": "7", "name": odd, "state": "PENDING", "user": "alice"}
        (job,) = parse.parse_squeue_text(parse.FIELD_SEPARATOR.join(row[n] for n in names) + "\n")
        assert job.name == odd and job.job_id == 7


def test_a_begin_time_past_year_9999_is_the_far_future_not_a_failed_queue(slurm_data: Path) -> None:
    """Captured on the dev cluster: ``sbatch --begin=now+3000000days`` (1939, year 10240), ``--begin=9999-12-31``
    (1940, whose expected end is past 9999) and ``now+2900000days`` (1941). squeue gives their times as epoch
    seconds past Python's last year, sacct the year with five digits and the seconds cut to one; before, one such
    job failed the parse of the whole queue, and with it every pass of the daemon."""
    raw = json.loads(read(slurm_data, "squeue_begin_far_future.json"))
    assert raw["jobs"][0]["eligible_time"] > parse.FAR_FUTURE.timestamp()
    jobs = {job.job_id: job for job in parse.parse_squeue_json(json.dumps(raw))}
    assert jobs[1939].eligible_time == parse.FAR_FUTURE and jobs[1939].state is JobState.PENDING
    assert jobs[1940].eligible_time == datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert jobs[1941].eligible_time == datetime(9966, 11, 5, 13, 44, 51, tzinfo=UTC)
    accounted = {
        job.job_id: job for job in parse.parse_sacct_text(read(slurm_data, "sacct_parsable2_begin_far_future.txt"))
    }
    assert "10240-08-20T13:44:5|" in read(slurm_data, "sacct_parsable2_begin_far_future.txt")
    assert (
        accounted[1939].eligible_time == parse.FAR_FUTURE and accounted[1940].eligible_time == jobs[1940].eligible_time
    )
    assert {job.job_id for job in parse.parse_squeue_text(read(slurm_data, "squeue_text_begin_far_future.txt"))} == {
        1939,
        1940,
        1941,
    }
    assert parse.epoch(int(parse.FAR_FUTURE.timestamp()) + 1) == parse.FAR_FUTURE
    assert parse.epoch("12345-01-01T00:00:00") == parse.FAR_FUTURE
