"""Tiresias' 2D-LAS on PS jobs in time slots, gang and elastic (Tiresias NSDI'19 §3.2.3; DL² §6.2's setting).

The priority is discretised 2D-LAS: a job's queue is the level of its attained service (GPU-seconds received,
:attr:`~hpc_elastic.policy.slots.SlotJob.service`) in the MLFQ of :mod:`hpc_elastic.policy.mlfq` (the same
queue logic as the event simulator's ``tiresias-las``); inside a queue, earlier arrival first. The default
thresholds are :data:`SLOT_THRESHOLDS`, decades of GPU-seconds around this workload's job sizes (a 147-minute job
on 4 GPUs attains 35,000 GPU-seconds): the event simulator's 3,200 GPU-seconds (the Tiresias testbed's single
threshold) is less than one slot of a 4-GPU job, so every job would be demoted after its first slot and 2D-LAS
would be FIFO among the rest. Promotion (PROMOTEKNOB) stays off, as in the event simulator. Allocations are
recomputed every slot, so a job that falls behind is preempted at a slot boundary, as 2D-LAS preempts.

- ``tiresias-las`` (:class:`SlotTiresiasLas`): in priority order, each job gets its full request as a gang
  (all its workers and PS or none), skipped when the gang does not fit.
- ``tiresias-las+elastic`` (:class:`SlotTiresiasLasElastic`): the same gangs first (each job's minimum is its
  request), then the spare resources grow the running jobs in priority order up to their maxima, workers with
  PS in the ratio of the request.
"""

from __future__ import annotations

import math

import numpy as np

from hpc_elastic.policy.drf import next_task
from hpc_elastic.policy.mlfq import MlfqConfig
from hpc_elastic.policy.slots import (
    JobType,
    Packing,
    Servers,
    SlotAction,
    SlotDecision,
    SlotInput,
    SlotJob,
    SlotPolicy,
)

#: MLFQ thresholds for PS jobs in slots, GPU-seconds (module docstring)
SLOT_THRESHOLDS: tuple[float, ...] = (10_000.0, 100_000.0, 1_000_000.0)


def las_order(mlfq: MlfqConfig, inp: SlotInput) -> list[int]:
    """Rows of ``inp.jobs`` in discretised 2D-LAS order: queue of the attained service, then arrival."""
    if not inp.jobs:
        return []
    service = np.array([job.service for job in inp.jobs], dtype=np.float64)
    queue = mlfq.level(service)
    return [int(row) for row in np.lexsort((np.arange(len(inp.jobs)), queue))]


def add_gang(packing: Packing, row: int, workers: int, ps: int) -> bool:
    """Give job ``row`` ``workers``/``ps`` (worker and PS pairs first), all or nothing."""
    mark = packing.mark()
    while (action := next_task(packing.workers(row), packing.ps(row), workers, ps)) is not None:
        if not packing.add(row, action):
            packing.rollback(mark)
            return False
    return True


def gang_fits(servers: Servers, kind: JobType, workers: int, ps: int) -> bool:
    """Whether ``workers``/``ps`` of ``kind`` place as one gang (:func:`add_gang`, the slot policies' placement) on
    these servers when they are empty: whether a gang of that request can ever start there."""
    job = SlotJob(0, 0, 0, 1.0, request_workers=workers, request_ps=ps, max_workers=workers, max_ps=ps)
    return add_gang(Packing(SlotInput(0, 1.0, (kind,), servers, (job,))), 0, workers, ps)


def grow(packing: Packing, row: int, max_workers: int, max_ps: int, ratio: float) -> None:
    """Add workers to a running job up to ``max_workers``, each with the PS that keep ``ps >= ratio x workers``
    (up to ``max_ps``), until the next step does not fit."""
    while packing.workers(row) < max_workers:
        need_ps = packing.ps(row) < min(max_ps, math.ceil((packing.workers(row) + 1) * ratio - 1e-9))
        if not packing.add(row, SlotAction.BOTH if need_ps else SlotAction.WORKER):
            return


class SlotTiresiasLas(SlotPolicy):
    """Discretised 2D-LAS, each job's request as a gang (module docstring)."""

    name = "tiresias-las"
    elastic = False

    def __init__(self, mlfq: MlfqConfig | None = None) -> None:
        self.mlfq = mlfq or MlfqConfig(SLOT_THRESHOLDS)

    def allocate(self, inp: SlotInput) -> SlotDecision:
        packing = Packing(inp)
        order = las_order(self.mlfq, inp)
        running = [row for row in order if add_gang(packing, row, *_request(inp, row))]
        if self.elastic:
            for row in running:
                job = inp.jobs[row]
                grow(packing, row, job.max_workers, job.max_ps, job.request_ps / job.request_workers)
        if packing.possible():
            packing.add(-1, SlotAction.VOID)
        return packing.decision()


class SlotTiresiasLasElastic(SlotTiresiasLas):
    """Discretised 2D-LAS gangs at the request, then spare resources to the running jobs in priority order."""

    name = "tiresias-las+elastic"
    elastic = True


def _request(inp: SlotInput, row: int) -> tuple[int, int]:
    job = inp.jobs[row]
    return job.request_workers, job.request_ps
