"""Execute actions through the Slurm adapter (the only way this package touches Slurm).

Preemption (Tiresias §3.2: checkpoint + requeue; ``scontrol suspend`` would keep the GPUs) and resize: the reason
goes into the job's ``AdminComment`` (:class:`hpc_elastic.jobdir.StopNotice`, a field only administrators may set)
and the checkpoint signal to the batch shell (``scancel --signal=USR1 --batch``); the job's wrapper turns it into
its own stop request.  The daemon writes nothing where a user could plant a link.  Nothing waits inside a pass:
the stop is recorded as in flight, and later passes requeue the job if its wrapper has not (``requeue_wait_s``
after a valid acknowledgement, :func:`acknowledgements`; ``grace_s`` after the signal without one) and set a
resized job's size.  Job names and paths never reach a shell: the adapter runs argv lists.
"""

from __future__ import annotations

import logging
import pwd
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpc_elastic.jobdir import JobDir, ScaleNotice, StopNotice, StopReason, ack_answers, find_job_dir
from hpc_elastic.slurm import Job, JobRef, JobState, SlurmClient, SlurmError, commands
from slurm_plugin.actions import (
    SPAN_WAIT_S,
    Action,
    Place,
    Preempt,
    ReleaseNodes,
    Requeue,
    Resize,
    Scale,
    SetOrder,
    SetSize,
    Span,
    held_by,
    keep_reservation,
    keep_text,
)
from slurm_plugin.config import PluginConfig
from slurm_plugin.easyscale import split_text
from slurm_plugin.store import JobRecord

log = logging.getLogger(__name__)

#: how long the nodes of a resized job's plan are held beyond its stop's grace, requeue wait and span wait: a
#: requeued job starts again only once its credential has expired (Slurm's ``cred_expire``, 120 s by default, 10 s
#: on the dev cluster). The daemon ends the reservation as soon as the job runs again; this bounds it otherwise.
KEEP_SLACK_S = 180.0


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    ok: bool
    detail: str


@dataclass
class ApplyResult:
    outcomes: list[Outcome] = field(default_factory=list)
    records: dict[int, JobRecord] = field(default_factory=dict)


def job_uid(job: Job) -> int | None:
    """The job's user id: squeue's, else the user name's on this machine; None when neither is known."""
    if job.user_id is not None:
        return job.user_id
    try:
        return pwd.getpwnam(job.user).pw_uid
    except (KeyError, ValueError):
        return None


def job_dir_of(roots: Sequence[Path], job: Job) -> JobDir | None:
    """The job's directory: ``<root>/<name>-<id>`` that is a real directory of the job's own user, else None."""
    uid = job_uid(job)
    ref = job.ref  # an array task's directory is named by the array's id and the task's
    return find_job_dir(tuple(roots), job.name, ref.job_id, uid, ref.array_task_id) if uid is not None else None


@dataclass(frozen=True, slots=True)
class Telemetry:
    """What the running jobs report to the scheduler (:class:`~hpc_elastic.jobdir.Progress`): the observed
    capability per device type of each (job id -> sorted (type, C_i) pairs), and the jobs whose current run trains
    at D2 with every operator of its model covered (the D2 guard: only those may be planned across GPU types).
    ``speeds``: each job's EST mini-batches per second per process in its current run, communication included
    (its steps per second x its ESTs / its processes; PACKLIMIT's refit, :mod:`slurm_plugin.pack_limit`)."""

    capabilities: dict[int, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    d2: frozenset[int] = frozenset()
    speeds: dict[int, float] = field(default_factory=dict)


def telemetry(roots: Sequence[Path], jobs: Mapping[int, Job]) -> Telemetry:
    """Each running job's report, read as the job's user's files only
    (:meth:`~hpc_elastic.jobdir.JobDir.read_progress_as`); capabilities only from the job's current incarnation (a
    record of an earlier run may name other devices), D2 from any (a requeued job runs the same script at the same
    level: its new run would otherwise be planned on one type until its first record), speeds from the current
    incarnation; a job without a valid report is left out."""
    out = Telemetry()
    d2: set[int] = set()
    for job_id, job in jobs.items():
        if job.state is not JobState.RUNNING:
            continue
        uid = job_uid(job)
        job_dir = job_dir_of(roots, job)
        progress = job_dir.read_progress_as(uid) if job_dir is not None and uid is not None else None
        if progress is None:
            continue
        if progress.d2:  # the job's level and model: the same in every incarnation (its script and marker)
            d2.add(job_id)
        if progress.restart_count != job.restart_count:
            continue
        if progress.capability:
            out.capabilities[job_id] = progress.capability
        if progress.steps_per_s is not None and progress.steps_per_s > 0:
            ests = progress.workers or progress.world_size
            out.speeds[job_id] = progress.steps_per_s * ests / progress.world_size
    return replace(out, d2=frozenset(d2))


def acknowledgements(
    roots: Sequence[Path], records: Mapping[int, JobRecord], jobs: Mapping[int, Job], now: float
) -> dict[int, float]:
    """Valid acknowledgements of the stops in flight (job id -> when written): read as the job's user's files
    only (:meth:`~hpc_elastic.jobdir.JobDir.read_ack_as`), and only one of the stopped job and incarnation written
    between the stop and now (:func:`~hpc_elastic.jobdir.ack_answers`); anything else is no acknowledgement, and
    the job is requeued when its grace period ends."""
    out: dict[int, float] = {}
    for job_id, record in records.items():
        job = jobs.get(job_id)
        if not record.stop_kind or record.stop_at is None or job is None:
            continue
        uid = job_uid(job)
        job_dir = job_dir_of(roots, job)
        ack = job_dir.read_ack_as(uid) if job_dir is not None and uid is not None else None
        if ack is not None and ack_answers(
            ack, job_id=job_id, restart_count=record.stop_restarts, requested_at=record.stop_at, now=now
        ):
            out[job_id] = ack.written_at
    return out


class Applier:
    """Applies actions; ``clock`` is injectable; ``dry_run`` logs and changes nothing. Never blocks."""

    def __init__(
        self,
        client: SlurmClient,
        config: PluginConfig,
        *,
        clock: Callable[[], float],
        dry_run: bool = False,
    ) -> None:
        self.client = client
        self.config = config
        self.clock = clock
        self.dry_run = dry_run
        self._jobs: Mapping[int, Job] = {}

    def apply(
        self, actions: Sequence[Action], records: Mapping[int, JobRecord], jobs: Mapping[int, Job] | None = None
    ) -> ApplyResult:
        """Apply ``actions`` in order; ``jobs`` (the managed jobs as squeue showed them) tells whose a job
        directory must be."""
        self._jobs = jobs or {}
        result = ApplyResult(records=dict(records))
        for action in actions:
            prefix = "[dry-run] " if self.dry_run else ""
            log.info("%s%s job %d: %s (%s)", prefix, action.kind.value, action.job_id, _describe(action), action.reason)
            if self.dry_run:
                result.outcomes.append(Outcome(action, True, "dry-run"))
                continue
            try:
                detail = self._apply_one(action, result)
                result.outcomes.append(Outcome(action, True, detail))
                if detail != _describe(action):
                    log.info("%s job %d: %s", action.kind.value, action.job_id, detail)
            except (SlurmError, OSError) as exc:
                log.warning("%s job %d failed: %s", action.kind.value, action.job_id, exc)
                result.outcomes.append(Outcome(action, False, str(exc)))
        return result

    def _ref(self, job_id: int) -> int | JobRef:
        """How Slurm addresses the job: an array task as ``<array>_<task>`` (its array's id reaches every task)."""
        job = self._jobs.get(job_id)
        return job.ref if job is not None and job.array_task_id is not None else job_id

    def _update(self, result: ApplyResult, job_id: int, **changes: object) -> None:
        record = result.records.get(job_id)
        if record is not None:
            result.records[job_id] = replace(record, **changes)  # type: ignore[arg-type]

    def _apply_one(self, action: Action, result: ApplyResult) -> str:
        if isinstance(action, SetOrder):
            self.client.update_job(self._ref(action.job_id), {action.field.value: action.value})
            return _describe(action)
        if isinstance(action, Place):
            fields: dict[str, str | int] = {}
            if action.num_nodes is not None:
                fields["NumNodes"] = action.num_nodes
            if action.node_list is not None:
                fields["ReqNodeList"] = action.node_list
            self.client.update_job(self._ref(action.job_id), fields)
            self._update(result, action.job_id, placement=action.signature)
            return _describe(action)
        if isinstance(action, (Preempt, Resize)):
            return self._stop(action, result)
        if isinstance(action, ReleaseNodes):
            self._update(result, action.job_id, resize_keep="")
            if action.job_id in self._jobs:
                # A running job keeps the name of the reservation it started in; requeued later (its next resize)
                # while that reservation has ended, Slurm holds it for good (RESV_DEL_HOLD): clear the name first
                # (22.05 takes the update on a running job; measured on the dev cluster).
                try:
                    self.client.update_job(self._ref(action.job_id), {"Reservation": ""})
                except SlurmError as exc:
                    log.warning("job %d: cannot clear its reservation %s (%s)", action.job_id, action.reservation, exc)
            try:
                self.client.end_reservation(action.reservation)
            except SlurmError as exc:  # gone already, or it ends at its end time by itself
                return f"reservation {action.reservation} not ended ({exc}); it ends at its end time"
            return f"reservation {action.reservation} ended"
        if isinstance(action, Scale):
            notice = ScaleNotice(action.workers, action.ps, round(self.clock(), 3), action.restart_count)
            ref = self._ref(action.job_id)
            self.client.update_job(ref, {"AdminComment": notice.encode()})
            self.client.cancel([ref], "USR2", batch=True)
            return "notice in its AdminComment, USR2 to its batch shell"
        if isinstance(action, Requeue):
            self.client.requeue([self._ref(action.job_id)])
            record = result.records.get(action.job_id)
            self._update(result, action.job_id, stop_kind="", stop_at=None)
            if record is not None and record.resize_to:
                tasks = action.span.gpus if action.span is not None else record.resize_to
                gpu_type = None if record.resize_split else action.gpu_type
                return "requeued by the daemon; " + self._set_size(
                    action.job_id, tasks, tasks * action.cpus_per_task, gpu_type, result, action.span
                )
            return "requeued by the daemon"
        return self._set_size(action.job_id, action.tasks, action.cpus, action.gpu_type, result, action.span)

    def _set_size(  # noqa: PLR0917 - the size, and where it comes from
        self, job_id: int, tasks: int, cpus: int, gpu_type: str | None, result: ApplyResult, span: Span | None = None
    ) -> str:
        """The pending job's new size: ``tasks`` GPUs of ``gpu_type``, or on the nodes of ``span`` (a job resized
        across types: untyped GPUs, the nodes giving the counts per type)."""
        if span is None:
            self.client.update_job(self._ref(job_id), commands.size_fields(tasks, cpus, gpu_type))
            self._update(result, job_id, resize_set=tasks)
            return f"NumTasks={tasks} NumCPUs={cpus}: {tasks} GPUs when it starts again"
        record = result.records.get(job_id)
        held = (held_by(record) or None) if record is not None else None
        for fields in commands.span_fields(tasks, cpus, span.nodes, span.excluded, held):
            self.client.update_job(self._ref(job_id), fields)
        self._update(result, job_id, resize_to=tasks, resize_set=tasks)
        if not span.nodes:
            return f"NumTasks={tasks} NumCPUs={cpus}, node lists cleared: {tasks} GPUs of any type when it starts again"
        shown = " + ".join(f"{n} {t}" for t, n in span.split)
        where = f"ReqNodeList={','.join(span.nodes)}" + (f" Reservation={held}" if held else "")
        return f"NumTasks={tasks} NumCPUs={cpus} {where}: {shown} when it starts again"

    def _keep(self, action: Resize, job: Job | None) -> str:
        """Hold the nodes of the job's plan (:attr:`Resize.keep`) for it: a reservation of its user's that no other
        job may use, created before its stop frees any GPU, so that a waiting job of any type does not take the
        GPUs the plan keeps when the requeue frees them (Slurm starts a waiting job at once, while the requeued
        job may start only once its credential has expired). What the store keeps of it ('' when none could be
        held)."""
        if not action.keep or job is None or not job.user:
            return ""
        preemption = self.config.preemption
        duration = preemption.grace_s + preemption.requeue_wait_s + SPAN_WAIT_S + KEEP_SLACK_S
        name = keep_reservation(action.job_id, action.restart_count)
        try:
            self.client.create_reservation(name, action.keep, job.user, duration)
        except (SlurmError, ValueError) as exc:  # e.g. the daemon is no Slurm operator: resized without it
            log.warning("job %d: cannot hold nodes %s for its resize (%s)", action.job_id, ",".join(action.keep), exc)
            return ""
        log.info("job %d: nodes %s held for it (reservation %s)", action.job_id, ",".join(action.keep), name)
        return keep_text(name, action.keep)

    def _stop(self, action: Preempt | Resize, result: ApplyResult) -> str:
        """Checkpoint request (the reason in the job's AdminComment, then the signal), recorded as in flight; a job
        without a job directory of its own user: requeue at once."""
        reason = StopReason.PREEMPT if isinstance(action, Preempt) else StopReason.RESIZE
        job = self._jobs.get(action.job_id)
        job_dir = job_dir_of(self.config.ckpt_roots, job) if action.checkpointed and job is not None else None
        now = self.clock()
        record = result.records.get(action.job_id)
        changes: dict[str, object] = {}
        if isinstance(action, Preempt) and record is not None:
            changes = {"last_preempt": now, "preemptions": record.preemptions + 1}
        if isinstance(action, Resize):
            changes["resize_to"] = action.new_gpus
            changes["resize_set"] = 0
            changes["resize_split"] = split_text(dict(action.split))
            changes["resize_keep"] = self._keep(action, job)
        if job_dir is None:
            log.warning(
                "job %d: no job directory of its user under %s; requeue without checkpoint",
                action.job_id,
                ", ".join(map(str, self.config.ckpt_roots)),
            )
            self.client.requeue([self._ref(action.job_id)])
            self._update(result, action.job_id, **changes)
            detail = "no job directory: requeued without checkpoint"
            if isinstance(action, Resize):
                cpus = action.new_gpus * action.cpus_per_task
                detail += "; " + self._set_size(action.job_id, action.new_gpus, cpus, action.gpu_type, result)
            return detail
        notice = StopNotice(reason, now, action.restart_count)
        try:
            self.client.update_job(self._ref(action.job_id), {"AdminComment": notice.encode()})
        except SlurmError as exc:  # the wrapper then tells a preemption from a time limit by the clock
            log.warning("job %d: cannot set the stop notice (%s); signalling anyway", action.job_id, exc)
        preemption = self.config.preemption
        self.client.cancel([self._ref(action.job_id)], preemption.signal, batch=preemption.batch)
        self._update(
            result, action.job_id, stop_kind=reason.value, stop_at=now, stop_restarts=action.restart_count, **changes
        )
        return f"checkpoint requested ({preemption.signal} to the batch shell); requeue follows its acknowledgement"


def _describe(action: Action) -> str:
    if isinstance(action, SetOrder):
        return f"{action.field.value} {action.old if action.old is not None else '?'} -> {action.value}"
    if isinstance(action, Place):
        return " ".join(
            part
            for part in (
                f"NumNodes={action.num_nodes}" if action.num_nodes is not None else "",
                f"ReqNodeList={action.node_list}" if action.node_list is not None else "",
            )
            if part
        )
    if isinstance(action, Resize):
        return f"{action.old_gpus} -> {action.new_gpus} GPUs (checkpoint, requeue, new size)"
    if isinstance(action, SetSize):
        return f"NumTasks={action.tasks} NumCPUs={action.cpus}"
    if isinstance(action, Requeue):
        return "requeue"
    if isinstance(action, ReleaseNodes):
        return f"end reservation {action.reservation}"
    if isinstance(action, Scale):
        return f"scale to {action.workers} workers, {action.ps} PS"
    return "checkpoint, then requeue"
