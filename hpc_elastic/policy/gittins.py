"""The 2D-Gittins index (Tiresias §3.2.2, Pseudocode 1 lines 9-12, and §3.2.3 for its discretisation).

For a job that has attained a GPU-seconds of service and a service quantum Δ,

    G(a, Δ) = P(S - a <= Δ | S > a) / E[min(S - a, Δ) | S > a]

where S is the job size (GPU-seconds) drawn from the empirical distribution of completed jobs. Note the
*remaining* service S - a in both terms (a public re-implementation compares S itself to Δ, which is wrong).

Discretised 2D-Gittins (§3.2.3) fixes Δ for a job in queue Q_i to the queue's upper threshold Q_i^hi; in the
last queue the paper sets Δ = ∞ and falls back to FIFO, which makes 2D-Gittins 2D-LAS whenever the higher queues
are not overloaded; like the public Tiresias simulator we keep the last finite quantum there
(:class:`~hpc_elastic.policy.policies.DeltaMode`).

:class:`ReferenceIndex` is the public simulator's own approximation of the index, for its reference model:
G evaluated just below the next sample size, with E[min(S, Δ)] over the sizes S (not the remaining service).

For an empirical distribution with sorted samples s_1..s_m, G(a, Δ) is piecewise: the sets {s > a} and
{s <= a + Δ} only change when a crosses a sample s_j or a sample minus Δ. :class:`GittinsTable` precomputes,
for a fixed Δ, the breakpoints and the per-piece counts and sums, so that an index lookup is a binary search
and three multiplications, exact (no grid rounding), and vectorised over all jobs of a pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hpc_elastic.policy.types import FloatArray, IntArray


@dataclass(frozen=True, eq=False)
class ServiceDistribution:
    """Empirical distribution of job sizes S (GPU-seconds): sorted, finite, > 0."""

    samples: FloatArray

    @classmethod
    def from_samples(cls, samples: Iterable[float]) -> ServiceDistribution:
        values = np.sort(np.asarray(list(samples), dtype=np.float64))
        if values.size and (not np.all(np.isfinite(values)) or values[0] <= 0):
            bad = values[~np.isfinite(values) | (values <= 0)][0]
            raise ValueError(f"job sizes must be finite and > 0 GPU-seconds, got {float(bad)!r}")
        values.setflags(write=False)
        return cls(samples=values)

    def __len__(self) -> int:
        return int(self.samples.size)


@dataclass(frozen=True, eq=False)
class GittinsTable:
    """G(a, Δ) for one fixed finite Δ, precomputed on the breakpoints of the empirical distribution."""

    delta: float
    breakpoints: FloatArray
    within: FloatArray  # c_k: number of samples with a < s <= a + Δ on piece k
    within_sum: FloatArray  # Σ s over those samples
    beyond: FloatArray  # number of samples with s > a + Δ
    fixed: FloatArray = field(init=False, repr=False)  # within_sum + Δ beyond: G = c / (fixed - a c)
    first: float = field(init=False, repr=False)  # G(0, Δ): the index of every job that has not run
    # c and ``fixed`` at ``breakpoints.searchsorted(a, side="right")``: piece k at k + 1, and the first piece also
    # at 0 (a < 0: a job promoted while it ran), so a lookup is one search and two gathers
    _within_at: FloatArray = field(init=False, repr=False)
    _fixed_at: FloatArray = field(init=False, repr=False)
    # The breakpoints' bits read as integers (None if one is negative): for floats >= 0 they order as the floats,
    # and a search over integers costs less than one over floats (which must place NaN).
    _bits: IntArray | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fixed = self.within_sum + self.delta * self.beyond
        object.__setattr__(self, "fixed", fixed)
        nonnegative = not (self.breakpoints < 0.0).any()
        object.__setattr__(self, "_bits", (self.breakpoints + 0.0).view(np.int64) if nonnegative else None)
        object.__setattr__(self, "_within_at", np.concatenate((self.within[:1], self.within)))
        object.__setattr__(self, "_fixed_at", np.concatenate((fixed[:1], fixed)))
        c, denom = float(self.within[0]), float(fixed[0])
        object.__setattr__(self, "first", c / denom if c > 0 and denom > 0 else 0.0)

    @classmethod
    def build(cls, dist: ServiceDistribution, delta: float) -> GittinsTable:
        if not (math.isfinite(delta) and delta > 0):
            raise ValueError(f"the Gittins service quantum Δ must be finite and > 0, got {delta!r}")
        s = dist.samples
        if s.size == 0:
            empty = np.zeros(1, dtype=np.float64)
            return cls(delta, np.zeros(1), empty, empty, empty)
        points = np.concatenate(([0.0], s, s - delta))
        bp = np.unique(points[points >= 0.0])
        # Evaluate the piece constants strictly inside each piece [bp_k, bp_k+1): no ties with samples there,
        # and the constants equal the value at the left end (both sets are right-continuous in a).
        upper = np.append(bp[1:], bp[-1] + 2.0 * delta + 1.0)
        mid = (bp + upper) / 2.0
        prefix = np.concatenate(([0.0], np.cumsum(s)))
        n_le_a = np.searchsorted(s, mid, side="right")
        n_le_ad = np.searchsorted(s, mid + delta, side="right")
        within = (n_le_ad - n_le_a).astype(np.float64)
        within_sum = prefix[n_le_ad] - prefix[n_le_a]
        beyond = (s.size - n_le_ad).astype(np.float64)
        return cls(delta, bp, within, within_sum, beyond)

    def index(self, attained: FloatArray) -> FloatArray:
        """G(a, Δ) for every a in ``attained`` (0 where no sample is larger than a: the job outlived history)."""
        # A pass's waiting jobs are mostly jobs that never ran (a = 0): they all get G(0, Δ), and only the others
        # are looked up (a <= 0 is on the first piece; the breakpoints are many). When most jobs ran (a busy
        # cluster's passes hold mostly running jobs), every job is looked up: a = 0 gives G(0, Δ) there too.
        ran = attained != 0.0
        n_ran = int(np.count_nonzero(ran))
        if 2 * n_ran > attained.size:
            return self._lookup(attained)
        out = np.full(attained.shape, self.first, dtype=np.float64)
        if n_ran:
            rows = ran.nonzero()[0]
            out[rows] = self._lookup(attained[rows])
        return out

    def _lookup(self, attained: FloatArray) -> FloatArray:
        """G(a, Δ) = c / (fixed - a c) on a's piece; 0 where that is not positive (c = 0: no sample left within
        Δ, which gives 0 either way since fixed - a c = fixed >= 0 there)."""
        if self._bits is not None and attained.dtype == np.float64:
            # The same piece: a >= 0 orders as its bits; a < 0 (and -0.0) has negative bits and falls before every
            # breakpoint, at 0, which holds the first piece as 1 does (where a float search puts -0.0). (A NaN a
            # gives a NaN denominator, hence 0, whatever its piece.)
            k = self._bits.searchsorted(attained.view(np.int64), side="right")
        else:
            k = self.breakpoints.searchsorted(attained, side="right")
        c = self._within_at.take(k)
        denom = self._fixed_at.take(k) - attained * c
        return np.divide(c, denom, out=np.zeros(attained.shape, dtype=np.float64), where=denom > 0.0)


@dataclass(frozen=True, eq=False)
class ReferenceIndex:
    """The index of the public Tiresias simulator (SymbioticLab/Tiresias, ``run_sim.py``: ``cal_r_gittins_index``
    and ``get_gittins_index``), to reproduce its decisions: for a job with attained service a, take the first
    sample s_i > a and evaluate, at x = s_i - 1, P = #(x < s <= x + Δ) / #(s > x) and E = (Σ s over those +
    Δ #(s > x + Δ)) / #(s > x) in whole units; the index is 10^6 P / E rounded as it rounds (P to 5, E to an
    integer, the index to 4 decimals); 0 from the largest sample on. (It counts the last sample beyond x + Δ
    once x + Δ reaches it.)"""

    values: FloatArray  # index of a job whose next sample is s_i
    samples: FloatArray

    @classmethod
    def build(cls, dist: ServiceDistribution, delta: float) -> ReferenceIndex:
        s = np.floor(dist.samples)
        m = s.size
        values = np.zeros(m, dtype=np.float64)
        prefix = np.concatenate(([0.0], np.cumsum(s)))
        for i, x in enumerate((s - 1.0).tolist()):
            if m == 0 or x > s[-1] - 1:
                continue
            lo = int(np.searchsorted(s, x, side="right"))
            hi = m - 1 if x + delta > s[-1] - 1 else int(np.searchsorted(s, x + delta, side="right"))
            p = round((hi - lo) / (m - lo), 5)
            e = float((prefix[hi] - prefix[lo] + delta * (m - hi)) // (m - lo))
            values[i] = round(p * 1e6 / e, 4) if e > 0 else 0.0
        return cls(values, s)

    def index(self, attained: FloatArray) -> FloatArray:
        """The index of every job (0 once it reached the largest sample)."""
        a = np.floor(attained)
        nxt = self.samples.searchsorted(a, side="right")
        out = np.zeros(a.shape, dtype=np.float64)
        alive = nxt < self.samples.size
        out[alive] = self.values[nxt[alive]]
        return out


def gittins_index(dist: ServiceDistribution, attained: float, delta: float) -> float:
    """G(a, Δ) straight from the definition (Pseudocode 1 line 11 with a fixed Δ); O(m). Δ may be ∞."""
    s = dist.samples
    alive = s[s > attained]
    if alive.size == 0:
        return 0.0
    rest = alive - attained
    prob = float(np.count_nonzero(rest <= delta)) / alive.size
    mean = float(np.minimum(rest, delta).mean())
    return prob / mean if mean > 0 else 0.0


def gittins_index_sup(dist: ServiceDistribution, attained: FloatArray) -> FloatArray:
    """sup over Δ > 0 of G(a, Δ) (continuous 2D-Gittins, Pseudocode 1 line 11), per job; O(n x m).

    For fixed a the numerator only steps up at Δ = s_j - a while the denominator grows in between, so the
    supremum is attained at one of those support points. Meant for small histories (the Figure 7 example);
    the discretised policy uses :class:`GittinsTable`.
    """
    s = dist.samples
    out = np.zeros(attained.shape, dtype=np.float64)
    for i, a in enumerate(attained.tolist()):
        rest = s[s > a] - a
        if rest.size == 0:
            continue
        deltas = np.unique(rest)
        # counts of rest <= Δ and Σ min(rest, Δ) for every candidate Δ, via the sorted residuals.
        rest_sorted = np.sort(rest)
        prefix = np.concatenate(([0.0], np.cumsum(rest_sorted)))
        n_le = np.searchsorted(rest_sorted, deltas, side="right")
        sums = prefix[n_le] + deltas * (rest.size - n_le)
        out[i] = float(np.max(n_le / sums))
    return out
