"""Horovod elastic mode with hpc-elastic's State: workers leave or join a running job without a restart.

Under ``horovodrun --min-np A --max-np B --host-discovery-script S`` Horovod keeps the surviving processes alive
when the discovered slots change: at the next ``commit`` they raise ``HostsUpdatedInterrupt`` (or a collective
fails with ``HorovodInternalError`` when a worker died), Horovod re-forms its process group inside the running
processes, and ``hvd.elastic.run`` calls the training function again (Horovod's elastic State protocol:
``save``/``restore``/``sync``/``reset``).  :func:`elastic_state` adapts a :class:`~hpc_elastic.state.State` to
that protocol:

- ``commit()``: an in-memory snapshot of the replicated state (host copies) and of the context of *every* EST,
  gathered from all ranks, so that a departing rank's ESTs are not lost with it; every ``persist`` commit is also a
  durable checkpoint on the shared filesystem (:meth:`State.commit`), which a requeue or a new allocation resumes
  from;
- ``restore()``: back to the last snapshot (a collective failed mid-step: the step is done again);
- ``reset()``: the session and the state follow Horovod's new rank and size: new process group, the ESTs this
  process runs now (N is fixed, any M <= N), and their contexts from the snapshot;
- ``sync()``: rank 0's snapshot to every rank (a joining process takes the state of the others); at the start of
  the run, where no process has a snapshot yet, every process first restores the newest checkpoint together.
  So a training script does not call ``state.restore()`` itself in this mode.

The ESTs (N) and the deterministic sum over them do not depend on the number of processes, so a run whose
membership changes continues bit for bit as the uninterrupted run (tests/unit/session/test_hvd_elastic.py).
Horovod is imported only when :func:`elastic_state` is called.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from hpc_elastic.checkpoint import Checkpoint, SaveMode
from hpc_elastic.checkpoint.tree import to_host
from hpc_elastic.collective import Backend
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.comm import communicator_of
from hpc_elastic.est.groups import HorovodCollective
from hpc_elastic.session import Session
from hpc_elastic.state import State

T = TypeVar("T")

_BCAST = "hpc_elastic.elastic.bcast"


@functools.cache
def _state_class() -> type[Any]:
    try:
        base = importlib.import_module("horovod.common.elastic").State
        hvd = importlib.import_module("horovod.torch")
    except ImportError as exc:
        raise HpcElasticError(f"Horovod's elastic mode needs Horovod built with PyTorch support: {exc}") from exc

    class HorovodElasticState(base):  # type: ignore[misc, valid-type]
        """Horovod's elastic ``State`` over an hpc-elastic :class:`State` (see the module docstring)."""

        def __init__(self, session: Session, state: State) -> None:
            if not isinstance(session.comm.collective, HorovodCollective):
                raise HpcElasticError(
                    f"Horovod's elastic mode needs the horovod backend, this session runs {session.backend.value}"
                )
            super().__init__(bcast_object=functools.partial(hvd.broadcast_object, name=_BCAST), get_rank=hvd.rank)
            self.session = session
            self.state = state
            self.snapshot: tuple[dict[str, Any], dict[int, Any]] | None = None
            self.restored: Checkpoint | None = None  # what the run resumed from (set by the first sync)
            self.resets = 0

        def save(self) -> None:
            """Snapshot (collective): host copies of the replicated state and of every EST's context."""
            contexts: dict[int, Any] = {}
            for part in self.session.comm.allgather_object(self.state.local_contexts()):
                contexts.update(part)
            self.snapshot = (to_host(self.state.replicated()), contexts)

        def commit(self, persist: bool = False) -> None:
            """Snapshot; with ``persist`` also a durable checkpoint (every rank passes the same value); then raise
            ``HostsUpdatedInterrupt`` on every rank if workers are to leave or join."""
            self.save()
            if persist:
                self.state.commit(mode=SaveMode.SYNC)
            self.check_host_updates()

        def restore(self) -> None:
            if self.snapshot is None:
                raise HpcElasticError("Horovod elastic restore before any commit: nothing to go back to")
            shared, contexts = self.snapshot
            self.state.load_replicated(to_host(shared))  # a copy: training must not write into the snapshot
            # the same process group: the same ESTs, back to their snapshot contexts
            self.state.rebind(self.state.comm, self.state.placement, to_host(contexts), self.state.store)

        def sync(self) -> None:
            rank0_has = hvd.broadcast_object(self.snapshot is not None, root_rank=0, name=_BCAST)
            if not rank0_has:
                # The run starts (every process is new): resume together from the newest checkpoint on the shared
                # filesystem, then snapshot.  A process that joins later takes rank 0's snapshot instead: the
                # store's restore is collective, and the others are not restoring.
                self.restored = self.state.restore()
                self.save()
            self.snapshot = hvd.broadcast_object(self.snapshot, root_rank=0, name=_BCAST)
            self.restore()

        def reset(self) -> None:
            """After Horovod re-formed its group (``hvd.init`` done): follow the new rank and size."""
            self.resets += 1
            self.session.rebind(communicator_of(Backend.HOROVOD, HorovodCollective()))
            contexts = self.snapshot[1] if self.snapshot is not None else {}
            self.state.rebind(
                self.session.comm, self.session.placement, to_host(contexts), self.session.checkpoint_store()
            )

    return HorovodElasticState


def elastic_state(session: Session, state: State) -> Any:
    """A Horovod elastic ``State`` over ``state`` for :func:`run` (the session's backend must be horovod)."""
    return _state_class()(session, state)


def run(hstate: Any, train: Callable[[], T]) -> T:
    """``hvd.elastic.run``: call ``train()`` (which calls ``hstate.commit()`` at step boundaries) and start it
    again after every membership change, from the last commit."""
    hvd = importlib.import_module("horovod.torch")
    result: T = hvd.elastic.run(lambda _state: train())(hstate)
    return result
