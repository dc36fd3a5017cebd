"""The Python API's pure parts and its worker program, without Slurm: ``import hpc_elastic`` stays light, resources
become SubmitSpec values, bad input is refused before anything is written, and the runner carries a function's
value or exception back in the job directory."""

from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hpc_elastic
from hpc_elastic import jobs
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.jobdir import JobDir, StopReason, StopRequest
from hpc_elastic.launch import call
from hpc_elastic.launch.workers import free_port
from tests.conftest import REPO
from tests.integration.api_functions import fail, train_linear

HAS_CLOUDPICKLE = importlib.util.find_spec("cloudpickle") is not None


def test_import_hpc_elastic_imports_neither_the_api_nor_torch() -> None:
    code = "import sys, hpc_elastic; print(sorted(m for m in ('torch', 'hpc_elastic.jobs') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_the_api_is_a_lazy_attribute_of_the_package() -> None:
    assert hpc_elastic.submit is jobs.submit and hpc_elastic.Job is jobs.Job
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        hpc_elastic.nothing  # noqa: B018


def test_resources_become_spec_values() -> None:
    options = jobs.resource_options({"ckpt_root": "/gpfs/jobs", "extra": ["--mail-type=END"], "gpus": 2})
    assert options == {"ckpt_root": Path("/gpfs/jobs"), "extra": ("--mail-type=END",), "gpus": 2}


def test_bad_resources_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    with pytest.raises(ValueError, match="--gpus must be >= 0"):
        hpc_elastic.submit(train_linear, args=(3,), gpus=-1, ckpt_root=root)
    with pytest.raises(ValueError, match="unknown submit settings: colour"):
        hpc_elastic.submit(train_linear, colour="blue", ckpt_root=root)
    with pytest.raises(ValueError, match="kwargs= is for a function"):
        hpc_elastic.submit(REPO / "wrappers" / "examples" / "train_mlp.py", kwargs={"steps": 3}, ckpt_root=root)
    assert not root.exists()


def test_without_cloudpickle_a_function_is_pickled_by_reference() -> None:
    def local(session: object) -> None:
        return None

    with pytest.raises(ValueError, match="cannot pickle the call of .*local"):
        jobs.pickle_call(local, (), {}, pickle)
    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in __main__"):
        jobs.pickle_call(local, (), {}, pickle)
    loaded = call.loads(jobs.pickle_call(train_linear, (3,), {"ckpt_every": 2}, pickle))
    assert loaded == call.Call(train_linear, (3,), {"ckpt_every": 2})
    assert call.import_root(train_linear) == str(REPO)  # tests.integration.api_functions imports from the repo
    with pytest.raises(HpcElasticError, match="not hold a call"):
        call.loads(pickle.dumps(call.Call(train_linear)))


@pytest.mark.skipif(not HAS_CLOUDPICKLE, reason="cloudpickle is not installed")
def test_with_cloudpickle_closures_go_but_unpicklable_arguments_are_refused() -> None:
    offset = 3
    data = jobs.pickle_call(lambda session: offset, (), {})
    assert call.loads(data).fn(None) == 3
    with socket.socket() as sock, pytest.raises(ValueError, match="cannot pickle the call"):
        jobs.pickle_call(train_linear, (sock,), {})


def test_an_unpicklable_return_value_becomes_a_failure_that_says_so() -> None:
    outcome = pickle.loads(call.encode(call.Outcome(ok=True, value=lambda: 0)))
    assert not outcome.ok and "cannot be pickled" in outcome.message


def start_call(
    tmp_path: Path, fn: object, *args: object, stop: StopRequest | None = None
) -> tuple[subprocess.CompletedProcess[str], JobDir]:
    """The runner as one worker of a one-process job (what the wrapper's srun starts); ``stop``: a stop requested
    before it starts."""
    path = tmp_path / "call.pkl"
    path.write_bytes(jobs.pickle_call(fn, args, {}))  # type: ignore[arg-type]
    job_dir = JobDir(tmp_path / "fn-1").prepare()
    if stop is not None:
        job_dir.request_stop(stop)
    # Without PYTHONPATH, as Slurm starts a worker: the function's module imports from the root its call file names.
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "HPC_ELASTIC_JOB_DIR": str(job_dir.path),
        "HPC_ELASTIC_WORLD_SIZE": "1",
        "HPC_ELASTIC_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [sys.executable, str(call.runner_script()), str(path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, job_dir


def run_call(tmp_path: Path, fn: object, *args: object) -> tuple[subprocess.CompletedProcess[str], call.Outcome]:
    proc, job_dir = start_call(tmp_path, fn, *args)
    data = job_dir.read_result(jobs.MAX_RESULT_BYTES)
    assert data is not None, proc.stderr
    return proc, pickle.loads(data)


def test_a_function_that_returned_for_a_stop_leaves_no_result(tmp_path: Path) -> None:
    """It checkpointed for a preemption (or a scancel): its value is not the job's outcome, the next run's is."""
    proc, job_dir = start_call(tmp_path, train_linear, 50, stop=StopRequest(StopReason.PREEMPT, time.time()))
    assert proc.returncode == 0, proc.stderr
    ack = job_dir.read_ack()
    assert ack is not None and ack.step == 0
    assert job_dir.read_result(jobs.MAX_RESULT_BYTES) is None


def test_the_runner_gives_the_function_the_session_and_rank_0_writes_its_value(tmp_path: Path) -> None:
    proc, outcome = run_call(tmp_path, train_linear, 3)
    assert proc.returncode == 0, proc.stderr
    assert outcome.ok and outcome.value["step"] == 3 and outcome.value["world_size"] == 1
    progress = JobDir(tmp_path / "fn-1").read_progress()
    assert progress is not None and progress.step == 3


def test_the_runner_carries_an_exception_back_and_fails(tmp_path: Path) -> None:
    proc, outcome = run_call(tmp_path, fail, "no data")
    assert proc.returncode == 1 and "ValueError: no data" in proc.stderr
    assert (outcome.ok, outcome.type_name, outcome.message) == (False, "ValueError", "no data")
    assert "in fail" in outcome.traceback
