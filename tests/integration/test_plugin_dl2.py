"""``policy = "dl2"`` on the dev cluster: a pass with a ps job running sends DL²'s new sizes as a scale notice in
the job's AdminComment and USR2 to its batch shell, which the job's wrapper applies; without the model file the
daemon falls back to 2D-LAS, exits 0 and says why in ``state.json``."""

from __future__ import annotations

import uuid
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpc_elastic.dl2 import model_file
from hpc_elastic.jobdir import JobDir, Progress, ScaleNotice, ScaleReply
from hpc_elastic.policy.dl2 import StateSpec
from hpc_elastic.ps.model import MODEL_NAME
from hpc_elastic.slurm import CliSlurm
from tests.integration.conftest import wait_for
from tests.integration.plugin_helpers import run_once, write_config
from tests.integration.test_ps_mode import submit_ps

pytestmark = [pytest.mark.integration, pytest.mark.cpu_lane]


def both_then_void(path: Path) -> StateSpec:
    """A model file whose network ignores its state (zero weights, constant logits): +1 worker and +1 PS to the first
    job while both fit its maxima, then void. So a job of ranges 1:3 workers and 1:2 PS gets 2 workers and 2 PS."""
    spec = StateSpec(jobs=4, type_names=(MODEL_NAME,), slot_seconds=1200.0, max_slots_run=100, max_epochs_left=100.0)
    bias = np.zeros(spec.action_size, dtype=np.float32)
    bias[spec.void], bias[2] = 1.0, 2.0  # action 2: both, on job row 0
    weight = np.zeros((spec.action_size, spec.state_size), dtype=np.float32)
    model_file.save(path, spec, {}, {}, {"policy.layers.0.weight": weight, "policy.layers.0.bias": bias})
    return spec


def _progress(job_dir: JobDir) -> Progress | None:
    progress = job_dir.read_progress()
    return progress if progress is not None and progress.epochs_total is not None else None


def _reply(job_dir: JobDir) -> ScaleReply | None:
    return job_dir.read_scale_reply()


@pytest.mark.timeout(600)
def test_the_daemon_sizes_a_running_ps_job_with_dl2_and_falls_back_without_its_model(
    slurm: CliSlurm, workdir: Path, cleanup: list[int]
) -> None:
    prefix = f"itdl2{uuid.uuid4().hex[:6]}"
    model = workdir / "dl2.model"
    both_then_void(model)
    config = write_config(workdir, prefix, f'[dl2]\nmodel = "{model}"\n', top='policy = "dl2"\n')
    name = f"{prefix}-a"
    # the master, 2 PS and 3 workers of 2 cores: 12 of the cpu partition's 16 (Brain sizes it within its ranges
    # until a scale request takes it over)
    settings = {"num_samples": 600_000, "shard_size": 100, "batch_size": 50, "epochs": 2}
    job_id = submit_ps(workdir, settings, "1:3", "1:2", ("--cpus-per-worker=2",), name)
    cleanup.append(job_id)
    job_dir = JobDir.of(workdir, name, job_id)
    progress = wait_for("the job's progress record", partial(_progress, job_dir), timeout_s=300, every_s=1.0)
    assert progress.epochs_total == 2.0 and progress.epochs_done == 0.0

    doc: dict[str, Any] = run_once(config)
    assert doc["dl2"]["status"] == "active", doc["dl2"]
    (request,) = doc["dl2"]["requests"]
    assert (request["job_id"], request["workers"], request["ps"], request["written"]) == (job_id, 2, 2, True), request
    assert (request["old_workers"], request["old_ps"]) != (2, 2)  # only a change is written
    notice = ScaleNotice.decode(slurm.job(job_id).admin_comment)
    assert notice is not None and (notice.workers, notice.ps, notice.restarts) == (2, 2, 0), notice
    reply = wait_for("the wrapper's answer", partial(_reply, job_dir), timeout_s=120, every_s=0.5)
    assert (reply.applied, reply.workers, reply.ps) == (True, 2, 2), reply
    assert reply.requested_at == notice.requested_at  # the answer to that notice
    assert not job_dir.scale_path.exists()  # the daemon wrote nothing into the job's directory

    model.unlink()
    doc = run_once(config)  # exit 0 (asserted by run_once), no scale request, the reason in state.json
    assert doc["dl2"]["status"] == f"model unusable: {model}: no model file", doc["dl2"]
    assert doc["dl2"]["requests"] == [] and not job_dir.scale_path.exists()
    assert job_id in [j["job_id"] for j in doc["jobs"]]
