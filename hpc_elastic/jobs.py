"""The Python API of hpc-elastic, as submitit users expect it: :func:`submit` a training script or a function, get a
:class:`Job` handle (``job_id``, ``state``, ``wait()``, ``result()``, ``cancel()``, ``checkpoints()``,
``stdout()``, ``status()``); and the reads behind ``hpc-elastic jobs`` / ``hpc-elastic job``.

::

    import hpc_elastic

    def train(session, steps):                    # gets the runtime session, like a training script
        ...
        return {"loss": loss}

    job = hpc_elastic.submit(train, args=(200,), gpus=2, workers=4, partition="gpu")
    print(job.job_id, job.state)
    print(job.result())                          # waits; the return value of rank 0, or RemoteError

A function is pickled (with cloudpickle when it is installed, else by reference: a module-level function of an
importable module) into ``<ckpt-root>/calls/`` and run in every worker process by :mod:`hpc_elastic.launch.call`;
rank 0 writes its outcome into the job directory.  Resources are the fields of
:class:`~hpc_elastic.launch.spec.SubmitSpec`, passed through as keyword arguments (``gpus=2``, ``workers=8``,
``partition="gpu"``, ``time="1:00:00"``, ``ckpt_root=...``): the same checks and the same batch script as
``hpc-elastic submit``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from hpc_elastic.env import read_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.jobdir import (
    CheckpointRecord,
    JobDir,
    call_path,
    find_job_dir,
    output_path,
    read_tail,
    write_call,
)
from hpc_elastic.jobstatus import ElasticStatus, JobReadings, elastic_status
from hpc_elastic.launch import call as call_runner
from hpc_elastic.launch.spec import SubmitSpec
from hpc_elastic.launch.submission import build_spec, submit_spec
from hpc_elastic.slurm import JobNotFound, JobState, SlurmClient, connect
from hpc_elastic.slurm.types import Job as SlurmJob

T = TypeVar("T")

#: how far back ``sacct`` is asked for a job squeue no longer knows
HISTORY_WINDOW = timedelta(days=30)
#: the most bytes a function's outcome may take
MAX_RESULT_BYTES = 256 << 20
DEFAULT_POLL_S = 2.0
_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.+-]")


class JobFailed(HpcElasticError):
    """The job ended without an outcome to return (cancelled, timed out, killed before rank 0 wrote one)."""


class RemoteError(HpcElasticError):
    """The submitted function raised: ``type_name``, ``message`` and the worker's ``remote_traceback``."""

    def __init__(self, job_id: int, type_name: str, message: str, remote_traceback: str) -> None:
        self.job_id = job_id
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"job {job_id}: the function raised {type_name}: {message}")


# ------------------------------------------------------------------------------------------ reading a job


def slurm_record(slurm: SlurmClient, job_id: int, now: float) -> SlurmJob:
    """Slurm's record of a job: ``squeue`` while it knows the job, else its newest accounting record (``sacct``:
    a requeued job has one per incarnation).  :class:`JobNotFound` when neither knows it."""
    found = slurm.jobs([job_id])
    if found:
        return found[0]
    start = datetime.fromtimestamp(now, UTC) - HISTORY_WINDOW
    records = [job for job in slurm.history(start, job_ids=[job_id]) if job.job_id == job_id]
    if not records:
        raise JobNotFound([], 0, f"no job {job_id} in squeue or in the last {HISTORY_WINDOW.days} days of sacct")
    return max(records, key=lambda job: (job.restart_count, job.submit_time or datetime.min.replace(tzinfo=UTC)))


def locate_job_dir(job: SlurmJob, roots: Sequence[Path]) -> JobDir | None:
    """The job's directory under the first of ``roots`` that holds it as a directory of this user."""
    return find_job_dir(tuple(roots), job.name, job.job_id, os.getuid())


def read_job_dir(job_dir: JobDir | None) -> JobReadings:
    """What the job's directory holds now (bounded reads through :class:`JobDir`)."""
    if job_dir is None:
        return JobReadings()
    return JobReadings(
        path=job_dir.path,
        progress=job_dir.read_progress(),
        checkpoints=job_dir.list_checkpoints(),
        past_stops=job_dir.past_stops(),
        stop=job_dir.read_stop(),
    )


def job_status(slurm: SlurmClient, job_id: int, roots: Sequence[Path], now: float | None = None) -> ElasticStatus:
    """The elastic state of job ``job_id`` (its directory looked up under ``roots``)."""
    moment = time.time() if now is None else now
    job = slurm_record(slurm, job_id, moment)
    return elastic_status(job, read_job_dir(locate_job_dir(job, roots)), moment)


def my_jobs(slurm: SlurmClient, roots: Sequence[Path], now: float | None = None) -> list[ElasticStatus]:
    """The elastic state of every job of this user that ``squeue`` knows (active or just finished)."""
    moment = time.time() if now is None else now
    uid = os.getuid()
    mine = sorted((job for job in slurm.jobs() if job.user_id == uid), key=lambda job: job.job_id)
    return [elastic_status(job, read_job_dir(locate_job_dir(job, roots)), moment) for job in mine]


def default_roots(ckpt_roots: Sequence[Path] = ()) -> tuple[Path, ...]:
    """Where job directories are looked for: ``ckpt_roots``, else the default checkpoint root of ``submit``."""
    return tuple(ckpt_roots) or (read_environment().gpfs_root / "jobs",)


# --------------------------------------------------------------------------------------------- the handle


class Job(Generic[T]):
    """A submitted job.  ``T``: what :meth:`result` returns (the function's return value; None for a script)."""

    def __init__(
        self, job_id: int, name: str, ckpt_root: Path, slurm: SlurmClient, *, has_result: bool = False
    ) -> None:
        self.job_id = job_id
        self.name = name
        self.ckpt_root = Path(ckpt_root)
        self.has_result = has_result
        self._slurm = slurm

    def __repr__(self) -> str:
        return f"Job(job_id={self.job_id}, name={self.name!r})"

    @property
    def job_dir(self) -> JobDir:
        return JobDir.of(self.ckpt_root, self.name, self.job_id)

    @property
    def state(self) -> JobState:
        """Slurm's state of the job now (``squeue``, else accounting)."""
        return slurm_record(self._slurm, self.job_id, time.time()).state

    def done(self) -> bool:
        return not self.state.is_active

    def status(self) -> ElasticStatus:
        """The elastic state: N, M, GPU types, step, steps/s, checkpoints, requeues, the plugin's last action."""
        return job_status(self._slurm, self.job_id, (self.ckpt_root,))

    def wait(self, timeout_s: float | None = None, poll_s: float = DEFAULT_POLL_S) -> JobState:
        """Block until the job has ended (requeues included: a requeued job is still active); its final state.
        ``TimeoutError`` after ``timeout_s`` seconds."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.state
            if not state.is_active:
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.job_id} still {state.value} after {timeout_s:.0f}s")
            time.sleep(poll_s)

    def result(self, timeout_s: float | None = None, poll_s: float = DEFAULT_POLL_S) -> T:
        """Wait for the job, then the return value of the function on rank 0.  :class:`RemoteError` when the
        function raised, :class:`JobFailed` when the job ended without an outcome (or was a script)."""
        state = self.wait(timeout_s, poll_s)
        if not self.has_result:
            raise JobFailed(f"job {self.job_id} ran a script: it has no result (it ended {state.value})")
        data = self.job_dir.read_result(MAX_RESULT_BYTES)
        if data is None:
            raise JobFailed(f"job {self.job_id} ended {state.value} without a result; see {self.output_path}")
        outcome = pickle.loads(data)  # noqa: S301 - this user's own file, written by this user's job
        if not isinstance(outcome, call_runner.Outcome):
            raise JobFailed(f"job {self.job_id}: {self.job_dir.result_path} holds no outcome")
        if not outcome.ok:
            raise RemoteError(self.job_id, outcome.type_name, outcome.message, outcome.traceback)
        value: T = outcome.value
        return value

    def cancel(self) -> None:
        """``scancel`` the job (a no-op for a job that has ended)."""
        if self.done():
            return
        self._slurm.cancel([self.job_id])

    def checkpoints(self) -> tuple[CheckpointRecord, ...]:
        """The job's committed checkpoints, newest first."""
        return self.job_dir.list_checkpoints()

    @property
    def output_path(self) -> Path:
        return output_path(self.ckpt_root, self.name, self.job_id)

    def stdout(self, limit: int = 1 << 20) -> str:
        """The job's output (standard output and error of the wrapper and the workers), its last ``limit`` bytes;
        empty before the job has started."""
        try:
            return read_tail(self.output_path, limit)
        except FileNotFoundError:
            return ""


# --------------------------------------------------------------------------------------------- submitting


def _pickler() -> ModuleType:
    """cloudpickle when it is installed (closures, lambdas, functions of ``__main__``), else pickle."""
    try:
        return importlib.import_module("cloudpickle")
    except ImportError:
        return pickle


def pickle_call(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], pickler: ModuleType | None = None
) -> bytes:
    """The call file's bytes (``pickler``: cloudpickle when installed, else pickle; :func:`call_runner.envelope`
    records where the function's module imports from); ``ValueError`` when it cannot be pickled (with pickle: a
    function that is not at module level of an importable module)."""
    chosen = pickler if pickler is not None else _pickler()
    if chosen is pickle and getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"function {getattr(fn, '__qualname__', fn)!r} is defined in __main__: without cloudpickle a function is "
            "pickled by reference, so it must live in an importable module"
        )
    try:
        data: bytes = chosen.dumps(call_runner.Call(fn, tuple(args), dict(kwargs)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"cannot pickle the call of {getattr(fn, '__qualname__', fn)!r}: {exc}") from None
    return call_runner.envelope(data, fn)


def resource_options(resources: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments as :class:`SubmitSpec` values: a ``str`` or ``os.PathLike`` for a path field becomes a
    ``Path``, a list for a tuple field a tuple (whatever fields the spec has; unknown names are refused by
    :func:`~hpc_elastic.launch.spec.merge`, naming them)."""
    kinds = {f.name: str(f.type) for f in fields(SubmitSpec)}
    out: dict[str, Any] = {}
    for name, value in resources.items():
        kind = kinds.get(name, "")
        if kind.startswith("Path") and isinstance(value, str | os.PathLike):
            out[name] = Path(value)
        elif kind.startswith("tuple") and isinstance(value, list):
            out[name] = tuple(value)
        else:
            out[name] = value
    return out


def _job_name(fn: Callable[..., Any]) -> str:
    return _NAME_SAFE.sub("-", getattr(fn, "__name__", "call"))[:64].lstrip(".") or "call"


def submit(
    script_or_callable: str | os.PathLike[str] | Callable[..., T],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    slurm: SlurmClient | None = None,
    **resources: Any,
) -> Job[T]:
    """Submit a training script (``args``: its command-line arguments) or a function (called in every worker
    process as ``fn(session, *args, **kwargs)``, ``session`` being :func:`hpc_elastic.init`'s) as an elastic
    job.  ``resources``: :class:`~hpc_elastic.launch.spec.SubmitSpec` fields (``gpus``, ``workers``,
    ``partition``, ``ckpt_root``, ...).  ``ValueError`` naming a bad value, with nothing submitted."""
    env = read_environment()
    if callable(script_or_callable):
        fn = script_or_callable
        options = {"job_name": _job_name(fn), **resource_options(resources)}
        spec = build_spec(call_runner.runner_script(), (), options, env, sys.executable)
        data = pickle_call(fn, args, kwargs or {})
        client = slurm if slurm is not None else connect(env)
        path = call_path(spec.ckpt_root)
        write_call(path, data)
        try:
            job_id = submit_spec(replace(spec, args=(str(path),)), client)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return Job(job_id, spec.name, spec.ckpt_root, client, has_result=True)
    if kwargs:
        raise ValueError("kwargs= is for a function; a script takes its command-line arguments in args=")
    script_args = tuple(str(arg) for arg in args)
    spec = build_spec(Path(script_or_callable), script_args, resource_options(resources), env, sys.executable)
    client = slurm if slurm is not None else connect(env)
    return Job(submit_spec(spec, client), spec.name, spec.ckpt_root, client)
