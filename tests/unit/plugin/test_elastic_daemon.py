"""The daemon under tiresias-las+elastic: the policy's sizes become the daemon's resize actions."""

from __future__ import annotations

from pathlib import Path

from hpc_elastic.slurm import Job, Node
from slurm_plugin.actions import Resize
from tests.unit.plugin.conftest import at, config, marked, start_of
from tests.unit.plugin.test_daemon import FakeSlurm, make


def test_elastic_policy_shrinks_a_borrower_for_a_waiting_job(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    """Job 24 (elastic, 2..8 GPUs) holds all 8 a100 GPUs; job 25 waits for one. The walk counts job 24 at its
    minimum, so job 25 runs, and job 24 keeps the 5 GPUs nobody else waits for: 8 -> 7, with preemption off."""
    jobs, nodes = busy
    jobs = [marked(j, elastic_min=2) if j.job_id == 24 else j for j in jobs]
    cfg = config(
        tmp_path,
        policy="tiresias-las+elastic",
        resize={"enabled": True},
        preemption={"enabled": False, "min_run_time_s": 30},
    )
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 24), 60))
    report = daemon.run_pass()
    assert report.decision is not None and [r.gpus for r in report.decision.resizes] == [7]
    resizes = [a for a in report.actions if isinstance(a, Resize)]
    assert [(r.job_id, r.old_gpus, r.new_gpus) for r in resizes] == [(24, 8, 7)]
    assert "elastic share is 7 GPUs" in resizes[0].reason
    assert fake.calls[-1] == ("cancel", ([24], "USR1", True))  # the checkpoint that starts the resize
