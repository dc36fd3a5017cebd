"""Soak: the daemon over 1,000 managed jobs, a fifth of them hostile (forged markers, acks and directories), for
several passes. No pass may be skipped for the whole cluster, every honest job must be handled, and nothing a
hostile job planted may make the daemon write outside its state directory."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from hpc_elastic.jobdir import Ack, JobDir, StopNotice, StopRequest
from hpc_elastic.slurm import GpuCounts, Job, Node
from slurm_plugin.daemon import Daemon
from slurm_plugin.store import Store
from tests.unit.plugin.conftest import MARK, at, config
from tests.unit.plugin.test_daemon import Clock, FakeSlurm

NODES, GPUS, RUNNING, PENDING = 64, 8, 448, 552
FORGED_MARKERS = [
    "hpc-elastic:v=1,workers=1,min=0,max=1,unit=gpu,backend=torch",
    "hpc-elastic:v=1,workers=1,min=1,max=1,unit=gpu,backend=torch,profile=/dev/zero",
    "hpc-elastic:v=1,workers=1,min=1,max=1,unit=gpu,backend=torch,profile=../../fifo",
    "hpc-elastic:v=1,workers=99999999,min=1,max=1,unit=gpu,backend=torch",
    "hpc-elastic:v=2,workers=1,min=1,max=1,unit=gpu,backend=torch",
    "hpc-elastic:garbage",
    "hpc-elastic:v=1,workers=1,min=1,max=1,unit=gpu,backend=torch,min=1",
]


class HostileSlurm(FakeSlurm):
    """Honest jobs checkpoint and acknowledge when signalled; hostile ones write forged acks (from the future,
    through links, as FIFOs) or nothing at all."""

    def __init__(self, jobs: list[Job], nodes: list[Node], root: Path, hostile: set[int], victim: Path) -> None:
        super().__init__(jobs, nodes)
        self.root, self.hostile, self.victim = root, hostile, victim
        self.rng = random.Random(3)

    def cancel(self, job_ids: object, signal: str | None = None, *, batch: bool = False, full: bool = False) -> None:
        ids = list(job_ids)  # type: ignore[call-overload]
        self.calls.append(("cancel", (ids, signal, batch)))
        for job in self._jobs:
            if job.job_id not in ids:
                continue
            notice = StopNotice.decode(job.admin_comment)
            assert notice is not None, "the daemon signals after its notice"
            job_dir = JobDir(self.root / f"{job.name}-{job.job_id}")
            if job.job_id not in self.hostile:
                job_dir.request_stop(StopRequest(notice.reason, notice.requested_at))
                job_dir.acknowledge(Ack(job.job_id, job.restart_count, 7, Path("/x"), notice.requested_at + 1))
                continue
            trick = self.rng.randrange(3)
            if not job_dir.control.is_dir() or job_dir.path.is_symlink():
                continue
            job_dir.ack_path.unlink(missing_ok=True)
            if trick == 0:  # from the future: once kept the job's GPUs for good
                job_dir.acknowledge(Ack(job.job_id, job.restart_count, 7, Path("/x"), 1e15))
            elif trick == 1:
                job_dir.ack_path.symlink_to(self.victim)
            else:
                os.mkfifo(job_dir.ack_path)


def cluster(template_node: Node) -> list[Node]:
    return [
        replace(
            template_node,
            name=f"gn{i:02d}",
            gpus=GpuCounts.of({"a100": GPUS}),
            gpus_allocated=GpuCounts.of({"a100": RUNNING // NODES}),
            partitions=("gpu", "gpu-a100"),
        )
        for i in range(NODES)
    ]


def test_a_thousand_jobs_a_fifth_hostile(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    captured_jobs, captured_nodes = busy
    running_template = next(j for j in captured_jobs if j.job_id == 24)
    pending_template = next(j for j in captured_jobs if j.job_id == 25)
    assert running_template.start_time is not None and pending_template.submit_time is not None
    nodes = cluster(next(n for n in captured_nodes if n.name == "node1"))
    rng = random.Random(11)
    me, other = os.getuid(), 65534
    root = tmp_path / "jobs"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.mkfifo(tmp_path / "fifo")
    jobs: list[Job] = []
    hostile: set[int] = set()
    for k in range(RUNNING + PENDING):
        job_id = 1000 + k
        bad = rng.random() < 0.2
        if k < RUNNING:
            node = nodes[k // (RUNNING // NODES)].name
            # hostile jobs started first: the most attained service, so the first to be preempted
            started = running_template.start_time + timedelta(seconds=rng.randrange(0, 300) if bad else 300 + k)
            job = replace(
                running_template, job_id=job_id, nodes=(node,), gpus=GpuCounts.of({"a100": 1}), start_time=started
            )
        else:
            submitted = pending_template.submit_time + timedelta(seconds=rng.randrange(0, 3000))
            job = replace(pending_template, job_id=job_id, submit_time=submitted, eligible_time=submitted)
        job = replace(job, name=f"soak{k}", user_id=me, comment=MARK.format(n=1))
        if bad:
            hostile.add(job_id)
            if rng.random() < 0.5:
                job = replace(job, comment=rng.choice(FORGED_MARKERS))
        jobs.append(job)
        job_dir = JobDir(root / f"{job.name}-{job_id}")
        if bad and rng.random() < 0.3:  # a directory linked to an honest job's, or to a site file
            job_dir.path.symlink_to(root / "soak0-1000" if rng.random() < 0.5 else tmp_path)
            continue
        job_dir.prepare()
        if bad:
            (job_dir.control / ".stop.1.tmp").symlink_to(victim)  # the old daemon's predictable temp name
            if me == 0 and rng.random() < 0.5:
                os.chown(job_dir.path, other, other)  # a directory of another user, named like this job's
    honest = {j.job_id for j in jobs} - hostile
    cfg = config(
        tmp_path,
        ckpt_roots=[str(root)],
        manage_all=False,
        tiresias={"thresholds": [600.0]},
        preemption={"min_run_time_s": 0, "grace_s": 60, "requeue_wait_s": 5, "max_per_pass": 50},
    )
    fake = HostileSlurm(jobs, nodes, root, hostile, victim)
    clock = Clock(at(running_template.start_time, 4000))
    daemon = Daemon(cfg, fake, Store(cfg.state_dir), clock=clock, sleep=clock.sleep)
    preempted: set[int] = set()
    requeued: set[int] = set()
    handled: set[int] = set()
    for _ in range(6):
        report = daemon.run_pass()
        assert not report.skipped, report.skipped
        assert report.observation is not None
        seen = {v.job_id for v in report.observation.jobs} | set(report.observation.managed)
        handled |= seen & honest
        assert not (set(report.observation.rejected) & honest)
        for kind, args in fake.calls:
            if kind == "cancel":
                preempted.update(args[0])  # type: ignore[index]
            elif kind == "requeue":
                requeued.update(args)  # type: ignore[arg-type]
        clock.sleep(61.0)  # past the grace period: a job with no valid ack is requeued whatever its files say
    assert handled == honest  # every honest job was seen and scheduled
    assert preempted & hostile, "the soak must preempt hostile jobs, to exercise their forged acks"
    assert preempted & hostile <= requeued  # no forged ack kept a job's GPUs
    assert preempted & honest <= requeued
    assert victim.read_text() == "precious"  # nothing written through a planted link
    for job_id in hostile:  # the daemon writes nothing in job directories: its stop is an AdminComment notice
        job = next(j for j in jobs if j.job_id == job_id)
        path = root / f"{job.name}-{job_id}"
        assert path.is_symlink() or not (path / "control" / "stop").exists()
