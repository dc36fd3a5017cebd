"""Execute actions through the Slurm adapter (the only way this package touches Slurm).

Preemption (Tiresias §3.2: checkpoint + requeue; ``scontrol suspend`` would keep the GPUs) and resize: write
``control/stop`` with reason ``preempt``/``resize`` in the job directory on the shared filesystem and send the
checkpoint signal to the batch shell (``scancel --signal=USR1 --batch``). Nothing waits inside a pass: the stop
is recorded as in flight, and later passes requeue the job if its wrapper has not (after ``control/ack.json``
plus ``requeue_wait_s``, or after ``grace_s`` without an acknowledgement) and set a resized job's size.
Job names and paths never reach a shell: the adapter runs argv lists, and a job directory is
used only if its name is a single plain path component.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpc_elastic.control import ACK_FILE, CONTROL_DIR, STOP_FILE, StopReason, StopRequest, parse_ack
from hpc_elastic.slurm import Job, SlurmClient, SlurmError, commands
from slurm_plugin.actions import Action, Place, Preempt, Requeue, Resize, SetOrder, SetSize
from slurm_plugin.config import PluginConfig
from slurm_plugin.store import JobRecord

log = logging.getLogger(__name__)
POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    ok: bool
    detail: str


@dataclass
class ApplyResult:
    outcomes: list[Outcome] = field(default_factory=list)
    records: dict[int, JobRecord] = field(default_factory=dict)


def job_directory(roots: Sequence[Path], name: str, job_id: int) -> Path | None:
    """``<root>/<name>-<id>`` under the first root where it exists; None for names that are not one plain path
    component (``..``, ``/``, NUL, newlines) so that a job name can never point outside the roots."""
    leaf = f"{name}-{job_id}"
    if not name or "/" in name or "\x00" in name or "\n" in name or name in {".", ".."} or leaf.startswith("."):
        return None
    for root in roots:
        path = root / leaf
        if path.parent == root and path.is_dir():
            return path
    return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_ack(job_dir: Path, requested_at: float) -> float | None:
    """When the job acknowledged a checkpoint requested at ``requested_at`` (None: not yet)."""
    try:
        ack = parse_ack((job_dir / CONTROL_DIR / ACK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return ack.written_at if ack.written_at >= requested_at - 1.0 else None


def acknowledgements(
    roots: Sequence[Path], records: Mapping[int, JobRecord], jobs: Mapping[int, Job]
) -> dict[int, float]:
    """Acknowledgements of the stops in flight (job id -> when written)."""
    out: dict[int, float] = {}
    for job_id, record in records.items():
        job = jobs.get(job_id)
        if not record.stop_kind or record.stop_at is None or job is None:
            continue
        job_dir = job_directory(roots, job.name, job_id)
        acked = read_ack(job_dir, record.stop_at) if job_dir is not None else None
        if acked is not None:
            out[job_id] = acked
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

    def apply(self, actions: Sequence[Action], records: Mapping[int, JobRecord]) -> ApplyResult:
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

    def _update(self, result: ApplyResult, job_id: int, **changes: object) -> None:
        record = result.records.get(job_id)
        if record is not None:
            result.records[job_id] = replace(record, **changes)  # type: ignore[arg-type]

    def _apply_one(self, action: Action, result: ApplyResult) -> str:
        if isinstance(action, SetOrder):
            self.client.update_job(action.job_id, {action.field.value: action.value})
            return _describe(action)
        if isinstance(action, Place):
            fields: dict[str, str | int] = {}
            if action.num_nodes is not None:
                fields["NumNodes"] = action.num_nodes
            if action.node_list is not None:
                fields["ReqNodeList"] = action.node_list
            self.client.update_job(action.job_id, fields)
            self._update(result, action.job_id, placement=action.signature)
            return _describe(action)
        if isinstance(action, (Preempt, Resize)):
            return self._stop(action, result)
        if isinstance(action, Requeue):
            self.client.requeue([action.job_id])
            record = result.records.get(action.job_id)
            self._update(result, action.job_id, stop_kind="", stop_at=None)
            if record is not None and record.resize_to:
                tasks = record.resize_to
                return "requeued by the daemon; " + self._set_size(
                    action.job_id, tasks, tasks * action.cpus_per_task, action.gpu_type, result
                )
            return "requeued by the daemon"
        return self._set_size(action.job_id, action.tasks, action.cpus, action.gpu_type, result)

    def _set_size(self, job_id: int, tasks: int, cpus: int, gpu_type: str | None, result: ApplyResult) -> str:
        self.client.update_job(job_id, commands.size_fields(tasks, cpus, gpu_type))
        self._update(result, job_id, resize_set=tasks)
        return f"NumTasks={tasks} NumCPUs={cpus}: {tasks} GPUs when it starts again"

    def _stop(self, action: Preempt | Resize, result: ApplyResult) -> str:
        """Checkpoint request (stop file + signal), recorded as in flight; no job directory: requeue at once."""
        reason = StopReason.PREEMPT if isinstance(action, Preempt) else StopReason.RESIZE
        job_dir = job_directory(self.config.ckpt_roots, action.name, action.job_id) if action.checkpointed else None
        now = self.clock()
        record = result.records.get(action.job_id)
        changes: dict[str, object] = {}
        if isinstance(action, Preempt) and record is not None:
            changes = {"last_preempt": now, "preemptions": record.preemptions + 1}
        if isinstance(action, Resize):
            changes["resize_to"] = action.new_gpus
            changes["resize_set"] = 0
        if job_dir is None:
            log.warning(
                "job %d: no job directory under %s; requeue without checkpoint",
                action.job_id,
                ", ".join(map(str, self.config.ckpt_roots)),
            )
            self.client.requeue([action.job_id])
            self._update(result, action.job_id, **changes)
            detail = "no job directory: requeued without checkpoint"
            if isinstance(action, Resize):
                cpus = action.new_gpus * action.cpus_per_task
                detail += "; " + self._set_size(action.job_id, action.new_gpus, cpus, action.gpu_type, result)
            return detail
        control = job_dir / CONTROL_DIR
        control.mkdir(exist_ok=True)
        _write_atomic(control / STOP_FILE, StopRequest(reason, now).to_json())
        preemption = self.config.preemption
        self.client.cancel([action.job_id], preemption.signal, batch=preemption.batch)
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
    return "checkpoint, then requeue"
