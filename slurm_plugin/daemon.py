"""The pass loop: observe -> policy -> actions -> apply -> store and export (the README's "The scheduler
plugin").

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from hpc_elastic.files import atomic_write_bytes
from hpc_elastic.launch.spec import JobMarker
from hpc_elastic.policy import ClusterState, Decision, JobTable, PassInput, Policy, PolicyOptions, make_policy
from hpc_elastic.policy.hetero import EstProfile, TiresiasLasEasyScale
from hpc_elastic.policy.policies import Dl2GpuFallback
from hpc_elastic.policy.types import ScalingCurve
from hpc_elastic.slurm import Job, Node, SlurmClient, SlurmError
from slurm_plugin.actions import (
    Action,
    ActionKind,
    Resize,
    followup_actions,
    held_by,
    plan,
    planned_by_job,
    ps_plan,
    ps_preempt_actions,
)
from slurm_plugin.apply import Applier, ApplyResult, Outcome, Telemetry, acknowledgements, job_uid, telemetry
from slurm_plugin.config import PluginConfig
from slurm_plugin.dl2_daemon import Dl2Report, Dl2Scaler
from slurm_plugin.easyscale import Capability, ScaleOutWatch, job_profile, may_span_types, observe_grow, watch_grow
from slurm_plugin.metrics import Metrics
from slurm_plugin.observe import Observation, PartialRead, Selection, apply_queue_changes, observe, service_samples
from slurm_plugin.pack_limit import PlacementReport, merge, refit, reports_of
from slurm_plugin.store import JobRecord, Store

log = logging.getLogger(__name__)
LOCK_NAME = "hpc-elastic-sched.lock"
STATE_NAME = "state.json"
MIN_SLEEP_S = 1.0
SETTLE_SLACK_S = 15.0
RECENT_ACTIONS = 200


class DaemonLocked(RuntimeError):
    """Another daemon holds the state directory's lock."""


SkewLookup = Callable[[JobMarker, int], float | None]
#: the profiled throughput per GPU type of the model of a profile (by the profile's name; the cluster's types):
#: sorted (type, rate) pairs, the types without a profile left out (``cli.profile_capability``)
CapabilityLookup = Callable[[str, tuple[str, ...]], Capability]


@dataclass
class PassReport:
    """What one pass saw and did (also written to ``state.json``)."""

    now: float
    skipped: str = ""
    actions: list[Action] = field(default_factory=list)
    result: ApplyResult | None = None
    decision: Decision | None = None
    observation: Observation | None = None
    #: the observed capability per device type each running job reported (job id -> sorted (type, C_i) pairs)
    capabilities: Mapping[int, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    #: ``policy = "dl2"``: DL²'s part of the pass (None under the other policies)
    dl2: Dl2Report | None = None
    #: PACKLIMIT in force (Tiresias §3.3.2: the configured one, or refitted from the jobs' placement reports) and
    #: how many reports the refit has kept
    pack_limit: float | None = None
    placement_reports: int = 0


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


def build_policy(config: PluginConfig, pack_limit: float | None = None) -> Policy:
    """The configured policy; ``pack_limit``: PACKLIMIT as refitted (None: the configured one)."""
    t = config.tiresias
    options = PolicyOptions(
        thresholds=t.thresholds,
        promote_knob=t.promote_knob,
        starve_limit=t.starve_limit_s,
        pack_limit=t.pack_limit if pack_limit is None else pack_limit,
        min_run_time=config.preemption.min_run_time_s,
        min_history=t.min_history,
        fallback_hold=config.resize.fallback_hold_s,
    )
    return make_policy(config.policy, options)


class StopRequested(BaseException):  # not an Exception: a handler of errors must not swallow it
    """Unwinds a daemon that was asked to stop between passes (:meth:`Daemon.request_stop`)."""


class Daemon:
    def __init__(
        self,
        config: PluginConfig,
        client: SlurmClient,
        store: Store,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        monotonic: Callable[[], float] | None = None,
        dry_run: bool = False,
        metrics: Metrics | None = None,
        skew_lookup: SkewLookup | None = None,
        capability_lookup: CapabilityLookup | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.store = store
        self.clock = clock  # wall time: Slurm's times, the records, the policy
        self.monotonic = monotonic or clock  # every wait and deadline: a wall-clock step must not stall or rush them
        self.sleep = sleep
        self.dry_run = dry_run
        self.metrics = metrics or Metrics()
        self.skew_lookup = skew_lookup
        self.capability_lookup = capability_lookup
        #: PACKLIMIT's refit (Tiresias §3.3.2): the jobs' placement reports, kept in the state store
        self._placements: tuple[PlacementReport, ...] = store.load_placements()
        self.pack_limit = self._fitted_pack_limit(self._placements)
        self.policy = build_policy(config, self.pack_limit)
        self.selection = Selection(config.manage_all, config.job_name_pattern)
        self.applier = Applier(client, config, clock=clock, dry_run=dry_run)
        self._history_at: float | None = None
        self._signature: frozenset[tuple[int, str, int]] | None = None
        self._recent: list[dict[str, Any]] | None = None
        self._rejected: dict[int, str] = {}  # the disqualified jobs already logged, and why
        #: ``tiresias-las+easyscale``'s Role 3: the grows carried out and what the grown jobs observed since, kept
        #: in the state store (a restarted daemon goes on watching them)
        self._grows: dict[int, ScaleOutWatch] = store.load_grows()
        #: ``dl2``: DL² sizes the running ps-mode jobs of CPU partitions once per slot
        self.dl2 = Dl2Scaler(config) if config.policy == Dl2GpuFallback.name else None
        self._in_pass = False
        self._stop_requested = False

    def request_stop(self) -> None:
        """Stop for good (the CLI calls it on SIGTERM and SIGINT): a pass in progress runs to its end, its Slurm
        actions and its store write included, then :meth:`run` returns; a daemon between passes stops at once
        (:class:`StopRequested` unwinds its wait). Killed mid-pass instead, a daemon would lose what that pass did
        in Slurm but had not stored yet: the nodes a reservation holds for a resized job, a stop in flight."""
        self._stop_requested = True
        if not self._in_pass:
            raise StopRequested

    # ------------------------------------------------------------------------------------------ one pass

    def refresh_history(self, now: float) -> None:
        """Job-size distribution for 2D-Gittins from sacct, at most every ``history_refresh_s`` (§3.2.2)."""
        if not self.policy.uses_history:
            return
        if self._history_at is not None and now - self._history_at < self.config.history_refresh_s:
            return
        end = datetime.fromtimestamp(now, tz=UTC)
        # job sizes only: no field a user writes, which could forge records in sacct's text
        records = self.client.history(end - timedelta(days=self.config.history_window_days), end, user_text=False)
        self.policy = build_policy(self.config, self.pack_limit).with_history(service_samples(records))
        self._history_at = now

    def run_pass(self, *, followups_only: bool = False) -> PassReport:
        """One pass: read, order, decide, act. ``followups_only``: only finish the stops in flight (requeue, new
        size), decide nothing new (``--once`` uses it to complete the preemptions of its pass)."""
        now = self.clock()
        report = PassReport(now)
        started = self.monotonic()
        try:
            jobs = self.client.jobs(site_factors=True)
            nodes = self.client.nodes()
            self.refresh_history(now)
        except SlurmError:
            self.metrics.errors.labels("read").inc()
            raise
        records = self.store.load()
        skews = self._skews(jobs)
        reports = telemetry(self.config.ckpt_roots, self._managed(jobs))
        report.capabilities = reports.capabilities
        unmodelled: dict[int, str] = {}  # elastic jobs whose speed model failed, and why
        profiles = self._profiles(jobs, nodes, reports, now, unmodelled)
        try:
            obs = observe(jobs, nodes, records, self.selection, now=now, skews=skews, profiles=profiles)
            cluster = ClusterState.from_nodes(list(obs.nodes))
            table = JobTable.from_views(list(obs.jobs), cluster)
        except (PartialRead, ValueError) as exc:
            self.metrics.errors.labels("partial-read").inc()
            report.skipped = f"partial read, no action this pass: {exc}"
            log.warning("%s", report.skipped)
            return report
        self._log_rejections({**obs.rejected, **unmodelled})
        self._signature = signature(obs.managed.values())
        if self.config.tiresias.refit_pack_limit:
            self._refit_pack_limit(obs, cluster, reports, now)
        decision = self.policy.schedule(PassInput(now, table, cluster))
        if not followups_only:
            records_after = apply_queue_changes(obs.records, decision, now)
            obs = replace(obs, records=records_after)
            for change in decision.queue_changes:
                log.info(
                    "job %s: %s from queue %d to %d", change.job_id, change.kind.value, change.old_queue, change.queue
                )
        acks = acknowledgements(self.config.ckpt_roots, obs.records, obs.managed, now)
        actions: list[Action] = list(followup_actions(obs, acks, self.config))
        cpu_decision = None
        if not followups_only:
            actions += plan(obs, decision, self.config, pack_limit=self.pack_limit)
            cpu_decision = ps_plan(obs, self.config)
            actions += ps_preempt_actions(obs, cpu_decision)
        result = self.applier.apply(actions, obs.records, obs.managed)
        if self.dl2 is not None:  # after the preemptions: DL² sizes the ps jobs that go on running
            if cpu_decision is None:  # a follow-up pass decides nothing new
                report.dl2 = Dl2Report(self.dl2.status)
            else:
                dl2 = self.dl2.run(obs, nodes, frozenset(cpu_decision.preempt), now)
                scales = dl2.scale_actions(obs.managed)
                sent = self.applier.apply(scales, result.records, obs.managed)
                actions += scales
                result.outcomes.extend(sent.outcomes)
                report.dl2 = dl2.with_outcomes(sent.outcomes, dry_run=self.dry_run)
        grows: dict[int, ScaleOutWatch] | None = None
        if profiles is not None:
            self._watch_grows(result, profiles, obs.managed)
            self._grows = {k: v for k, v in self._grows.items() if k in result.records}  # forgotten with the job
            grows = self._grows
        placements = self._placements if self.config.tiresias.refit_pack_limit else None
        self.store.save(result.records.values(), obs.forget, grows, placements)
        self._export(report, obs=obs, decision=decision, actions=actions, result=result, started=started)
        return report

    def _refit_pack_limit(self, obs: Observation, cluster: ClusterState, reports: Telemetry, now: float) -> None:
        """PACKLIMIT refitted from the jobs' placement reports with this pass's (:mod:`slurm_plugin.pack_limit`);
        the policy places with it from this pass on."""
        runs: dict[int, tuple[int, int, str]] = {}
        for job_id, job in obs.managed.items():
            marker, uid = obs.markers.get(job_id), job_uid(job)  # (the pass's markers: jobs the policy sees)
            if marker is not None and marker.profile and uid is not None:  # a profile is "<model>@<device type>"
                runs[job_id] = (job.restart_count, uid, marker.profile.partition("@")[0])
        new = reports_of(obs.jobs, cluster, runs=runs, speeds=reports.speeds, now=now)
        placements = merge(self._placements, new)
        try:
            fitted = self._fitted_pack_limit(placements)
        except (ValueError, ArithmeticError) as exc:  # the jobs' words: the reports of this pass are not kept
            log.warning("PACKLIMIT not refitted from this pass's placement reports: %s", exc)
            return
        self._placements = placements
        if fitted != self.pack_limit:
            log.info(
                "PACKLIMIT %.3g -> %.3g, refitted from %d placement reports",
                self.pack_limit,
                fitted,
                len(self._placements),
            )
            self.pack_limit = fitted
            self.policy = self.policy.with_options(replace(self.policy.options, pack_limit=fitted))

    def _fitted_pack_limit(self, placements: tuple[PlacementReport, ...]) -> float:
        """PACKLIMIT from ``placements`` (the configured one when the refit is off)."""
        t = self.config.tiresias
        return refit(placements, t.pack_limit, t.refit_tolerance) if t.refit_pack_limit else t.pack_limit

    def _managed(self, jobs: list[Job]) -> dict[int, Job]:
        return {job.job_id: job for job in jobs if job.state.is_active and self.selection.manages(job)}

    def _profiles(
        self, jobs: list[Job], nodes: list[Node], reports: Telemetry, now: float, unmodelled: dict[int, str]
    ) -> dict[int, ScalingCurve] | None:
        """The elastic jobs' speed models for ``tiresias-las+easyscale`` (None for the other policies): C_i from
        the job's profile (the one its marker names, :attr:`capability_lookup`) corrected by what it observed,
        Role 3's observation of the last grow the daemon carried out, and whether its plans may span GPU types (the
        D2 guard) (:mod:`slurm_plugin.easyscale`). A job whose figures fail its model is left out, and said in
        ``unmodelled``."""
        if not isinstance(self.policy, TiresiasLasEasyScale):
            return None
        types = tuple(sorted({t for node in nodes for t, count in node.gpus.by_type if t and count > 0}))
        out: dict[int, ScalingCurve] = {}
        if not types:
            return out
        rates: dict[str, Capability] = {}  # each profile read once a pass
        for job in jobs:
            managed, marker, _ = self.selection.judge(job)
            if not (job.state.is_active and managed and marker is not None and marker.elastic):
                continue
            seen = reports.capabilities.get(job.job_id, ())
            mixed = may_span_types(marker, job.job_id in reports.d2)
            profiled: Capability = ()
            if marker.profile and self.capability_lookup is not None:
                if marker.profile not in rates:
                    rates[marker.profile] = self.capability_lookup(marker.profile, types)
                profiled = rates[marker.profile]
            try:
                profile = job_profile(marker, job, types, seen, mixed=mixed, profiled=profiled)
            except (ValueError, ArithmeticError) as exc:  # one job's figures: that job is left out, not the pass
                unmodelled[job.job_id] = f"no speed model from its profile and telemetry: {exc}"
                continue
            watch = self._grows.get(job.job_id)
            if watch is not None:
                watch = self._grows[job.job_id] = observe_grow(watch, profile, job, reported=bool(seen), now=now)
            out[job.job_id] = replace(profile, scale_out=watch.scale_out if watch is not None else None)
        return out

    def _watch_grows(self, result: ApplyResult, profiles: Mapping[int, ScalingCurve], jobs: Mapping[int, Job]) -> None:
        """Remember each grow carried out this pass (Role 3: the job's throughput before it)."""
        for outcome in result.outcomes:
            action = outcome.action
            if not (outcome.ok and isinstance(action, Resize) and action.new_gpus > action.old_gpus):
                continue
            profile, job = profiles.get(action.job_id), jobs.get(action.job_id)
            if isinstance(profile, EstProfile) and job is not None:
                self._grows[action.job_id] = watch_grow(profile, job, self._grows.get(action.job_id))

    def _log_rejections(self, rejected: Mapping[int, str]) -> None:
        """Log each disqualified job once (again only if the reason changes); forget those no longer listed."""
        for job_id, why in rejected.items():
            if self._rejected.get(job_id) != why:
                log.warning("job %d left out: %s", job_id, why)
                self.metrics.errors.labels("rejected-job").inc()
        self._rejected = dict(rejected)

    def _skews(self, jobs: list[Job]) -> dict[int, float]:
        out: dict[int, float] = {}
        if self.skew_lookup is None:
            return out
        for job in jobs:
            managed, marker, _ = self.selection.judge(job)
            if not job.state.is_active or not managed or marker is None or not marker.profile:
                continue
            skew = self.skew_lookup(marker, max(1, job.gpu_count))
            if skew is not None:
                out[job.job_id] = skew
        return out

    def _export(
        self,
        report: PassReport,
        *,
        obs: Observation,
        decision: Decision,
        actions: list[Action],
        result: ApplyResult,
        started: float,
    ) -> None:
        report.actions, report.result, report.decision, report.observation = actions, result, decision, obs
        report.pack_limit, report.placement_reports = self.pack_limit, len(self._placements)
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
        counts = Counter((int(result.records[v.job_id].queue), v.status.value) for v in obs.jobs)
        self.metrics.set_jobs((q, s, n) for (q, s), n in counts.items())
        self.metrics.pass_latency.observe(max(0.0, self.monotonic() - started))
        self.metrics.last_pass.set(self.clock())
        if not self.dry_run:
            path = self.config.state_dir / STATE_NAME
            if self._recent is None:  # a restarted daemon goes on with its predecessor's list
                self._recent = previous_actions(path)
            doc = state_document(report)
            self._recent = (self._recent + doc["actions"])[-RECENT_ACTIONS:]
            doc["recent_actions"] = self._recent
            write_state(path, doc)

    # ------------------------------------------------------------------------------------------ the loop

    def run(self, *, once: bool = False) -> int:
        """Passes until a stop is requested (0), or one pass with ``once``; 1 after too many failed passes in a
        row, 3 when ``once``'s pass was skipped."""
        try:
            return self._loop(once=once)
        except StopRequested:
            pass
        log.info("stop requested: exiting")
        return 0

    def _loop(self, *, once: bool) -> int:
        errors = 0
        while True:  # until _between_passes raises StopRequested
            try:
                report = self._pass()
                if once:
                    self._settle(report)
                errors = 0
            except Exception as exc:  # a pass that fails is retried with back-off, whatever failed
                errors += 1
                how = log.error if isinstance(exc, SlurmError) else log.exception
                how("pass failed (%d/%d in a row): %s", errors, self.config.max_consecutive_errors, exc)
                if once or errors >= self.config.max_consecutive_errors:
                    return 1
                self._between_passes(self.sleep, min(self.config.interval_s * 2**errors, 300.0))
                continue
            if once:
                return 0 if not report.skipped else 3
            self._between_passes(self._wait, self._sleep_time(report))

    def _pass(self, *, followups_only: bool = False) -> PassReport:
        """:meth:`run_pass`, which a stop request lets finish."""
        self._in_pass = True
        try:
            return self.run_pass(followups_only=followups_only)
        finally:
            self._in_pass = False

    def _between_passes(self, wait: Callable[[float], None], seconds: float) -> None:
        if self._stop_requested:  # asked during the pass that just ended
            raise StopRequested
        wait(seconds)

    def _settle(self, report: PassReport) -> None:
        """``--once``: finish the checkpoint + requeue (and new sizes) that this pass started, with follow-up
        passes that decide nothing new, within the grace period."""
        p = self.config.preemption
        deadline = self.monotonic() + p.grace_s + p.requeue_wait_s + SETTLE_SLACK_S
        while report.result is not None and unsettled(report.result.records) and self.monotonic() < deadline:
            self._between_passes(self.sleep, self.config.stop_poll_s)
            report = self._pass(followups_only=True)

    def _wait(self, seconds: float) -> None:
        """Sleep until the next pass, but start it early when managed jobs arrive, start or finish: one squeue
        every ``event_poll_s`` compared with the last pass."""
        deadline = self.monotonic() + seconds
        poll = self.config.event_poll_s
        while True:
            left = deadline - self.monotonic()
            if left <= 0:
                return
            if poll <= 0:
                self.sleep(left)
                return
            self.sleep(min(poll, left))
            if self.monotonic() >= deadline:
                return
            try:
                now = signature(j for j in self.client.jobs() if self.selection.manages(j))
            except SlurmError:
                continue  # the next pass reports it
            if self._signature is not None and now != self._signature:
                log.info("managed jobs arrived, started or ended: pass now")
                self.metrics.early_passes.inc()
                return

    def _sleep_time(self, report: PassReport) -> float:
        wait = self.config.interval_s
        wake = report.decision.next_wakeup if report.decision is not None else None
        if wake is not None and math.isfinite(wake):
            wait = min(wait, max(MIN_SLEEP_S, wake - report.now))
        if report.result is not None and unsettled(report.result.records):
            wait = min(wait, self.config.stop_poll_s)  # a checkpoint + requeue is in flight: look again soon
        return wait


def release_held_nodes(client: SlurmClient, state_dir: Path) -> list[str]:
    """End every reservation a stopped daemon still holds for a resized job (its store's ``resize_keep``): a daemon
    stopped for good no longer makes the pass that ends one once its job runs again or is gone, and the nodes would
    stay held until the reservation's end time. The reservations ended, by name; one Slurm no longer has is
    skipped (logged). Call it only once the daemon has exited: a live one may create another."""
    store = Store(state_dir, read_only=True)
    try:
        names = sorted({held_by(record) for record in store.load().values() if record.resize_keep})
    finally:
        store.close()
    ended: list[str] = []
    for name in names:
        try:
            client.end_reservation(name)
        except SlurmError as exc:
            log.info("reservation %s not ended (%s)", name, exc)
            continue
        ended.append(name)
    return ended


def unsettled(records: Mapping[int, JobRecord]) -> bool:
    """A stop in flight, or a resized job whose new size is not set yet."""
    return any(r.stop_kind or r.resize_to != r.resize_set for r in records.values())


def signature(jobs: Iterable[Job]) -> frozenset[tuple[int, str, int]]:
    """What makes an early pass worth it: managed jobs appearing, changing state or being requeued."""
    return frozenset((j.job_id, j.state.value, j.restart_count) for j in jobs if j.state.is_active)


def state_document(report: PassReport) -> dict[str, Any]:
    """Managed jobs with queue, attained service, priority rank, placement and planned action."""
    obs, decision, result = report.observation, report.decision, report.result
    doc: dict[str, Any] = {"time": report.now, "skipped": report.skipped, "jobs": [], "actions": []}
    if report.dl2 is not None:
        doc["dl2"] = report.dl2.to_dict()
    if obs is None or decision is None or result is None:
        return doc
    doc["pack_limit"], doc["placement_reports"] = report.pack_limit, report.placement_reports
    planned = planned_by_job(report.actions)

    def add(job: Job, state: str, gpus: int, service: tuple[float, float, float | None], rank: int | None) -> None:
        record = result.records[job.job_id]
        attained, executed, waiting = service
        doc["jobs"].append(
            {
                "job_id": job.job_id,
                "name": job.name,
                "state": state,
                "gpus": gpus,
                "queue": record.queue,
                "attained_gpu_s": round(attained, 1),
                "executed_s": round(executed, 1),
                "waiting_s": None if waiting is None else round(waiting, 1),
                "rank": rank,
                "site_factor": job.site_factor,
                "nodes": list(job.nodes),
                "preemptions": record.preemptions,
                "planned": planned.get(job.job_id, ""),
                "in_flight": record.stop_kind,
                "resize_to": record.resize_to or None,
                "placement": record.placement,
                "capability": dict(report.capabilities.get(job.job_id, ())),
            }
        )

    rank = {obs.jobs[row].job_id: i + 1 for i, row in enumerate(decision.priority_order.tolist())}
    for view in obs.jobs:
        times = (view.attained_service, view.executed_time, view.waiting_time)
        add(obs.slurm_jobs[view.job_id], view.status.value, view.gpus, times, rank[view.job_id])
    seen = {view.job_id for view in obs.jobs}
    for job_id, job in sorted(obs.managed.items()):
        if job_id not in seen:
            record = result.records[job_id]
            why = f" ({job.pending_reason})" if job.pending_reason else ""
            service = (record.attained_service, record.executed_time, None)
            add(job, f"{job.state.value.lower()}{why}", job.gpu_count, service, None)
    doc["actions"] = [outcome_document(report.now, outcome) for outcome in result.outcomes]
    return doc


def outcome_document(now: float, outcome: Outcome) -> dict[str, Any]:
    return {
        "time": now,
        "kind": outcome.action.kind.value,
        "job_id": outcome.action.job_id,
        "ok": outcome.ok,
        "detail": outcome.detail,
        "reason": outcome.action.reason,
    }


def previous_actions(path: Path) -> list[dict[str, Any]]:
    """The recent actions recorded in an existing state file (empty when there is none or it is unreadable)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    recent = doc.get("recent_actions") if isinstance(doc, dict) else None
    return [a for a in recent if isinstance(a, dict)] if isinstance(recent, list) else []


def write_state(path: Path, doc: dict[str, Any]) -> None:
    """The queue view's state file, replaced atomically (readable by everyone: ``hpc-elastic-queue``)."""
    atomic_write_bytes(path, json.dumps(doc, indent=1, sort_keys=True).encode())
