"""Every policy the daemon runs, on random clusters (two GPU types, nodes of 1-8 GPUs) with rigid and elastic jobs,
running and waiting, with and without a minimum run time (and with a STARVELIMIT every waiting job has passed):
passes run to the end (no exception, no skip), and what
they start, resize or preempt is a job of the cluster."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from hpc_elastic.jobdir import JobDir
from hpc_elastic.policy.registry import DAEMON_POLICY_NAMES
from hpc_elastic.slurm import GpuCounts, Job, Node
from tests.unit.plugin.conftest import at, config
from tests.unit.plugin.test_daemon import FakeSlurm, make

TYPES = ("a100", "v100")


def scenario(seed: int, jobs: list[Job], nodes: list[Node], root: Path) -> tuple[list[Job], list[Node]]:
    """A random cluster and its jobs, from the captured running (24) and pending (25) jobs and node1."""
    rng = random.Random(seed)
    running_template = next(j for j in jobs if j.job_id == 24)
    pending_template = next(j for j in jobs if j.job_id == 25)
    assert running_template.start_time is not None and pending_template.submit_time is not None
    node_template = next(n for n in nodes if n.name == "node1")
    sizes = [(rng.choice(TYPES), rng.choice([1, 2, 4, 8])) for _ in range(rng.randint(2, 6))]
    used = [0] * len(sizes)
    out: list[Job] = []
    for k in range(rng.randint(1, 16)):
        gpu_type = rng.choice(TYPES)
        gpus = rng.choice([1, 1, 2, 4, 8])
        elastic = rng.random() < 0.5
        low, top = (rng.randint(1, gpus), rng.randint(gpus, 2 * gpus)) if elastic else (gpus, gpus)
        typed = rng.random() < 0.5
        comment = f"hpc-elastic:v=1,workers={top},min={low},max={top},unit=gpu,backend=torch" + (
            f",gpu_type={gpu_type}" if typed else ""
        )
        fits = [i for i, (t, size) in enumerate(sizes) if t == gpu_type and size - used[i] >= gpus]
        job_id = 100 + k
        if fits and rng.random() < 0.6:
            node = rng.choice(fits)
            used[node] += gpus
            started = running_template.start_time + timedelta(seconds=rng.randrange(0, 4490))  # some within 300 s
            job = replace(running_template, start_time=started, nodes=(f"gn{node}",))
        else:
            submitted = pending_template.submit_time + timedelta(seconds=rng.randrange(0, 4000))
            job = replace(pending_template, submit_time=submitted, eligible_time=submitted)
        job = replace(
            job,
            job_id=job_id,
            name=f"j{k}",
            user_id=os.getuid(),
            comment=comment,
            partition=rng.choice(["gpu", f"gpu-{gpu_type}"]),
            gpus=GpuCounts.of({gpu_type: gpus}),
        )
        JobDir(root / f"{job.name}-{job_id}").prepare()
        out.append(job)
    cluster = [
        replace(
            node_template,
            name=f"gn{i}",
            gpus=GpuCounts.of({t: size}),
            gpus_allocated=GpuCounts.of({t: used[i]}),
            partitions=("gpu", f"gpu-{t}"),
        )
        for i, (t, size) in enumerate(sizes)
    ]
    return out, cluster


@pytest.mark.parametrize("policy", DAEMON_POLICY_NAMES)
@pytest.mark.parametrize(("min_run", "starve"), [(0, "inf"), (300, "inf"), (300, "60")])
def test_passes_of_every_daemon_policy_on_random_clusters(
    tmp_path: Path, busy: tuple[list[Job], list[Node]], policy: str, min_run: int, starve: str
) -> None:
    captured_jobs, captured_nodes = busy
    start = next(j for j in captured_jobs if j.job_id == 24).start_time
    assert start is not None
    for seed in range(8):
        state = tmp_path / f"{seed}"
        root = state / "jobs"
        root.mkdir(parents=True)
        jobs, nodes = scenario(seed, captured_jobs, captured_nodes, root)
        cfg = config(
            state,
            policy=policy,
            ckpt_roots=[str(root)],
            resize={"enabled": True},
            tiresias={"thresholds": [600.0], "starve_limit_s": float(starve)},
            preemption={"min_run_time_s": min_run, "grace_s": 20, "requeue_wait_s": 2},
            **({"dl2": {"model": str(state / "absent.model")}} if policy == "dl2" else {}),  # its fallback
        )
        fake = FakeSlurm(jobs, nodes, ack_root=root)
        daemon, clock = make(cfg, fake, at(start, 4500))
        for _ in range(3):
            report = daemon.run_pass()
            assert not report.skipped, (seed, report.skipped)
            clock.sleep(30.0)
        ids = {j.job_id for j in jobs}
        for kind, args in fake.calls:
            assert {getattr(t, "job_id", t) for t in targets(kind, args)} <= ids, (seed, kind, args)


def targets(kind: str, args: object) -> list[object]:
    """The jobs a recorded call of :class:`FakeSlurm` acted on."""
    if kind == "cancel" and isinstance(args, tuple):
        return list(args[0])
    if isinstance(args, list):  # requeue, and the actions of scontrol (hold, release, ...)
        return args
    if kind == "update" and isinstance(args, tuple):
        return [args[0]]
    return []
