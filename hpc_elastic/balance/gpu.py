"""LB-BSP Alg. 2: batch sizes of GPU workers by moving samples from the straggler to the leader (pure).

LB-BSP §3.3.2.  After every iteration k-1 each worker reports its batch processing time t_i^{k-1} (the iteration
minus its wait at the barrier, §4) and its free device memory; :func:`alg2_step` then

- line 5: picks the *leader*, the fastest worker among those with at least 5 % free memory (and, here, room under
  its memory cap x^o for Δ more samples, §3.3.1(4));
- line 6: picks the *straggler*, the slowest worker;
- lines 8-9: if the straggler's batch is already ≤ Δ, asks for the straggler to be removed (a warning in the
  decision: "restart the training process without that worker", §3.3.2) and changes nothing;
- lines 10-11: if the leader was faster than the straggler in each of the last D iterations, moves Δ samples
  from the straggler to the leader;
- lines 12-13: else, if the leader was ever slower than the straggler (an oscillation: "a former leader now
  identified as a straggler or vice versa"), switches from the fast-approach phase (Δ = 5, D = 5) to the
  fine-tune phase (Δ = 1, D = 20).

Σ x_i = X holds after every step because a move takes from one worker what it gives to another.  The state is
explicit and bounded: the last D_fine iterations' times and, for line 12's "∃ h ∈ {1, ..., k-1}", one flag per
ordered pair of workers saying whether the first was ever slower than the second.  Δ and D are parameters of
:class:`Alg2Config`, so a caller whose unit of work is not one sample (whole ESTs, Δ = 1) uses the same loop.

With a coarse unit one move is a large share of a worker's batch, and a move that merely swaps leader and
straggler would be undone D iterations later, for ever (with Δ = 1 the fine-tune phase only widens the window).
``Alg2Config.predictive`` adds one condition to line 10: the move is made only when it shortens the iteration as
the workers' recent times predict it, that is when both the leader's mean time per unit over the window times its
batch plus Δ and the straggler's mean time per unit times its batch minus Δ stay below the straggler's mean time
now.  Off by default: the paper's rule for samples, where Δ is a small share of a batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from hpc_elastic.balance.apportion import apportion, check_caps
from hpc_elastic.profile.schema import Profile


class Phase(StrEnum):
    """The two phases of Alg. 2 (§3.3.2)."""

    FAST_APPROACH = "fast-approach"
    FINE_TUNE = "fine-tune"


class Outcome(StrEnum):
    """What one step of Alg. 2 did."""

    MOVED = "moved"  # line 11: Δ samples from the straggler to the leader
    SWITCHED = "switched"  # line 13: oscillation seen, now in the fine-tune phase
    DROP = "drop"  # line 9: the straggler's batch is ≤ Δ; remove it
    WAITING = "waiting"  # neither: the leader has not led for D iterations yet (or no oscillation to act on)
    NO_LEADER = "no-leader"  # no worker but the straggler may grow (memory)


@dataclass(frozen=True)
class Alg2Config:
    """Step sizes Δ and observation windows D of the two phases, and the free-memory floor of line 5."""

    fast_step: int = 5
    fast_window: int = 5
    fine_step: int = 1
    fine_window: int = 20
    min_free_memory: float = 0.05
    #: move only when the move is predicted to shorten the iteration (see the module docstring)
    predictive: bool = False

    def __post_init__(self) -> None:
        for name in ("fast_step", "fast_window", "fine_step", "fine_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.min_free_memory < 1:
            raise ValueError(f"min_free_memory must be in [0, 1), got {self.min_free_memory!r}")

    def step(self, phase: Phase) -> int:
        return self.fast_step if phase is Phase.FAST_APPROACH else self.fine_step

    def window(self, phase: Phase) -> int:
        return self.fast_window if phase is Phase.FAST_APPROACH else self.fine_window


@dataclass(frozen=True)
class WorkerReading:
    """What worker i reports after iteration k-1: t_i^{k-1} in seconds and its free device memory fraction now."""

    seconds: float
    free_memory: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"batch processing time must be finite and >= 0, got {self.seconds!r}")
        if not 0 <= self.free_memory <= 1:
            raise ValueError(f"free memory fraction must be in [0, 1], got {self.free_memory!r}")


@dataclass(frozen=True)
class Alg2State:
    """Batch sizes x_i, memory caps x^o_i (None: none known), phase, and the history Alg. 2 needs."""

    sizes: tuple[int, ...]
    caps: tuple[int | None, ...]
    phase: Phase = Phase.FAST_APPROACH
    observed: int = 0  # iterations reported so far (k - 1)
    recent: tuple[tuple[float, ...], ...] = ()  # times of the last ≤ max(D) iterations, oldest first
    ever_slower: tuple[tuple[bool, ...], ...] = ()  # [a][b]: t_a^h > t_b^h for some observed h

    def __post_init__(self) -> None:
        n = len(self.sizes)
        if n == 0:
            raise ValueError("Alg. 2 needs at least one worker")
        for x in self.sizes:
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"batch sizes must be positive integers, got {list(self.sizes)}")
        check_caps(self.caps, n)
        for x, cap in zip(self.sizes, self.caps, strict=True):
            if cap is not None and x > cap:
                raise ValueError(f"batch size {x} is above its memory cap {cap}")
        if any(len(row) != n for row in self.recent):
            raise ValueError(f"every recorded iteration needs {n} times")
        if self.ever_slower and (len(self.ever_slower) != n or any(len(row) != n for row in self.ever_slower)):
            raise ValueError(f"ever_slower must be {n} x {n}")

    @classmethod
    def initial(cls, total: int, caps: Sequence[int | None]) -> Alg2State:
        """Start of Alg. 2: X split as evenly as the caps allow (the BSP batch ẋ = X/n where n divides X)."""
        n = len(caps)
        sizes = apportion([1.0] * n, total, caps)
        if min(sizes) < 1:
            raise ValueError(f"a global batch of {total} leaves a worker of {n} without samples")
        return cls(sizes=sizes, caps=tuple(caps))

    @property
    def total(self) -> int:
        """X = Σ x_i."""
        return sum(self.sizes)

    @property
    def workers(self) -> int:
        return len(self.sizes)

    def slower(self, a: int, b: int) -> bool:
        """Line 12: was worker ``a`` slower than worker ``b`` in some observed iteration?"""
        return bool(self.ever_slower) and self.ever_slower[a][b]

    def without(self, worker: int) -> Alg2State:
        """The state after removing ``worker`` (line 9's "remove this straggler"): its samples go to the others
        in proportion to their batches, under their caps, so X is kept; the history of the others is kept."""
        n = self.workers
        if not 0 <= worker < n or n == 1:
            raise ValueError(f"cannot remove worker {worker} of {n}")
        keep = [i for i in range(n) if i != worker]
        caps = [self.caps[i] for i in keep]
        sizes = apportion([float(self.sizes[i]) for i in keep], self.total, caps)
        return replace(
            self,
            sizes=sizes,
            caps=tuple(caps),
            recent=tuple(tuple(row[i] for i in keep) for row in self.recent),
            ever_slower=tuple(tuple(self.ever_slower[a][b] for b in keep) for a in keep) if self.ever_slower else (),
        )


@dataclass(frozen=True)
class Move:
    """Line 11: ``samples`` from ``giver`` (the straggler) to ``taker`` (the leader)."""

    giver: int
    taker: int
    samples: int


@dataclass(frozen=True)
class Alg2Decision:
    """The batch sizes x^k for the next iteration and why."""

    sizes: tuple[int, ...]
    outcome: Outcome
    phase: Phase
    leader: int | None
    straggler: int
    move: Move | None = None
    drop: int | None = None  # line 9: the worker to remove (the caller restarts without it, see Alg2State.without)
    warning: str | None = None


def memory_cap(profile: Profile | None) -> int | None:
    """x^o of a worker from its device type's profile (§3.3.1(4)); None when no limit was measured.

    A search that stopped at its largest batch (``capped``) only tells that this batch fits: it is the cap used,
    the largest batch known to fit.  A profile in which not even one sample fits is a ValueError.
    """
    if profile is None or profile.memory_limit is None:
        return None
    limit = profile.memory_limit.batch_size
    if limit is None:
        raise ValueError(f"profile {profile.name}: not even one sample fits in memory")
    return limit


def _argmin(values: Sequence[float], candidates: Sequence[int]) -> int | None:
    best: int | None = None
    for i in candidates:
        if best is None or values[i] < values[best]:
            best = i
    return best


def _move_helps(sizes: Sequence[int], last: Sequence[Sequence[float]], leader: int, straggler: int, delta: int) -> bool:
    """Whether moving ``delta`` units from ``straggler`` to ``leader`` shortens the slower of the two, their times
    taken as proportional to their batches (the mean over ``last``, the window's iterations)."""
    t_lead = sum(t[leader] for t in last) / len(last)
    t_strag = sum(t[straggler] for t in last) / len(last)
    lead_after = t_lead * (sizes[leader] + delta) / sizes[leader]
    strag_after = t_strag * (sizes[straggler] - delta) / sizes[straggler]
    return max(lead_after, strag_after) < t_strag


def alg2_step(
    state: Alg2State, readings: Sequence[WorkerReading], config: Alg2Config | None = None
) -> tuple[Alg2State, Alg2Decision]:
    """One call of GPU_UpdateBatchSize(k) (Alg. 2) after iteration k-1; returns the new state and the decision."""
    cfg = config if config is not None else Alg2Config()
    n = state.workers
    if len(readings) != n:
        raise ValueError(f"expected {n} worker readings, got {len(readings)}")
    times = tuple(r.seconds for r in readings)
    slower = [
        [state.slower(a, b) or times[a] > times[b] for b in range(n)] for a in range(n)
    ]  # line 12's history, now including h = k-1
    keep = max(cfg.fast_window, cfg.fine_window)
    new_state = replace(
        state,
        observed=state.observed + 1,
        recent=(*state.recent, times)[-keep:],
        ever_slower=tuple(tuple(row) for row in slower),
    )
    delta = cfg.step(state.phase)
    window = cfg.window(state.phase)
    straggler = max(range(n), key=lambda i: (times[i], -i))  # line 6 (ties: lowest index)
    eligible = [
        i
        for i in range(n)
        if readings[i].free_memory >= cfg.min_free_memory
        and (state.caps[i] is None or state.sizes[i] + delta <= (state.caps[i] or 0))
    ]
    leader = _argmin(times, eligible)  # line 5

    def decide(outcome: Outcome, sizes: tuple[int, ...] = state.sizes, phase: Phase = state.phase) -> Alg2Decision:
        return Alg2Decision(sizes, outcome, phase, leader, straggler)

    if state.sizes[straggler] <= delta and n > 1:  # lines 8-9
        warning = (
            f"worker {straggler} has {state.sizes[straggler]} samples, not more than the step {delta}: "
            "LB-BSP would remove it; restart without it"
        )
        return new_state, replace(decide(Outcome.DROP), drop=straggler, warning=warning)
    if leader is None or leader == straggler:
        return new_state, decide(Outcome.NO_LEADER if leader is None else Outcome.WAITING)
    last = new_state.recent[-window:]
    if (
        len(last) == window
        and all(t[leader] < t[straggler] for t in last)
        and (not cfg.predictive or _move_helps(state.sizes, last, leader, straggler, delta))
    ):  # lines 10-11
        sizes = list(state.sizes)
        sizes[leader] += delta
        sizes[straggler] -= delta
        moved = replace(new_state, sizes=tuple(sizes))
        return moved, replace(decide(Outcome.MOVED, moved.sizes), move=Move(straggler, leader, delta))
    if state.phase is Phase.FAST_APPROACH and slower[leader][straggler]:  # lines 12-13
        switched = replace(new_state, phase=Phase.FINE_TUNE)
        return switched, decide(Outcome.SWITCHED, phase=Phase.FINE_TUNE)
    return new_state, decide(Outcome.WAITING)
