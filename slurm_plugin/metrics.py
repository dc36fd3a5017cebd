"""Prometheus metrics of the daemon, in a registry of its own, served on a loopback address."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from slurm_plugin.actions import ActionKind


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.pass_latency = Histogram(
            "hpc_elastic_sched_pass_seconds",
            "Duration of one scheduling pass",
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.jobs = Gauge(
            "hpc_elastic_sched_jobs", "Managed jobs by MLFQ queue and state", ["queue", "state"], registry=self.registry
        )
        self.preemptions = Counter("hpc_elastic_sched_preemptions", "Preemptions applied", registry=self.registry)
        self.resizes = Counter("hpc_elastic_sched_resizes", "Resizes applied", registry=self.registry)
        self.actions = Counter(
            "hpc_elastic_sched_actions", "Actions by kind and result", ["kind", "result"], registry=self.registry
        )
        self.errors = Counter(
            "hpc_elastic_sched_errors", "Errors by where they happened", ["where"], registry=self.registry
        )
        self.early_passes = Counter(
            "hpc_elastic_sched_early_passes",
            "Passes started early because managed jobs arrived, started or ended",
            registry=self.registry,
        )
        self.last_pass = Gauge(
            "hpc_elastic_sched_last_pass_timestamp_seconds", "End of the last complete pass", registry=self.registry
        )
        for kind in ActionKind:
            for result in ("ok", "failed", "dry-run"):  # every kind, also those not seen yet
                self.actions.labels(kind.value, result)

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)

    def set_jobs(self, counts: Iterable[tuple[int, str, int]]) -> None:
        self.jobs.clear()
        for queue, state, count in counts:
            self.jobs.labels(str(queue), state).set(count)
