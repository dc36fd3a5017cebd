"""hpc-elastic-sched under ``tiresias-las+easyscale`` on the real dev cluster: one job across GPU types.

The story (partition ``gpu``: node1-2 a100, node3-4 v100; plain fillers hold all GPUs but node1's and node2's last
2 a100 and, once the two elastic jobs run, node3's last 2 v100): two elastic jobs of N = 8 logical workers (ESTs)
start on 2 a100 each, elastic between 2 and 4 GPUs, submitted without a GPU type:

- the bundled example's MLP at D2 (the model scanner covers it; its run reports D2 to the daemon): EasyScale's
  proposals grow it into node3's 2 idle v100, a plan across types (Eq. 1d: 8 ESTs on 2 a100 + 2 v100, 2 each,
  twice the throughput of 4 each on 2 a100), which the daemon gives the requeued job as nodes (node lists that
  Slurm's block fill turns into 2 a100 + 2 v100, the same job id); then a 2-GPU gang job arrives and 2D-LAS,
  counting the elastic job at its minimum, lets it in: the elastic job shrinks back to 2 GPUs. Its final
  parameters are, bit for bit, those of one uninterrupted 1-process run at D2;
- the example's BatchNorm + Dropout model, which D2 does not cover, at D1: it stays on its a100, never resized.

The test asserts the order of events and the values Slurm and the jobs report, never durations.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.slurm import CliSlurm, JobState
from slurm_plugin.scenario import DaemonProcess
from tests.integration.conftest import hpc_submit, wait_for
from tests.integration.plugin_helpers import ended, job_of, running, write_resize_config
from tests.integration.test_runtime_story import DATA_ARGS, EXAMPLE, SHA, STEPPER, _filler, reference_sha, said

pytestmark = pytest.mark.integration
N = 8
STEPS = 80
MODEL_ARGS = ("--model=mlp", f"--steps={STEPS}", *DATA_ARGS)
ELASTIC = ("--gpus=2", "--min-gpus=2", "--max-gpus=4", f"--workers={N}", "--partition=gpu")


def _actions(workdir: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads((workdir / "state" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return [a for a in doc.get("recent_actions", []) if isinstance(a, dict)]


@pytest.mark.timeout(900)
def test_easyscale_grows_a_d2_job_across_gpu_types_and_shrinks_it_for_a_gang_job_with_the_same_bits(
    slurm: CliSlurm, cleanup: list[int], lane_root: Path
) -> None:
    prefix = f"ith{uuid.uuid4().hex[:6]}"
    workdir = lane_root / prefix
    workdir.mkdir(parents=True)
    config = write_resize_config(workdir, prefix, grace_s=120, policy="tiresias-las+easyscale")
    daemon = DaemonProcess(config, workdir / "daemon.log")

    def fill(node: str, gres: str, tag: str = "") -> int:
        job = _filler(slurm, workdir, f"{prefix}-f{node}{tag}", "--partition=gpu", f"-w{node}", f"--gres={gres}")
        cleanup.append(job)
        return job

    try:
        fillers = [fill("node1", "gpu:a100:2"), fill("node2", "gpu:a100:2"), fill("node3", "gpu:v100:2")]
        fillers += [fill("node4", "gpu:v100:4"), later := fill("node3", "gpu:v100:2", "b")]
        wait_for("the fillers to run", lambda: all(running(slurm, f) for f in fillers), timeout_s=60)
        plain = hpc_submit(
            workdir,
            EXAMPLE,
            *ELASTIC,
            f"--job-name={prefix}-bn",
            args=("--model=bn-dropout", "--steps=100000", *DATA_ARGS, "--step-delay=0.5"),
        )
        cleanup.append(plain)
        wait_for("the D1 job to run", lambda: running(slurm, plain), timeout_s=60)
        elastic = hpc_submit(
            workdir,
            EXAMPLE,
            *ELASTIC,
            "--level=d2",
            f"--job-name={prefix}-el",
            args=(*MODEL_ARGS, "--ckpt-every=10", "--step-delay=0.25"),
        )
        cleanup.append(elastic)
        out = workdir / f"{prefix}-el-{elastic}.out"
        plain_out = workdir / f"{prefix}-bn-{plain}.out"
        wait_for("training on 2 a100", lambda: said(out, "rank 0 of 2 (torch, cpu, a100)"), timeout_s=150)
        wait_for("the D1 job training", lambda: said(plain_out, "rank 0 of 2 "), timeout_s=150)
        slurm.cancel([later])  # 2 v100 idle on node3, nothing waits
        wait_for("node3's 2 v100 to be idle", lambda: ended(slurm, later), timeout_s=60)
        daemon.start()
        grown = wait_for("the job to run again", lambda: running(slurm, elastic, restarts=1), timeout_s=180)
        wait_for("training on 4 processes", lambda: said(out, "rank 0 of 4 "), timeout_s=150)
        assert daemon.alive, (workdir / "daemon.log").read_text()
        waiting = hpc_submit(
            workdir, STEPPER, "--gpus=2", "--partition=gpu", f"--job-name={prefix}-w", args=("100000",)
        )
        cleanup.append(waiting)
        shrunk = wait_for("the job to run again on 2 GPUs", lambda: running(slurm, elastic, restarts=2), timeout_s=240)
        wait_for("the gang job to run", lambda: running(slurm, waiting), timeout_s=60)
        done = wait_for("the elastic job to complete", lambda: ended(slurm, elastic), timeout_s=400)
        assert done.state is JobState.COMPLETED, f"elastic job ended {done.state.value} (see {workdir})"
        still = job_of(slurm, plain)
    finally:
        daemon.kill(signal.SIGTERM)
    # the D2 job: 2 a100 -> 2 a100 + 2 v100 (one job id, one job on both types) -> 2 GPUs of one type (its minimum
    # keeps the type it ran faster on, the fake GPUs' speeds differ by noise only)
    assert grown.gpus.by_type == (("a100", 2), ("v100", 2)) and len(grown.nodes) == 2
    ((kept, two),) = shrunk.gpus.by_type
    assert kept in {"a100", "v100"} and two == 2
    text = out.read_text()
    starts = [line.split("rank 0 of ")[1].split(";")[0] for line in text.splitlines() if "rank 0 of " in line]
    assert [s.split(")")[0] for s in starts] == [
        "2 (torch, cpu, a100",
        "4 (torch, cpu, a100+v100",
        f"2 (torch, cpu, {kept}",
    ]
    assert text.count("stop (resize) at step") == 2
    resizes = [a for a in _actions(workdir) if a["kind"] == "resize"]
    assert [a["job_id"] for a in resizes] == [elastic, elastic], resizes  # never the D1 job
    assert all(a["ok"] for a in resizes)
    assert str(resizes[0]["reason"]).startswith("grow into GPUs no waiting job can use")
    assert str(resizes[0]["reason"]).endswith("(2 a100 + 2 v100)"), resizes
    # the plan keeps the type of its minimum; Slurm may start the gang job on those GPUs first (it asks for any
    # type), and the requeued job then takes 2 of the others (the daemon's fallback, said in its log)
    assert str(resizes[1]["reason"]).startswith("shrink: the policy's elastic share is 2 GPUs (2 ")
    (final,) = SHA.findall(text)
    assert final == reference_sha(workdir, *MODEL_ARGS, workers=N, level=DeterminismLevel.D2)
    # the model D2 does not cover: on its 2 a100 throughout, while v100 were idle and the other job took them
    assert still is not None and still.state is JobState.RUNNING and still.restart_count == 0
    assert still.gpus.by_type == (("a100", 2),)
    assert said(plain_out, "rank 0 of ") == 1
