"""Execute actions through the Slurm adapter (the only way this package touches Slurm).

Preemption (Tiresias §3.2: checkpoint + requeue; ``scontrol suspend`` would keep the GPUs): write
``control/stop`` with reason ``preempt`` in the job directory on the shared filesystem, send the checkpoint
signal to the batch shell (``scancel --signal=USR1 --batch``), wait for ``control/ack.json`` up to the grace
period, then requeue unless the job's wrapper already did. Job names and paths never reach a shell: the
adapter runs argv lists, and a job directory is used only if its name is a single plain path component.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from hpc_elastic.control import ACK_FILE, CONTROL_DIR, STOP_FILE, StopReason, StopRequest, parse_ack
from hpc_elastic.slurm import Job, SlurmError
from slurm_plugin.actions import Action, Place, Preempt, Resize, SetOrder
from slurm_plugin.config import PluginConfig
from slurm_plugin.store import JobRecord

log = logging.getLogger(__name__)
POLL_S = 0.5


class SlurmOps(Protocol):
    """The part of :class:`hpc_elastic.slurm.CliSlurm` the daemon uses."""

    def jobs(self, job_ids: Iterable[int] | None = None, *, site_factors: bool = False) -> list[Job]: ...
    def update_job(self, job_id: int, fields: Mapping[str, str | int]) -> None: ...
    def requeue(self, job_ids: Iterable[int]) -> None: ...
    def cancel(
        self, job_ids: Iterable[int], signal: str | None = None, *, batch: bool = False, full: bool = False
    ) -> None: ...


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


def _acked(job_dir: Path, requested_at: float) -> bool:
    try:
        ack = parse_ack((job_dir / CONTROL_DIR / ACK_FILE).read_text())
    except (OSError, ValueError):
        return False
    return ack.written_at >= requested_at - 1.0


class Applier:
    """Applies actions; ``clock`` and ``sleep`` are injectable; ``dry_run`` logs and changes nothing."""

    def __init__(
        self,
        client: SlurmOps,
        config: PluginConfig,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        dry_run: bool = False,
    ) -> None:
        self.client = client
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self.dry_run = dry_run

    def apply(
        self, actions: Sequence[Action], records: Mapping[int, JobRecord], jobs: Mapping[int, Job]
    ) -> ApplyResult:
        result = ApplyResult(records=dict(records))
        preempts = [a for a in actions if isinstance(a, Preempt)]
        if preempts:
            self._preempt(preempts, jobs, result)
        for action in actions:
            if isinstance(action, Preempt):
                continue
            prefix = "[dry-run] " if self.dry_run else ""
            log.info("%s%s job %d: %s (%s)", prefix, action.kind.value, action.job_id, _describe(action), action.reason)
            if self.dry_run:
                result.outcomes.append(Outcome(action, True, "dry-run"))
                continue
            try:
                self._apply_one(action, result)
                result.outcomes.append(Outcome(action, True, _describe(action)))
            except SlurmError as exc:
                log.warning("%s job %d failed: %s", action.kind.value, action.job_id, exc)
                result.outcomes.append(Outcome(action, False, str(exc)))
        return result

    def _apply_one(self, action: Action, result: ApplyResult) -> None:
        if isinstance(action, SetOrder):
            self.client.update_job(action.job_id, {action.field.value: action.value})
        elif isinstance(action, Place):
            fields: dict[str, str | int] = {}
            if action.num_nodes is not None:
                fields["NumNodes"] = action.num_nodes
            if action.node_list is not None:
                fields["ReqNodeList"] = action.node_list
            self.client.update_job(action.job_id, fields)
            record = result.records.get(action.job_id)
            if record is not None:
                result.records[action.job_id] = replace(record, placement=action.signature)
        elif isinstance(action, Resize):
            # The adapter cannot change a pending job's task count yet (NumTasks is not an updatable field),
            # and Slurm 22.05 cannot grow GPU jobs in place: resizes are planned and reported only.
            raise SlurmError(f"resize of job {action.job_id} to {action.new_gpus} GPUs is not supported yet")

    # ---------------------------------------------------------------------------------------- preemption

    def _preempt(self, actions: Sequence[Preempt], jobs: Mapping[int, Job], result: ApplyResult) -> None:
        signalled: dict[int, tuple[Preempt, Path | None, float]] = {}
        for action in actions:
            log.info("%spreempt job %d (%s)", "[dry-run] " if self.dry_run else "", action.job_id, action.reason)
            if self.dry_run:
                result.outcomes.append(Outcome(action, True, "dry-run"))
                continue
            job_dir = job_directory(self.config.ckpt_roots, action.name, action.job_id) if action.checkpointed else None
            now = self.clock()
            try:
                if job_dir is not None:
                    control = job_dir / CONTROL_DIR
                    control.mkdir(exist_ok=True)
                    _write_atomic(control / STOP_FILE, StopRequest(StopReason.PREEMPT, now).to_json())
                    preemption = self.config.preemption
                    self.client.cancel([action.job_id], preemption.signal, batch=preemption.batch)
                else:
                    log.warning("job %d: no job directory under %s; requeue without checkpoint", action.job_id,
                                ", ".join(map(str, self.config.ckpt_roots)))
                signalled[action.job_id] = (action, job_dir, now)
            except (SlurmError, OSError) as exc:
                log.warning("preempt job %d failed: %s", action.job_id, exc)
                result.outcomes.append(Outcome(action, False, str(exc)))
        if not signalled:
            return
        waiting = {i for i, (_, d, _) in signalled.items() if d is not None}
        deadline = self.clock() + self.config.preemption.grace_s
        while waiting and self.clock() < deadline:
            waiting = {i for i in waiting if not _acked(signalled[i][1] or Path("/nonexistent"), signalled[i][2])}
            if waiting:
                self.sleep(POLL_S)
        acked = {i for i, (_, d, _) in signalled.items() if d is not None and i not in waiting}
        before = {i: jobs[i].restart_count if i in jobs else 0 for i in signalled}
        # the wrapper requeues after its checkpoint: give it ``requeue_wait_s`` before doing it ourselves
        requeue_deadline = self.clock() + (self.config.preemption.requeue_wait_s if acked else 0.0)
        left = set(signalled)
        while True:
            with contextlib.suppress(SlurmError):
                current = {j.job_id: j for j in self.client.jobs(sorted(left))}
                left = {i for i in left if i in current and current[i].state.is_running
                        and current[i].restart_count <= before[i]}
            if not left or self.clock() >= requeue_deadline:
                break
            self.sleep(POLL_S)
        for job_id, (action, _job_dir, at) in signalled.items():
            detail = "checkpoint acknowledged" if job_id in acked else "no checkpoint acknowledgement"
            ok = True
            if job_id in left:
                try:
                    self.client.requeue([job_id])
                    detail += "; requeued by the daemon"
                except SlurmError as exc:
                    ok, detail = False, f"{detail}; requeue failed: {exc}"
            else:
                detail += "; requeued by its wrapper"
            log.info("preempt job %d: %s", job_id, detail)
            result.outcomes.append(Outcome(action, ok, detail))
            record = result.records.get(job_id)
            if record is not None and ok:
                result.records[job_id] = replace(record, last_preempt=at, preemptions=record.preemptions + 1)


def _describe(action: Action) -> str:
    if isinstance(action, SetOrder):
        return f"{action.field.value} {action.old if action.old is not None else '?'} -> {action.value}"
    if isinstance(action, Place):
        return " ".join(
            part for part in (
                f"NumNodes={action.num_nodes}" if action.num_nodes is not None else "",
                f"ReqNodeList={action.node_list}" if action.node_list is not None else "",
            ) if part
        )
    if isinstance(action, Resize):
        return f"{action.old_gpus} -> {action.new_gpus} GPUs"
    return json.dumps({"job": action.job_id})
