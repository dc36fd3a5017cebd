"""Priority discretisation: K logical queues (Tiresias §3.2.3, Figures 8-9, Pseudocode 1 lines 5-8).

Queue Q_i holds the jobs whose attained service a_J = W_J x t_J lies in [Q_i^lo, Q_i^hi) with Q_1^lo = 0,
Q_K^hi = ∞ and Q_{i+1}^lo = Q_i^hi. A job enters Q_1, is demoted when a_J crosses its queue's upper threshold
(Activity), and is promoted back to Q_1 when it has been WAITING so long that δ_J >= PROMOTEKNOB x t_J
(Starvation); promotion resets t_J and δ_J (hence a_J) so that the job is not demoted again at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hpc_elastic.policy.types import BoolArray, FloatArray, IntArray, JobTable

#: Tolerance (GPU-seconds / seconds) for threshold crossings computed from floating-point clocks.
EPS = 1e-6

#: The paper's testbed setting (§5.2): two queues split at 3200 GPU-seconds.
DEFAULT_THRESHOLDS: tuple[float, ...] = (3200.0,)


@dataclass(frozen=True, slots=True)
class MlfqConfig:
    """Queue thresholds in GPU-seconds (K = len + 1 queues) and PROMOTEKNOB (∞ disables promotion)."""

    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    promote_knob: float = math.inf
    _lower: FloatArray = field(init=False, repr=False, compare=False)  # Q_2^lo .. Q_K^lo
    _upper: FloatArray = field(init=False, repr=False, compare=False)  # Q_1^hi .. Q_K^hi (∞)

    def __post_init__(self) -> None:
        previous = 0.0
        for value in self.thresholds:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > previous):
                raise ValueError(
                    f"queue thresholds must be finite, > 0 and strictly increasing GPU-seconds, got {value!r} "
                    f"in {list(self.thresholds)!r}"
                )
            previous = float(value)
        if not (isinstance(self.promote_knob, (int, float)) and self.promote_knob >= 0):
            raise ValueError(f"PROMOTEKNOB must be >= 0 (inf disables promotion), got {self.promote_knob!r}")
        object.__setattr__(self, "_lower", np.asarray(self.thresholds, dtype=np.float64))
        object.__setattr__(self, "_upper", np.asarray((*self.thresholds, math.inf), dtype=np.float64))

    @property
    def n_queues(self) -> int:
        return len(self.thresholds) + 1

    def level(self, attained: FloatArray) -> IntArray:
        """The queue a job with this attained service belongs to (ignoring promotions)."""
        if len(self.thresholds) == 1:  # (the common two queues: one comparison)
            return (attained >= self.thresholds[0] - EPS).astype(np.int64)
        return np.searchsorted(self._lower, attained + EPS, side="right")

    def upper(self, queue: IntArray) -> FloatArray:
        """Q_i^hi of each queue index (∞ for the last queue); ``queue`` within [0, K - 1]."""
        return self._upper[queue]


def mlfq_update(config: MlfqConfig, jobs: JobTable) -> tuple[IntArray, BoolArray | None]:
    """New queue of every job after demotions (a_J crossed Q_i^hi) and promotions (δ_J >= knob x t_J).

    Returns (new_queue, promoted); promoted is None when PROMOTEKNOB is ∞. Demotion only moves a job down, to the
    queue its a_J belongs to; a job never moves up except by promotion, which only applies to waiting jobs below
    Q_1 and puts them in Q_1.
    """
    last = config.n_queues - 1
    queue = jobs.queue
    if len(queue) and int(queue.max()) > last:  # a queue of a configuration with more queues
        queue = np.minimum(queue, last)
    new_queue = np.maximum(queue, config.level(jobs.attained))
    if math.isinf(config.promote_knob):
        return new_queue, None
    promoted = (~jobs.running) & (new_queue > 0) & (jobs.waiting + EPS >= config.promote_knob * jobs.executed)
    return np.where(promoted, 0, new_queue), promoted


def mlfq_wakeup(
    config: MlfqConfig,
    now: float,
    *,
    jobs: JobTable,
    queue: IntArray,
    attained: FloatArray,
    holding: BoolArray,
    waiting: BoolArray,
    gpus: IntArray | None = None,
    holders_first: bool = False,
) -> float:
    """Earliest future time a demotion or promotion happens (only meaningful while jobs wait); ∞ if none.

    ``holding`` marks the jobs that hold GPUs after the pass, ``waiting`` the jobs still waiting; ``gpus`` the
    GPUs the holders run on after the pass (default: their GPUs now). ``holders_first``: inside a queue the jobs
    holding GPUs rank ahead of the waiting ones (QueueOrder.START); a demotion then changes nothing unless a job
    waits in the queue the holder leaves (the jobs it falls behind are otherwise holders that fitted with it), so
    a holder wakes the scheduler when it leaves the first queue at or below its own in which a job waits.
    """
    if not waiting.any():
        return math.inf
    best = math.inf
    if config.thresholds:
        leaves = queue
        if holders_first:
            waited = np.zeros(config.n_queues, dtype=np.bool_)
            waited[queue[waiting]] = True
            first_waited = list(range(config.n_queues))  # the first queue at or below q with a waiting job
            for q in range(config.n_queues - 2, -1, -1):
                if not waited[q]:
                    first_waited[q] = first_waited[q + 1]
            leaves = np.asarray(first_waited, dtype=np.int64)[queue]
        # crossing time of every holder (∞ for the last queue, whose Q^hi is ∞)
        per = jobs.gpus if gpus is None else np.maximum(gpus, 1)  # (a job that waits has no GPUs after the pass)
        cross = (config.upper(leaves) - attained) / per
        best = now + float(np.min(cross[holding], initial=math.inf))  # (a masked min costs twice this)
    if not math.isinf(config.promote_knob):
        low = waiting & (queue > 0)
        if low.any():
            rows = low.nonzero()[0]
            due = now + np.maximum(config.promote_knob * jobs.executed[rows] - jobs.waiting[rows], 0.0)
            best = min(best, float(np.min(due)))
    return best
