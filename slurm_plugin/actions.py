"""Turn a policy :class:`Decision` into the Slurm changes that differ from Slurm's current state (pure).

Each action carries the reason that is logged when it is applied (or would be, with ``--dry-run``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from hpc_elastic.policy import Decision, JobStatus
from hpc_elastic.slurm.parse import compress_hostlist
from slurm_plugin.config import OrderField, PluginConfig
from slurm_plugin.observe import Observation


class ActionKind(StrEnum):
    ORDER = "order"
    PREEMPT = "preempt"
    PLACE = "place"
    RESIZE = "resize"


@dataclass(frozen=True, slots=True)
class SetOrder:
    """Set the SiteFactor (or Priority) of a pending job so that Slurm starts jobs in the policy's order."""

    job_id: int
    field: OrderField
    value: int
    old: int | None
    reason: str
    kind: ActionKind = ActionKind.ORDER


@dataclass(frozen=True, slots=True)
class Preempt:
    """Checkpoint (stop file + signal), wait for the acknowledgement, requeue."""

    job_id: int
    name: str
    checkpointed: bool
    reason: str
    kind: ActionKind = ActionKind.PREEMPT


@dataclass(frozen=True, slots=True)
class Place:
    """Node-count / node-list constraints of a pending job (Tiresias §3.3)."""

    job_id: int
    num_nodes: int | None
    node_list: str | None
    reason: str
    kind: ActionKind = ActionKind.PLACE

    @property
    def signature(self) -> str:
        return f"N={self.num_nodes or ''};L={self.node_list or ''}"


@dataclass(frozen=True, slots=True)
class Resize:
    """Change an elastic job's GPUs within [min, max] (checkpoint -> requeue with the new size)."""

    job_id: int
    old_gpus: int
    new_gpus: int
    reason: str
    kind: ActionKind = ActionKind.RESIZE


Action = SetOrder | Preempt | Place | Resize


def order_actions(obs: Observation, decision: Decision, config: PluginConfig) -> list[SetOrder]:
    """Pending managed jobs get strictly decreasing values in the policy's priority order (Tiresias §3.2.3:
    queue first, then FIFO by first start / Gittins index); only values that differ from Slurm's are set."""
    pending = [row for row in decision.priority_order.tolist() if obs.jobs[row].status is JobStatus.PENDING]
    field = config.order.field
    out: list[SetOrder] = []
    for rank, row in enumerate(pending):
        view = obs.jobs[row]
        job = obs.slurm_jobs[view.job_id]
        queue = obs.records[int(view.job_id)].queue
        value = config.order.base + (len(pending) - rank) * config.order.step
        old = job.site_factor if field is OrderField.SITE_FACTOR else job.priority
        if old != value:
            reason = (
                f"rank {rank + 1}/{len(pending)} among pending managed jobs "
                f"(queue {queue}, attained {view.attained_service:.0f} GPU-s)"
            )
            out.append(SetOrder(int(view.job_id), field, value, old, reason))
    return out


def preempt_actions(obs: Observation, decision: Decision, config: PluginConfig) -> list[Preempt]:
    """The policy's victims, except those that ran less than ``min_run_time_s`` since their last (re)start or
    were preempted less than that long ago (preemption is expensive: Tiresias §2.2, §3.2.3)."""
    if not config.preemption.enabled:
        return []
    started_on: dict[str, list[str]] = {}
    for start in decision.starts:
        for node, _ in start.allocation:
            started_on.setdefault(node, []).append(start.job_id)
    out: list[Preempt] = []
    min_run = config.preemption.min_run_time_s
    for victim in decision.preemptions:
        view = obs.jobs[victim.row]
        record = obs.records[int(view.job_id)]
        if view.status is not JobStatus.RUNNING or view.run_time < min_run:
            continue
        if record.last_preempt is not None and obs.now - record.last_preempt < min_run:
            continue
        beneficiaries = sorted({j for node, _ in view.allocation for j in started_on.get(node, [])}, key=int)
        job = obs.slurm_jobs[view.job_id]
        reason = (
            f"queue {record.queue} with {view.attained_service:.0f} GPU-s attained; its GPUs go to higher-priority "
            f"job(s) {','.join(beneficiaries) or '?'}"
        )
        out.append(Preempt(int(view.job_id), job.name, obs.markers.get(view.job_id) is not None, reason))
        if len(out) >= config.preemption.max_per_pass:
            break
    return out


def place_actions(
    obs: Observation, decision: Decision, config: PluginConfig, pack_limit: float
) -> list[Place]:
    """For the jobs the policy starts now: consolidate skewed jobs (S_J > PACKLIMIT) on as few nodes as the
    plan uses; with ``pin_nodes`` pin every start to the planned nodes (spread to limit fragmentation, §3.3)."""
    if not config.placement.enabled:
        return []
    out: list[Place] = []
    for start in decision.starts:
        view = obs.jobs[start.row]
        record = obs.records[int(view.job_id)]
        skewed = view.skew is not None and view.skew > pack_limit
        nodes = [name for name, _ in start.allocation]
        num_nodes = len(nodes) if skewed else None
        node_list = compress_hostlist(nodes) if config.placement.pin_nodes else None
        if num_nodes is None and node_list is None:
            continue
        why = f"skew {view.skew:.2f} > PACKLIMIT {pack_limit:.2f}: consolidate" if skewed else "planned nodes"
        action = Place(int(view.job_id), num_nodes, node_list, f"{why} on {','.join(nodes)}")
        if action.signature != record.placement:
            out.append(action)
    return out


def resize_actions(obs: Observation, decision: Decision, config: PluginConfig) -> list[Resize]:
    """Elastic jobs shrink toward ``min`` while feasible jobs wait, and grow toward ``max`` into GPUs left idle
    when nothing waits (one job per pass, so a resize is never undone by the next one of the same pass)."""
    if not config.resize.enabled:
        return []
    started = {s.row for s in decision.starts}
    victims = {p.row for p in decision.preemptions}
    infeasible = set(decision.infeasible)
    waiting = [
        row for row, v in enumerate(obs.jobs)
        if v.status is JobStatus.PENDING and row not in started and row not in infeasible
    ]
    running = [
        row for row, v in enumerate(obs.jobs)
        if v.status is JobStatus.RUNNING and row not in victims and v.run_time >= config.preemption.min_run_time_s
    ]
    if waiting:
        need = min(obs.jobs[row].gpus for row in waiting)
        for row in reversed(decision.priority_order.tolist()):  # lowest priority first
            view = obs.jobs[row]
            if row in running and view.min_gpus is not None and view.gpus > view.min_gpus:
                new = max(view.min_gpus, view.gpus - need)
                return [Resize(int(view.job_id), view.gpus, new, f"shrink: {len(waiting)} feasible job(s) wait")]
        return []
    free_by_type: dict[str, int] = {}
    for node in obs.nodes:
        free_by_type[node.gpu_type] = free_by_type.get(node.gpu_type, 0) + node.free_gpus
    for row in decision.priority_order.tolist():  # highest priority first
        view = obs.jobs[row]
        if row not in running or view.max_gpus is None or view.gpus >= view.max_gpus:
            continue
        types = view.gpu_types or frozenset(free_by_type)
        free = max((free_by_type.get(t, 0) for t in types), default=0)
        if free > 0:
            new = min(view.max_gpus, view.gpus + free)
            return [Resize(int(view.job_id), view.gpus, new, f"grow: {free} GPU(s) idle and no job waits")]
    return []


def plan(obs: Observation, decision: Decision, config: PluginConfig) -> list[Action]:
    """All actions of a pass: preemptions first (they free GPUs), then placement, order, resize."""
    pack_limit = config.tiresias.pack_limit
    actions: list[Action] = []
    actions += preempt_actions(obs, decision, config)
    actions += place_actions(obs, decision, config, pack_limit)
    actions += order_actions(obs, decision, config)
    actions += resize_actions(obs, decision, config)
    return actions


def planned_by_job(actions: list[Action]) -> Mapping[int, str]:
    """A short description of the planned action per job (for ``queue`` and the state file)."""
    out: dict[int, str] = {}
    for action in actions:
        out[action.job_id] = (out.get(action.job_id, "") + f" {action.kind.value}").strip()
    return out
