"""hpc-elastic-sched on the real dev cluster: order via SiteFactor, checkpointed preemption.

Each test manages only its own jobs (``job_name_pattern``), so other tests' jobs on the cluster are left alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm, Job, JobState
from slurm_plugin.store import Store
from tests.conftest import DATA
from tests.integration.conftest import wait_for
from tests.integration.plugin_helpers import run_once, write_config

pytestmark = pytest.mark.integration
STEPPER = DATA / "workers" / "stepper.py"


def submit(workdir: Path, name: str, gpus: int, steps: int) -> int:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_elastic",
            "submit",
            str(STEPPER),
            f"--gpus={gpus}",
            "--gpu-type=a100",
            "--partition=gpu-a100",
            f"--job-name={name}",
            f"--ckpt-root={workdir}",
            "--",
            str(steps),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return int(out.stdout.strip())


def running(slurm: CliSlurm, job_id: int) -> bool:
    return slurm.job(job_id).state is JobState.RUNNING


def test_once_orders_pending_jobs_by_site_factor(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    prefix = f"itp{uuid.uuid4().hex[:6]}"
    config = write_config(workdir, prefix, "[preemption]\nenabled = false\n")
    blocker = submit(workdir, f"{prefix}-big", 8, 100000)
    submitted.append(blocker)
    wait_for("the blocker to run", lambda: running(slurm, blocker), timeout_s=60)
    waiting = [submit(workdir, f"{prefix}-w{i}", gpus, 10) for i, gpus in enumerate((2, 4, 1))]
    submitted.extend(waiting)

    dry = run_once(config, "--dry-run")
    assert dry == {}  # --dry-run writes no state and sets nothing
    assert all(job.site_factor in (None, 0) for job in slurm.jobs(waiting, site_factors=True))

    doc = run_once(config)
    factors = {job.job_id: job.site_factor for job in slurm.jobs(waiting, site_factors=True)}
    # all in Q1 and never started: FIFO by submission (Tiresias §3.2.3), strictly decreasing factors
    first, second, third = (factors[job_id] or 0 for job_id in waiting)
    assert first > second > third > 0
    ranks = {job["job_id"]: job["rank"] for job in doc["jobs"]}
    assert ranks[waiting[0]] < ranks[waiting[1]] < ranks[waiting[2]]
    assert {a["job_id"] for a in doc["actions"] if a["kind"] == "order"} == set(waiting)
    assert not [a for a in doc["actions"] if a["kind"] == "preempt"]

    again = run_once(config)
    assert not [a for a in again["actions"] if a["kind"] == "order"]  # only differences are applied


def test_higher_priority_job_preempts_with_checkpoint(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    prefix = f"itp{uuid.uuid4().hex[:6]}"
    # a 1 GPU-second threshold demotes the running 8-GPU job at once; no minimum run time
    config = write_config(
        workdir,
        prefix,
        "[tiresias]\nthresholds = [1.0]\n[preemption]\nmin_run_time_s = 0\ngrace_s = 60\nrequeue_wait_s = 20\n",
    )
    victim = submit(workdir, f"{prefix}-long", 8, 100000)
    submitted.append(victim)
    victim_dir = workdir / f"{prefix}-long-{victim}"
    wait_for(
        "the long job's 8 workers",
        lambda: (
            len((victim_dir / "starts.log").read_text().splitlines()) == 8
            if (victim_dir / "starts.log").exists()
            else None
        ),
        timeout_s=90,
    )
    short = submit(workdir, f"{prefix}-short", 4, 50)
    submitted.append(short)
    wait_for("the short job to wait", lambda: slurm.job(short).state is JobState.PENDING)

    # --dry-run: the same decision is logged, nothing changes in Slurm or on disk
    dry = subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli", "--config", str(config), "--once", "--dry-run"],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert dry.returncode == 0, dry.stderr
    assert f"[dry-run] preempt job {victim}" in dry.stderr
    assert running(slurm, victim) and slurm.job(victim).restart_count == 0
    assert not (victim_dir / "control" / "stop").exists() and not (config.parent / "state" / "state.json").exists()
    assert slurm.jobs([short], site_factors=True)[0].site_factor in (None, 0)

    doc = run_once(config)  # one pass, then follow-up passes until the checkpoint + requeue is done
    preempts = [a for a in doc["recent_actions"] if a["kind"] == "preempt"]
    assert [a["job_id"] for a in preempts] == [victim]
    assert preempts[0]["ok"] and "checkpoint requested" in preempts[0]["detail"]
    assert str(short) in preempts[0]["reason"] and preempts[0]["reason"].startswith("queue 1 ")
    assert slurm.job(victim).restart_count == 1  # requeued (by its wrapper after the ack, or by the daemon)
    ack = json.loads((victim_dir / "control" / "ack.json").read_text())
    assert ack["job_id"] == victim and ack["step"] > 0
    stop = (
        json.loads((victim_dir / "control").joinpath("stop").read_text())
        if (victim_dir / "control" / "stop").exists()
        else {"reason": "preempt"}
    )
    assert stop["reason"] == "preempt"

    wait_for(
        "the short job to start",
        lambda: slurm.job(short).state in (JobState.RUNNING, JobState.COMPLETED) or None,
        timeout_s=60,
    )

    # a requeued job passes through COMPLETING (its epilog) before it waits again; the short job can start meanwhile
    def waiting_victim() -> Job | None:
        job = slurm.job(victim)
        return job if job.state.is_pending else None

    requeued = wait_for("the victim to wait, requeued", waiting_victim)
    assert requeued.restart_count == 1
    record = Store(config.parent / "state", read_only=True).load()[victim]
    assert record.preemptions == 1 and record.queue == 1 and record.attained_service > 1.0
