"""hpc-elastic-sched on the real dev cluster: elastic resize (grow, shrink) and skew-aware placement.

Only the gpu-a100 partition (node1-2, 4 a100 GPUs each) is used, and each daemon manages only its test's jobs
(``job_name_pattern``). The tests assert the order of events and the values Slurm and the jobs report, never
durations.

Resize story (one run, module fixture): a plain filler holds the 4 GPUs of one node; an elastic training job
(``--gpus=2 --min-gpus=2 --max-gpus=4 --workers=4``) starts on 2 GPUs; with nothing waiting the daemon grows it
into the 2 idle GPUs (checkpoint with stop reason ``resize`` -> requeue -> NumTasks=4); then a 2-GPU job arrives
and waits, and the daemon shrinks the elastic job back to 2 GPUs so that the waiting job starts. The elastic
job's final parameters must equal those of an uninterrupted run with the same N=4 logical workers.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.slurm import CliSlurm, Job, JobState
from slurm_plugin.scenario import TRAINER, DaemonProcess, cancel_active
from tests.conftest import DATA
from tests.integration.conftest import hpc_submit, root_of, wait_for
from tests.integration.plugin_helpers import MARK, ended, run_once, running, write_config, write_resize_config

pytestmark = pytest.mark.integration
STEPPER = DATA / "workers" / "stepper.py"
PARTITION = ("--partition=gpu-a100", "--gpu-type=a100")
#: train_mlp arguments of the elastic job (the reference run uses the same but the delay, which changes no bit)
STEPS = 400
TRAIN_ARGS = (f"--steps={STEPS}", "--step-delay=0.1")
WORKERS = 4


def _plain(slurm: CliSlurm, workdir: Path, name: str, options: list[str]) -> int:
    """A plain ``sbatch`` job that sleeps (a filler, or with ``MARK`` a managed job without a job directory)."""
    return slurm.submit(
        script_text="#!/bin/bash\nsleep 3600\n",
        options=[f"--job-name={name}", "--partition=gpu-a100", f"--output={workdir}/{name}-%j.out", *options],
    )


def _actions(workdir: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads((workdir / "state" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return list(doc.get("recent_actions", []))


def reference_sha(workdir: Path) -> str:
    """The uninterrupted run: train_mlp in one local process with the same N (bitwise identical across M)."""
    job_dir = workdir / "reference"
    job_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_ELASTIC_"))}
    env.update(
        HPC_ELASTIC_BACKEND="torch",
        HPC_ELASTIC_WORKERS=str(WORKERS),
        HPC_ELASTIC_RANK="0",
        HPC_ELASTIC_WORLD_SIZE="1",
        HPC_ELASTIC_JOB_DIR=str(job_dir),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29000 + os.getpid() % 1000),
    )
    result = job_dir / "result.json"
    subprocess.run(
        [sys.executable, str(TRAINER), f"--steps={STEPS}", f"--result={result}"],
        check=True,
        capture_output=True,
        env=env,
        timeout=120,
    )
    doc = json.loads(result.read_text())
    assert doc["world_size"] == 1 and doc["num_workers"] == WORKERS and not doc["stopped"]
    return str(doc["sha256"])


@dataclass
class ElasticRun:
    workdir: Path
    job_dir: Path
    elastic: int
    waiting: int
    #: the elastic job as Slurm reported it while it ran after the grow, and after the shrink
    grown: Job
    shrunk: Job
    waiting_started: Job
    output: str
    result: dict[str, Any]
    reference: str
    actions: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def elastic_run(slurm: CliSlurm, request: pytest.FixtureRequest) -> Iterator[ElasticRun]:
    prefix = f"ite{uuid.uuid4().hex[:6]}"
    workdir = root_of(request.node) / prefix
    workdir.mkdir(parents=True)
    config = write_resize_config(workdir, prefix, grace_s=90)
    daemon = DaemonProcess(config, workdir / "daemon.log")
    ids: list[int] = []
    result_path = workdir / "elastic.result.json"
    try:
        filler = _plain(slurm, workdir, f"{prefix}-filler", ["--nodes=1", "--gres=gpu:a100:4"])  # not managed
        ids.append(filler)
        wait_for("the filler to run", lambda: running(slurm, filler), timeout_s=60)
        elastic = hpc_submit(
            workdir,
            TRAINER,
            "--gpus=2",
            "--min-gpus=2",
            f"--max-gpus={WORKERS}",
            f"--workers={WORKERS}",
            *PARTITION,
            f"--job-name={prefix}-elastic",
            args=(*TRAIN_ARGS, f"--result={result_path}"),
        )
        ids.append(elastic)
        out = workdir / f"{prefix}-elastic-{elastic}.out"

        def said(text: str, count: int = 1) -> bool:
            return out.exists() and out.read_text().count(text) >= count

        wait_for("the elastic job to train on 2 processes", lambda: said("rank 0 of 2 "), timeout_s=120)
        daemon.start()  # 2 a100 GPUs idle, nothing waits: it grows
        grown = wait_for(
            "the elastic job to run again on 4 GPUs",
            lambda: running(slurm, elastic, restarts=1),
            timeout_s=150,
        )
        wait_for("the grown job to train on 4 processes", lambda: said("rank 0 of 4 "), timeout_s=120)
        assert daemon.alive, (workdir / "daemon.log").read_text()
        waiting = hpc_submit(workdir, STEPPER, "--gpus=2", *PARTITION, f"--job-name={prefix}-wait", args=("100000",))
        ids.append(waiting)
        started = wait_for(
            "the waiting job to start",
            lambda: running(slurm, waiting),
            timeout_s=150,
        )
        shrunk = wait_for(
            "the elastic job to run again on 2 GPUs",
            lambda: running(slurm, elastic, restarts=2),
            timeout_s=150,
        )
        done = wait_for(
            "the elastic job to complete",
            lambda: ended(slurm, elastic),
            timeout_s=240,
        )
        assert done.state is JobState.COMPLETED, f"elastic job ended {done.state.value} (see {workdir})"
        actions = _actions(workdir)
        daemon.kill(signal.SIGTERM)
        assert not cancel_active(slurm, ids), "the story's jobs did not end"  # the module's next tests need the GPUs
        yield ElasticRun(
            workdir=workdir,
            job_dir=workdir / f"{prefix}-elastic-{elastic}",
            elastic=elastic,
            waiting=waiting,
            grown=grown,
            shrunk=shrunk,
            waiting_started=started,
            output=out.read_text(),
            result=json.loads(result_path.read_text()),
            reference=reference_sha(workdir),
            actions=actions,
        )
    finally:
        daemon.kill(signal.SIGTERM)
        cancel_active(slurm, ids)


def _resizes(run: ElasticRun) -> list[dict[str, Any]]:
    """The daemon's resize actions on the elastic job, and the ones that set its new size (``size``, or a
    ``requeue`` by the daemon that sets it at once)."""
    return [a for a in run.actions if a["kind"] in ("resize", "size", "requeue") and a["job_id"] == run.elastic]


def test_elastic_job_grows_into_idle_gpus(elastic_run: ElasticRun) -> None:
    run = elastic_run
    resizes = [a for a in _resizes(run) if a["kind"] == "resize"]
    assert resizes and resizes[0]["ok"] and resizes[0]["reason"].startswith("grow: 2 a100 GPU(s) idle")
    assert resizes[0]["detail"].startswith("checkpoint requested")
    sizes = [a for a in _resizes(run) if "NumTasks=" in a["detail"]]
    assert sizes and "NumTasks=4" in sizes[0]["detail"]  # set while the requeued job waited
    # Slurm ran the job's second run with 4 tasks, 4 GPUs; the job itself saw 4 processes, N=4 workers
    assert run.grown.gpu_count == 4 and run.grown.restart_count == 1
    starts = [line for line in run.output.splitlines() if line.startswith("rank 0 of ")]
    assert starts[0].startswith("rank 0 of 2 ") and "restored from nothing at step 0" in starts[0]
    assert starts[1].startswith("rank 0 of 4 ") and f"logical workers {WORKERS};" in starts[1]
    assert "stop (resize) at step" in run.output.split(starts[1])[0]  # it checkpointed for the resize first
    assert "at step 0" not in starts[1]  # and resumed from that checkpoint


def test_elastic_job_shrinks_for_a_waiting_job_with_the_same_result(elastic_run: ElasticRun) -> None:
    run = elastic_run
    resizes = [a for a in _resizes(run) if a["kind"] == "resize"]
    assert [r["reason"].split(":")[0] for r in resizes] == ["grow", "shrink"]  # one of each, in this order
    shrink = resizes[1]
    assert shrink["ok"] and f"job(s) {run.waiting} wait for a100 GPUs" in shrink["reason"]
    # order of events: the waiting job started while the elastic job was requeued, before its 2-GPU run
    assert run.shrunk.gpu_count == 2 and run.shrunk.restart_count == 2
    assert run.waiting_started.start_time is not None and run.shrunk.start_time is not None
    assert run.waiting_started.start_time <= run.shrunk.start_time
    assert run.waiting_started.gpu_count == 2
    starts = [line for line in run.output.splitlines() if line.startswith("rank 0 of ")]
    assert [s.split(" (")[0] for s in starts] == ["rank 0 of 2", "rank 0 of 4", "rank 0 of 2"]
    assert run.output.count("stop (resize) at step") == 2
    # the last run resumed from the resize checkpoint and finished with N=4 on 2 processes
    result = run.result
    assert not result["stopped"] and result["step"] == STEPS
    assert result["world_size"] == 2 and result["num_workers"] == WORKERS
    assert result["restored_from"] is not None and result["start_step"] > 0
    assert result["sha256"] == run.reference  # bitwise identical to the uninterrupted run
    # each incarnation set the previous acknowledgement aside (ack.json.handled-*): one per resize checkpoint
    acks = [json.loads(p.read_text()) for p in (run.job_dir / "control").glob("ack.json*")]
    assert len(acks) == 2 and all(a["job_id"] == run.elastic for a in acks)
    assert result["start_step"] in {a["step"] for a in acks}


# ------------------------------------------------------------------------------------------------ placement


def test_skewed_job_consolidated_others_placed_against_fragmentation(
    slurm: CliSlurm, workdir: Path, submitted: list[int]
) -> None:
    """node1: 2 GPUs held by a plain filler, 2 by a managed victim; node2: 4 by a managed victim. A non-skewed
    2-GPU job (mlp profile, S_J 0.25) and a skewed 4-GPU job (vgg_like profile, S_J 0.79 > PACKLIMIT 0.5) wait.
    One pass demotes and preempts the victims (thresholds [1.0], no job directory: requeued at once) and places
    the waiting jobs first: the skewed one on a single node (NumNodes=1), the other on the planned node that
    leaves the fewest GPUs stranded (best fit, ReqNodeList with ``pin_nodes``)."""
    prefix = f"itl{uuid.uuid4().hex[:6]}"
    config = write_config(
        workdir,
        prefix,
        "[tiresias]\nthresholds = [1.0]\n[preemption]\nmin_run_time_s = 0\ngrace_s = 10\nrequeue_wait_s = 1\n"
        "[placement]\npin_nodes = true\n",
    )
    gres = "--gres=gpu:a100:{}"
    submitted.append(_plain(slurm, workdir, f"{prefix}-filler", ["--nodelist=node1", gres.format(2)]))
    victims = [
        _plain(slurm, workdir, f"{prefix}-v1", ["--nodelist=node1", gres.format(2), f"--comment={MARK}"]),
        _plain(slurm, workdir, f"{prefix}-v2", ["--nodelist=node2", gres.format(4), f"--comment={MARK}"]),
    ]
    submitted.extend(victims)
    wait_for("the filler and victims to run", lambda: all(j.state.is_running for j in slurm.jobs(submitted)))
    spread = hpc_submit(
        workdir,
        STEPPER,
        "--gpus=2",
        *PARTITION,
        "--profile=mlp",
        f"--job-name={prefix}-spread",
        args=("100000", "--progress"),
    )
    submitted.append(spread)
    packed = hpc_submit(
        workdir,
        STEPPER,
        "--gpus=4",
        *PARTITION,
        "--profile=vgg_like",
        f"--job-name={prefix}-packed",
        args=("100000", "--progress"),
    )
    submitted.append(packed)
    wait_for(
        "both jobs to wait",
        lambda: all(j.state is JobState.PENDING and j.pending_reason for j in slurm.jobs([spread, packed])),
    )

    doc = run_once(config)
    places = {a["job_id"]: a for a in doc["recent_actions"] if a["kind"] == "place"}
    assert set(places) == {spread, packed} and all(a["ok"] for a in places.values()), places
    assert "skew 0.79 > PACKLIMIT 0.50: consolidate" in places[packed]["reason"]
    assert "NumNodes=1" in places[packed]["detail"]
    assert "consolidate" not in places[spread]["reason"] and "NumNodes" not in places[spread]["detail"]
    preempted = {a["job_id"] for a in doc["recent_actions"] if a["kind"] == "preempt" and a["ok"]}
    assert preempted == set(victims)
    planned = {job["job_id"]: job["placement"] for job in doc["jobs"]}

    def both_running() -> list[Job] | None:
        jobs = {j.job_id: j for j in slurm.jobs([spread, packed])}
        return [jobs[spread], jobs[packed]] if all(j.state.is_running for j in jobs.values()) else None

    spread_job, packed_job = wait_for("both jobs to start", both_running, timeout_s=90)
    # Slurm's node lists: the skewed job on the fewest nodes (one whole node), the other on the node already
    # partly used (node1: the filler's 2 + its 2), so no node is left with stranded GPUs
    assert packed_job.nodes == ("node2",) and packed_job.gpu_count == 4
    assert spread_job.nodes == ("node1",) and spread_job.gpu_count == 2
    assert planned[packed] == "N=1;L=node2" and planned[spread] == "N=;L=node1"
    # PACKLIMIT's refit (§3.3.2) reads the jobs' reports: once both have recorded a speed, a pass keeps one
    # placement report of each, on one node (consolidated), of its profile's model and skew; one placement per model
    # separates nothing, so PACKLIMIT stays the configured one. (The victims, requeued and waiting, are cancelled
    # first: the pass has nothing else to do.)
    slurm.cancel(victims)

    def speed_of(job: Job) -> float | None:
        path = workdir / f"{job.name}-{job.job_id}" / "control" / "progress.json"
        rate = json.loads(path.read_text()).get("steps_per_s") if path.is_file() else None
        return rate if isinstance(rate, float) and rate > 0 else None

    wait_for("both jobs to report a speed", lambda: all(speed_of(j) for j in (spread_job, packed_job)), timeout_s=60)
    doc = run_once(config)
    assert doc["placement_reports"] == 2 and doc["pack_limit"] == 0.5, doc
    with sqlite3.connect(workdir / "state" / "state.sqlite3") as db:
        rows = db.execute("SELECT job_id, model, skew, consolidated, speed FROM placements ORDER BY job_id").fetchall()
    assert [(r[0], r[1], round(r[2], 2), r[3]) for r in rows] == sorted(
        [(spread, "mlp on a100", 0.25, 1), (packed, "vgg_like on a100", 0.79, 1)]
    )
    assert all(r[4] > 0 for r in rows)
