"""An Optimus-like slot policy (Peng et al., EuroSys'18 §4-5), DL²'s white-box baseline (DL² §6.2).

Optimus estimates each job's remaining time from its remaining epochs and its fitted speed function f(w, p)
(§3.2-3.3): ``T(w, p) = epochs_left / (f(w, p) / steps_per_epoch)``. Here the policy reads the type's Optimus
coefficients (the fit of a well-profiled type) but never a job's own speed factor, which it cannot know (DL²
§6.4's point: real speeds vary around the model). Allocation (§4.1): every job first gets one worker and one PS,
in arrival order while they fit; then, greedily, the one task (a worker or a PS of any job) with the largest
marginal gain, the drop of that job's remaining time per unit of the dominant resource the task uses
(``max(task GPUs / cluster GPUs, task cores / cluster cores)``), until no task has a positive gain or none fits.
Placement is the cluster's load balancing (:class:`~hpc_elastic.policy.slots.Packing`), not Optimus' own (§5).
"""

from __future__ import annotations

import heapq
import math

from hpc_elastic.policy.slots import Packing, SlotAction, SlotDecision, SlotInput, SlotJob, SlotPolicy


def remaining_seconds(inp: SlotInput, job: SlotJob, workers: int, ps: int) -> float:
    """Optimus' estimate of a job's remaining time at ``workers``/``ps`` (∞ when it would not progress)."""
    speed = inp.job_type(job).epochs_per_second(workers, ps)
    return job.epochs_left / speed if speed > 0 else math.inf


def task_share(inp: SlotInput, job: SlotJob, action: SlotAction) -> float:
    """The dominant share of the cluster that one worker or one PS of ``job`` uses."""
    kind = inp.job_type(job)
    gpus, cpus = (kind.worker_gpus, kind.worker_cpus) if action is SlotAction.WORKER else (0, kind.ps_cpus)
    total_gpus = inp.servers.total_gpus
    return max(gpus / total_gpus if total_gpus else 0.0, cpus / inp.servers.total_cpus)


def marginal_gain(inp: SlotInput, job: SlotJob, workers: int, ps: int, action: SlotAction) -> float:
    """Drop of the remaining time per unit of dominant resource when ``action`` adds one task (Optimus §4.1)."""
    w, p = (workers + 1, ps) if action is SlotAction.WORKER else (workers, ps + 1)
    now = remaining_seconds(inp, job, workers, ps)
    after = remaining_seconds(inp, job, w, p)
    if math.isinf(after):
        return 0.0
    return (now - after) / task_share(inp, job, action)


class OptimusLike(SlotPolicy):
    """Optimus' greedy marginal-gain allocation on the type's speed model (module docstring)."""

    name = "optimus"

    def allocate(self, inp: SlotInput) -> SlotDecision:
        packing = Packing(inp)
        running = [row for row in range(len(inp.jobs)) if packing.add(row, SlotAction.BOTH)]
        # max-heap of (−gain, row, action); a job's entries are refreshed when it gets a task (version check)
        version = [0] * len(inp.jobs)
        heap: list[tuple[float, int, int, SlotAction]] = []

        def push(row: int) -> None:
            job = inp.jobs[row]
            w, p = packing.workers(row), packing.ps(row)
            for action in (SlotAction.WORKER, SlotAction.PS):
                gain = marginal_gain(inp, job, w, p, action)
                if gain > 0:
                    heapq.heappush(heap, (-gain, row, version[row], action))

        for row in running:
            push(row)
        while heap:
            _, row, seen, action = heapq.heappop(heap)
            if seen != version[row]:
                continue
            if not packing.add(row, action):
                continue  # it fits nowhere (nor will it: the slot only fills up) or the job is at its maximum
            version[row] += 1
            push(row)
        if packing.possible():
            packing.add(-1, SlotAction.VOID)
        return packing.decision()
