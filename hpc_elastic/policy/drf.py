"""Dominant Resource Fairness on PS jobs in time slots: DL²'s baseline and supervised teacher (DL² §6.2).

DRF (Ghodsi et al., NSDI'11, §4 and Algorithm 1) as YARN and Mesos run it: progressive filling, one task at a
time, always to the job with the lowest dominant share (its largest share of the cluster's GPUs or cores) whose
next task fits; ties go to the earlier arrival. A job's tasks are what its user requested (``request_workers``
workers and ``request_ps`` PS; DRF is not elastic and never gives more): a worker and a PS together while both
are below the request (DL²'s ``BOTH`` action), then the missing kind alone. A job whose next task fits nowhere
gets nothing more this slot (the resources only shrink as the slot fills).

Static, as DL² describes its baselines (§1, §2.2: they "allocate resources according to user specification and
do not adjust resource allocation during training"), and as YARN and Mesos run DRF without preemption: a task
once granted is held until the job ends. Every slot the running jobs are granted first, in arrival order, what
they held in the previous slot (pairs, then the rest: in DL²'s action space the same allocation is rebuilt anew
each slot, §4.1); then progressive filling gives the free resources towards the requests.

Filling stops when every job has its request or nothing fits; the decision's action sequence ends with ``VOID`` when
some action would still have fit (DRF chose to stop), so :attr:`SlotDecision.actions` is DRF's decision in DL²'s
action space (§4.1), the labels of its supervised bootstrap (§4.2).
"""

from __future__ import annotations

import heapq

from hpc_elastic.policy.slots import Packing, SlotAction, SlotDecision, SlotInput, SlotPolicy


def next_task(workers: int, ps: int, request_workers: int, request_ps: int) -> SlotAction | None:
    """The next task DRF offers a job with ``workers``/``ps`` towards its request; None when it has it all."""
    if workers < request_workers and ps < request_ps:
        return SlotAction.BOTH
    if workers < request_workers:
        return SlotAction.WORKER
    if ps < request_ps:
        return SlotAction.PS
    return None


def _keep(packing: Packing, row: int, workers: int, ps: int) -> None:
    """Grant job ``row`` again the ``workers`` and ``ps`` it held (pairs first); a task that no longer fits the
    servers as this slot's placement left them is not granted (the job then competes for it as for any task)."""
    for action in (
        (SlotAction.BOTH,) * min(workers, ps)
        + (SlotAction.WORKER,) * max(workers - ps, 0)
        + (SlotAction.PS,) * max(ps - workers, 0)
    ):
        packing.add(row, action)


class Drf(SlotPolicy):
    """DRF progressive filling of every job's request (module docstring)."""

    name = "drf"

    def allocate(self, inp: SlotInput) -> SlotDecision:
        packing = Packing(inp)
        for row, job in enumerate(inp.jobs):
            _keep(packing, row, job.workers, job.ps)
        # (dominant share, row): the row is the arrival order, so equal shares go to the earlier arrival
        heap = [
            (inp.dominant_share(job, packing.workers(row), packing.ps(row)), row) for row, job in enumerate(inp.jobs)
        ]
        heapq.heapify(heap)
        while heap:
            _, row = heapq.heappop(heap)
            job = inp.jobs[row]
            action = next_task(packing.workers(row), packing.ps(row), job.request_workers, job.request_ps)
            if action is None or not packing.add(row, action):
                continue  # has its request, or its next task fits nowhere: out of this slot's filling
            w, p = packing.workers(row), packing.ps(row)
            if next_task(w, p, job.request_workers, job.request_ps) is not None:
                heapq.heappush(heap, (inp.dominant_share(job, w, p), row))
        if packing.possible():
            packing.add(-1, SlotAction.VOID)
        return packing.decision()
