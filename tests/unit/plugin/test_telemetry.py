"""The daemon reads each running job's telemetry (its observed capability per device type) from the job's
progress record: as the job's user's files only, from the job's current incarnation, and nothing hostile."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from hpc_elastic.jobdir import JobDir, Progress
from hpc_elastic.slurm import Job, JobState, Node
from slurm_plugin.apply import telemetry
from slurm_plugin.config import parse_config
from tests.unit.plugin.conftest import at, start_of
from tests.unit.plugin.test_daemon import PREEMPTING, FakeSlurm, make

ME = os.getuid()
REPORT = (("a100", 35.0), ("v100", 5.0))


def record(
    job_dir: JobDir, restart_count: int, capability: tuple[tuple[str, float], ...] = REPORT, *, d2: bool = False
) -> None:
    job_dir.record_progress(Progress(40, 1766400000.0, 2.0, 3, restart_count, 0, ("a100", "v100"), 8, capability, d2))


def test_capabilities_come_from_running_jobs_of_this_incarnation_and_their_own_user(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    base = Job(job_id=7, name="el", user="u", user_id=ME, state=JobState.RUNNING, restart_count=2)
    jobs = {
        7: base,
        8: replace(base, job_id=8, name="old"),  # its record is of an earlier run
        9: replace(base, job_id=9, name="waits", state=JobState.PENDING),
        10: replace(base, job_id=10, name="other", user_id=65534),  # the directory is not that user's
        11: replace(base, job_id=11, name="bad"),
        12: replace(base, job_id=12, name="none"),  # no report yet
    }
    for job in jobs.values():
        JobDir.of(root, job.name, job.job_id).prepare()
    record(JobDir.of(root, "el", 7), 2, d2=True)
    record(JobDir.of(root, "old", 8), 1, d2=True)
    record(JobDir.of(root, "waits", 9), 2, d2=True)
    record(JobDir.of(root, "other", 10), 2, d2=True)
    bad = JobDir.of(root, "bad", 11)
    record(bad, 2)
    bad.progress_path.write_text(bad.progress_path.read_text().replace("35.0", "NaN"))
    record(JobDir.of(root, "none", 12), 2, ())
    reports = telemetry([root], jobs)
    assert reports.capabilities == {7: REPORT}
    # the D2 guard comes from the same record, of any incarnation of a running job (8's earlier run counts)
    assert reports.d2 == frozenset({7, 8})


def test_the_daemons_state_shows_each_jobs_capability(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    running = next(j for j in jobs if j.job_id == 24)
    jobs = [replace(j, user_id=ME) if j.job_id == 24 else j for j in jobs]
    state = tmp_path / "state"
    state.mkdir()
    cfg = parse_config({"state_dir": str(state), "ckpt_roots": [str(tmp_path / "jobs")], **PREEMPTING})
    record(JobDir.of(tmp_path / "jobs", running.name, 24).prepare(), running.restart_count)
    daemon, _ = make(cfg, FakeSlurm(jobs, nodes), at(start_of(jobs, 24), 60))
    report = daemon.run_pass()
    assert report.capabilities == {24: REPORT}
    by_id = {job["job_id"]: job for job in json.loads((state / "state.json").read_text())["jobs"]}
    assert by_id[24]["capability"] == {"a100": 35.0, "v100": 5.0} and by_id[25]["capability"] == {}
