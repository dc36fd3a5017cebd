"""hpc-elastic-sched under ``tiresias-las+easyscale`` on the real dev cluster.

The story (the v100 partition, node3-4): a plain filler holds node4's 4 GPUs; the bundled example (the MLP model)
with N = 8 logical workers (ESTs) is submitted on 2 v100 GPUs, elastic between 2 and 4. With nothing waiting,
EasyScale's proposals give it node3's 2 idle GPUs (Role 1's plan: 8 ESTs on 4 GPUs, 2 each, twice the throughput
of 4 each on 2); then a 2-GPU gang job arrives and 2D-LAS, counting the elastic job at its minimum, lets it in: the
elastic job shrinks back to 2. It stays on v100 throughout (the daemon keeps a job on one GPU type), and its final
parameters are, bit for bit, those of one uninterrupted 1-process run. The test asserts the order of events and the
values Slurm and the jobs report, never durations.
"""

from __future__ import annotations

import json
import re
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.slurm import CliSlurm, JobState
from slurm_plugin.scenario import DaemonProcess
from tests.integration.conftest import hpc_submit, wait_for
from tests.integration.plugin_helpers import ended, running, write_resize_config
from tests.integration.test_runtime_story import DATA_ARGS, EXAMPLE, SHA, STEPPER, _filler, reference_sha, said

pytestmark = pytest.mark.integration
N = 8
STEPS = 80
MODEL_ARGS = ("--model=mlp", f"--steps={STEPS}", *DATA_ARGS)
PARTITION = ("--partition=gpu-v100", "--gpu-type=v100")


def _actions(workdir: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads((workdir / "state" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return [a for a in doc.get("recent_actions", []) if isinstance(a, dict)]


@pytest.mark.timeout(900)
def test_easyscale_grows_an_n8_job_into_idle_gpus_and_shrinks_it_for_a_gang_job_with_the_same_bits(
    slurm: CliSlurm, cleanup: list[int], lane_root: Path
) -> None:
    prefix = f"ith{uuid.uuid4().hex[:6]}"
    workdir = lane_root / prefix
    workdir.mkdir(parents=True)
    config = write_resize_config(workdir, prefix, grace_s=120, policy="tiresias-las+easyscale")
    daemon = DaemonProcess(config, workdir / "daemon.log")
    try:
        filler = _filler(slurm, workdir, f"{prefix}-filler", "--partition=gpu-v100", "--nodelist=node4", "--gres=gpu:4")
        cleanup.append(filler)
        wait_for("the filler to run", lambda: running(slurm, filler), timeout_s=60)
        elastic = hpc_submit(
            workdir,
            EXAMPLE,
            "--gpus=2",
            "--min-gpus=2",
            "--max-gpus=4",
            f"--workers={N}",
            *PARTITION,
            f"--job-name={prefix}-el",
            args=(*MODEL_ARGS, "--ckpt-every=10", "--step-delay=0.25"),
        )
        cleanup.append(elastic)
        out = workdir / f"{prefix}-el-{elastic}.out"
        wait_for("training on 2 processes", lambda: said(out, "rank 0 of 2 "), timeout_s=150)
        daemon.start()  # 2 v100 GPUs idle, nothing waits: EasyScale's proposals grow it
        grown = wait_for("the job to run again on 4 GPUs", lambda: running(slurm, elastic, restarts=1), timeout_s=180)
        wait_for("training on 4 processes", lambda: said(out, "rank 0 of 4 "), timeout_s=150)
        assert daemon.alive, (workdir / "daemon.log").read_text()
        waiting = hpc_submit(workdir, STEPPER, "--gpus=2", *PARTITION, f"--job-name={prefix}-w", args=("100000",))
        cleanup.append(waiting)
        shrunk = wait_for("the job to run again on 2 GPUs", lambda: running(slurm, elastic, restarts=2), timeout_s=240)
        assert running(slurm, waiting) is not None
        done = wait_for("the elastic job to complete", lambda: ended(slurm, elastic), timeout_s=400)
        assert done.state is JobState.COMPLETED, f"elastic job ended {done.state.value} (see {workdir})"
    finally:
        daemon.kill(signal.SIGTERM)
    assert grown.gpu_count == 4 and shrunk.gpu_count == 2
    # one GPU type throughout: the daemon keeps a job on the type it holds
    assert {t for t, _ in grown.gpus.by_type if t} == {"v100"} and {t for t, _ in shrunk.gpus.by_type if t} == {"v100"}
    text = out.read_text()
    starts = [line.split(" (")[0] for line in text.splitlines() if line.startswith("rank 0 of ")]
    assert starts == ["rank 0 of 2", "rank 0 of 4", "rank 0 of 2"], starts
    assert text.count("stop (resize) at step") == 2
    resizes = [a for a in _actions(workdir) if a["kind"] == "resize" and a["job_id"] == elastic]
    assert [str(a["reason"]).split(":")[0] for a in resizes] == [
        "grow into GPUs no waiting job can use",
        "shrink",
    ], resizes
    assert all(a["ok"] for a in resizes) and "elastic share is 4 GPUs" in str(resizes[0]["reason"])
    assert "elastic share is 2 GPUs" in str(resizes[1]["reason"])
    assert re.search(r"stop \(resize\) at step \d+", text)
    (final,) = SHA.findall(text)
    assert final == reference_sha(workdir, *MODEL_ARGS, workers=N)
