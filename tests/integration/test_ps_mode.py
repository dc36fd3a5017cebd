"""PS mode on the real dev cluster, submitted with ``hpc-elastic submit --mode ps`` on the ``cpu`` partition: the
wrapper runs the job master, 2 parameter servers and 3 workers, each as its own ``srun`` step, and trains Wide & Deep
asynchronously to the end with every sample counted exactly once per epoch; a parameter server killed with SIGKILL
mid-epoch (``scancel --signal=KILL`` of its step) is replaced inside the running job from the latest checkpoint,
the same workers going on; a worker's step killed the same way afterwards is a lost worker whose shards go back to
TODO; a worker that outgrows its step's memory (the ``worker_ballast_mb`` knob) is killed by Slurm, told from a
crash by its step's accounting, and comes back as a new step with twice the memory (Brain's adjust); in a job of
a whole node (``--exclusive``) whose PS runs hot, Brain replaces the PS by a step of more cores than the job's task
size, and a plan whose steps fit no node of the allocation is refused with the reason; and the daemon
(``hpc-elastic-sched``) preempts a ps job that attained more CPU-core-time for one that does not fit the partition's
free cores, the preempted job checkpointing, requeueing and finishing from its checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.jobdir import JobDir, ScaleReply
from hpc_elastic.ps.rpc import Client, PeerUnavailable
from hpc_elastic.slurm import CliSlurm, Job
from slurm_plugin.store import Store
from tests.integration.conftest import wait_for
from tests.integration.plugin_helpers import ended, run_once, write_config

pytestmark = [pytest.mark.integration, pytest.mark.cpu_lane]

SAMPLES = 2000
NAME = "ps-mode-test"


def submit_ps(
    workdir: Path,
    settings: dict[str, Any],
    workers: str = "3:3",
    ps: str = "2:2",
    extra: tuple[str, ...] = (),
    name: str = NAME,
) -> int:
    """``hpc-elastic submit --mode ps`` of a job of 2 PS and 3 workers (by default) on the cpu partition; the job
    id."""
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(settings))
    argv = [
        *(sys.executable, "-m", "hpc_elastic", "submit", str(path), f"--ckpt-root={workdir}", "--mode=ps"),
        *(f"--workers-range={workers}", f"--ps-range={ps}", "--partition=cpu", "--time=10", f"--job-name={name}"),
        *extra,
    ]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout
    return int(out.strip())


def final_status(slurm: CliSlurm, workdir: Path, job_id: int, name: str = NAME) -> tuple[dict[str, Any], Path]:
    job = wait_for("the PS job to end", lambda: ended(slurm, job_id), timeout_s=500, every_s=2.0)
    run_dir = JobDir.of(workdir, name, job_id).ps
    output = workdir / f"{name}-{job_id}.out"
    log = output.read_text() if output.exists() else ""
    assert job.state.value == "COMPLETED", log
    return json.loads((run_dir / "status.json").read_text()), run_dir


def assert_exactly_once(status: dict[str, Any], epochs: int, samples: int = SAMPLES) -> None:
    assert status["finished"] and not status["failed_shards"] and status["lost"] == []
    assert len(status["epochs"]) == epochs
    for epoch in status["epochs"]:
        assert epoch["exactly_once"] and (epoch["min_count"], epoch["max_count"]) == (1, 1)
        assert sum(epoch["samples_by_worker"].values()) == samples
    held = status["held_out"]  # the model on 5,000 records no worker trained on, trained and untrained
    assert held["final"] < held["initial"] - 0.02, held


def step_cpus(job_id: int) -> list[tuple[str, int]]:
    """Each step's name and allocated CPUs, from sacct."""
    out = subprocess.run(
        ["sacct", "-j", str(job_id), "--noheader", "--parsable2", "--format=JobName,AllocCPUS"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [(name, int(cpus)) for name, cpus in (line.split("|") for line in out.split()) if cpus.isdigit()]


def step_names(job_id: int) -> list[str]:
    """Each step's name, from sacct."""
    return [name for name, _ in step_cpus(job_id)]


def test_submit_mode_ps_runs_master_ps_and_workers_as_srun_steps(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    job_id = submit_ps(workdir, {"num_samples": SAMPLES, "shard_size": 100, "batch_size": 50, "epochs": 2})
    cleanup.append(job_id)
    status, run_dir = final_status(slurm, workdir, job_id)
    assert_exactly_once(status, 2)
    assert sorted(status["registered"]) == ["w0", "w1", "w2"] and status["ps_replaced"] == []
    assert {"master", "ps0", "ps1", "w0", "w1", "w2"} <= set(step_names(job_id))
    for name in ("master", "ps0", "ps1", "w0"):
        assert (run_dir / f"{name}.log").exists()


def _master_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        address = (run_dir / "master.addr").read_text()
    except FileNotFoundError:
        return None
    client = Client(address, timeout=10)
    try:
        reply, _ = client.call("status")
    except PeerUnavailable:
        return None
    finally:
        client.close()
    return reply


def _step_id(job_id: int, name: str) -> str | None:
    out = subprocess.run(
        ["squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i %j"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    ids = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]]
    return ids[0] if ids else None


def _kill_step(job_id: int, name: str) -> None:
    step = wait_for(f"the {name} step", lambda: _step_id(job_id, name), timeout_s=30)
    subprocess.run(["scancel", "--signal=KILL", step], check=True, timeout=30)


def test_a_ps_killed_mid_epoch_is_replaced_in_the_running_job_then_a_worker_is_lost(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    epochs = 6
    job_id = submit_ps(workdir, {"num_samples": SAMPLES, "shard_size": 50, "batch_size": 25, "epochs": epochs})
    cleanup.append(job_id)
    run_dir = JobDir.of(workdir, NAME, job_id).ps

    def when(cond: Any) -> Any:
        def probe() -> dict[str, Any] | None:
            status = _master_status(run_dir)
            return status if status is not None and cond(status) else None

        return probe

    before = wait_for(
        "the first epoch under way",
        when(lambda s: s["checkpoint_seq"] >= 2 and not s["epochs"][1]["complete"]),  # in epoch 0 or 1
        timeout_s=300,
        every_s=0.5,
    )
    _kill_step(job_id, "ps1")
    wait_for("the PS replaced", when(lambda s: s["rollbacks"] == 1), timeout_s=120, every_s=0.5)
    _kill_step(job_id, "w2")
    status, _ = final_status(slurm, workdir, job_id)
    assert status["lost"] == ["w2"]
    status["lost"] = []
    assert_exactly_once(status, epochs)
    assert [r["index"] for r in status["ps_replaced"]] == [1] and status["rollbacks"] == 1
    assert status["ps_replaced"][0]["checkpoint"] >= before["checkpoint_seq"]  # the queues of a checkpoint
    assert sorted(status["registered"]) == ["w0", "w1", "w2"]  # no worker restarted or added
    assert step_names(job_id).count("ps1") == 2  # the killed step and its replacement


def test_with_ranges_brain_samples_optimizes_and_adjusts_inside_the_allocation(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    samples = 60_000
    job_id = submit_ps(workdir, {"num_samples": samples, "shard_size": 100, "batch_size": 50}, workers="1:4", ps="1:2")
    cleanup.append(job_id)
    status, _ = final_status(slurm, workdir, job_id)
    brain = status["brain"]
    assert [s["stage"] for s in brain["steps"][:2]] == ["sample", "optimize"], brain
    fallbacks = brain["fallbacks"]  # back to the best observed plan after one measured slower
    assert brain["cores"] == 6 and brain["adjust_steps"] == len(brain["steps"]) - 2 - len(fallbacks)
    for back in fallbacks:
        assert back["from"]["samples_s"] < back["to"]["samples_s"], back
    first = brain["steps"][0]
    assert (first["workers"], first["ps_cores"]) == (1, [1, 1]) and first["samples_s"] > 0
    for step in brain["steps"]:
        assert 1 <= step["workers"] <= 4 and 1 <= len(step["ps_cores"]) <= 2
        assert step["workers"] * step["worker_cores"] + sum(step["ps_cores"]) <= 6  # never beyond the allocation
    lost = set(status["lost"])  # workers Brain scaled in
    status["lost"] = []
    assert_exactly_once(status, 1, samples)
    assert lost <= set(status["registered"])


def test_usr1_mid_epoch_checkpoints_requeues_and_the_next_run_restores_exactly_once(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # long enough (about 20 s of training here) for the signal to come mid-epoch: 2,000 samples take under a second
    epochs, samples = 2, 60_000
    job_id = submit_ps(workdir, {"num_samples": samples, "shard_size": 50, "batch_size": 25, "epochs": epochs})
    cleanup.append(job_id)
    job_dir = JobDir.of(workdir, NAME, job_id)
    wait_for(
        "the first epoch under way",
        lambda: (s := _master_status(job_dir.ps)) is not None and s["shards_done"] >= 8 and s["queues"]["epoch"] == 0,
        timeout_s=300,
        every_s=0.5,
    )
    # the checkpoint signal, as the daemon or a user sends it (scancel --signal=USR1 --batch)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job_id)], check=True, timeout=30)
    status, _ = final_status(slurm, workdir, job_id)
    job = slurm.job(job_id)
    assert job.restart_count == 1
    ack_name = sorted(p.name for p in job_dir.control.glob("ack.json.handled-*"))
    assert len(ack_name) == 1  # the first run's acknowledgement, set aside by the second
    ack = json.loads((job_dir.control / ack_name[0]).read_text())
    assert ack["reason"] == "preempt" and ack["restart_count"] == 0
    assert status["restored_from"] == ack["step"]  # the stop's checkpoint, the last of the first run
    assert_exactly_once(status, epochs, samples)
    first_run = {w: n for w, n in status["epochs"][0]["samples_by_worker"].items() if not w.startswith("r1")}
    assert sum(first_run.values()) >= 8 * 50  # the first run's samples, still credited
    assert sorted(status["registered"]) == ["r1w0", "r1w1", "r1w2"]


def _scale(job_id: int, workdir: Path, workers: int | None, ps: int | None) -> subprocess.CompletedProcess[str]:
    sizes = [*([f"--workers={workers}"] if workers else []), *([f"--ps={ps}"] if ps else [])]
    argv = [sys.executable, "-m", "hpc_elastic", "scale", str(job_id), *sizes, f"--ckpt-root={workdir}"]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)


def _training(run_dir: Path, workers: int) -> dict[str, Any] | None:
    """The master's status once exactly ``workers`` workers are alive and each holds a shard or has trained one."""
    status = _master_status(run_dir)
    if status is None or not status["epochs"]:
        return None
    alive = set(status["registered"]) - set(status["lost"])
    trained = status["epochs"][0]["samples_by_worker"]
    ok = len(alive) == workers and all(w in status["doing_by_worker"] or trained.get(w) for w in alive)
    return status if ok else None


def _new_reply(job_dir: JobDir, previous: ScaleReply | None) -> ScaleReply | None:
    reply = job_dir.read_scale_reply()
    return reply if reply is not None and reply != previous else None


@pytest.mark.timeout(600)
def test_hpc_elastic_scale_sets_workers_and_ps_of_the_running_job_within_one_epoch(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # an epoch long enough for three requests (80,000 samples train in about 14 s with batched leases)
    # a whole node (--exclusive): Brain's plans may give a process more than the task size of one core (its sample
    # plan ran one worker of 4 cores here); a user's request gives the job processes of the task size, Brain's
    # replaced, so 4 workers and 2 PS take 6 of the 7 cores beside the master
    samples = 600_000  # a CI run on a faster host ended an epoch of 250,000 before the second request
    settings = {"num_samples": samples, "shard_size": 100, "batch_size": 50}
    job_id = submit_ps(workdir, settings, workers="1:4", ps="1:2", extra=("--exclusive", "--mem=12000"))
    cleanup.append(job_id)
    job_dir = JobDir.of(workdir, NAME, job_id)
    wait_for("the job training", lambda: (s := _master_status(job_dir.ps)) is not None and s["shards_done"] >= 2,
             timeout_s=300, every_s=0.5)  # fmt: skip
    bad = _scale(job_id, workdir, 5, None)  # beyond --workers-range: one line, exit 2, nothing written
    assert bad.returncode == 2 and "--workers 5 is outside the job's range 1:4" in bad.stderr, bad
    assert not job_dir.scale_path.exists()
    during: list[dict[str, Any]] = []
    for workers, ps in ((2, 1), (4, 2), (1, 1)):
        previous = job_dir.read_scale_reply()
        done = _scale(job_id, workdir, workers, ps)
        assert done.returncode == 0, done.stderr
        what = f"{workers} workers, {ps} PS"
        reply = wait_for(f"the answer to {what}", partial(_new_reply, job_dir, previous), timeout_s=120)
        assert (reply.applied, reply.workers, reply.ps) == (True, workers, ps), reply
        status = wait_for(f"{what} training", partial(_training, job_dir.ps, workers), timeout_s=120)
        during.append(status)
    assert all(s["queues"]["epoch"] == 0 and not s["finished"] for s in during)  # all within the one epoch
    assert [s["num_ps"] for s in during] == [1, 2, 1]
    status, _ = final_status(slurm, workdir, job_id)
    assert status["brain"]["interrupted"] is True  # the user's request took the job from Brain
    lost = set(status["lost"])  # workers scaled in (or replaced: a step still starting when the PS changed)
    status["lost"] = []
    assert_exactly_once(status, 1, samples)
    registered = set(status["registered"])
    assert len(registered - lost) == 1  # one worker left
    # a worker that never registered never leased a shard
    assert set(status["epochs"][0]["samples_by_worker"]) <= registered


def test_a_worker_out_of_memory_comes_back_as_a_new_step_with_twice_the_memory(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # each worker's step asks for 1024 MiB (one core); a worker takes 1200 MiB more after its first shard, so Slurm
    # (jobacct_gather/linux with OverMemoryKill) kills it; the allocation has 2560 MiB per core: room for 2048
    samples = 60_000
    settings = {"num_samples": samples, "shard_size": 500, "batch_size": 100, "epochs": 1, "worker_ballast_mb": 1200}
    job_id = submit_ps(workdir, settings, workers="2:2", ps="1:1", extra=("--mem-per-cpu=2560",))
    cleanup.append(job_id)
    status, _ = final_status(slurm, workdir, job_id)
    ooms = status["oom"]
    assert ooms, status
    for record in ooms:
        assert record["role"] == "worker" and record["mem_mb"] == 1024 and record["new_mem_mb"] == 2048
        assert record["max_rss_mb"] > 1024 and record["replaced_by"] in status["registered"]
    lost = set(status["lost"])  # the workers Slurm killed: their shards went back to TODO
    assert lost == {record["process"] for record in ooms}
    status["lost"] = []
    assert_exactly_once(status, 1, samples)
    steps = {step.name: step for step in slurm.steps(job_id)}
    for record in ooms:
        killed, replacement = steps[record["process"]], steps[record["replaced_by"]]
        assert killed.out_of_memory and killed.mem_mb == 1024
        assert replacement.mem_mb == 2048 and not replacement.out_of_memory


def _pending_for_resources(slurm: CliSlurm, job_id: int) -> Job | None:
    job = slurm.job(job_id)
    return job if job.state.is_pending and job.pending_reason == "Resources" else None


def _started(slurm: CliSlurm, job_id: int) -> Job | None:
    job = slurm.job(job_id)
    return job if job.start_time is not None and not job.state.is_pending else None


@pytest.mark.timeout(600)
def test_the_daemon_preempts_a_ps_job_with_more_core_time_for_one_that_does_not_fit(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # the cpu partition: node5-6, 8 CPUs each. A: the master, 1 PS and 2 workers of 3 cores (12 of the 16); B: the
    # master, 1 PS and 1 worker of 2 cores (6, more than the 4 left free). The daemon manages only these two jobs.
    prefix = f"itps{uuid.uuid4().hex[:6]}"
    config = write_config(workdir, prefix, "[preemption]\nmin_run_time_s = 0\ngrace_s = 60\nrequeue_wait_s = 20\n")
    name_a, name_b = f"{prefix}-a", f"{prefix}-b"
    epochs, samples = 2, 60_000
    settings_a = {"num_samples": samples, "shard_size": 50, "batch_size": 25, "epochs": epochs}
    job_a = submit_ps(workdir, settings_a, "2:2", "1:1", ("--cpus-per-worker=3",), name_a)
    cleanup.append(job_a)
    dir_a = JobDir.of(workdir, name_a, job_a)
    wait_for(
        "A training in its first epoch",
        lambda: (s := _master_status(dir_a.ps)) is not None and s["shards_done"] >= 8 and s["queues"]["epoch"] == 0,
        timeout_s=300,
        every_s=0.5,
    )
    first_run = slurm.job(job_a)
    assert first_run.cpus == 12 and first_run.restart_count == 0
    settings_b = {"num_samples": SAMPLES, "shard_size": 100, "batch_size": 50, "epochs": 2}
    job_b = submit_ps(workdir, settings_b, "1:1", "1:1", ("--cpus-per-worker=2",), name_b)
    cleanup.append(job_b)
    waiting = wait_for("B waiting for cores", partial(_pending_for_resources, slurm, job_b))
    assert waiting.state.is_pending

    doc = run_once(config)  # the pass, then follow-up passes until A's checkpoint and requeue are done
    preempts = [a for a in doc["recent_actions"] if a["kind"] == "preempt"]
    assert [a["job_id"] for a in preempts] == [job_a], doc["recent_actions"]
    preempt = preempts[0]
    assert preempt["ok"] and "checkpoint requested" in preempt["detail"], preempt
    assert preempt["reason"].startswith("ps job: ") and f"go to ps job {job_b} (0 core-s, 6 cores)" in preempt["reason"]
    assert "its 12 cores" in preempt["reason"] and "on partition cpu" in preempt["reason"]
    record = Store(config.parent / "state", read_only=True).load()[job_a]
    assert record.preemptions == 1 and record.executed_time > 0
    assert slurm.job(job_a).restart_count == 1  # requeued (by its wrapper after the acknowledgement)

    started_b = wait_for("B to start", partial(_started, slurm, job_b))
    assert started_b.start_time is not None
    assert started_b.start_time.timestamp() >= int(preempt["time"])  # B started after the preemption
    status_b, _ = final_status(slurm, workdir, job_b, name_b)
    assert_exactly_once(status_b, 2)
    assert status_b["restored_from"] is None and slurm.job(job_b).restart_count == 0

    status_a, _ = final_status(slurm, workdir, job_a, name_a)
    second_run = slurm.job(job_a)
    assert second_run.restart_count == 1
    assert second_run.start_time is not None and second_run.start_time >= started_b.start_time
    handled = sorted(dir_a.control.glob("ack.json.handled-*"))
    assert len(handled) == 1  # the first run's acknowledgement, set aside by the second
    ack = json.loads(handled[0].read_text())
    assert ack["reason"] == "preempt" and ack["restart_count"] == 0 and ack["job_id"] == job_a
    assert preempt["time"] <= ack["written_at"]  # the checkpoint answered the daemon's request
    assert status_a["restored_from"] == ack["step"]  # restored from the stop's checkpoint, DOING first
    assert_exactly_once(status_a, epochs, samples)
    first = {w: n for w, n in status_a["epochs"][0]["samples_by_worker"].items() if not w.startswith("r1")}
    assert sum(first.values()) >= 8 * 50  # the first run's samples, still credited
    assert sorted(status_a["registered"]) == ["r1w0", "r1w1"]


@pytest.mark.timeout(600)
def test_brain_replaces_a_hot_ps_by_a_step_larger_than_the_task_size_inside_the_allocation(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    # tasks of one core (the master, 1 PS, 2 workers: a budget of 3), on a whole node (--exclusive: 8 CPUs, 7 beside
    # the master); a hot threshold of 5 % makes the one PS hot as soon as it trains
    samples = 250_000
    settings = {"num_samples": samples, "shard_size": 100, "batch_size": 50, "hot_threshold": 0.05}
    job_id = submit_ps(workdir, settings, workers="1:2", ps="1:1", extra=("--exclusive", "--mem=12000"))
    cleanup.append(job_id)
    status, _ = final_status(slurm, workdir, job_id)
    brain = status["brain"]
    assert brain["cores"] == 7, brain  # the node's 8 CPUs less the master's
    stages = [s["stage"] for s in brain["steps"]]
    assert stages[:2] == ["sample", "optimize"] and "adjust" in stages, brain
    hot = [s for s in brain["steps"] if s["stage"] == "adjust" and "hot PS" in s["reasons"][0]]
    assert hot and max(hot[0]["ps_cores"]) > 1, brain  # larger than the task size of one core
    for step in brain["steps"]:
        assert step["workers"] * step["worker_cores"] + sum(step["ps_cores"]) <= 7
    for refused in brain["refused"]:  # a PS that would not fit beside the one it replaces: refused, never pending
        assert any(why in refused["reason"] for why in ("fits no node", "rolled back", "measured slower")), refused
    largest = max(max(s["ps_cores"]) for s in brain["steps"])
    ps_steps = [cpus for name, cpus in step_cpus(job_id) if re.fullmatch(r"ps\d+", name)]
    assert max(ps_steps) == largest > 1, ps_steps  # Slurm ran the larger PS as a step of that many CPUs
    assert len(ps_steps) >= 2  # the first PS and its replacement(s)
    lost = set(status["lost"])  # workers Brain scaled in
    status["lost"] = []
    assert_exactly_once(status, 1, samples)
    assert lost <= set(status["registered"])
