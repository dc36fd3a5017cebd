"""From Slurm's jobs and nodes to the policy's :class:`JobView`/:class:`NodeView` (pure: ``now`` is passed in).

Attained service a_J = W_J x t_J (Tiresias §3.2.2) is accumulated across runs: a requeue ends a run (its
service is banked) and the next start opens a new one. Waiting time δ_J adds up the waiting spells since the job
first ran after its arrival or last promotion, and only a promotion resets it (§3.2.3 "Avoiding starvation").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from hpc_elastic.launch.spec import JobMarker, MarkerError, decode_marker
from hpc_elastic.policy import Decision, JobStatus, JobView, NodeView
from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.policy.types import ScalingCurve
from hpc_elastic.slurm import Job, JobState, Node
from slurm_plugin.cpu_policy import PsJobView
from slurm_plugin.store import JobRecord

#: A run whose start time moved by more than this (seconds) is a new run.
RESTART_TOLERANCE_S = 1.0
#: A managed job absent from squeue this long (seconds) is forgotten (Slurm keeps ended jobs MinJobAge=300 s).
FORGET_AFTER_S = 600.0
_HELD = re.compile(r"held|dependency", re.IGNORECASE)


class PartialRead(ValueError):
    """Slurm's answers do not add up (e.g. sinfo lags squeue): no action may be based on them this pass."""


@dataclass(frozen=True, slots=True)
class Selection:
    """Which jobs the daemon manages."""

    manage_all: bool = False
    name_pattern: str = ""

    def judge(self, job: Job) -> tuple[bool, JobMarker | None, str | None]:
        """``(managed, marker, why not)`` from one reading of the job's comment: a selected job is the daemon's
        unless its marker is invalid (a forged or broken marker disqualifies its job, whatever ``manage_all``
        says; ``why not`` then names the fault)."""
        if self.name_pattern and not re.search(self.name_pattern, job.name):
            return False, None, None
        try:
            marker = decode_marker(job.comment)
        except MarkerError as exc:
            return False, None, str(exc)
        return self.manage_all or marker is not None, marker, None

    def manages(self, job: Job) -> bool:
        return self.judge(job)[0]


@dataclass(frozen=True)
class Observation:
    """One pass's view: policy inputs plus the Slurm jobs and updated records behind them."""

    now: float
    jobs: tuple[JobView, ...]
    nodes: tuple[NodeView, ...]
    slurm_jobs: Mapping[int, Job]
    markers: Mapping[int, JobMarker | None]
    records: Mapping[int, JobRecord]
    forget: tuple[int, ...]
    #: every managed active job (also those the policy does not see: held, or waiting for their BeginTime)
    managed: Mapping[int, Job] = field(default_factory=dict)
    #: active jobs left out of this pass, and why (an invalid marker, a field the policy refuses): never the pass
    rejected: Mapping[int, str] = field(default_factory=dict)
    #: managed ps-mode jobs on CPU partitions (pending or running), ordered by :mod:`slurm_plugin.cpu_policy`
    ps_jobs: tuple[PsJobView, ...] = ()
    #: the free cores of each partition of CPU nodes (nodes that cannot take work offer none)
    cpu_free: Mapping[str, int] = field(default_factory=dict)


#: the states of a job that started again after a requeue
_RUNS_AGAIN = frozenset({JobState.CONFIGURING, JobState.RUNNING})


def advance(record: JobRecord | None, job: Job, now: float) -> JobRecord:
    """The record after seeing ``job`` at ``now``: bank ended runs, follow the current one."""
    submit = job.submit_time.timestamp() if job.submit_time else now
    rec = record or JobRecord(job_id=job.job_id, first_seen=now, waiting_since=submit, submitted=submit)
    if rec.missing_since is not None:
        rec = replace(rec, missing_since=None)
    if rec.stop_kind and (job.restart_count > rec.stop_restarts or not job.state.is_running):
        rec = replace(rec, stop_kind="", stop_at=None)  # the requested checkpoint + requeue happened
    if rec.resize_to and not rec.stop_kind and job.state in _RUNS_AGAIN:
        # the job runs again (at its new size if it was set); not while its old allocation completes after the
        # requeue (COMPLETING, already with the new restart count): the new size is still to be set
        rec = replace(rec, resize_to=0, resize_set=0, resize_split="")
    if job.state.is_running and job.start_time is not None:
        start = job.start_time.timestamp()
        if rec.run_start is not None and abs(rec.run_start - start) > RESTART_TOLERANCE_S:
            # a whole run ended (and a new one began) between two passes: bank what was seen of it
            rec = replace(rec, banked_service=rec.attained_service, banked_exec=rec.executed_time, run_start=None)
        if rec.run_start is None and rec.banked_exec > 0.0:  # a new run ends a waiting spell that counts
            rec = replace(rec, banked_wait=rec.banked_wait + max(0.0, start - rec.waiting_since))
        gpus = job.gpu_count or rec.run_gpus
        return replace(
            rec,
            run_start=start,
            run_gpus=gpus,
            run_exec=max(0.0, now - start),
            first_start=rec.first_start if rec.first_start is not None else start,
        )
    if rec.run_start is not None:  # the run ended (requeue / preemption): bank it, start waiting
        return replace(
            rec,
            banked_service=rec.attained_service,
            banked_exec=rec.executed_time,
            run_start=None,
            run_exec=0.0,
            waiting_since=now,
        )
    return rec


def _submitted(job: Job, record: JobRecord) -> float:
    """When the job was submitted. Slurm resets a job's submit time when it is requeued (seen on 22.05), so a
    preempted job would look newer than it is: the record keeps the submit time of its first sighting (a record
    of an older daemon lacks it; then the first sighting bounds the real submission)."""
    if record.submitted is not None:
        return record.submitted
    if job.submit_time is None:
        return record.first_seen
    return min(job.submit_time.timestamp(), record.first_seen)


def node_views(nodes: Iterable[Node]) -> tuple[NodeView, ...]:
    """GPU nodes only, one GPU type each; a node that cannot take work offers no free GPU."""
    out = []
    for node in nodes:
        if node.gpus.total <= 0:
            continue
        gpu_type = node.gpus.by_type[0][0]
        total = node.gpus.total
        free = min(total, node.gpus_free.total) if node.available else 0
        out.append(NodeView(name=node.name, total_gpus=total, free_gpus=free, gpu_type=gpu_type))
    return tuple(out)


def cpu_free_cores(nodes: Iterable[Node]) -> dict[str, int]:
    """The free cores of each partition of nodes without GPUs (a node of several partitions counts in each)."""
    free: dict[str, int] = {}
    for node in nodes:
        if node.gpus.total > 0:
            continue
        idle = max(0, node.cpus - node.cpus_allocated) if node.available else 0
        for part in node.partitions:
            free[part] = free.get(part, 0) + idle
    return free


def ps_view(job: Job, marker: JobMarker | None, record: JobRecord, *, running: bool) -> PsJobView | None:
    """The view of a ps-mode job on a CPU partition (its marker records the ranges), else None. Its attained
    service is CPU-core-time: the allocation's cores times the seconds it ran, over all its runs."""
    if marker is None or marker.ps is None or job.gpu_count > 0 or job.cpus < 1:
        return None
    return PsJobView(
        job_id=job.job_id,
        partition=job.partition.split(",")[0],
        running=running,
        cores=job.cpus,
        core_seconds=record.executed_time * job.cpus,
        submitted=_submitted(job, record),
    )


def split_allocation(
    job: Job, in_use: dict[str, int], node_types: Mapping[str, str] | None = None
) -> tuple[tuple[str, int], ...]:
    """Per-node GPUs of a running job (squeue gives the total, per type, and the node list): evenly, within what
    each node reports in use, each type's GPUs on the job's nodes of that type (``node_types``) when it holds
    several; ``in_use`` is decremented. Raises :class:`PartialRead` when it cannot add up."""
    nodes = [n for n in job.nodes if n in in_use]
    if len(nodes) != len(job.nodes) or not nodes:
        raise PartialRead(f"job {job.job_id} runs on {','.join(job.nodes) or '?'}, not all known GPU nodes")
    typed = [(t, count) for t, count in job.gpus.by_type if t and count > 0]
    if len(typed) > 1 and node_types is not None:
        parts = [(count, [n for n in nodes if node_types.get(n) == t]) for t, count in typed]
    else:
        parts = [(job.gpu_count, nodes)]
    out: list[tuple[str, int]] = []
    for need, part in parts:
        if not part:
            raise PartialRead(f"job {job.job_id} holds GPUs of a type none of its nodes has")
        share = {n: min(in_use[n], need // len(part) + (1 if i < need % len(part) else 0)) for i, n in enumerate(part)}
        left = need - sum(share.values())
        for n in part:
            extra = min(left, in_use[n] - share[n])
            share[n] += extra
            left -= extra
        if left:
            raise PartialRead(f"job {job.job_id} holds {job.gpu_count} GPUs but its nodes report fewer in use")
        for n in part:
            in_use[n] -= share[n]
        out.extend((n, c) for n, c in share.items() if c)
    return tuple(sorted(out, key=lambda item: nodes.index(item[0])))


def _gpu_types(
    job: Job, marker: JobMarker | None, partition_types: Mapping[str, frozenset[str]], *, spans: bool = False
) -> frozenset[str] | None:
    """The GPU types a job may run on: its partitions' types and the type it asked for or holds; a job whose plans
    may span types (``spans``) is not held to the types of its allocation."""
    allowed: frozenset[str] | None = None
    if job.partition:
        parts = [p for p in job.partition.split(",") if p in partition_types]
        if parts:
            allowed = frozenset().union(*(partition_types[p] for p in parts))
    asked = set() if spans else {t for t, _ in job.gpus.by_type if t}
    if marker is not None and marker.gpu_type:
        asked.add(marker.gpu_type)
    if asked:
        allowed = frozenset(asked) if allowed is None else allowed & frozenset(asked)
    return allowed


def observe(
    jobs: Sequence[Job],
    nodes: Sequence[Node],
    records: Mapping[int, JobRecord],
    selection: Selection,
    *,
    now: float,
    skews: Mapping[int, float] | None = None,
    profiles: Mapping[int, ScalingCurve] | None = None,
) -> Observation:
    """Policy views of the managed GPU jobs that are pending (not held) or running, and of the managed ps-mode
    jobs on CPU partitions (:class:`~slurm_plugin.cpu_policy.PsJobView`). ``profiles``: the elastic jobs' speed
    models (``tiresias-las+easyscale``); with them a running job may use only the GPU types it holds, as a resize
    keeps a job's type (Slurm 22.05 does not change a pending job's GPU type: a new typed ``TresPerJob`` leaves the
    old type's TRES next to the new one), unless its profile lets its plans span types (the D2 guard): it may then
    use its partition's types, which the daemon gives it as nodes (the README's "One job on two GPU types")."""
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")
    views = node_views(nodes)
    if not views:
        raise PartialRead("sinfo reported no GPU node")
    in_use = {v.name: v.total_gpus - v.free_gpus for v in views}
    node_types = {v.name: v.gpu_type for v in views}
    partition_types: dict[str, set[str]] = {}
    for node in nodes:
        if node.gpus.total > 0:
            for part in node.partitions:
                partition_types.setdefault(part, set()).add(node.gpus.by_type[0][0])
    frozen_types = {p: frozenset(t) for p, t in partition_types.items()}
    skews = skews or {}
    out_views: list[JobView] = []
    slurm_jobs: dict[int, Job] = {}
    markers: dict[int, JobMarker | None] = {}
    new_records: dict[int, JobRecord] = {}
    managed: dict[int, Job] = {}
    rejected: dict[int, str] = {}
    ps_jobs: list[PsJobView] = []
    for job in sorted(jobs, key=lambda j: j.job_id):
        if not job.state.is_active:
            continue
        managed_now, marker, why = selection.judge(job)
        if not managed_now:
            if why is not None:
                rejected[job.job_id] = why
            earlier = records.get(job.job_id)
            if earlier is not None and earlier.stop_kind:  # a stop in flight is finished whatever the comment says
                new_records[job.job_id] = advance(earlier, job, now)
                managed[job.job_id] = job
            continue
        record = advance(records.get(job.job_id), job, now)
        new_records[job.job_id] = record
        managed[job.job_id] = job
        running = job.state.is_running
        held = _HELD.search(job.pending_reason) is not None or job.state is JobState.REQUEUE_HOLD
        # a requeued job may not start before its BeginTime (credential expiry): nothing to preempt for yet
        eligible = job.eligible_time is None or job.eligible_time.timestamp() <= now
        pending = job.state.is_pending and not held and eligible and job.pending_reason != "BeginTime"
        if (running and job.start_time is not None) or pending:
            ps = ps_view(job, marker, record, running=running)
            if ps is not None:
                ps_jobs.append(ps)
                markers[job.job_id] = marker
                continue
        if job.gpu_count < 1 or not (running or pending) or (running and job.start_time is None):
            continue
        key = job.job_id
        elastic = marker if marker is not None and marker.elastic else None
        # a pending job resized after its requeue: squeue shows the old GPU count until it starts
        gpus = record.resize_set if pending and record.resize_set else job.gpu_count
        allocation = split_allocation(job, in_use, node_types) if running else ()  # PartialRead: the whole pass waits
        held_types = frozenset(t for t, count in job.gpus.by_type if t and count > 0)
        profile = (profiles or {}).get(key)
        # a running job keeps the types it holds, unless the D2 guard lets its plans span its partition's types
        spans = isinstance(profile, EstProfile) and profile.mixed
        allowed = _gpu_types(job, marker, frozen_types, spans=spans)
        try:
            view = JobView(
                job_id=key,
                gpus=gpus,
                submit_time=_submitted(job, record),
                status=JobStatus.RUNNING if running else JobStatus.PENDING,
                attained_service=record.attained_service,
                executed_time=record.executed_time,
                waiting_time=record.waiting_time(now),
                current_wait=0.0 if running else max(0.0, now - record.waiting_since),
                run_time=record.run_exec if running else 0.0,
                first_start_time=record.first_start,
                queue=record.queue,
                skew=skews.get(job.job_id),
                gpu_types=held_types if profiles is not None and running and held_types and not spans else allowed,
                allocation=allocation,
                time_limit=float(job.time_limit_s) if job.time_limit_s else None,
                min_gpus=elastic.min if elastic else None,
                max_gpus=elastic.max if elastic else None,
                scaling=profile,
            )
        except ValueError as exc:  # one job's odd fields keep that job, not the cluster, out of the pass
            rejected[key] = str(exc)
            continue
        out_views.append(view)
        slurm_jobs[key] = job
        markers[key] = marker
    # A job missing from squeue is forgotten only after FORGET_AFTER_S: a controller that is restarting can
    # answer with an empty or short job list, and forgetting would lose the job's attained service. A job squeue
    # still lists keeps its record even when it is not managed now (its marker removed for a while): putting the
    # marker back must not reset its attained service.
    listed = {job.job_id for job in jobs}
    forget = []
    for job_id, record in records.items():
        if job_id in new_records:
            continue
        if job_id in listed:
            new_records[job_id] = replace(record, missing_since=None) if record.missing_since is not None else record
            continue
        since = record.missing_since if record.missing_since is not None else now
        if now - since >= FORGET_AFTER_S:
            forget.append(job_id)
        else:
            new_records[job_id] = replace(record, missing_since=since)
    return Observation(
        now,
        tuple(out_views),
        views,
        slurm_jobs,
        markers,
        new_records,
        tuple(forget),
        managed,
        rejected,
        tuple(ps_jobs),
        cpu_free_cores(nodes),
    )


def apply_queue_changes(records: Mapping[int, JobRecord], decision: Decision, now: float) -> dict[int, JobRecord]:
    """Records after the pass's demotions/promotions; a promotion resets t_J, δ_J and a_J (§3.2.3)."""
    out = dict(records)
    for change in decision.queue_changes:
        job_id = change.job_id
        rec = out.get(job_id)
        if rec is None:
            continue
        rec = replace(rec, queue=change.queue)
        if change.reset:
            rec = replace(rec, banked_service=0.0, banked_exec=0.0, run_exec=0.0, waiting_since=now, banked_wait=0.0)
        out[job_id] = rec
    return out


#: A job whose last accounting record is in one of these states has ended for good: a time-out, a failure or a
#: cancellation ends a job as surely as success does, after the GPU-seconds it got. (REQUEUED, PREEMPTED and
#: the active states are not final: the job goes on in a later record.)
FINAL_STATES = frozenset(
    {
        JobState.COMPLETED,
        JobState.TIMEOUT,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.OUT_OF_MEMORY,
        JobState.NODE_FAIL,
        JobState.DEADLINE,
    }
)


def service_samples(history: Iterable[Job]) -> list[float]:
    """GPU-seconds of the jobs that ended after running (all records of a job summed: each requeue is its own
    sacct record), the job-size distribution of 2D-Gittins (§3.2.2). A job counts when its last record (the
    latest to start, in sacct order among equals) is in :data:`FINAL_STATES`."""
    total: dict[int, float] = {}
    last: dict[int, tuple[float, JobState]] = {}
    for record in history:
        if record.elapsed_s and record.gpu_count:
            total[record.job_id] = total.get(record.job_id, 0.0) + record.gpu_count * record.elapsed_s
        began = record.start_time or record.submit_time
        key = began.timestamp() if began is not None else -math.inf
        if record.job_id not in last or key >= last[record.job_id][0]:
            last[record.job_id] = (key, record.state)
    return [total[j] for j in sorted(total) if total[j] > 0 and last[j][1] in FINAL_STATES]
