"""The one runtime as users submit it, on the real dev cluster.

The story (torch, MPI and Horovod): the bundled example (BatchNorm, dropout, an augmenting loader) with N = 8
logical workers (ESTs) is submitted on 3 a100 GPUs, elastic between 2 and 5.  The scheduler plugin grows it to 5 GPUs
when 2 sit idle (5 does not divide 8: the ESTs run anyway), a worker is killed with SIGKILL (the wrapper restarts
the step in the allocation from the newest checkpoint), then a 3-GPU job arrives and the plugin shrinks the
elastic job to 2.  Its final parameters must be, bit for bit, those of one uninterrupted 1-process run.

Then the GPU-type guard: a job submitted to the mixed ``gpu`` partition without ``--gpu-type`` keeps the type of its
first allocation across requeues; a model D2 does not cover never runs at d2 (so never across types); a D2-covered
model runs on a100 and v100 at once with the same bits.  And ``verify-determinism --submit``, bad input.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.spec import decode_marker
from hpc_elastic.slurm import CliSlurm, JobState
from slurm_plugin.grow_story import reference_params_sha
from slurm_plugin.scenario import DaemonProcess
from tests.conftest import DATA, REPO, require_horovod
from tests.integration.conftest import hpc_submit, jobs_writing_under, processes_with, wait_for
from tests.integration.plugin_helpers import ended, job_of, running, write_resize_config

pytestmark = pytest.mark.integration
EXAMPLE = REPO / "hpc_elastic" / "est" / "example.py"
STEPPER = DATA / "workers" / "stepper.py"
N = 8
STEPS = 80  # the story reached its shrink at steps 11-27 in 12 runs here (each of the three backends)
#: 192 samples / (8 ESTs x 8) = 3 steps per epoch; one loader worker per process (5 processes on 2 cores)
DATA_ARGS = ("--dataset-size=192", "--loader-workers=1")
STORY_ARGS = (f"--steps={STEPS}", *DATA_ARGS, "--ckpt-every=10", "--step-delay=0.25")
SHA = re.compile(r"final-params-sha256 ([0-9a-f]{64})")


def _filler(slurm: CliSlurm, workdir: Path, name: str, *options: str) -> int:
    options = (f"--job-name={name}", f"--output={workdir}/{name}-%j.out", *options)
    return slurm.submit(script_text="#!/bin/bash\nsleep 3600\n", options=options)


#: the reference runs done in this session, by their arguments (the three backends' stories share one)
_REFERENCES: dict[tuple[tuple[str, ...], int, DeterminismLevel | None], str] = {}


def reference_sha(workdir: Path, *args: str, workers: int = N, level: DeterminismLevel | None = None) -> str:
    """The uninterrupted run: the example on one local process with the same N (the same bits on any M); run once
    per session for the same arguments."""
    key = (args, workers, level)
    if key not in _REFERENCES:
        _REFERENCES[key] = _run_reference(workdir, *args, workers=workers, level=level)
    return _REFERENCES[key]


def _run_reference(workdir: Path, *args: str, workers: int, level: DeterminismLevel | None) -> str:
    job_dir = workdir / f"reference-{uuid.uuid4().hex[:6]}"
    return reference_params_sha(job_dir, (sys.executable, str(EXAMPLE), *args), workers=workers, level=level)


def said(out: Path, text: str) -> int:
    return out.read_text().count(text) if out.exists() else 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["torch", "mpi", "horovod"])
def test_n8_grows_to_5_is_killed_shrinks_to_2_and_ends_with_the_bits_of_one_process(
    slurm: CliSlurm, backend: str, cleanup: list[int], lane_root: Path
) -> None:
    if backend == "horovod":
        require_horovod()
    prefix = f"itr{backend[0]}{uuid.uuid4().hex[:5]}"
    workdir = lane_root / prefix
    workdir.mkdir(parents=True)
    config = write_resize_config(workdir, prefix, grace_s=120)
    daemon = DaemonProcess(config, workdir / "daemon.log")
    try:
        filler = _filler(slurm, workdir, f"{prefix}-filler", "--partition=gpu-a100", "--nodes=1", "--gres=gpu:a100:3")
        cleanup.append(filler)
        wait_for("the filler to run", lambda: running(slurm, filler), timeout_s=60)
        elastic = hpc_submit(
            workdir,
            EXAMPLE,
            "--gpus=3",
            "--min-gpus=2",
            "--max-gpus=5",
            f"--workers={N}",
            "--partition=gpu-a100",
            "--gpu-type=a100",
            f"--backend={backend}",
            f"--job-name={prefix}-el",
            args=STORY_ARGS,
        )
        cleanup.append(elastic)
        out = workdir / f"{prefix}-el-{elastic}.out"
        job_dir = workdir / f"{prefix}-el-{elastic}"
        wait_for("training on 3 processes", lambda: said(out, "rank 0 of 3 "), timeout_s=150)
        daemon.start()  # 2 a100 GPUs idle, nothing waits: it grows to its maximum, 5
        grown = wait_for("the job to run again on 5 GPUs", lambda: running(slurm, elastic, restarts=1), timeout_s=180)
        assert grown.gpu_count == 5
        wait_for("training on 5 processes", lambda: said(out, "rank 0 of 5 "), timeout_s=150)
        grown_at = int(re.findall(r"stop \(resize\) at step (\d+)", out.read_text())[0])
        wait_for("a periodic checkpoint on 5", lambda: _newest_step(job_dir) > grown_at, timeout_s=120)
        victims = wait_for(
            "worker rank 1",
            lambda: [p for p in processes_with(f"HPC_ELASTIC_JOB_DIR={job_dir}", "SLURM_PROCID=1") if _python(p)],
        )
        os.kill(victims[0], signal.SIGKILL)
        wait_for("the step restarted in the allocation", lambda: said(out, "rank 0 of 5 ") >= 2, timeout_s=150)
        assert running(slurm, elastic, restarts=1)  # restarted inside the allocation, not requeued
        waiting = hpc_submit(
            workdir,
            STEPPER,
            "--gpus=3",
            "--partition=gpu-a100",
            "--gpu-type=a100",
            f"--job-name={prefix}-w",
            args=("100000",),
        )
        cleanup.append(waiting)
        shrunk = wait_for("the job to run again on 2 GPUs", lambda: running(slurm, elastic, restarts=2), timeout_s=240)
        assert shrunk.gpu_count == 2 and running(slurm, waiting) is not None
        done = wait_for("the elastic job to complete", lambda: ended(slurm, elastic), timeout_s=400)
        assert done.state is JobState.COMPLETED, f"elastic job ended {done.state.value} (see {workdir})"
    finally:
        daemon.kill(signal.SIGTERM)
    text = out.read_text()
    starts = [line.split(" (")[0] for line in text.splitlines() if line.startswith("rank 0 of ")]
    assert starts == ["rank 0 of 3", "rank 0 of 5", "rank 0 of 5", "rank 0 of 2"], starts
    assert text.count("stop (resize) at step") == 2 and "restart 1 of 2 from the newest checkpoint" in text
    resizes = [a for a in _actions(workdir) if a["kind"] == "resize" and a["job_id"] == elastic]
    assert [str(a["reason"]).split(":")[0] for a in resizes] == ["grow", "shrink"]
    final = SHA.findall(text)
    assert len(final) == 1
    assert final[0] == reference_sha(workdir, f"--steps={STEPS}", *DATA_ARGS)


def _newest_step(job_dir: Path) -> int:
    steps = CheckpointStore(job_dir / "checkpoints").steps()
    return steps[0] if steps else -1


def _python(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith("python")
    except OSError:
        return False


def _actions(workdir: Path) -> list[dict[str, object]]:
    try:
        doc = json.loads((workdir / "state" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return list(doc.get("recent_actions", []))


# ------------------------------------------------------------------------------------------------ GPU types


def _fill(slurm: CliSlurm, workdir: Path, prefix: str, gpu_type: str, leave: dict[str, int]) -> list[int]:
    """Plain jobs holding every free ``gpu_type`` GPU of the ``gpu`` partition's nodes but ``leave[node]``."""
    ids = []
    for node in slurm.nodes():
        free = node.gpus_free.get(gpu_type) - leave.get(node.name, 0)
        if node.gpus.get(gpu_type) and free > 0:
            ids.append(
                _filler(
                    slurm,
                    workdir,
                    f"{prefix}-f{node.name}",
                    "--partition=gpu",
                    f"-w{node.name}",
                    f"--gres=gpu:{gpu_type}:{free}",
                )
            )
    return ids


@pytest.mark.timeout(900)
def test_a_job_without_gpu_type_keeps_the_type_of_its_first_allocation(
    slurm: CliSlurm, cleanup: list[int], lane_root: Path
) -> None:
    prefix = f"itp{uuid.uuid4().hex[:6]}"
    workdir = lane_root / prefix
    workdir.mkdir(parents=True)
    args = ("--steps=120", *DATA_ARGS, "--ckpt-every=10", "--step-delay=0.25")
    job_id = hpc_submit(
        workdir, EXAMPLE, "--gpus=2", "--workers=2", "--partition=gpu", f"--job-name={prefix}-j", args=args
    )
    cleanup.append(job_id)
    out = workdir / f"{prefix}-j-{job_id}.out"
    first = wait_for("the first run", lambda: running(slurm, job_id), timeout_s=60)
    (gpu_type,) = {t for t, count in first.gpus.by_type if count}  # Slurm chose one type for the 2 GPUs
    wait_for("training", lambda: said(out, "rank 0 of 2 "), timeout_s=120)
    marker = decode_marker(slurm.job(job_id).comment)
    assert marker is not None and marker.gpu_type == gpu_type  # pinned into its marker
    assert f"pinned to {gpu_type} (level d1: the bits depend on the device type)" in out.read_text()
    fillers = _fill(slurm, workdir, prefix, gpu_type, {})  # every other GPU of its type
    cleanup.extend(fillers)
    wait_for("the fillers", lambda: all(running(slurm, f) for f in fillers), timeout_s=60)
    slurm.cancel([job_id], "USR1", batch=True)  # a preemption: checkpoint, requeue
    wait_for(
        "the requeue", lambda: (j := job_of(slurm, job_id)) is not None and j.restart_count == 1 and j.state.is_pending
    )
    assert f"waits for {gpu_type} GPUs" in out.read_text()
    # its own GPUs, freed by the requeue, go to a filler before its BeginTime: only the other type stays free
    more = wait_for("its GPUs to be free", lambda: _fill(slurm, workdir, f"{prefix}x", gpu_type, {}), timeout_s=60)
    fillers += more
    cleanup.extend(more)
    wait_for("the last filler", lambda: all(running(slurm, f) for f in more), timeout_s=60)
    eligible = wait_for("the job to be eligible", lambda: job_of(slurm, job_id), timeout_s=10).eligible_time
    wait_for("the BeginTime to pass", lambda: eligible is None or time.time() > eligible.timestamp() + 20, timeout_s=90)
    still = job_of(slurm, job_id)  # past its BeginTime, with 8 GPUs of the other type free, it waits for its own
    assert still is not None and still.state.is_pending and still.restart_count == 1, still
    slurm.cancel(fillers)
    again = wait_for("the second run", lambda: running(slurm, job_id, restarts=1), timeout_s=120)
    assert {t for t, count in again.gpus.by_type if count} == {gpu_type}
    done = wait_for("the job to complete", lambda: ended(slurm, job_id), timeout_s=300)
    assert done.state is JobState.COMPLETED
    (sha,) = SHA.findall(out.read_text())
    assert sha == reference_sha(workdir, "--steps=120", *DATA_ARGS, workers=2)


@pytest.mark.timeout(600)
def test_d2_refuses_a_model_it_does_not_cover(slurm: CliSlurm, cleanup: list[int], workdir: Path) -> None:
    job_id = hpc_submit(
        workdir,
        EXAMPLE,
        "--gpus=1",
        "--partition=gpu",
        "--level=d2",
        "--max-restarts=0",
        "--job-name=it-d2no",
        args=("--steps=4",),
    )
    cleanup.append(job_id)
    done = wait_for("the job to end", lambda: ended(slurm, job_id), timeout_s=180)
    assert done.state is JobState.FAILED
    text = (workdir / f"it-d2no-{job_id}.out").read_text()
    assert "D2 does not hold for this model: Dropout" in text and "rank 0 of" not in text


@pytest.mark.timeout(600)
def test_a_d2_model_trains_on_a100_and_v100_at_once_with_the_same_bits(
    slurm: CliSlurm, cleanup: list[int], lane_root: Path
) -> None:
    prefix = f"itm{uuid.uuid4().hex[:6]}"
    workdir = lane_root / prefix
    workdir.mkdir(parents=True)
    # one GPU left free on node2 (a100), node3 and node4 (v100): 3 GPUs can only come from both types
    leave = {"node2": 1, "node3": 1, "node4": 1}
    fillers = _fill(slurm, workdir, prefix, "a100", leave) + _fill(slurm, workdir, prefix, "v100", leave)
    cleanup.extend(fillers)
    wait_for("the fillers", lambda: all(running(slurm, f) for f in fillers), timeout_s=60)
    args = ("--model=mlp", "--steps=12", "--dataset-size=96", "--loader-workers=1")
    job_id = hpc_submit(
        workdir,
        EXAMPLE,
        "--gpus=3",
        "--workers=4",
        "--partition=gpu",
        "--level=d2",
        f"--job-name={prefix}-j",
        args=args,
    )
    cleanup.append(job_id)
    done = wait_for("the job to end", lambda: ended(slurm, job_id), timeout_s=300)
    text = (workdir / f"{prefix}-j-{job_id}.out").read_text()
    assert done.state is JobState.COMPLETED, text[-2000:]
    assert "rank 0 of 3 (torch, cpu, a100+v100)" in text and "level d2" in text
    (sha,) = SHA.findall(text)
    assert sha == reference_sha(workdir, *args, workers=4, level=DeterminismLevel.D2)


# ------------------------------------------------------------------------------------------------ verify, bad input


@pytest.mark.timeout(900)
def test_verify_determinism_submit_runs_every_case_as_a_slurm_job(slurm: CliSlurm, workdir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_elastic",
            "verify-determinism",
            "--submit",
            "--partition=gpu-a100",
            "--gpu-type=a100",
            "--workers=4",
            "--procs=1,3",
            "--steps=6",
            "--resize-at=3",
            f"--workdir={workdir}",
            "--timeout=300",
            "--",
            "--loader-workers=1",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "as Slurm jobs" in out.stdout and "OK: all 3 runs ended in bitwise-identical states" in out.stdout
    assert out.stdout.count(" match ") == 2
    resized = next(path for path in workdir.glob("resize-m1-m3-*") if path.is_dir())
    assert "stop (resize) at step 3" in (workdir / f"{resized.name}.out").read_text()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--gpus=2", "--max-gpus=8", "--workers=4"],
            "--workers (4) must be at least --max-gpus (8): N ESTs run on at most N processes",
        ),
        (["--gpus=2", "--gpu-type=h100", "--partition=gpu"], "partition gpu has no h100 GPUs (it has: a100, v100)"),
        (["--gpus=2", "--gpu-type=a100", "--partition=gpu-v100"], "partition gpu-v100 has no a100 GPUs (it has: v100)"),
    ],
)
def test_bad_input_is_one_line_and_submits_nothing(
    slurm: CliSlurm, workdir: Path, options: list[str], message: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "submit", str(EXAMPLE), f"--ckpt-root={workdir}", *options],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"hpc-elastic: error: {message}"]
    assert jobs_writing_under(workdir) == []
