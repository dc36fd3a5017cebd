"""A parameter server: its partition of the dense arrays and of the embedding rows, updated with Adagrad as the
workers' gradients arrive (asynchronously: every push is applied on its own, in arrival order).

Re-partition (a PS added or removed while the job runs, §5.3): the master *freezes* every current PS, which in
one step under its lock stops serving (pulls and pushes are refused with :class:`hpc_elastic.ps.rpc.Moved`, nothing
applied) and hands over its snapshot; then it *reconfigures* each PS of the new set with its new index, the new
number of PS and all the snapshots: the PS keeps what hashes to it and serves again. A push is therefore either in
the snapshot or refused and re-sent by the worker to the new owner: no gradient is lost or applied twice.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from hpc_elastic.ps import rpc, wire
from hpc_elastic.ps.checkpoint import PsSnapshot
from hpc_elastic.ps.config import MAX_PROCESSES, PsJobConfig
from hpc_elastic.ps.data import owner
from hpc_elastic.ps.model import dense_owner, dense_shapes, init_dense, init_rows
from hpc_elastic.ps.usage import own_usage

#: Adagrad's initial accumulator (TensorFlow's default)
ADAGRAD_INIT = 0.1


class ParameterServer:
    """Partition ``index`` of ``num_ps``: the dense arrays whose name hashes to it and the embedding rows whose id
    does (:func:`hpc_elastic.ps.data.owner`)."""

    def __init__(self, config: PsJobConfig, index: int, num_ps: int) -> None:
        self.config = config
        self._lock = threading.Lock()
        self.frozen = False
        self.generation = 0  # of the partition: one more at each re-partition; requests carry the one they assume
        self._partition(index, num_ps)

    def _partition(self, index: int, num_ps: int) -> None:
        """Become partition ``index`` of ``num_ps`` with initial values."""
        if not 0 <= index < num_ps <= MAX_PROCESSES:
            raise ValueError(f"PS index {index} outside [0, {num_ps}), or more than {MAX_PROCESSES} PS")
        self.index, self.num_ps = index, num_ps
        spec = self.config.model()
        all_ids = np.arange(self.config.criteo().num_ids, dtype=np.int64)
        self.ids = all_ids[owner(all_ids, num_ps) == index]
        self.rows = init_rows(spec, self.ids)
        self.rows_acc = np.full_like(self.rows, ADAGRAD_INIT)
        names = [n for n in dense_shapes(spec) if dense_owner(n, num_ps) == index]
        self.dense = init_dense(spec, names)
        self.dense_acc = {n: np.full_like(v, ADAGRAD_INIT) for n, v in self.dense.items()}
        self.updates = 0

    def _slots(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        slots = np.searchsorted(self.ids, ids)
        if ids.size and (slots.max() >= self.ids.size or np.any(self.ids[slots] != ids)):
            raise ValueError(f"ids not held by PS {self.index} of {self.num_ps}")
        return slots.astype(np.int64)

    def _serving(self, header: dict[str, Any]) -> None:
        if self.frozen:
            raise rpc.Moved(f"PS {self.index} is frozen for a re-partition")
        if int(header.get("generation", 0)) != self.generation:
            raise rpc.Moved(f"PS {self.index} holds partition generation {self.generation}")

    def pull(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        names = header.get("names", [])
        with self._lock:
            self._serving(header)
            missing = [n for n in names if n not in self.dense]
            if missing:
                raise ValueError(f"dense arrays not held by PS {self.index} of {self.num_ps}: {missing}")
            slots = self._slots(arrays["ids"])
            out = {"rows": self.rows[slots]}
            out.update({f"d:{n}": self.dense[n].copy() for n in names})
            return {"updates": self.updates}, out

    def push(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        ids = arrays["ids"]
        if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
            raise ValueError("pushed ids must be sorted and unique")
        grads = arrays["rows"]
        dense = {k[2:]: g for k, g in arrays.items() if k.startswith("d:")}
        lr = self.config.lr
        with self._lock:
            self._serving(header)
            slots = self._slots(ids)
            unknown = [n for n in dense if n not in self.dense]
            if unknown:
                raise ValueError(f"dense arrays not held by PS {self.index} of {self.num_ps}: {unknown}")
            acc = self.rows_acc[slots] + grads * grads
            self.rows_acc[slots] = acc
            self.rows[slots] -= lr * grads / np.sqrt(acc)
            for name, g in dense.items():
                self.dense_acc[name] += g * g
                self.dense[name] -= lr * g / np.sqrt(self.dense_acc[name])
            self.updates += 1
            return {"updates": self.updates}, {}

    def _snapshot(self) -> PsSnapshot:
        return PsSnapshot(
            ids=self.ids.copy(),
            rows=self.rows.copy(),
            rows_acc=self.rows_acc.copy(),
            dense={n: v.copy() for n, v in self.dense.items()},
            dense_acc={n: v.copy() for n, v in self.dense_acc.items()},
            updates=self.updates,
        )

    def snapshot(self) -> PsSnapshot:
        with self._lock:
            return self._snapshot()

    def _load(self, partitions: list[PsSnapshot]) -> None:
        seen = np.zeros(self.ids.size, dtype=bool)
        for part in partitions:
            mine = np.isin(part.ids, self.ids)
            slots = self._slots(part.ids[mine])
            self.rows[slots] = part.rows[mine]
            self.rows_acc[slots] = part.rows_acc[mine]
            seen[slots] = True
            for name, value in part.dense.items():
                if name in self.dense:
                    self.dense[name] = value.copy()
                    self.dense_acc[name] = part.dense_acc[name].copy()
        missing = [n for n in self.dense if not any(n in part.dense for part in partitions)]
        if not seen.all() or missing:
            lacking = int((~seen).sum())
            raise ValueError(f"the partitions lack {lacking} rows and the arrays {missing} of PS {self.index}")
        self.updates = sum(part.updates for part in partitions)

    def load(self, partitions: list[PsSnapshot]) -> None:
        """Take this PS's rows and arrays from a checkpoint's partitions (of any number of PS: re-partition)."""
        with self._lock:
            self._load(partitions)

    def freeze(self) -> PsSnapshot:
        """Stop serving and hand over the partition, in one step."""
        with self._lock:
            self.frozen = True
            return self._snapshot()

    def reconfigure(self, index: int, num_ps: int, generation: int, partitions: list[PsSnapshot]) -> None:
        """Become partition ``index`` of ``num_ps`` of ``generation`` holding the values of ``partitions``, and
        serve again (requests of other generations are refused as moved)."""
        with self._lock:
            self._partition(index, num_ps)
            self._load(partitions)
            self.generation = generation
            self.frozen = False

    # -- RPC handlers ----------------------------------------------------------------------------------------------

    def snapshot_handler(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        return {}, self.snapshot().to_arrays()

    def freeze_handler(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        return {}, self.freeze().to_arrays()

    def reconfigure_handler(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        index, num_ps, generation = int(header["index"]), int(header["num_ps"]), int(header["generation"])
        self.reconfigure(index, num_ps, generation, [PsSnapshot.from_arrays(arrays)])
        return {"index": self.index, "num_ps": self.num_ps}, {}

    def handlers(self) -> dict[str, rpc.Handler]:
        return {
            "pull": self.pull,
            "push": self.push,
            "snapshot": self.snapshot_handler,
            "freeze": self.freeze_handler,
            "reconfigure": self.reconfigure_handler,
            "usage": lambda header, arrays: ({**own_usage(), "generation": self.generation}, {}),
        }
