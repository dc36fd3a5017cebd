"""The example training script (wrappers/examples/train_mlp.py) as real processes on gloo, MPI and Horovod:
stop file -> checkpoint -> ack -> exit 0 -> restart on a different number of processes -> continues exactly.

What is asserted, and why it may be asserted bitwise: the job has N = 2 logical workers (ESTs).  Each computes the
gradient of its own mini-batch; the runtime sums the N gradients exactly (integers on aligned bins), so an optimizer
step is the same arithmetic whatever the number of processes M and whichever backend moved the bytes; the data plan
is keyed on ESTs, not processes; a checkpoint holds the exact tensors and every EST's context.  Hence:
- every (step, logical worker) pair is trained exactly once over stop + resume, on exactly the samples the
  uninterrupted run used for it, and every epoch uses each of the 48 samples exactly once;
- the final parameters have the same sha256 as the uninterrupted one-process torch run (same machine, one
  intra-op thread: the reference and the elastic runs execute the same float operations in the same order).
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.unit.session.launch import (
    EXAMPLE,
    HVD_REASON,
    MPI_REASON,
    Run,
    clear_control,
    launch,
    read_traces,
    trace_steps,
    wait_for_steps,
    write_stop,
)

N = 2
DATASET = 48  # 48 samples / (2 workers x batch 4): 6 steps per epoch
STEPS = 40
DELAY = ["--step-delay", "0.15"]  # slow enough that the stop file arrives mid-run
ARGS = ["--steps", str(STEPS), "--dataset", str(DATASET), "--batch", "4"]


def ok(run: Run) -> dict[str, Any]:
    assert run.wait() == 0, "\n".join(run.outputs)
    return run.result()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, no interruption."""
    work = tmp_path_factory.mktemp("reference")
    run = launch("torch", 1, work / "job", [*ARGS, "--trace", str(work / "trace")], workers=N, logs=work)
    result = ok(run)
    assert (result["step"], result["stopped"], result["restored_from"]) == (STEPS, False, None)
    assert f"final-params-sha256 {result['sha256']}" in "".join(run.outputs)
    plan = {(r["step"], r["worker"]): r["indices"] for r in read_traces(work / "trace")}
    assert len(plan) == STEPS * N
    return {"sha256": result["sha256"], "plan": plan}


def stop_mid_run(backend: str, world: int, job: Path, trace: Path, logs: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    run = launch(backend, world, job, [*ARGS, *DELAY, "--trace", str(trace)], workers=N, logs=logs)
    wait_for_steps(run, trace, 4)
    write_stop(job, "preempt")
    result = ok(run)
    ack = json.loads((job / "control" / "ack.json").read_text())
    return result, ack


def check_stop(result: dict[str, Any], ack: dict[str, Any], job: Path, world: int) -> int:
    step = int(ack["step"])
    assert result["stopped"] is True and result["world_size"] == world
    assert result["step"] == step and 4 <= step < STEPS
    assert set(ack) == {"job_id", "restart_count", "step", "checkpoint", "written_at", "reason"}
    assert ack["checkpoint"] == str((job / "checkpoints" / f"ckpt-{step:012d}").resolve())
    assert (ack["job_id"], ack["restart_count"]) == (None, 0)
    manifest = json.loads((Path(ack["checkpoint"]) / "MANIFEST.json").read_text())
    assert manifest["world_size"] == world and manifest["meta"]["est"]["num_ests"] == N
    assert sorted(manifest["files"]) == [f"shard-{r:05d}.pt" for r in range(world)]
    return step


def check_exactly_once(trace: Path, reference: dict[str, Any]) -> None:
    records = read_traces(trace)
    pairs = Counter((r["step"], r["worker"]) for r in records)
    assert set(pairs) == set(reference["plan"]) and set(pairs.values()) == {1}  # no step lost, none repeated
    for r in records:
        assert r["indices"] == reference["plan"][(r["step"], r["worker"])]
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for r in records:
        per_epoch[r["epoch"]] += r["indices"]
    complete = STEPS // 6  # 6 steps per epoch
    assert sorted(per_epoch) == list(range(complete + (STEPS % 6 > 0)))
    for epoch in range(complete):
        assert sorted(per_epoch[epoch]) == list(range(DATASET)), f"epoch {epoch}"


def test_gloo_stop_ack_then_resume_on_fewer_processes(reference: dict[str, Any], tmp_path: Path) -> None:
    job, trace = tmp_path / "job", tmp_path / "trace"
    result, ack = stop_mid_run("torch", 2, job, trace, tmp_path)
    step = check_stop(result, ack, job, 2)

    # restarted while the stop file is still there: it stops at once, acknowledging the same checkpoint
    again = ok(launch("torch", 1, job, [*ARGS, "--trace", str(trace)], workers=N, logs=tmp_path))
    assert (again["stopped"], again["step"], again["start_step"]) == (True, step, step)
    assert json.loads((job / "control" / "ack.json").read_text())["checkpoint"] == ack["checkpoint"]
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == [f"ckpt-{step:012d}"]

    clear_control(job)  # the wrapper's part before a new incarnation
    final = ok(launch("torch", 1, job, [*ARGS, "--trace", str(trace)], workers=N, logs=tmp_path))
    assert (final["start_step"], final["step"], final["world_size"]) == (step, STEPS, 1)
    assert final["restored_from"] == ack["checkpoint"]
    check_exactly_once(trace, reference)
    assert final["sha256"] == reference["sha256"]


@pytest.mark.skipif(MPI_REASON is not None, reason=f"MPI unavailable: {MPI_REASON}")
def test_mpi_stop_ack_then_resume_on_more_processes(reference: dict[str, Any], tmp_path: Path) -> None:
    job, trace = tmp_path / "job", tmp_path / "trace"
    result, ack = stop_mid_run("mpi", 1, job, trace, tmp_path)
    step = check_stop(result, ack, job, 1)
    clear_control(job)
    final = ok(launch("mpi", 2, job, [*ARGS, "--trace", str(trace)], workers=N, logs=tmp_path))
    assert (final["start_step"], final["step"], final["world_size"], final["backend"]) == (step, STEPS, 2, "mpi")
    check_exactly_once(trace, reference)
    assert final["sha256"] == reference["sha256"]


@pytest.mark.skipif(HVD_REASON is not None, reason=str(HVD_REASON))
def test_horovod_stop_ack_then_resume_on_fewer_processes(reference: dict[str, Any], tmp_path: Path) -> None:
    job, trace = tmp_path / "job", tmp_path / "trace"
    result, ack = stop_mid_run("horovod", 2, job, trace, tmp_path)
    step = check_stop(result, ack, job, 2)
    clear_control(job)
    final = ok(launch("horovod", 1, job, [*ARGS, "--trace", str(trace)], workers=N, logs=tmp_path))
    assert (final["start_step"], final["step"], final["backend"]) == (step, STEPS, "horovod")
    check_exactly_once(trace, reference)
    assert final["sha256"] == reference["sha256"]


def test_gloo_kill_9_mid_run_resumes_from_the_last_async_checkpoint(reference: dict[str, Any], tmp_path: Path) -> None:
    job, trace = tmp_path / "job", tmp_path / "trace"
    periodic = ["--ckpt-every", "4", "--async-ckpt"]
    run = launch("torch", 2, job, [*ARGS, *DELAY, *periodic, "--trace", str(trace)], workers=N, logs=tmp_path)
    wait_for_steps(run, trace, 10)
    run.group.signal(signal.SIGKILL)  # every worker, wherever it is (possibly in the middle of a checkpoint)
    assert run.wait() == -9
    reached = max(trace_steps(trace))
    time.sleep(0.1)
    final = ok(launch("torch", 2, job, [*ARGS, *periodic], workers=N, logs=tmp_path))
    restored = final["start_step"]
    assert restored % 4 == 0 and 8 <= restored <= reached + 1
    assert final["restored_from"] == str((job / "checkpoints" / f"ckpt-{restored:012d}").resolve())
    assert final["step"] == STEPS and final["sha256"] == reference["sha256"]
    kept = sorted(p.name for p in (job / "checkpoints").iterdir())
    assert len(kept) == 3 and all(name.startswith("ckpt-") for name in kept)  # keep 3, leftovers cleaned


@pytest.mark.parametrize(("backend", "world"), [("torch", 4), ("torch", 3), ("mpi", 3)])
def test_any_number_of_processes_gives_the_bits_of_one(backend: str, world: int, tmp_path: Path) -> None:
    """N = 4 logical workers on M = 4 and M = 3 processes (M need not divide N; gloo, then mpirun) against M = 1:
    the same final parameters."""
    if backend == "mpi" and MPI_REASON is not None:
        pytest.skip(f"MPI unavailable: {MPI_REASON}")
    short = ["--steps", "12", "--dataset", str(DATASET), "--batch", "4"]
    one = ok(launch("torch", 1, tmp_path / "one", short, workers=4, logs=tmp_path / "l1"))
    many = ok(launch(backend, world, tmp_path / "many", short, workers=4, logs=tmp_path / "lm"))
    assert (many["world_size"], many["num_workers"], many["backend"]) == (world, 4, backend)
    assert (one["world_size"], one["num_workers"]) == (1, 4)
    assert many["sha256"] == one["sha256"]


def test_the_cnn_example_gives_the_same_bits_on_one_and_two_processes(tmp_path: Path) -> None:
    cnn = EXAMPLE.with_name("train_cnn.py")
    short = ["--steps", "8", "--dataset", "40", "--batch", "4"]  # 5 steps per epoch
    one = ok(launch("torch", 1, tmp_path / "one", short, workers=2, logs=tmp_path / "l1", script=cnn))
    two = ok(launch("torch", 2, tmp_path / "two", short, workers=2, logs=tmp_path / "l2", script=cnn))
    assert (one["step"], two["step"], two["world_size"]) == (8, 8, 2)
    assert one["sha256"] == two["sha256"]
