"""Scaling a running ps-mode job through its job directory: the request (``control/scale``) as the wrapper reads it
(hostile input refused with a reason), the wrapper's decision against the job's ranges and cores, the marker that
records the ranges, ``hpc-elastic scale``'s checks (one line, exit 2, nothing written), and a job of local processes
scaled by requests while Brain held it."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import hpc_elastic.jobdir as jobdir_module
from hpc_elastic import files
from hpc_elastic.cli.main import cli
from hpc_elastic.collective import Backend
from hpc_elastic.env import JobEnvironment
from hpc_elastic.jobdir import JobDir, ScaleNotice, ScaleReply, ScaleRequest, parse_scale
from hpc_elastic.launch.scale import ScaleConfig, request_scale
from hpc_elastic.launch.spec import JobMarker, MarkerError, MarkerUnit, PsShape, decode_marker
from hpc_elastic.ps.allocation import Books, PsWrapper, apply_sizes, decide_scale, parse_args
from hpc_elastic.ps.job import PsLauncher, StepNotPlaced
from hpc_elastic.ps.placement import Nodes
from hpc_elastic.slurm.types import JobState
from tests.unit.ps.test_allocation import RequeueSlurm, master_status


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"workers": 0, "requested_at": 1}', "scale workers must be an integer in"),
        ('{"workers": true, "requested_at": 1}', "scale workers must be an integer in"),
        ('{"ps": -1, "requested_at": 1}', "scale ps must be an integer in"),
        ('{"ps": 99999, "requested_at": 1}', "scale ps must be an integer in"),
        ('{"requested_at": 1}', "names workers, ps or both"),
        ('{"workers": 2}', "requested_at must be epoch seconds"),
        ('{"workers": 2, "requested_at": 1, "cmd": "rm"}', "unknown key 'cmd'"),
        ("[2]", "JSON object"),
        ("workers=2", "not JSON"),
    ],
)
def test_a_bad_scale_request_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_scale(text)


def test_a_scale_request_round_trips_and_is_set_aside_once_read(tmp_path: Path) -> None:
    job_dir = JobDir(tmp_path / "j-1").prepare()
    request = ScaleRequest(4, None, 10.0)
    job_dir.request_scale(request)
    assert job_dir.take_scale(11) == request
    assert job_dir.take_scale(12) is None
    (handled,) = job_dir.control.glob("scale.handled-11-*")
    assert parse_scale(handled.read_text()) == request  # kept, as read


def test_a_request_written_while_one_is_taken_waits_for_the_next_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper claims the file before it reads it: a second ``hpc-elastic scale`` landing meanwhile is the
    next request, never set aside unread under the first one's name."""
    job_dir = JobDir(tmp_path / "j-1").prepare()
    first, second = ScaleRequest(4, None, 10.0), ScaleRequest(8, None, 11.0)
    job_dir.request_scale(first)
    real = files.read_owned

    def read_then_a_new_request(*args: Any, **kwargs: Any) -> bytes:
        data = real(*args, **kwargs)
        job_dir.request_scale(second)  # the user's second request, between the read and any set-aside
        return data

    monkeypatch.setattr(jobdir_module, "read_owned", read_then_a_new_request)
    assert job_dir.take_scale(11) == first
    monkeypatch.undo()
    assert job_dir.take_scale(11) == second  # same second: the claimed names still differ
    assert len(list(job_dir.control.glob("scale.handled-11-*"))) == 2 and job_dir.take_scale(12) is None


@pytest.mark.parametrize("plant", ["link", "fifo", "large", "garbage"])
def test_a_hostile_scale_file_is_refused_with_the_reason_and_set_aside(tmp_path: Path, plant: str) -> None:
    job_dir = JobDir(tmp_path / "j-1").prepare()
    secret = tmp_path / "secret"
    secret.write_text('{"workers": 2, "requested_at": 1}')
    if plant == "link":
        job_dir.scale_path.symlink_to(secret)
    elif plant == "fifo":
        os.mkfifo(job_dir.scale_path)
    elif plant == "large":
        job_dir.scale_path.write_text(" " * 10_000)
    else:
        job_dir.scale_path.write_text('{"workers": "all"}')
    with pytest.raises(ValueError, match=r"refused|must be"):
        job_dir.take_scale(5)
    assert not job_dir.scale_path.exists() and not job_dir.scale_path.is_symlink()
    assert job_dir.take_scale(6) is None


def test_the_wrapper_decides_within_the_ranges_and_the_allocations_cores() -> None:
    config = parse_args(["--mode=ps", "--ckpt-root=/g", "--workers-range=1:4", "--ps-range=1:2"])
    assert config.cores == 6
    decision = decide_scale(ScaleRequest(4, 2, 1.0), 2, (1,), config, config.cores)
    assert (decision.workers, decision.ps, decision.refusal) == (4, 2, None)
    assert decide_scale(ScaleRequest(None, 1, 1.0), 3, (1, 1), config, config.cores).refusal is None
    out = decide_scale(ScaleRequest(5, None, 1.0), 2, (1,), config, config.cores)
    assert (out.workers, out.ps, out.refusal) == (2, 1, "workers 5 is outside the job's range 1:4")
    # Brain gave the PS 2 cores each: the request asks for processes of the task size, 4 + 2 of 1 core
    assert decide_scale(ScaleRequest(4, None, 1.0), 1, (2, 2), config, config.cores).refusal is None
    wide = parse_args(["--mode=ps", "--ckpt-root=/g", "--workers-range=1:4", "--ps-range=1:2", "--cpus-per-worker=2"])
    out = decide_scale(ScaleRequest(4, 2, 1.0), 1, (2,), wide, 10)
    assert out.refusal == "4 workers and 2 PS of 2 cores need 12 cores; the allocation has 10"
    assert (out.workers, out.ps) == (1, 1)  # the sizes unchanged


@dataclass(frozen=True)
class Proc:
    node: str
    cpus: int


def test_a_request_gives_the_job_the_task_size_in_place_of_brains_sizes() -> None:
    # an --exclusive job of one 8-CPU node, tasks of 1 core: Brain's sample plan ran one worker of 4 cores and 2 PS;
    # the user asks for 2 workers and 1 PS, then 4 and 2 (1 + 4 + 2 = 7 cores of the task size): every step fits
    config = parse_args(["--mode=ps", "--ckpt-root=/g", "--workers-range=1:4", "--ps-range=1:2"])
    node = Nodes.of(["node5"], [8])
    books = Books(node, ("node5", 1), {"w0": ("node5", 4)}, [("node5", 1), ("node5", 1)])
    for workers, ps in ((2, 1), (4, 2), (1, 1)):
        decision = decide_scale(ScaleRequest(workers, ps, 1.0), len(books.worker_cores), books.ps_cores, config, 7)
        assert decision.refusal is None
        apply_sizes(books, decision.workers, decision.ps, config.cpus_per_worker)
        assert sorted(books.worker_cores.values()) == [1] * workers and books.ps_cores == (1,) * ps
    assert "w0" not in books.worker_cores  # Brain's worker of 4 cores left for one of the task size
    # Brain's PS of 3 cores beside 2 workers of 1: a request for 2 PS replaces it; the workers of the task size stay
    books = Books(node, ("node5", 1), {"w0": ("node5", 1), "w1": ("node5", 1)}, [("node5", 3)])
    apply_sizes(books, 2, 2, 1)
    assert books.ps_cores == (1, 1) and books.worker_cores == {"w0": 1, "w1": 1}
    # kept counting Brain's worker at its 4 cores (as the dev cluster's job did), 4 workers and 2 PS overfill the node
    books = Books(node, ("node5", 1), {"w0": ("node5", 4), "w1": ("node5", 1)}, [("node5", 1)])
    with pytest.raises(StepNotPlaced, match="a new worker: a step of 1 cores fits no node"):
        for _ in range(2):
            books.add_worker(cpus=1)
        books.add_ps(1)
    # a job of just the tasks asked for (7 = master + 4 + 2): a PS of 2 cores has no room for its replacement
    # beside the 4 workers it keeps; refused before any step stops or starts
    tight = Nodes.of(["node5"], [7])
    books = Books(tight, ("node5", 1), {f"w{k}": ("node5", 1) for k in range(4)}, [("node5", 2)])
    with pytest.raises(StepNotPlaced, match="a new PS: a step of 1 cores fits no node"):
        apply_sizes(books, 4, 2, 1)


def test_the_wrapper_refuses_a_request_whose_steps_fit_no_node_before_touching_the_job(tmp_path: Path) -> None:
    config = parse_args(["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=1:4", "--ps-range=1:2"])
    wrapper = PsWrapper(config, JobEnvironment(job_id=8, job_name="ps"), RequeueSlurm())  # type: ignore[arg-type]
    wrapper.job_dir.prepare()
    touched: list[str] = []

    class Job:  # a PsJob under srun whose steps are those of the tight allocation above
        def __init__(self) -> None:
            self.nodes = Nodes.of(["node5"], [7])
            self.master_proc = Proc("node5", 1)
            self.workers = {f"w{k}": Proc("node5", 1) for k in range(4)}
            self.ps = [Proc("node5", 2)]
            self.worker_cores = dict.fromkeys(self.workers, 1)
            self.ps_cores = (2,)

        def __getattr__(self, name: str) -> Any:
            touched.append(name)
            raise AssertionError(f"the job was touched: {name}")

    wrapper.job_dir.request_scale(ScaleRequest(4, 2, 5.0))
    reply = wrapper.scale(Job())  # type: ignore[arg-type]
    assert reply is not None and not reply.applied and touched == []
    assert reply.reason.startswith("refused: a new PS: a step of 1 cores fits no node of the allocation"), reply
    assert (reply.workers, reply.ps) == (4, 1)


def test_a_ps_jobs_marker_records_its_ranges() -> None:
    marker = JobMarker(8, 8, 8, MarkerUnit.PROC, Backend.TORCH, ps=PsShape((1, 4), (1, 2), 2))
    text = marker.encode()
    assert text.endswith(",ps_workers=1-4,ps_servers=1-2,cpw=2")
    assert decode_marker(text) == marker and marker.ps is not None and marker.ps.cores == 12
    with pytest.raises(MarkerError, match="together"):
        decode_marker(text.replace(",cpw=2", ""))
    with pytest.raises(MarkerError, match="1 <= A <= B"):
        decode_marker(text.replace("ps_workers=1-4", "ps_workers=4-1"))
    with pytest.raises(MarkerError, match="bad marker ps sizes"):
        decode_marker(text.replace("ps_servers=1-2", "ps_servers=x"))


class ScaleSlurm:
    """One job, as ``scontrol show job`` would give it."""

    def __init__(self, comment: str, state: JobState = JobState.RUNNING, user_id: int | None = None) -> None:
        self.comment, self.state = comment, state
        self.user_id = os.getuid() if user_id is None else user_id

    def job(self, job_id: int) -> object:
        fields = {"job_id": job_id, "name": "ps", "user": "u", "user_id": self.user_id}
        return type("Job", (), {**fields, "state": self.state, "comment": self.comment})()


PS_MARKER = JobMarker(7, 7, 7, MarkerUnit.PROC, Backend.TORCH, ps=PsShape((1, 4), (1, 2), 1)).encode()


@pytest.mark.parametrize(
    ("slurm", "workers", "ps", "message"),
    [
        (ScaleSlurm(PS_MARKER), 5, None, "--workers 5 is outside the job's range 1:4"),
        (ScaleSlurm(PS_MARKER), None, 3, "--ps 3 is outside the job's range 1:2"),
        (ScaleSlurm(PS_MARKER, JobState.PENDING), 2, None, "is PENDING: only a running job scales"),
        (ScaleSlurm(PS_MARKER, user_id=os.getuid() + 1), 2, None, "not yours"),
        (ScaleSlurm("hpc-elastic:v=1,workers=2,min=2,max=2,unit=proc,backend=torch"), 2, None, "not a ps-mode job"),
    ],
)
def test_hpc_elastic_scale_refuses_before_writing(
    tmp_path: Path, slurm: ScaleSlurm, workers: int | None, ps: int | None, message: str
) -> None:
    job_dir = JobDir.of(tmp_path, "ps", 9).prepare()
    with pytest.raises(ValueError, match=message):
        request_scale(slurm, ScaleConfig(9, workers, ps, (tmp_path,)), uid=os.getuid(), now=1.0)  # type: ignore[arg-type]
    assert not job_dir.scale_path.exists()
    written = request_scale(ScaleSlurm(PS_MARKER), ScaleConfig(9, 3, 2, (tmp_path,)), uid=os.getuid(), now=1.0)  # type: ignore[arg-type]
    assert written.take_scale(2) == ScaleRequest(3, 2, 1.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["9"], "give --workers, --ps or both"),
        (["9", "--workers", "0"], "--workers must be at least 1, got 0"),
        (["9", "--ps", "-2"], "--ps must be at least 1, got -2"),
        (["9", "--workers", "two"], "'two' is not a valid integer"),
    ],
)
def test_bad_scale_values_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["scale", *args, f"--ckpt-root={tmp_path}"])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


SAMPLES = 150_000  # one epoch outlasting the four requests, each waiting for its workers to train a shard


Sizes = list[tuple[int | None, int | None]]


def scale_when(job_dir: JobDir, steps: Sizes, replies: list[ScaleReply]) -> threading.Thread:
    """Once the job trains, request each (workers, PS) in turn, waiting for the wrapper's answer to each and for
    the workers it added to have a shard counted."""

    def body() -> None:
        deadline = time.monotonic() + 180
        while (s := master_status(job_dir.ps)) is None or s["shards_done"] < 4:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        for n, (workers, ps) in enumerate(steps):
            at = 1000.0 + n
            job_dir.request_scale(ScaleRequest(workers, ps, at))
            while (reply := job_dir.read_scale_reply()) is None or reply.requested_at != at:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            replies.append(reply)
            while reply.applied and (s := master_status(job_dir.ps)) is not None:
                live = set(s["registered"]) - set(s["lost"])
                trained = s["epochs"][0]["samples_by_worker"]
                if len(live) >= reply.workers and all(trained.get(w, 0) > 0 for w in live):
                    break  # the workers added train (a shard of theirs counted) before the next request
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_scale_requests_take_the_job_from_brain_and_keep_every_sample_exactly_once(tmp_path: Path) -> None:
    settings = {"num_samples": SAMPLES, "shard_size": 100, "batch_size": 50}
    argv = ["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=1:4", "--ps-range=1:2"]
    config = parse_args([*argv, f"--ps-config={json.dumps(settings)}"])
    job = JobEnvironment(job_id=8, job_name="ps")
    # the workers lost here are those the requests scale in; the liveness timeout (its own test: test_job.py) is
    # set beyond what a loaded machine's pauses reach, so that none is declared lost for want of a call
    ps_wrapper = PsWrapper(config, job, RequeueSlurm(), launcher=PsLauncher.LOCAL, liveness_s=600.0)  # type: ignore[arg-type]
    replies: list[ScaleReply] = []
    thread = scale_when(ps_wrapper.job_dir, [(2, 1), (4, 2), (9, None), (1, 1)], replies)
    assert ps_wrapper.run() == 0
    thread.join(timeout=5)
    assert [(r.applied, r.workers, r.ps) for r in replies] == [(True, 2, 1), (True, 4, 2), (False, 4, 2), (True, 1, 1)]
    assert replies[2].reason == "refused: workers 9 is outside the job's range 1:4"
    status: dict[str, Any] = json.loads((ps_wrapper.job_dir.ps / "status.json").read_text())
    assert status["brain"]["interrupted"] is True
    assert status["finished"] and not status["failed_shards"] and len(status["epochs"]) == 1
    epoch = status["epochs"][0]
    assert epoch["exactly_once"] and (epoch["min_count"], epoch["max_count"]) == (1, 1)
    assert sum(epoch["samples_by_worker"].values()) == SAMPLES
    assert len(status["registered"]) == 4 and len(status["lost"]) == 3 and status["num_ps"] == 1
    assert status["expired"] == []  # lost by the requests' scale-in, none for want of a call
    assert len(status["repartition_seconds"]) == 3  # PS 2 -> 1 (Brain's sample plan), 1 -> 2, 2 -> 1
    assert all(epoch["samples_by_worker"].get(w, 0) > 0 for w in status["registered"])
    # its progress record, what the scheduler's DL² reads: its sizes and its epochs (done: 0 or 1 of 1)
    progress = ps_wrapper.job_dir.read_progress()
    assert progress is not None and progress.epochs_total == 1.0 and progress.epochs_done in (0.0, 1.0)
    assert progress.ps in (1, 2) and 1 <= progress.world_size <= 4 and progress.restart_count == 0


@dataclass
class NoticeSlurm:
    """Slurm's view of the wrapper's own job: its AdminComment (what the scheduler daemon set)."""

    admin_comment: str = ""
    reads: int = 0

    def job(self, job_id: int) -> Any:
        self.reads += 1
        return type("Current", (), {"admin_comment": self.admin_comment})()


def test_usr2_takes_the_daemons_scale_notice_of_this_run_once(tmp_path: Path) -> None:
    config = parse_args(["--mode=ps", f"--ckpt-root={tmp_path}", "--workers-range=1:4", "--ps-range=1:2"])
    slurm = NoticeSlurm(ScaleNotice(4, 2, 1_700_000_000.5, 0).encode())
    wrapper = PsWrapper(config, JobEnvironment(job_id=8, job_name="ps"), slurm)  # type: ignore[arg-type]
    assert wrapper.scale_notice() is None and slurm.reads == 0  # no USR2: Slurm is not asked
    wrapper._on_usr2(12, None)
    assert wrapper.wanted()
    assert wrapper.scale_notice() == ScaleRequest(4, 2, 1_700_000_000.5)
    assert not wrapper.usr2
    wrapper._on_usr2(12, None)
    assert wrapper.scale_notice() is None  # the same notice again (a second USR2): taken once
    for comment in (
        ScaleNotice(3, 1, 1_700_000_100.0, 1).encode(),  # for the next run
        "hpc-elastic-stop:reason=preempt,at=1700000100.000,restarts=0",
        "hpc-elastic-scale:workers=3,ps=1;rm -rf /,at=1,restarts=0",
        "",
    ):
        slurm.admin_comment = comment
        wrapper._on_usr2(12, None)
        assert wrapper.scale_notice() is None, comment
    slurm.admin_comment = ScaleNotice(3, 1, 1_700_000_200.0, 0).encode()
    wrapper._on_usr2(12, None)
    assert wrapper.scale_notice() == ScaleRequest(3, 1, 1_700_000_200.0)


@pytest.mark.parametrize("bad", [(0, 1, 1.0, 0), (1, 5000, 1.0, 0), (1, 1, -1.0, 0), (1, 1, 1.0, -1)])
def test_a_bad_scale_notice_is_refused(bad: tuple[int, int, float, int]) -> None:
    with pytest.raises(ValueError, match="scale notice"):
        ScaleNotice(*bad)
