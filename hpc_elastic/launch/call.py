"""The worker program of a function submitted with :func:`hpc_elastic.submit`: ``python call.py CALLFILE``.

Every worker process loads the pickled :class:`Call`, opens the runtime session (:func:`hpc_elastic.init`, as a
training script does) and calls ``fn(session, *args, **kwargs)``.  Rank 0 writes the :class:`Outcome` (the return
value, unless the function returned because the job was stopped; or what the function raised) into the job
directory atomically (``result.pkl``,
:meth:`hpc_elastic.jobdir.JobDir.write_result`); a rank whose function raised writes its own failure there too.
The process exits 0 when the function returned, and fails with the exception when it raised (the wrapper then
restarts the worker step within its restart budget, as for a script).
"""

from __future__ import annotations

import pickle
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hpc_elastic
from hpc_elastic.errors import HpcElasticError


@dataclass(frozen=True)
class Call:
    """A function and its arguments, as pickled by :func:`hpc_elastic.submit`."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What the job leaves for ``Job.result()``: the value, or the exception's type, message and traceback."""

    ok: bool
    value: Any = None
    type_name: str = ""
    message: str = ""
    traceback: str = ""


def runner_script() -> Path:
    """This module's file: what the batch script's workers run (``python call.py CALLFILE``)."""
    return Path(__file__).resolve()


def failure(exc: BaseException) -> Outcome:
    return Outcome(
        ok=False,
        type_name=type(exc).__qualname__,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
    )


def encode(outcome: Outcome) -> bytes:
    """The outcome's bytes; a value that cannot be pickled becomes a failure that says so."""
    try:
        return pickle.dumps(outcome)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        return pickle.dumps(failure(HpcElasticError(f"the function's return value cannot be pickled: {exc}")))


#: the first item of a call file's envelope
CALL_FORMAT = "hpc-elastic-call/1"


def import_root(fn: Callable[..., Any]) -> str | None:
    """The ``sys.path`` entry from which the module of ``fn`` imports (``/src`` for ``pkg.mod`` in
    ``/src/pkg/mod.py``); None for a module without a file (``__main__`` of an interpreter, builtins)."""
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    file = getattr(module, "__file__", None)
    if not isinstance(name, str) or not isinstance(file, str) or name == "__main__":
        return None
    path = Path(file).resolve()
    depth = len(name.split(".")) - (0 if path.name == "__init__.py" else 1)
    return str(path.parents[depth]) if depth < len(path.parents) else None


def envelope(payload: bytes, fn: Callable[..., Any]) -> bytes:
    """A call file: the pickled :class:`Call` (``payload``) with where its function's module imports from. A
    function pickled by reference is found again only if its module imports in the worker, which runs this file
    from wherever Slurm starts it: :func:`loads` puts that directory on ``sys.path`` first."""
    root = import_root(fn)
    return pickle.dumps((CALL_FORMAT, [root] if root else [], payload))


def loads(data: bytes, where: str = "call file") -> Call:
    """The :class:`Call` of a call file (:func:`envelope`), its function's import root put on ``sys.path``."""
    outer = pickle.loads(data)  # noqa: S301 - this user's own file, written by hpc_elastic.submit
    if not (isinstance(outer, tuple) and len(outer) == 3 and outer[0] == CALL_FORMAT):
        raise HpcElasticError(f"{where} does not hold a call submitted by hpc_elastic.submit")
    _, roots, payload = outer
    for root in reversed(roots):
        if isinstance(root, str) and root not in sys.path:
            sys.path.insert(0, root)
    call = pickle.loads(payload)  # noqa: S301 - as above
    if not isinstance(call, Call):
        raise HpcElasticError(f"{where} does not hold a call submitted by hpc_elastic.submit")
    return call


def load_call(path: Path) -> Call:
    return loads(path.read_bytes(), str(path))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: call.py CALLFILE", file=sys.stderr)
        return 2
    call = load_call(Path(argv[0]))
    with hpc_elastic.init() as session:
        if session.job_dir is None:
            raise HpcElasticError("no job directory: HPC_ELASTIC_JOB_DIR is not set (run under hpc-elastic-run)")
        try:
            value = call.fn(session, *call.args, **call.kwargs)
        except Exception as exc:  # carried back to Job.result(), then raised here too: the worker fails
            session.job_dir.write_result(encode(failure(exc)))
            raise
        # A function that returned because the job was stopped (a preemption, a resize, a scancel, the time limit:
        # it checkpointed at ``session.should_stop()``) has no outcome yet: a requeued run gives it, or none does.
        if session.is_root and session.stop_request is None:
            session.job_dir.write_result(encode(Outcome(ok=True, value=value)))
    return 0


if __name__ == "__main__":
    # Run as a script, this file's directory is sys.path[0]: take it away so that none of its siblings shadows a
    # module of the user's function; and load the classes above under their module's name, so that they pickle.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    from hpc_elastic.launch.call import main as call_main

    sys.exit(call_main(sys.argv[1:]))
