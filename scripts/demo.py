"""The demo behind ``make demo``: a sample GPU job on the local Slurm cluster, seen through hpc-elastic.

It submits a job asking for two a100 GPUs, shows ``hpc-elastic cluster status`` while it runs, waits for it
to finish, reads its accounting record back from ``sacct`` and shows the cluster again.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

from hpc_elastic.env import read_environment
from hpc_elastic.slurm import JobState, connect

SAMPLE_JOB = """#!/bin/bash
echo "job $SLURM_JOB_ID on $SLURMD_NODENAME: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_JOB_GPUS=$SLURM_JOB_GPUS"
srun --ntasks=1 bash -c 'echo "step on $SLURMD_NODENAME sees GPUs $CUDA_VISIBLE_DEVICES"'
sleep 8
echo done
"""


def status() -> None:
    subprocess.run([sys.executable, "-m", "hpc_elastic", "cluster", "status"], check=True)


def main() -> int:
    env = read_environment()
    slurm = connect(env)
    out_dir = env.gpfs_root / "demo" / uuid.uuid4().hex[:8]
    out_dir.mkdir(parents=True, exist_ok=True)
    start = datetime.now(UTC) - timedelta(minutes=1)
    job_id = slurm.submit(
        script_text=SAMPLE_JOB,
        options=[
            "--job-name=hpc-elastic-demo",
            "--partition=gpu-a100",
            "--gres=gpu:a100:2",
            f"--output={out_dir}/%j.out",
        ],
    )
    print(f"submitted sample job {job_id} (2 x a100) — output in {out_dir}")
    deadline = time.monotonic() + 120
    while slurm.job(job_id).state is not JobState.RUNNING:
        if time.monotonic() > deadline:
            print(f"job {job_id} did not start within 120 s", file=sys.stderr)
            return 1
        time.sleep(0.5)
    job = slurm.job(job_id)
    print(f"job {job_id} running on {','.join(job.nodes)} with GPUs {job.gpus}")
    status()
    while True:
        records = [j for j in slurm.history(start, job_ids=[job_id]) if not j.state.is_active and j.partition]
        if records:
            break
        if time.monotonic() > deadline + 60:
            print(f"job {job_id} did not finish in time", file=sys.stderr)
            return 1
        time.sleep(1)
    record = records[-1]
    print(
        f"sacct: job {record.job_id} {record.state.value} exit={record.exit_code} elapsed={record.elapsed_s}s "
        f"GPUs={record.gpus} nodes={','.join(record.nodes)}"
    )
    print((out_dir / f"{job_id}.out").read_text().rstrip())
    status()
    return 0 if record.state is JobState.COMPLETED else 1


if __name__ == "__main__":
    sys.exit(main())
