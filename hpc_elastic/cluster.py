"""A summary of the cluster per partition: pure, from the adapter's nodes, partitions and jobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpc_elastic.slurm.types import GpuCounts, Job, Node, Partition


@dataclass(frozen=True)
class NodeSummary:
    name: str
    state: str
    available: bool
    cpus: int
    cpus_allocated: int
    gpus: GpuCounts
    gpus_free: GpuCounts


@dataclass(frozen=True)
class PartitionSummary:
    name: str
    state: str
    default: bool
    nodes: tuple[NodeSummary, ...]
    node_states: tuple[tuple[str, int], ...]
    gpus_total: GpuCounts
    gpus_free: GpuCounts
    jobs_running: int
    jobs_pending: int


@dataclass(frozen=True)
class ClusterSummary:
    partitions: tuple[PartitionSummary, ...]
    nodes: int
    gpus_total: GpuCounts
    gpus_free: GpuCounts
    jobs_running: int
    jobs_pending: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; GPU counts become ``{type: count}`` objects."""

        def convert(value: Any) -> Any:
            if isinstance(value, dict):
                if set(value) == {"by_type"}:
                    return {name or "gpu": count for name, count in value["by_type"]}
                return {key: convert(item) for key, item in value.items()}
            if isinstance(value, list | tuple):
                if value and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value):
                    return {k: convert(v) for k, v in value}
                return [convert(v) for v in value]
            return value

        result: dict[str, Any] = convert(asdict(self))
        return result


def _sum(counts: Sequence[GpuCounts]) -> GpuCounts:
    return GpuCounts.of([pair for c in counts for pair in c.by_type])


def summarize(partitions: Sequence[Partition], nodes: Sequence[Node], jobs: Sequence[Job]) -> ClusterSummary:
    """Nodes per partition with state, GPUs by type free/total, jobs running and pending per partition.

    GPUs on unavailable nodes (down, drained) count in the total but not as free.
    """
    by_name = {node.name: node for node in nodes}
    running: Counter[str] = Counter()
    pending: Counter[str] = Counter()
    for job in jobs:
        for name in job.partition.split(","):
            if job.state.is_running:
                running[name] += 1
            elif job.state.is_pending:
                pending[name] += 1
    summaries = []
    for part in partitions:
        members = [by_name[n] for n in part.nodes if n in by_name]
        node_rows = tuple(
            NodeSummary(
                name=n.name,
                state=n.state.value + "".join(f"+{f}" for f in n.flags),
                available=n.available,
                cpus=n.cpus,
                cpus_allocated=n.cpus_allocated,
                gpus=n.gpus,
                gpus_free=n.gpus_free if n.available else GpuCounts(),
            )
            for n in members
        )
        states = Counter(row.state for row in node_rows)
        summaries.append(
            PartitionSummary(
                name=part.name,
                state=part.state.value,
                default=part.default,
                nodes=node_rows,
                node_states=tuple(sorted(states.items())),
                gpus_total=_sum([row.gpus for row in node_rows]),
                gpus_free=_sum([row.gpus_free for row in node_rows]),
                jobs_running=running[part.name],
                jobs_pending=pending[part.name],
            )
        )
    return ClusterSummary(
        partitions=tuple(summaries),
        nodes=len(nodes),
        gpus_total=_sum([n.gpus for n in nodes]),
        gpus_free=_sum([n.gpus_free for n in nodes if n.available]),
        jobs_running=sum(1 for j in jobs if j.state.is_running),
        jobs_pending=sum(1 for j in jobs if j.state.is_pending),
    )
