"""The daemon's side of ``policy = "dl2"``: the model file, the jobs' progress records, the scale notices.

Once per slot (``[dl2] slot_s``, DL² §3.1) this reads what :mod:`slurm_plugin.dl2_slots` needs that a Slurm read
does not show (each running ps-mode job's progress record and scale reply, through the job directory's reader
for the daemon, :mod:`hpc_elastic.jobdir`) and runs its pure decision; the targets that changed become
:class:`~slurm_plugin.actions.Scale` actions, which the daemon's applier sends to the jobs' wrappers the way a stop
goes: a :class:`hpc_elastic.jobdir.ScaleNotice` in the job's ``AdminComment`` (a field only Slurm administrators
set), then ``USR2`` to the batch shell; the wrapper applies or refuses it as it does a user's ``hpc-elastic scale``
request and answers in the job directory. The daemon writes nothing into a user's
directory (``site-config/SECURITY.md``), so it scales the jobs of every user. A notice not answered within a slot
may be sent again; one answered, or newer than the reply, is read back from Slurm (a restarted daemon knows its
requests in flight). It falls back to the default plan alone (2D-LAS, nothing scaled) when the model file is
missing, not a regular file of at most ``model_file.MAX_BYTES`` (a link is refused), corrupt, or when a partition's
slot is out of the model's training range; each reason is logged once and kept for ``state.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_elastic.dl2 import model_file
from hpc_elastic.files import UnsafeFile, read_owned
from hpc_elastic.jobdir import ScaleNotice, ScaleReply
from hpc_elastic.policy.dl2 import Network, StateSpec
from hpc_elastic.ps.model import MODEL_NAME
from hpc_elastic.sim.ps_jobs import TYPES_BY_NAME
from hpc_elastic.slurm import Job, Node
from slurm_plugin.actions import Scale
from slurm_plugin.apply import Outcome, job_dir_of, job_uid
from slurm_plugin.config import PluginConfig
from slurm_plugin.dl2_slots import Dl2Plan, PsSlotView, ScaleTarget, plan_slot, slot_input
from slurm_plugin.observe import Observation

log = logging.getLogger(__name__)

#: ``state.json``'s ``dl2.status`` while the network decides
ACTIVE = "active"


def read_model(path: Path) -> model_file.ModelFile:
    """The model file at ``path``, read strictly (site-owned): a regular file reached without following a link at
    its end, at most ``model_file.MAX_BYTES`` (:func:`hpc_elastic.files.read_owned`), then checked by
    :func:`model_file.decode`; ``ValueError`` saying why it cannot be used."""
    try:
        data = read_owned(path.parent, [path.name], limit=model_file.MAX_BYTES)
    except FileNotFoundError:
        raise ValueError(f"{path}: no model file") from None
    except UnsafeFile as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the model file ({exc.strerror or exc})") from None
    return model_file.decode(data, str(path))


@dataclass(frozen=True)
class ScaleRequested:
    """A target of the slot and what became of it (``written``: sent to the job; else ``detail`` says why not)."""

    target: ScaleTarget
    written: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.target), "written": self.written, "detail": self.detail}


@dataclass(frozen=True)
class Dl2Report:
    """One pass's DL² part: ``status`` (:data:`ACTIVE` or the fallback reason), the slot decided (None: none this
    pass), its plans and what became of their targets (:meth:`with_outcomes`)."""

    status: str
    slot: int | None = None
    requests: tuple[ScaleRequested, ...] = ()
    plans: tuple[Dl2Plan, ...] = field(default=())

    def scale_actions(self, managed: Mapping[int, Job]) -> list[Scale]:
        """The slot's targets as actions (none when no slot was decided this pass)."""
        if self.slot is None:
            return []
        return [
            Scale(t.job_id, t.workers, t.ps, managed[t.job_id].restart_count, t.reason)
            for plan in self.plans
            for t in plan.targets
        ]

    def with_outcomes(self, outcomes: Sequence[Outcome], *, dry_run: bool) -> Dl2Report:
        """The report with what the applier did of its :meth:`scale_actions` (their outcomes, in their order)."""
        targets = [t for plan in self.plans for t in plan.targets] if self.slot is not None else []
        requests = tuple(
            ScaleRequested(target, o.ok and not dry_run, o.detail if o.ok else f"not sent: {o.detail}")
            for target, o in zip(targets, outcomes, strict=True)
        )
        return dataclasses.replace(self, requests=requests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "slot": self.slot,
            "requests": [r.to_dict() for r in self.requests],
            "fallbacks": {p.partition: p.fallback for p in self.plans if p.fallback},
        }


class Dl2Scaler:
    """DL² for the running ps-mode jobs of CPU partitions, once per slot (module docstring)."""

    def __init__(self, config: PluginConfig) -> None:
        if config.dl2.model is None:
            raise ValueError('policy "dl2" needs [dl2] model')
        self.path: Path = config.dl2.model
        self.slot_s = config.dl2.slot_s
        self.roots = config.ckpt_roots
        self.status = ""
        self._model: tuple[tuple[int, ...], StateSpec, Network] | tuple[tuple[int, ...], str] | None = None
        self._slot: int | None = None

    def _load(self) -> tuple[StateSpec, Network] | str:
        """The model's spec and network, or why there is none; read again only when the file changed."""
        try:
            info = os.lstat(self.path)
            key: tuple[int, ...] = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_mode)
        except OSError:
            key = ()
        if self._model is None or self._model[0] != key:
            try:
                loaded = read_model(self.path)
                self._model = (key, loaded.spec, loaded.network())
            except ValueError as exc:
                self._model = (key, f"model unusable: {exc}")
        if len(self._model) == 2:
            return self._model[1]
        return self._model[1], self._model[2]

    def _say(self, status: str) -> None:
        """Log the status when it changes (a fallback reason once, not every pass)."""
        if status != self.status:
            if status == ACTIVE:
                log.info("dl2: the model %s sizes the ps jobs once per %gs slot", self.path, self.slot_s)
            else:
                log.warning("dl2: falling back to 2D-LAS for ps jobs: %s", status)
        self.status = status

    def run(self, obs: Observation, nodes: Iterable[Node], preempted: frozenset[int], now: float) -> Dl2Report:
        """The pass's DL² part: nothing when this slot was decided already; else the fallback reason, or the slot's
        decision (:meth:`Dl2Report.scale_actions` are its notices to send)."""
        slot = int(now // self.slot_s)
        if self._slot == slot:
            return Dl2Report(self.status)
        model = self._load()
        if isinstance(model, str):
            self._say(model)
            return Dl2Report(model)
        spec, network = model
        views = self._views(obs, preempted, now)
        cores = partition_cores(nodes)
        plans = []
        for partition in sorted({v.partition for v in views}):
            mine = [v for v in views if v.partition == partition]
            inp = slot_input(spec, TYPES_BY_NAME, cores.get(partition, ()), mine, slot=slot, slot_seconds=self.slot_s)
            plans.append(plan_slot(spec, network, partition, inp, jobs=mine, free_cores=obs.cpu_free.get(partition, 0)))
        fallbacks = [f"partition {p.partition}: {p.fallback}" for p in plans if p.fallback]
        self._say("; ".join(fallbacks) if fallbacks else ACTIVE)
        if fallbacks and len(fallbacks) == len(plans):
            return Dl2Report(self.status, plans=tuple(plans))  # nothing decided: look again next pass
        self._slot = slot
        return Dl2Report(self.status, slot, plans=tuple(plans))

    def _views(self, obs: Observation, preempted: frozenset[int], now: float) -> list[PsSlotView]:
        """The running ps-mode jobs (not those this pass preempts or whose stop is under way) with their progress
        records and scale state: a request waits while the user's file is in the job directory, or while the
        daemon's notice of this run is not answered and younger than a slot."""
        out = []
        for ps_view in obs.ps_jobs:
            marker = obs.markers.get(ps_view.job_id)
            job = obs.managed.get(ps_view.job_id)
            record = obs.records.get(ps_view.job_id)
            if not ps_view.running or ps_view.job_id in preempted or job is None or record is None:
                continue
            if record.stop_kind:  # a checkpoint + requeue is under way: the job stops, it is not resized
                continue
            if marker is None or marker.ps is None:
                continue
            uid = job_uid(job)
            job_dir = job_dir_of(self.roots, job)
            progress = reply = None
            pending = False
            if job_dir is not None and uid is not None:
                progress = job_dir.read_progress_as(uid)
                reply = job_dir.read_scale_reply_as(uid)
                pending = job_dir.scale_requested() or self._unanswered(job, reply, now)
            if progress is not None and progress.restart_count != job.restart_count:
                progress = None  # an earlier run's
            shape = marker.ps
            out.append(
                PsSlotView(
                    job_id=job.job_id,
                    partition=ps_view.partition,
                    model=MODEL_NAME,  # a ps-mode job trains the built-in Wide & Deep
                    submitted=ps_view.submitted,
                    executed_s=record.executed_time,
                    epochs_done=progress.epochs_done if progress is not None else None,
                    epochs_total=progress.epochs_total if progress is not None else None,
                    workers=progress.world_size if progress is not None else shape.workers[1],
                    ps=(progress.ps or shape.ps[0]) if progress is not None else shape.ps[0],
                    workers_range=shape.workers,
                    ps_range=shape.ps,
                    cores_per_task=shape.cpus_per_worker,
                    scale_pending=pending,
                )
            )
        return out

    def _unanswered(self, job: Job, reply: ScaleReply | None, now: float) -> bool:
        """Whether the daemon's scale notice in the job's AdminComment (for this run) waits for its answer: the
        reply names an earlier request, or there is none yet, and the notice is younger than a slot."""
        notice = ScaleNotice.decode(job.admin_comment)
        if notice is None or notice.restarts != job.restart_count or now - notice.requested_at >= self.slot_s:
            return False
        return reply is None or reply.requested_at is None or reply.requested_at < notice.requested_at


def partition_cores(nodes: Iterable[Node]) -> Mapping[str, tuple[int, ...]]:
    """The cores of each node without GPUs that can take work, by partition (a node of several in each)."""
    out: dict[str, list[int]] = {}
    for node in nodes:
        if node.gpus.total > 0 or not node.available or node.cpus < 1:
            continue
        for part in node.partitions:
            out.setdefault(part, []).append(node.cpus)
    return {part: tuple(cores) for part, cores in out.items()}
