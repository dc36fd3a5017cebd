"""Turn a policy :class:`Decision` into the Slurm changes that differ from Slurm's current state (pure).

Each action carries the reason that is logged when it is applied (or would be, with ``--dry-run``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from hpc_elastic.policy import Decision, JobStatus, JobView
from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.slurm import Job
from hpc_elastic.slurm.parse import compress_hostlist
from slurm_plugin.config import OrderField, PluginConfig
from slurm_plugin.cpu_policy import CpuDecision, PsJobView, plan_ps_jobs
from slurm_plugin.easyscale import node_order_key, parse_split, span_nodes
from slurm_plugin.observe import Observation
from slurm_plugin.store import JobRecord


class ActionKind(StrEnum):
    ORDER = "order"
    PREEMPT = "preempt"
    PLACE = "place"
    RESIZE = "resize"
    REQUEUE = "requeue"
    SIZE = "size"
    RELEASE = "release"
    SCALE = "scale"


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
    """Ask for a checkpoint (a stop notice in the job's AdminComment, then the signal); the requeue follows (by
    the job's wrapper after its acknowledgement, else by a later pass: :class:`Requeue`). Jobs without a job
    directory are requeued at once."""

    job_id: int
    name: str
    checkpointed: bool
    restart_count: int
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
    """Change an elastic job's GPUs within [min, max]: checkpoint (stop reason ``resize``) -> requeue ->
    :class:`SetSize` on the pending job. GPU jobs cannot change size in place: their worker step has a fixed
    task count, and Slurm 22.05 cannot grow a job that holds GRES."""

    job_id: int
    name: str
    checkpointed: bool
    restart_count: int
    old_gpus: int
    new_gpus: int
    reason: str
    cpus_per_task: int = 1
    gpu_type: str | None = None  # the type of its GPUs (a requeued job keeps it)
    #: the new GPUs per type of a job whose plans may span types (the D2 guard), given as nodes when it waits
    split: tuple[tuple[str, int], ...] = ()
    #: the nodes of the policy's plan for such a job, held for it (a Slurm reservation) from its stop until it runs
    #: again: the GPUs it gives up free at its requeue, when a waiting job of any type starts at once, while the
    #: requeued job may start only some seconds later (:func:`keep_nodes`)
    keep: tuple[str, ...] = ()
    kind: ActionKind = ActionKind.RESIZE


@dataclass(frozen=True, slots=True)
class Span:
    """A pending job's new GPUs per type (``split``) as nodes: ``nodes`` to require, ``excluded`` the other GPU
    nodes (:func:`slurm_plugin.easyscale.span_nodes`); ``why`` says when the split could not be given as asked."""

    split: tuple[tuple[str, int], ...]
    nodes: tuple[str, ...]
    excluded: tuple[str, ...]
    why: str = ""

    @property
    def gpus(self) -> int:
        return sum(n for _, n in self.split)


@dataclass(frozen=True, slots=True)
class Requeue:
    """Requeue a job whose checkpoint was acknowledged (its wrapper did not requeue it) or whose grace ended."""

    job_id: int
    reason: str
    cpus_per_task: int = 1  # for the new size of a job being resized
    gpu_type: str | None = None
    span: Span | None = None  # the new size as nodes (a job resized across types)
    kind: ActionKind = ActionKind.REQUEUE


@dataclass(frozen=True, slots=True)
class SetSize:
    """Set a pending (requeued) job's task count, hence its GPUs (one per task), and its CPUs."""

    job_id: int
    tasks: int
    cpus: int
    reason: str
    gpu_type: str | None = None
    span: Span | None = None  # the new size as nodes (a job resized across types)
    kind: ActionKind = ActionKind.SIZE


@dataclass(frozen=True, slots=True)
class ReleaseNodes:
    """End the reservation that held a resized job's planned nodes (:attr:`Resize.keep`, EasyScale §3.4's plan):
    the job runs again, or it no longer waits to."""

    job_id: int
    reservation: str
    reason: str
    kind: ActionKind = ActionKind.RELEASE


@dataclass(frozen=True, slots=True)
class Scale:
    """DL²'s new size of a running ps-mode job (its slot's decision, DL² §3.1): a scale notice in the job's
    AdminComment (for its run ``restart_count``), then ``USR2`` to its batch shell; the job's wrapper applies or
    refuses it as it does a user's ``hpc-elastic scale`` request and answers in the job directory."""

    job_id: int
    workers: int
    ps: int
    restart_count: int
    reason: str
    kind: ActionKind = ActionKind.SCALE


Action = SetOrder | Preempt | Place | Resize | Requeue | SetSize | ReleaseNodes | Scale
Stop = Preempt | Resize


def order_actions(obs: Observation, decision: Decision, config: PluginConfig) -> list[SetOrder]:
    """Pending managed jobs get strictly decreasing values in the policy's priority order (Tiresias §3.2.3:
    queue first, then FIFO by first start / Gittins index); only values that differ from Slurm's are set."""
    pending = [row for row in decision.priority_order.tolist() if obs.jobs[row].status is JobStatus.PENDING]
    field = config.order.field
    out: list[SetOrder] = []
    for rank, row in enumerate(pending):
        view = obs.jobs[row]
        job = obs.slurm_jobs[view.job_id]
        queue = obs.records[view.job_id].queue
        value = config.order.base + (len(pending) - rank) * config.order.step
        old = job.site_factor if field is OrderField.SITE_FACTOR else job.priority
        if old != value:
            reason = (
                f"rank {rank + 1}/{len(pending)} among pending managed jobs "
                f"(queue {queue}, attained {view.attained_service:.0f} GPU-s)"
            )
            out.append(SetOrder(view.job_id, field, value, old, reason))
    return out


def preempt_actions(obs: Observation, decision: Decision, config: PluginConfig) -> list[Preempt]:
    """The policy's victims, except those that ran less than ``min_run_time_s`` since their last (re)start or
    were preempted less than that long ago (preemption is expensive: Tiresias §2.2, §3.2.3)."""
    if not config.preemption.enabled:
        return []
    started_on: dict[str, list[int]] = {}
    for start in decision.starts:
        for node, _ in start.allocation:
            started_on.setdefault(node, []).append(start.job_id)
    out: list[Preempt] = []
    min_run = config.preemption.min_run_time_s
    for victim in decision.preemptions:
        if len(out) >= config.preemption.max_per_pass:  # 0: the pass preempts nothing
            break
        view = obs.jobs[victim.row]
        record = obs.records[view.job_id]
        if view.status is not JobStatus.RUNNING or view.run_time < min_run or _busy(record):
            continue
        if record.last_preempt is not None and obs.now - record.last_preempt < min_run:
            continue
        beneficiaries = sorted({j for node, _ in view.allocation for j in started_on.get(node, [])})
        job = obs.slurm_jobs[view.job_id]
        reason = (
            f"queue {record.queue} with {view.attained_service:.0f} GPU-s attained; its GPUs go to higher-priority "
            f"job(s) {','.join(map(str, beneficiaries)) or '?'}"
        )
        checkpointed = obs.markers.get(view.job_id) is not None
        out.append(Preempt(view.job_id, job.name, checkpointed, job.restart_count, reason))
    return out


def ps_plan(obs: Observation, config: PluginConfig) -> CpuDecision:
    """The pass's plan for the ps-mode jobs on CPU partitions (:func:`slurm_plugin.cpu_policy.plan_ps_jobs`): a
    running job may be preempted once it ran ``min_run_time_s`` since its last (re)start and preemption, with no
    stop in flight; nothing when preemption is off."""
    if not config.preemption.enabled:
        return CpuDecision()
    min_run = config.preemption.min_run_time_s

    def may_preempt(view: PsJobView) -> bool:
        record = obs.records.get(view.job_id)
        if record is None or not view.running or record.run_exec < min_run or _busy(record):
            return False
        return record.last_preempt is None or obs.now - record.last_preempt >= min_run

    views = [replace(v, may_preempt=may_preempt(v)) for v in obs.ps_jobs]
    return plan_ps_jobs(views, obs.cpu_free, max_preempt=config.preemption.max_per_pass)


def ps_preempt_actions(obs: Observation, decision: CpuDecision) -> list[Preempt]:
    """The ps jobs the plan preempts: a checkpoint request their wrapper answers (checkpoint, acknowledge,
    requeue: :mod:`hpc_elastic.ps.allocation`), as a GPU job's."""
    out = []
    for job_id in decision.preempt:
        job = obs.managed[job_id]
        out.append(Preempt(job_id, job.name, True, job.restart_count, f"ps job: {decision.reasons[job_id]}"))
    return out


def place_actions(obs: Observation, decision: Decision, config: PluginConfig, pack_limit: float) -> list[Place]:
    """For the jobs the policy starts now: consolidate skewed jobs (S_J > PACKLIMIT) on as few nodes as the
    plan uses; with ``pin_nodes`` pin every start to the planned nodes (spread to limit fragmentation, §3.3)."""
    if not config.placement.enabled:
        return []
    out: list[Place] = []
    for start in decision.starts:
        view = obs.jobs[start.row]
        record = obs.records[view.job_id]
        skewed = view.skew is not None and view.skew > pack_limit
        nodes = [name for name, _ in start.allocation]
        num_nodes = len(nodes) if skewed else None
        node_list = compress_hostlist(nodes) if config.placement.pin_nodes else None
        if num_nodes is None and node_list is None:
            continue
        why = f"skew {view.skew:.2f} > PACKLIMIT {pack_limit:.2f}: consolidate" if skewed else "planned nodes"
        action = Place(view.job_id, num_nodes, node_list, f"{why} on {','.join(nodes)}")
        if action.signature != record.placement:
            out.append(action)
    return out


def _busy(record: JobRecord) -> bool:
    """A checkpoint + requeue (preemption or resize) of this job is in flight."""
    return bool(record.stop_kind or record.resize_to)


def elastic_sizes(view: JobView) -> list[int]:
    """GPU counts an elastic job may run with: every count in [min, max] (its marker keeps max <= its logical
    workers N, and N ESTs run on any number of processes from 1 to N with the same bits: EasyScale §3, Eq. 1a)."""
    if view.min_gpus is None or view.max_gpus is None:
        return []
    return list(range(view.min_gpus, view.max_gpus + 1))


def resize_actions(
    obs: Observation, decision: Decision, config: PluginConfig, preempted: frozenset[int] = frozenset()
) -> list[Resize]:
    """Elastic jobs shrink toward ``min`` while a feasible job waits and the GPUs given up let it start, and
    grow toward ``max`` into GPUs left idle when nothing waits. One resize per pass and none while another is in
    flight, so that the same free GPUs are never promised twice. ``preempted``: the jobs this pass really
    preempts; a start the policy planned on the GPUs of a victim that is kept (preemption disabled, minimum run
    time) does not happen, so that job still waits (and the kept victim may shrink for it instead). An elastic
    policy (``Decision.resizes``) chooses the sizes itself: its first resize of a job that may be resized is
    carried out."""
    if not config.resize.enabled or any(_busy(r) for r in obs.records.values()):
        return []
    kept = [p.row for p in decision.preemptions if p.job_id not in preempted]
    kept_nodes = {node for row in kept for node, _ in obs.jobs[row].allocation}
    starts = [s for s in decision.starts if not any(node in kept_nodes for node, _ in s.allocation)]
    started = {s.row for s in starts}
    infeasible = set(decision.infeasible)
    waiting = [
        row
        for row, v in enumerate(obs.jobs)
        if v.status is JobStatus.PENDING and row not in started and row not in infeasible
    ]
    running = {
        row
        for row, v in enumerate(obs.jobs)
        if v.status is JobStatus.RUNNING
        and v.job_id not in preempted
        and v.run_time >= config.preemption.min_run_time_s
    }
    free_by_type: dict[str, int] = {}
    for node in obs.nodes:
        free_by_type[node.gpu_type] = free_by_type.get(node.gpu_type, 0) + node.free_gpus
    node_type = {node.name: node.gpu_type for node in obs.nodes}
    for start in starts:  # GPUs this pass gives to starting jobs are not idle
        for name, count in start.allocation:
            free_by_type[node_type[name]] -= count

    def job_type(view: JobView) -> str:
        return node_type[view.allocation[0][0]]

    def resize(view: JobView, new: int, why: str, alloc: tuple[tuple[str, int], ...] = ()) -> Resize:
        job = obs.slurm_jobs[view.job_id]
        checkpointed = obs.markers.get(view.job_id) is not None
        split: dict[str, int] = {}
        if _spans(view):
            for name, count in alloc:
                split[node_type[name]] = split.get(node_type[name], 0) + count
        return Resize(
            view.job_id,
            job.name,
            checkpointed,
            job.restart_count,
            view.gpus,
            new,
            why,
            cpus_per_task(job),
            None if split else gpu_type_of(job),
            tuple(sorted(split.items())),
            keep_nodes(alloc) if split else (),
        )

    if decision.resizes:  # an elastic policy chose the sizes (tiresias-las+elastic): carry out its first one
        for change in decision.resizes:
            if change.row in running:
                view = obs.jobs[change.row]
                verb = "grow into GPUs no waiting job can use" if change.gpus > view.gpus else "shrink"
                if change.gpus == view.gpus:
                    verb = "move to other GPUs"
                why = f"{verb}: the policy's elastic share is {change.gpus} GPUs"
                action = resize(view, change.gpus, why, change.allocation)
                if action.split:
                    shown = " + ".join(f"{n} {t}" for t, n in action.split)
                    action = replace(action, reason=f"{why} ({shown})")
                return [action]
        return []
    if waiting:
        for row in reversed(decision.priority_order.tolist()):  # lowest priority first
            view = obs.jobs[row]
            if row not in running or _planned(view):
                continue
            smaller = [n for n in elastic_sizes(view) if n < view.gpus]
            if not smaller:
                continue
            pool = job_type(view)
            fits = [
                w for w in waiting if obs.jobs[w].gpu_types is None or pool in (obs.jobs[w].gpu_types or frozenset())
            ]
            for new in sorted(smaller, reverse=True):  # give up as few GPUs as will let a waiting job start
                freed = max(0, free_by_type.get(pool, 0)) + view.gpus - new
                helped = [w for w in fits if obs.jobs[w].gpus <= freed]
                if helped:
                    names = ",".join(str(obs.jobs[w].job_id) for w in helped[:3])
                    return [resize(view, new, f"shrink: job(s) {names} wait for {pool} GPUs")]
        return []
    for row in decision.priority_order.tolist():  # highest priority first
        view = obs.jobs[row]
        if row not in running or _planned(view):
            continue
        idle = max(0, free_by_type.get(job_type(view), 0))
        larger = [n for n in elastic_sizes(view) if view.gpus < n <= view.gpus + idle]
        if larger:
            new = max(larger)
            return [resize(view, new, f"grow: {idle} {job_type(view)} GPU(s) idle and no job waits")]
    return []


def _planned(view: JobView) -> bool:
    """Whether the job has an EasyScale speed model (``tiresias-las+easyscale``): only the policy's plans resize it
    (§3.4: a grow only where Role 2's proposal is granted, Role 3's fallback kept), never the count-only rules."""
    return isinstance(view.scaling, EstProfile)


def _spans(view: JobView) -> bool:
    """Whether the job's plans may span GPU types (the D2 guard): only the policy's plans resize it, as nodes; the
    count-only rules of :func:`resize_actions` know no GPUs per type."""
    return isinstance(view.scaling, EstProfile) and view.scaling.mixed


def _own(obs: Observation, job_id: int) -> tuple[tuple[str, int], ...]:
    """The GPUs (node, count) job ``job_id`` holds in this pass's view (none when it is not running)."""
    view = next((v for v in obs.jobs if v.job_id == job_id and v.status is JobStatus.RUNNING), None)
    return view.allocation if view is not None else ()


def gpu_type_of(job: Job) -> str | None:
    """The GPU type a job asked for or holds (None: any type)."""
    return next((t for t, count in job.gpus.by_type if t and count > 0), None)


def cpus_per_task(job: Job) -> int:
    """CPUs per task of ``job``, from squeue's CPUs and tasks: both follow our NumTasks/NumCPUs updates, while
    22.05 reports ``cpus_per_task`` as null and, for a pending job, the GPU count of the submission."""
    tasks = job.tasks or job.gpu_count
    return max(1, job.cpus // max(1, tasks)) if job.cpus else 1


#: how long a requeued job planned across types waits for the nodes of its plan before it falls back (Slurm may
#: show its old allocation in use for a second or two after the requeue; the requeued job may start some seconds
#: after the requeue, at its old size and nodes, when it is not set by then)
SPAN_WAIT_S = 5.0


def keep_nodes(alloc: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The nodes of a plan's allocation (node, GPUs), in Slurm's order: what the daemon holds for a job resized
    across types until it runs again (:attr:`Resize.keep`), so that the job gets the GPUs of its plan (EasyScale
    §3.4: Role 1's plan, granted by the inter-job scheduler) and not the ones a waiting job takes when the requeue
    frees them (the policy placed the waiting job on the others)."""
    return tuple(sorted({node for node, count in alloc if count > 0}, key=node_order_key))


def span_of(
    obs: Observation,
    job_id: int,
    split_text: str,
    own: tuple[tuple[str, int], ...] = (),
    kept: tuple[str, ...] = (),
) -> Span | None:
    """The nodes that give job ``job_id`` its stored new GPUs per type (``split_text``, empty: none stored), its
    own GPUs ``own`` (node, count) counted free (it is being requeued); the nodes held for it (``kept``, its
    plan's) first, when they give the split. When no set of nodes gives the split (the free GPUs per node do
    not add up to it, Slurm 22.05 filling nodes in order), the job falls back to one type: the split's largest
    part that is free (as much of it as is), the job's own GPUs counted."""
    try:
        split = parse_split(split_text)
    except ValueError:
        return None
    if not split:
        return None
    mine = dict(own)  # (the split's types are the job's partition's: the policy planned it on those)
    free = [(node.name, node.gpu_type, node.free_gpus + mine.get(node.name, 0)) for node in obs.nodes]
    wanted = tuple(sorted(split.items()))
    held = span_nodes(split, [row for row in free if row[0] in kept]) if kept else None
    if held is not None:
        others = tuple(sorted({n.name for n in obs.nodes} - set(held[0]), key=node_order_key))
        return Span(wanted, held[0], others)
    found = span_nodes(split, free)
    if found is not None:
        return Span(wanted, *found)
    for gpu_type, count in sorted(split.items(), key=lambda item: (-item[1], item[0])):
        alone = [(n, t, f) for n, t, f in free if t == gpu_type]
        for size in range(min(count, sum(f for _, _, f in alone)), 0, -1):
            found = span_nodes({gpu_type: size}, alone)
            if found is not None:
                others = tuple(sorted({n.name for n in obs.nodes} - set(found[0]), key=node_order_key))
                shown = " + ".join(f"{n} {t}" for t, n in wanted)
                why = f"no nodes give {shown} (free GPUs per node); {size} {gpu_type} instead"
                return Span(((gpu_type, size),), found[0], others, why)
    return None


def followup_actions(
    obs: Observation, acks: Mapping[int, float], config: PluginConfig
) -> list[Requeue | SetSize | ReleaseNodes]:
    """What stops in flight need now. ``acks`` maps job id -> time of a checkpoint acknowledgement written
    after the stop was requested. The job's wrapper requeues it after the checkpoint; the daemon requeues when
    the wrapper has not done so ``requeue_wait_s`` after the acknowledgement, or when no acknowledgement came
    within ``grace_s``. A resized job gets its new size while it waits after the requeue; the nodes held for it
    (:attr:`Resize.keep`) are released once it runs again or is gone."""
    out: list[Requeue | SetSize | ReleaseNodes] = []
    preemption = config.preemption
    for job_id in sorted(obs.records):
        record = obs.records[job_id]
        job = obs.managed.get(job_id)
        if record.resize_keep and (job is None or not (record.resize_to or record.stop_kind)):
            why = "it runs again" if job is not None and job.state.is_running else "it no longer waits for them"
            why = f"the nodes held for its resize ({record.resize_keep}): {why}"
            out.append(ReleaseNodes(job_id, held_by(record), why))
        if job is None:
            continue
        if record.stop_kind and job.state.is_running:
            acked = acks.get(job_id)
            asked = record.stop_at if record.stop_at is not None else obs.now
            if acked is not None and obs.now - acked >= preemption.requeue_wait_s:
                out.append(
                    Requeue(
                        job_id,
                        f"{record.stop_kind}: checkpoint acknowledged; the job did not requeue "
                        f"itself within {preemption.requeue_wait_s:.0f}s",
                        cpus_per_task(job),
                        gpu_type_of(job),
                        span_of(obs, job_id, record.resize_split, _own(obs, job_id), _kept(record)),
                    )
                )
            elif acked is None and obs.now - asked >= preemption.grace_s:
                out.append(
                    Requeue(
                        job_id,
                        f"{record.stop_kind}: no checkpoint acknowledgement within "
                        f"{preemption.grace_s:.0f}s; it resumes from an older checkpoint",
                        cpus_per_task(job),
                        gpu_type_of(job),
                        span_of(obs, job_id, record.resize_split, _own(obs, job_id), _kept(record)),
                    )
                )
        elif record.resize_to != record.resize_set and not record.stop_kind and job.state.is_pending:
            per_task = cpus_per_task(job)
            span = span_of(obs, job_id, record.resize_split, kept=_kept(record))
            if record.resize_split and (span is None or span.why):
                if obs.now - record.waiting_since < SPAN_WAIT_S:
                    continue  # its old allocation may still show in use: the plan's nodes may free up
                if span is None:  # nothing of the plan is free: any nodes, untyped
                    split = tuple(sorted(parse_split(record.resize_split).items()))
                    span = Span(split, (), (), "none of its GPUs free: any nodes")
            tasks = span.gpus if span is not None else record.resize_to
            why = f"resize to {tasks} GPUs after its checkpoint and requeue"
            if span is not None:
                why += " on " + (",".join(span.nodes) or "any nodes") + (f": {span.why}" if span.why else "")
            gpu_type = None if record.resize_split else gpu_type_of(job)  # a job planned across types asks untyped
            out.append(SetSize(job_id, tasks, tasks * per_task, why, gpu_type, span))
    return out


def keep_reservation(job_id: int, restart_count: int) -> str:
    """The name of the Slurm reservation that holds the planned nodes of job ``job_id`` resized in its incarnation
    ``restart_count``: one name per resize, as Slurm keeps an ended reservation for a while (the next resize's
    would be a duplicate)."""
    return f"hpc-elastic-keep-{job_id}-{restart_count}"


def keep_text(reservation: str, nodes: tuple[str, ...]) -> str:
    """``<reservation>:<node>,<node>``: what the store keeps of the nodes held for a resized job (``resize_keep``)."""
    return f"{reservation}:{','.join(nodes)}"


def held_by(record: JobRecord) -> str:
    """The reservation that holds the nodes of a resized job ('' when none does)."""
    return record.resize_keep.partition(":")[0]


def _kept(record: JobRecord) -> tuple[str, ...]:
    """The nodes held for a resized job (none when none are)."""
    return tuple(n for n in record.resize_keep.partition(":")[2].split(",") if n)


def plan(obs: Observation, decision: Decision, config: PluginConfig, *, pack_limit: float) -> list[Action]:
    """All actions of a pass: placement and order of the pending jobs first, then the preemptions that free their
    GPUs (a victim without a job directory is requeued at once, and Slurm may start the waiting job right away:
    its node constraints and SiteFactor must already be set), then resizes. ``pack_limit``: PACKLIMIT in force
    (the configured one, or as the daemon refitted it)."""
    actions: list[Action] = []
    actions += place_actions(obs, decision, config, pack_limit)
    actions += order_actions(obs, decision, config)
    preempts = preempt_actions(obs, decision, config)
    actions += preempts
    actions += resize_actions(obs, decision, config, frozenset(p.job_id for p in preempts))
    return actions


def in_flight(records: Mapping[int, JobRecord]) -> bool:
    """Whether a checkpoint + requeue or a resize is under way (the daemon then looks again sooner)."""
    return any(_busy(r) for r in records.values())


def planned_by_job(actions: list[Action]) -> Mapping[int, str]:
    """A short description of the planned action per job (for ``queue`` and the state file)."""
    out: dict[int, str] = {}
    for action in actions:
        out[action.job_id] = (out.get(action.job_id, "") + f" {action.kind.value}").strip()
    return out
