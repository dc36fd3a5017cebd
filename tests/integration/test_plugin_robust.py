"""hpc-elastic-sched on the real dev cluster: hostile job names, bad configuration, slurmctld restarting."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm, JobState, SlurmError
from slurm_plugin.scenario import DaemonProcess
from tests.integration.conftest import DEV_CLUSTER, stop_controller, wait_for

pytestmark = pytest.mark.integration
HOSTILE = ("x; rm -rf /tmp/y", "$(touch /tmp/pwned)")
MARK = "hpc-elastic:v=1,workers=4,min=4,max=4,unit=gpu,backend=torch,gpu_type=a100"


def sched(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli", *args], check=False, capture_output=True, text=True, timeout=150
    )


def test_hostile_job_names_execute_nothing(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    victim_dir = Path("/tmp/y")
    victim_dir.mkdir(exist_ok=True)
    keep = victim_dir / f"keep-{uuid.uuid4().hex[:8]}"
    keep.write_text("must survive\n")
    pwned = Path("/tmp/pwned")
    pwned.unlink(missing_ok=True)
    for name in HOSTILE:  # marked as submitted through hpc-elastic; 8 a100 GPUs each: one runs, one waits
        submitted.append(
            slurm.submit(
                script_text="#!/bin/bash\nsleep 300\n",
                options=[
                    f"--job-name={name}",
                    "--partition=gpu-a100",
                    "--nodes=2",
                    "--gres=gpu:a100:4",
                    f"--comment={MARK}",
                    f"--output={workdir}/hostile-%j.out",
                ],
            )
        )
    wait_for("one hostile job to run", lambda: any(j.state.is_running for j in slurm.jobs(submitted)), timeout_s=120)
    state = workdir / "state"
    state.mkdir()
    config = workdir / "sched.toml"
    # the pattern matches exactly the two names; a 1 GPU-s threshold makes the running one a victim at once
    config.write_text(
        f'state_dir = "{state}"\njob_name_pattern = "^(x; rm -rf /tmp/y|\\\\$\\\\(touch /tmp/pwned\\\\))$"\n'
        f'ckpt_roots = ["{workdir}"]\n[tiresias]\nthresholds = [1.0]\n[preemption]\nmin_run_time_s = 0\n'
        "grace_s = 5\nrequeue_wait_s = 1\n[metrics]\nenabled = false\n"
    )
    out = sched("--config", str(config), "--once")
    assert out.returncode == 0, out.stderr
    doc = json.loads((state / "state.json").read_text())
    assert sorted(job["name"] for job in doc["jobs"]) == sorted(HOSTILE)  # names kept verbatim
    kinds = {a["kind"] for a in doc["recent_actions"] if a["ok"]}
    assert "order" in kinds  # the daemon did act on these jobs
    queue = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "queue", "--config", str(config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert queue.returncode == 0, queue.stderr
    time.sleep(1)
    assert keep.read_text() == "must survive\n"
    assert not pwned.exists()
    keep.unlink()


def test_bad_config_exits_2_with_each_reason(workdir: Path) -> None:
    bad = workdir / "bad.toml"
    bad.write_text(
        f'state_dir = "{workdir}/does-not-exist"\npolicy = "tiresias-las"\nfrobnicate = true\n'
        '[tiresias]\nthresholds = [100.0, 50.0]\n[preemption]\ngrace_s = -1\n[metrics]\naddress = "0.0.0.0"\n'
    )
    out = sched("--config", str(bad), "--once")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert any("unknown key 'frobnicate'" in line for line in lines)
    assert any("thresholds" in line and "strictly increasing" in line for line in lines)
    assert any("preemption.grace_s" in line for line in lines)
    assert any("loopback" in line for line in lines)
    assert any("does not exist" in line for line in lines)
    assert all(line.startswith("hpc-elastic-sched: ") for line in lines)
    assert sched("--config", str(workdir / "missing.toml"), "--once").returncode == 2
    broken = workdir / "broken.toml"
    broken.write_text("state_dir = \n")
    out = sched("--config", str(broken), "--once")
    assert out.returncode == 2 and "not valid TOML" in out.stderr


def _slurmctld_up(slurm: CliSlurm) -> bool:
    try:
        slurm.ping()
        return True
    except SlurmError:
        return False


@pytest.mark.disruptive
def test_slurmctld_restart_mid_run_causes_no_wrong_action(slurm: CliSlurm, workdir: Path, submitted: list[int]) -> None:
    prefix = f"itr{uuid.uuid4().hex[:6]}"
    stepper = Path(__file__).resolve().parent.parent / "data" / "workers" / "stepper.py"
    job_id = int(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "hpc_elastic",
                "submit",
                str(stepper),
                "--gpus=2",
                "--gpu-type=a100",
                "--partition=gpu-a100",
                f"--job-name={prefix}-run",
                f"--ckpt-root={workdir}",
                "--",
                "100000",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    )
    submitted.append(job_id)
    wait_for("the job to run", lambda: slurm.job(job_id).state is JobState.RUNNING, timeout_s=90)
    state = workdir / "state"
    state.mkdir()
    config = workdir / "sched.toml"
    # alone on its GPUs, the job must never be preempted or requeued, whatever the daemon reads
    config.write_text(
        f'state_dir = "{state}"\njob_name_pattern = "^{prefix}-"\nckpt_roots = ["{workdir}"]\ninterval_s = 2\n'
        "max_consecutive_errors = 50\n[tiresias]\nthresholds = [1.0]\n[preemption]\nmin_run_time_s = 0\n"
        "[metrics]\nenabled = false\n"
    )
    daemon = DaemonProcess(config, workdir / "daemon.log")
    daemon.start()
    try:
        doc_path = state / "state.json"
        wait_for("a first pass", doc_path.exists, timeout_s=30)
        before = json.loads(doc_path.read_text())
        attained_before = before["jobs"][0]["attained_gpu_s"]
        try:
            stop_controller(slurm)
            time.sleep(8)  # several passes fail while the controller is away
            assert daemon.alive
        finally:
            subprocess.run([str(DEV_CLUSTER), "up"], check=False, capture_output=True, timeout=300)
            wait_for("slurmctld to answer again", lambda: _slurmctld_up(slurm), timeout_s=120)
        mtime = doc_path.stat().st_mtime
        wait_for("two passes after the restart", lambda: doc_path.stat().st_mtime > mtime + 2, timeout_s=60)
        after = json.loads(doc_path.read_text())
        assert daemon.alive
        job = slurm.job(job_id)
        assert job.state is JobState.RUNNING and job.restart_count == 0
        assert after["jobs"][0]["job_id"] == job_id and after["jobs"][0]["attained_gpu_s"] > attained_before
        wrong = [a for a in after["recent_actions"] if a["kind"] in ("preempt", "requeue", "resize", "size")]
        assert wrong == []
        # one demotion only: the job's record (queue, attained service) survived the outage
        assert (workdir / "daemon.log").read_text().count(f"job {job_id}: demote") == 1
        assert not (workdir / f"{prefix}-run-{job_id}" / "control" / "stop").exists()
    finally:
        daemon.kill(signal.SIGTERM)
        assert _slurmctld_up(slurm)
