"""A minimal stop-aware worker for the wrapper's integration tests (the training library is not used here).

Each rank counts steps from the last committed step; on a stop request every rank exits at the next step
boundary and rank 0 commits the step and acknowledges. Prints one line per start with its placement. With
``--progress`` rank 0 also writes the job's progress record every second (its steps per second: the speed the
scheduler reads, as the training runtime's records give it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hpc_elastic.env import read_job_environment
from hpc_elastic.jobdir import JobDir, Progress


def main() -> int:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    job = read_job_environment()
    if job.job_dir is None:
        print("HPC_ELASTIC_JOB_DIR is not set", file=sys.stderr)
        return 2
    state = job.job_dir / "checkpoints" / "step.json"
    step = json.loads(state.read_text())["step"] if state.exists() else 0
    with open(job.job_dir / "starts.log", "a") as log:
        log.write(
            f"rank={job.rank}/{job.world_size} restart={job.restart_count} node={job.node_name} "
            f"gpus={','.join(job.gpus)} step={step} workers={job.workers}\n"
        )
    stop = job.job_dir / "control" / "stop"
    report = "--progress" in sys.argv[2:] and job.rank == 0
    since, since_step = time.monotonic(), step
    while step < total:
        if report and time.monotonic() - since >= 1.0:
            rate = (step - since_step) / (time.monotonic() - since)
            progress = Progress(
                step, time.time(), rate, job.world_size, job.restart_count, job.attempt, (), job.workers
            )
            JobDir(job.job_dir).record_progress(progress)
            since, since_step = time.monotonic(), step
        if stop.exists():
            if job.rank == 0:
                write(state, {"step": step})
                write(
                    job.job_dir / "control" / "ack.json",
                    {
                        "job_id": job.job_id,
                        "restart_count": job.restart_count,
                        "step": step,
                        "checkpoint": str(state),
                        "written_at": time.time(),
                    },
                )
            return 0
        time.sleep(0.1)
        step += 1
    if job.rank == 0:
        write(state, {"step": step})
        (job.job_dir / "done").write_text(str(step))
    return 0


def write(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
