"""Hypothesis strategies: random but consistent scheduling-pass inputs."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from hpc_elastic.policy import ClusterState, JobStatus, JobTable, JobView, NodeView, PassInput
from hpc_elastic.policy.hetero import est_profile


@st.composite
def pass_inputs(
    draw: st.DrawFn,
    *,
    max_jobs: int = 14,
    types: tuple[str, ...] = ("",),
    max_queue: int = 2,
    elastic: bool = False,
) -> tuple[PassInput, list[JobView], list[NodeView]]:
    """Nodes of ``types`` and jobs on them; with ``elastic``, some jobs run on [min, max] GPUs with an EasyScale
    profile (maxP = their maximum, a capability per type)."""
    n_nodes = draw(st.integers(1, 4))
    totals = [draw(st.integers(1, 8)) for _ in range(n_nodes)]
    node_types = [draw(st.sampled_from(types)) for _ in range(n_nodes)]
    used = [0] * n_nodes
    jobs: list[JobView] = []
    n_jobs = draw(st.integers(0, max_jobs))
    for i in range(n_jobs):
        gpus = draw(st.integers(1, 8))
        submit = float(draw(st.integers(0, 50)))
        queue = draw(st.integers(0, max_queue))
        attained = float(draw(st.integers(0, 12000)))
        executed = float(draw(st.integers(0, 4000)))
        waiting = float(draw(st.integers(0, 4000)))
        started = draw(st.booleans())
        first_start = submit + float(draw(st.integers(0, 20))) if started else None
        skew = draw(st.one_of(st.none(), st.floats(0.0, 1.0)))
        remaining = float(draw(st.integers(1, 1000)))
        allowed = draw(st.one_of(st.none(), st.frozensets(st.sampled_from(types), min_size=1)))
        position = draw(st.one_of(st.none(), st.integers(0, 30).map(float)))
        want_run = started and draw(st.booleans())
        allocation: tuple[tuple[str, int], ...] = ()
        if want_run:
            # place on one node of an allowed type, if room
            for node in range(n_nodes):
                ok_type = allowed is None or node_types[node] in allowed
                if ok_type and totals[node] - used[node] >= gpus:
                    used[node] += gpus
                    allocation = ((f"n{node}", gpus),)
                    break
        status = JobStatus.RUNNING if allocation else JobStatus.PENDING
        bounds: dict[str, object] = {}
        if elastic and draw(st.booleans()):
            low = draw(st.integers(1, gpus))
            top = draw(st.integers(max(gpus, low + 1), 2 * gpus + 1))
            capability = {t: draw(st.sampled_from([0.5, 1.0, 3.0])) for t in types}
            bounds = {"min_gpus": low, "max_gpus": top, "scaling": est_profile(capability, top, types[0])}
        jobs.append(
            JobView(
                job_id=i,
                gpus=gpus,
                submit_time=submit,
                status=status,
                attained_service=attained,
                executed_time=executed,
                waiting_time=0.0 if allocation else waiting,
                current_wait=0.0 if allocation else float(draw(st.integers(0, 4000))),
                run_time=float(draw(st.integers(0, 600))) if allocation else 0.0,
                first_start_time=first_start,
                queue=queue,
                skew=skew,
                gpu_types=allowed,
                allocation=allocation,
                remaining_time=remaining,
                time_limit=remaining * 2,
                queue_position=position,
                **bounds,  # type: ignore[arg-type]
            )
        )
    nodes = [NodeView(f"n{i}", totals[i], totals[i] - used[i], node_types[i]) for i in range(n_nodes)]
    cluster = ClusterState.from_nodes(nodes)
    table = JobTable.from_views(jobs, cluster)
    now = 100.0 + float(draw(st.integers(0, 100)))
    return PassInput(now, table, cluster), jobs, nodes


def level(thresholds: tuple[float, ...], attained: float) -> int:
    return sum(1 for t in thresholds if attained >= t)


INF = math.inf
