"""The pass loop: observe -> policy -> actions -> apply -> store and export (issue 4, "Each pass").

Robustness: a pass that cannot read Slurm completely takes no action; consecutive failures are retried with
backoff up to ``max_consecutive_errors`` and then the daemon exits non-zero (systemd restarts it). A lock file
in the state directory keeps two daemons from acting at once (``--dry-run`` takes none and writes nothing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Protocol

from hpc_elastic.launch.spec import JobMarker
from hpc_elastic.policy import ClusterState, Decision, JobTable, PassInput, Policy, PolicyOptions, make_policy
from hpc_elastic.slurm import Job, Node, SlurmError
from slurm_plugin.actions import Action, ActionKind, plan, planned_by_job
from slurm_plugin.apply import Applier, ApplyResult, SlurmOps
from slurm_plugin.config import PluginConfig
from slurm_plugin.metrics import Metrics
from slurm_plugin.observe import Observation, PartialRead, Selection, apply_queue_changes, observe, service_samples
from slurm_plugin.store import Store

log = logging.getLogger(__name__)
LOCK_NAME = "hpc-elastic-sched.lock"
STATE_NAME = "state.json"
MIN_SLEEP_S = 1.0


class DaemonLocked(RuntimeError):
    """Another daemon holds the state directory's lock."""


class HistoryClient(SlurmOps, Protocol):
    def nodes(self) -> list[Node]: ...
    def history(self, start: datetime, end: datetime | None = None) -> list[Job]: ...


SkewLookup = Callable[[JobMarker, int], float | None]


@dataclass
class PassReport:
    """What one pass saw and did (also written to ``state.json``)."""

    now: float
    skipped: str = ""
    actions: list[Action] = field(default_factory=list)
    result: ApplyResult | None = None
    decision: Decision | None = None
    observation: Observation | None = None


@contextlib.contextmanager
def state_lock(state_dir: Path) -> Iterator[IO[str]]:
    handle = open(state_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held for the daemon's life
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DaemonLocked(f"another hpc-elastic-sched holds {state_dir / LOCK_NAME}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield handle
    finally:
        handle.close()


def build_policy(config: PluginConfig) -> Policy:
    t = config.tiresias
    options = PolicyOptions(
        thresholds=t.thresholds,
        promote_knob=t.promote_knob,
        pack_limit=t.pack_limit,
        min_run_time=config.preemption.min_run_time_s,
    )
    return make_policy(config.policy, options)


class Daemon:
    def __init__(
        self,
        config: PluginConfig,
        client: HistoryClient,
        store: Store,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        dry_run: bool = False,
        metrics: Metrics | None = None,
        skew_lookup: SkewLookup | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.store = store
        self.clock = clock
        self.sleep = sleep
        self.dry_run = dry_run
        self.metrics = metrics or Metrics()
        self.skew_lookup = skew_lookup
        self.policy = build_policy(config)
        self.selection = Selection(config.manage_all, config.job_name_pattern)
        self.applier = Applier(client, config, clock=clock, sleep=sleep, dry_run=dry_run)
        self._history_at: float | None = None

    # ------------------------------------------------------------------------------------------ one pass

    def refresh_history(self, now: float) -> None:
        """Job-size distribution for 2D-Gittins from sacct, at most every ``history_refresh_s`` (§3.2.2)."""
        if not self.policy.uses_history:
            return
        if self._history_at is not None and now - self._history_at < self.config.history_refresh_s:
            return
        end = datetime.fromtimestamp(now, tz=UTC)
        records = self.client.history(end - timedelta(days=self.config.history_window_days), end)
        self.policy = build_policy(self.config).with_history(service_samples(records))
        self._history_at = now

    def run_pass(self) -> PassReport:
        now = self.clock()
        report = PassReport(now)
        started = now
        try:
            jobs = self.client.jobs(site_factors=True)
            nodes = self.client.nodes()
            self.refresh_history(now)
        except SlurmError:
            self.metrics.errors.labels("read").inc()
            raise
        records = self.store.load()
        skews = self._skews(jobs)
        try:
            obs = observe(jobs, nodes, records, self.selection, now=now, skews=skews)
            cluster = ClusterState.from_nodes(list(obs.nodes))
            table = JobTable.from_views(list(obs.jobs), cluster)
        except (PartialRead, ValueError) as exc:
            self.metrics.errors.labels("partial-read").inc()
            report.skipped = f"partial read, no action this pass: {exc}"
            log.warning("%s", report.skipped)
            return report
        decision = self.policy.schedule(PassInput(now, table, cluster))
        records_after = apply_queue_changes(obs.records, decision, now)
        obs = Observation(obs.now, obs.jobs, obs.nodes, obs.slurm_jobs, obs.markers, records_after, obs.forget)
        for change in decision.queue_changes:
            log.info("job %s: %s from queue %d to %d", change.job_id, change.kind.value, change.old_queue, change.queue)
        actions = plan(obs, decision, self.config)
        by_id = {int(k): v for k, v in obs.slurm_jobs.items()}
        result = self.applier.apply(actions, records_after, by_id)
        self.store.save(result.records.values(), obs.forget)
        self._export(report, obs=obs, decision=decision, actions=actions, result=result, started=started)
        return report

    def _skews(self, jobs: list[Job]) -> dict[int, float]:
        out: dict[int, float] = {}
        if self.skew_lookup is None:
            return out
        for job in jobs:
            marker = self.selection.marker(job)
            if marker is None or not marker.profile:
                continue
            skew = self.skew_lookup(marker, max(1, job.gpu_count))
            if skew is not None:
                out[job.job_id] = skew
        return out

    def _export(
        self, report: PassReport, *, obs: Observation, decision: Decision, actions: list[Action],
        result: ApplyResult, started: float,
    ) -> None:
        report.actions, report.result, report.decision, report.observation = actions, result, decision, obs
        for outcome in result.outcomes:
            label = "dry-run" if self.dry_run else ("ok" if outcome.ok else "failed")
            self.metrics.actions.labels(outcome.action.kind.value, label).inc()
            if outcome.ok and not self.dry_run:
                if outcome.action.kind is ActionKind.PREEMPT:
                    self.metrics.preemptions.inc()
                elif outcome.action.kind is ActionKind.RESIZE:
                    self.metrics.resizes.inc()
            if not outcome.ok:
                self.metrics.errors.labels("apply").inc()
        counts = Counter((int(result.records[int(v.job_id)].queue), v.status.value) for v in obs.jobs)
        self.metrics.set_jobs((q, s, n) for (q, s), n in counts.items())
        self.metrics.pass_latency.observe(max(0.0, self.clock() - started))
        self.metrics.last_pass.set(self.clock())
        if not self.dry_run:
            write_state(self.config.state_dir / STATE_NAME, state_document(report))

    # ------------------------------------------------------------------------------------------ the loop

    def run(self, *, once: bool = False) -> int:
        errors = 0
        while True:
            try:
                report = self.run_pass()
                errors = 0
            except SlurmError as exc:
                errors += 1
                log.error("pass failed (%d/%d in a row): %s", errors, self.config.max_consecutive_errors, exc)
                if once or errors >= self.config.max_consecutive_errors:
                    return 1
                self.sleep(min(self.config.interval_s * 2**errors, 300.0))
                continue
            if once:
                return 0 if not report.skipped else 3
            self.sleep(self._sleep_time(report))

    def _sleep_time(self, report: PassReport) -> float:
        wait = self.config.interval_s
        wake = report.decision.next_wakeup if report.decision is not None else None
        if wake is not None and math.isfinite(wake):
            wait = min(wait, max(MIN_SLEEP_S, wake - report.now))
        return wait


def state_document(report: PassReport) -> dict[str, Any]:
    """Managed jobs with queue, attained service, priority rank, placement and planned action."""
    obs, decision, result = report.observation, report.decision, report.result
    doc: dict[str, Any] = {"time": report.now, "skipped": report.skipped, "jobs": [], "actions": []}
    if obs is None or decision is None or result is None:
        return doc
    planned = planned_by_job(report.actions)
    rank = {int(obs.jobs[row].job_id): i + 1 for i, row in enumerate(decision.priority_order.tolist())}
    for view in obs.jobs:
        job_id = int(view.job_id)
        record = result.records[job_id]
        job = obs.slurm_jobs[view.job_id]
        doc["jobs"].append({
            "job_id": job_id, "name": job.name, "state": view.status.value, "gpus": view.gpus,
            "queue": record.queue, "attained_gpu_s": round(view.attained_service, 1),
            "executed_s": round(view.executed_time, 1), "waiting_s": round(view.waiting_time, 1),
            "rank": rank[job_id], "site_factor": job.site_factor, "nodes": list(job.nodes),
            "preemptions": record.preemptions, "planned": planned.get(job_id, ""),
        })
    for outcome in result.outcomes:
        doc["actions"].append({
            "kind": outcome.action.kind.value, "job_id": outcome.action.job_id, "ok": outcome.ok,
            "detail": outcome.detail, "reason": outcome.action.reason,
        })
    return doc


def write_state(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)
