"""A parameter server: its partition of the dense arrays and of the embedding rows, updated with Adagrad as the
workers' gradients arrive (asynchronously: every push is applied on its own, in arrival order)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from hpc_elastic.ps import rpc, wire
from hpc_elastic.ps.checkpoint import PsSnapshot
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.data import owner
from hpc_elastic.ps.model import dense_owner, dense_shapes, init_dense, init_rows

#: Adagrad's initial accumulator (TensorFlow's default)
ADAGRAD_INIT = 0.1


class ParameterServer:
    """Partition ``index`` of ``num_ps``: the dense arrays whose name hashes to it and the embedding rows whose id
    does (:func:`hpc_elastic.ps.data.owner`)."""

    def __init__(self, config: PsJobConfig, index: int, num_ps: int) -> None:
        if not 0 <= index < num_ps:
            raise ValueError(f"PS index {index} outside [0, {num_ps})")
        self.config = config
        self.index = index
        spec = config.model()
        all_ids = np.arange(config.criteo().num_ids, dtype=np.int64)
        self.ids = all_ids[owner(all_ids, num_ps) == index]
        self.rows = init_rows(spec, self.ids)
        self.rows_acc = np.full_like(self.rows, ADAGRAD_INIT)
        names = [n for n in dense_shapes(spec) if dense_owner(n, num_ps) == index]
        self.dense = init_dense(spec, names)
        self.dense_acc = {n: np.full_like(v, ADAGRAD_INIT) for n, v in self.dense.items()}
        self.updates = 0
        self._lock = threading.Lock()

    def _slots(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        slots = np.searchsorted(self.ids, ids)
        if ids.size and (slots.max() >= self.ids.size or np.any(self.ids[slots] != ids)):
            raise ValueError(f"ids not held by PS {self.index}")
        return slots.astype(np.int64)

    def pull(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        names = header.get("names", [])
        missing = [n for n in names if n not in self.dense]
        if missing:
            raise ValueError(f"dense arrays not held by PS {self.index}: {missing}")
        slots = self._slots(arrays["ids"])
        with self._lock:
            out = {"rows": self.rows[slots]}
            out.update({f"d:{n}": self.dense[n].copy() for n in names})
        return {"updates": self.updates}, out

    def push(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        ids = arrays["ids"]
        if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
            raise ValueError("pushed ids must be sorted and unique")
        slots = self._slots(ids)
        grads = arrays["rows"]
        dense = {k[2:]: g for k, g in arrays.items() if k.startswith("d:")}
        lr = self.config.lr
        with self._lock:
            acc = self.rows_acc[slots] + grads * grads
            self.rows_acc[slots] = acc
            self.rows[slots] -= lr * grads / np.sqrt(acc)
            for name, g in dense.items():
                if name not in self.dense:
                    raise ValueError(f"dense array {name!r} not held by PS {self.index}")
                self.dense_acc[name] += g * g
                self.dense[name] -= lr * g / np.sqrt(self.dense_acc[name])
            self.updates += 1
        return {"updates": self.updates}, {}

    def snapshot(self) -> PsSnapshot:
        with self._lock:
            return PsSnapshot(
                ids=self.ids.copy(),
                rows=self.rows.copy(),
                rows_acc=self.rows_acc.copy(),
                dense={n: v.copy() for n, v in self.dense.items()},
                dense_acc={n: v.copy() for n, v in self.dense_acc.items()},
                updates=self.updates,
            )

    def load(self, partitions: list[PsSnapshot]) -> None:
        """Take this PS's rows and arrays from a checkpoint's partitions (of any number of PS: re-partition)."""
        seen = np.zeros(self.ids.size, dtype=bool)
        with self._lock:
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
                raise ValueError(
                    f"the checkpoint lacks {int((~seen).sum())} rows and arrays {missing} of PS {self.index}"
                )
            self.updates = sum(part.updates for part in partitions)

    def snapshot_handler(self, header: dict[str, Any], arrays: wire.Arrays) -> rpc.Reply:
        return {}, self.snapshot().to_arrays()

    def handlers(self) -> dict[str, rpc.Handler]:
        return {"pull": self.pull, "push": self.push, "snapshot": self.snapshot_handler}
