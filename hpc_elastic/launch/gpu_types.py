"""Which GPU types a job may run on (pure: no Slurm, no clock).

At D0 and D1 the bits a job produces depend on the device type (kernels, libraries and their reduction orders differ
between an a100 and a v100), so a job keeps one type for its whole life: the ``--gpu-type`` it was submitted with,
or else the type of its first allocation, which the wrapper writes into the job's marker and into its requeues.
Only a job at D2 (EasyScale §3.3: hardware-agnostic kernels, checked by the model scanner when the runtime starts)
may run on mixed or other types.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.slurm.types import Node


class TypeAction(enum.StrEnum):
    RUN = "run"  # the allocation fits the job's type (or the job may use any type)
    PIN = "pin"  # a first allocation of one type: run, and keep that type from now on
    REFUSE = "refuse"  # the allocation has another or several types: requeue, pinned to ``gpu_type``


@dataclass(frozen=True)
class TypeDecision:
    action: TypeAction
    gpu_type: str | None
    reason: str


def decide_gpu_type(allocated: Mapping[str, int], pinned: str | None, level: DeterminismLevel | None) -> TypeDecision:
    """What the wrapper does with an allocation of ``allocated`` GPUs by type, for a job pinned to ``pinned`` (None:
    not yet) at determinism ``level`` (None: the runtime's default, D1)."""
    types = sorted(t for t, count in allocated.items() if count > 0 and t)
    shown = "+".join(f"{allocated[t]} {t}" for t in types) or "no typed GPUs"
    if not types:
        return TypeDecision(TypeAction.RUN, pinned, f"allocation has {shown}")
    if level is DeterminismLevel.D2:
        return TypeDecision(
            TypeAction.RUN, pinned, f"{shown}: level d2, the model scanner decides whether the types may mix"
        )
    why = f"level {(level or DeterminismLevel.D1).value}: the bits depend on the device type"
    if pinned is None:
        if len(types) == 1:
            return TypeDecision(TypeAction.PIN, types[0], f"first allocation {shown}: pinned to {types[0]} ({why})")
        most = max(types, key=lambda t: (allocated[t], t))
        return TypeDecision(TypeAction.REFUSE, most, f"first allocation mixes {shown}: requeued on {most} ({why})")
    if types == [pinned]:
        return TypeDecision(TypeAction.RUN, pinned, f"{shown}, the job's type")
    return TypeDecision(TypeAction.REFUSE, pinned, f"allocation has {shown}, the job is pinned to {pinned} ({why})")


def feature_for_type(nodes: Sequence[Node], gpu_type: str) -> str | None:
    """A node feature that selects exactly the GPU nodes of ``gpu_type`` (a constraint a requeued job can carry:
    Slurm 22.05 cannot change a pending job's GPU type), or None when the site's features do not tell the types
    apart.  The feature named like the type wins when there are several."""
    gpu_nodes = [n for n in nodes if n.gpus.total > 0]
    mine = [n for n in gpu_nodes if n.gpus.get(gpu_type) > 0]
    if not mine:
        return None
    others = [n for n in gpu_nodes if n.gpus.get(gpu_type) == 0]
    common = set(mine[0].features).intersection(*(set(n.features) for n in mine[1:]))
    selective = sorted(f for f in common if not any(f in n.features for n in others))
    if gpu_type in selective:
        return gpu_type
    return selective[0] if selective else None
