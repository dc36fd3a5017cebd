"""Where a PS job's processes go inside its allocation: each process is a job step of one task on one node
(``srun --exact --nodes=1 --cpus-per-task=C``), which Slurm starts only where one node of the allocation has ``C``
of its allocated CPUs free. The job keeps the books itself: :class:`Nodes` holds the allocation's CPUs per node
(``SLURM_JOB_NODELIST`` with ``SLURM_JOB_CPUS_PER_NODE``), the caller the cores its running steps hold per node,
and a new step goes to the node that :meth:`Nodes.place` names (``--nodelist``), so a step that does not fit is
known before it is started, never left pending.

Pure: frozen dataclasses and mappings in, decisions out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Nodes:
    """The allocation's CPUs on each of its nodes, in node-list order."""

    cpus: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not self.cpus:
            raise ValueError("an allocation has at least one node")
        names = [name for name, _ in self.cpus]
        if len(set(names)) != len(names):
            raise ValueError(f"a node named twice in the allocation: {names}")
        for name, count in self.cpus:
            if not name or isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"bad node of the allocation: {name!r} with {count!r} CPUs")

    @classmethod
    def of(cls, names: Sequence[str], counts: Sequence[int]) -> Nodes:
        """The allocation's node names and CPU counts (one each, same order); ``ValueError`` when they differ."""
        if len(names) != len(counts):
            raise ValueError(f"{len(names)} nodes {list(names)} but {len(counts)} CPU counts {list(counts)}")
        return cls(tuple(zip(names, counts, strict=True)))

    @property
    def total(self) -> int:
        return sum(count for _, count in self.cpus)

    def free(self, held: Mapping[str, int]) -> dict[str, int]:
        """The CPUs of each node not held by running steps (``held``: cores per node); ``ValueError`` for a node
        not in the allocation or more held than it has."""
        free = dict(self.cpus)
        for node, cores in held.items():
            if node not in free:
                raise ValueError(f"node {node!r} is not in the allocation {sorted(free)}")
            free[node] -= cores
            if free[node] < 0:
                raise ValueError(f"node {node!r} holds {cores} cores of its {dict(self.cpus)[node]}")
        return free

    def largest_free(self, held: Mapping[str, int]) -> int:
        """The most cores one new step may have now: the largest free share of a node."""
        return max(self.free(held).values())

    def place(self, cpus: int, held: Mapping[str, int]) -> str | None:
        """The node for a new step of ``cpus`` cores: of those with that many free, the one with the fewest (best
        fit: the largest free shares stay whole for a larger step), the first in node-list order among equals; None
        when no node has them."""
        if cpus < 1:
            raise ValueError(f"a step has at least one core, not {cpus}")
        fitting = [(left, k, node) for k, (node, left) in enumerate(self.free(held).items()) if left >= cpus]
        return min(fitting)[2] if fitting else None

    def placed(self, sizes: Sequence[int], held: Mapping[str, int]) -> tuple[dict[str, int], str | None]:
        """New steps of ``sizes`` cores placed beside the running ones (``held``), largest first, each by
        :meth:`place`: the cores held per node afterwards, and why one of them fits no node (None when all fit;
        the books then hold those placed before it)."""
        taken = dict(held)
        for cpus in sorted(sizes, reverse=True):
            node = self.place(cpus, taken)
            if node is None:
                free = self.free(taken)
                shares = ", ".join(f"{name} {left}" for name, left in free.items())
                return taken, (
                    f"a step of {cpus} cores fits no node of the allocation (free cores per node: {shares}; new "
                    f"steps of {sorted(sizes, reverse=True)} cores)"
                )
            taken[node] = taken.get(node, 0) + cpus
        return taken, None

    def refusal(self, sizes: Sequence[int], held: Mapping[str, int]) -> str | None:
        """Why new steps of ``sizes`` cores cannot all start beside the running ones (``held``); None when they
        fit (:meth:`placed`)."""
        return self.placed(sizes, held)[1]
