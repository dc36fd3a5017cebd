"""Placement: which GPUs a starting job gets (Tiresias §3.3, Pseudocode 1 lines 20-22), and PACKLIMIT.

Tiresias consolidates a job on as few nodes as possible when its skew S_J (largest-tensor share / parameter-server
load skew, from its profile) exceeds PACKLIMIT, and otherwise places it to minimise fragmentation (§3.3.2). We
read "minimise fragmentation" as: one node when the job fits on one (best fit: the fullest node that still fits),
otherwise fill the most-used nodes first so that whole nodes stay free for the jobs that need consolidation.
A consolidated job that needs several nodes goes under one network switch when one can hold it.

PACKLIMIT itself is refitted from history "with a simple linear classifier ... using a job's placement and
corresponding performance as features" (§3.3.2, "Determining PACKLIMIT"): :func:`fit_pack_limit`.

:class:`FreeIndex` keeps the free GPUs of each pool bucketed by count, so a placement costs O(GPUs per node)
plus the nodes it touches, not O(nodes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hpc_elastic.policy.types import ClusterState, PlacementMode

DEFAULT_PACK_LIMIT = 0.5
"""Skew above which a job is consolidated. The paper gives no number; Table 6 separates the VGG family and
AlexNet (largest tensor >= ~60% of the model) from the other models (<= ~20%), and 0.5 sits between."""


_NO_FIT = np.iinfo(np.int64).max

#: Single-node fits a :class:`FreeIndex` scans with numpy before it builds its sets of nodes per free count and
#: looks there (a pass that places many jobs, e.g. a time-slicing rotation, pays the sets once and then a short
#: Python loop per job; a pass that places a few pays a few scans).
_SCANNED_FITS = 4


class FreeIndex:
    """Free GPUs per node of one pass (mutable). Construction costs a few vectorised operations.

    A single-node best fit is a vectorised scan (ties: lowest node row), or, after :data:`_SCANNED_FITS` scans, the
    lowest row of the first non-empty set of nodes with a free count at or above the job's GPUs (the same node).
    Jobs that need several nodes use free-GPU buckets per pool (nodes bucketed by free count, in row order), built
    on first need, so a placement then costs O(GPUs per node) plus the nodes it touches. (The buckets' order is
    part of the placement: it must not depend on when single-node fits built the sets, hence two structures.)
    """

    __slots__ = ("_buckets", "_cluster", "_fits", "_free", "_pool_free", "_scans", "_switched")

    def __init__(self, cluster: ClusterState, extra_free: dict[int, int] | None = None) -> None:
        self._cluster = cluster
        free = cluster.free.copy()
        if extra_free:
            nodes_x = np.fromiter(extra_free.keys(), dtype=np.int64, count=len(extra_free))
            counts_x = np.fromiter(extra_free.values(), dtype=np.int64, count=len(extra_free))
            free[nodes_x] += counts_x  # (the nodes of a dict are distinct)
        self._free = free
        if cluster.n_pools == 1:
            self._pool_free: list[int] = [int(free.sum())]
        else:
            self._pool_free = np.bincount(cluster.pool, weights=free, minlength=cluster.n_pools).astype(int).tolist()
        self._buckets: list[list[dict[int, None]]] | None = None
        self._switched: bool | None = None
        self._fits: list[list[set[int]]] | None = None
        self._scans = 0

    def _fit_sets(self) -> list[list[set[int]]]:
        """Per pool and free count, the nodes with that many free GPUs (> 0), for single-node best fits."""
        if self._fits is None:
            cluster = self._cluster
            max_size = int(cluster.total.max()) if cluster.total.size else 0
            fits: list[list[set[int]]] = [[set() for _ in range(max_size + 1)] for _ in range(cluster.n_pools)]
            rows = (self._free > 0).nonzero()[0]
            for node, k, p in zip(rows.tolist(), self._free[rows].tolist(), cluster.pool[rows].tolist(), strict=True):
                fits[p][k].add(node)
            self._fits = fits
        return self._fits

    def _bucketed(self) -> list[list[dict[int, None]]]:
        if self._buckets is None:
            cluster = self._cluster
            max_size = int(cluster.total.max()) if cluster.total.size else 0
            buckets: list[list[dict[int, None]]] = [[{} for _ in range(max_size + 1)] for _ in range(cluster.n_pools)]
            rows = (self._free > 0).nonzero()[0]
            for node, k, p in zip(rows.tolist(), self._free[rows].tolist(), cluster.pool[rows].tolist(), strict=True):
                buckets[p][k][node] = None
            self._buckets = buckets
        return self._buckets

    @property
    def free(self) -> list[int]:
        """Free GPUs of every node (row order of the cluster)."""
        out: list[int] = self._free.tolist()
        return out

    def free_of(self, node: int) -> int:
        return int(self._free[node])

    def pool_free(self, pool: int) -> int:
        return self._pool_free[pool]

    def _move(self, node: int, new: int, old: int) -> None:
        pool = int(self._cluster.pool[node]) if len(self._pool_free) > 1 else 0
        self._free[node] = new
        self._pool_free[pool] += new - old
        if self._buckets is not None:
            buckets = self._buckets[pool]
            if old > 0:
                del buckets[old][node]
            if new > 0:
                buckets[new][node] = None
        if self._fits is not None:
            fits = self._fits[pool]
            if old > 0:
                fits[old].discard(node)
            if new > 0:
                fits[new].add(node)

    def take(self, allocation: Iterable[tuple[int, int]]) -> None:
        for node, count in allocation:
            have = int(self._free[node])
            if count > have:
                raise ValueError(f"node row {node} has {have} free GPUs, cannot take {count}")
            self._move(node, have - count, have)

    def release(self, allocation: Iterable[tuple[int, int]]) -> None:
        for node, count in allocation:
            have = int(self._free[node])
            self._move(node, have + count, have)

    def _best_fit(self, pool: int, gpus: int) -> int | None:
        """The node of ``pool`` with the fewest free GPUs that still holds ``gpus`` (lowest row on ties)."""
        if gpus > 0:  # (every node with a free GPU is in a set)
            if self._fits is None:
                self._scans += 1
                if self._scans > _SCANNED_FITS:
                    self._fit_sets()
            if self._fits is not None:
                sets = self._fits[pool]
                for k in range(gpus, len(sets)):
                    nodes = sets[k]
                    if nodes:
                        return min(nodes)
                return None
        free = self._free
        if free.size == 0:
            return None
        if self._cluster.n_pools == 1:
            # the first minimum of free - gpus >= 0: read as unsigned, a node too small (free - gpus < 0) counts
            # above every node that fits
            node = int((free - gpus).view(np.uint64).argmin())
            return node if free[node] >= gpus else None
        ok = (free >= gpus) & (self._cluster.pool == pool)
        # the first minimum of the free counts where the job fits (the others masked above any count)
        node = int(np.where(ok, free, _NO_FIT).argmin())
        return node if ok[node] else None

    def _switch(self, node: int) -> int:
        return int(self._cluster.switch[node])

    def _has_switches(self) -> bool:
        if self._switched is None:
            switch = self._cluster.switch
            self._switched = bool(switch.size) and int(switch.max()) != int(switch.min())
        return self._switched

    def _several(self, pool: int, gpus: int, consolidate: bool) -> list[tuple[int, int]] | None:
        """GPUs on several nodes (no single node holds ``gpus``)."""
        buckets = self._bucketed()[pool]
        chosen: list[tuple[int, int]] = []
        need = gpus
        if consolidate:
            # Fewest nodes, within one switch when one can hold the job (§3.3: avoid the network).
            nodes = [(node, k) for k in range(len(buckets) - 1, 0, -1) for node in buckets[k]]
            best: list[tuple[int, int]] | None = None
            switches = {self._switch(node) for node, _ in nodes} if self._has_switches() else set()
            if len(switches) > 1:
                for sw in sorted(switches):
                    option = _fewest([(node, k) for node, k in nodes if self._switch(node) == sw], gpus)
                    if option is not None and (best is None or len(option) < len(best)):
                        best = option
            return best if best is not None else _fewest(nodes, gpus)
        # Least fragmentation: fill the nodes with the fewest free GPUs first (whole nodes stay free).
        for k in range(1, len(buckets)):
            for node in buckets[k]:
                take = min(k, need)
                chosen.append((node, take))
                need -= take
                if need == 0:
                    return chosen
        return None

    def place(
        self, pool: int, gpus: int, mode: PlacementMode, skew: float, pack_limit: float
    ) -> list[tuple[int, int]] | None:
        """Choose ``gpus`` GPUs in ``pool`` (and take them), or return None if they cannot be placed.

        ``skew`` NaN means unknown, hence not skewed (SKEW_AWARE spreads it).
        """
        if mode is PlacementMode.STRICT:
            chosen = self._strict(pool, gpus)
        else:
            single = self._best_fit(pool, gpus)
            if single is not None:  # (the best single node first, whatever the mode)
                have = self._free.item(single)
                self._move(single, have - gpus, have)
                return [(single, gpus)]
            if mode is PlacementMode.SKEW_AWARE:
                consolidate = not math.isnan(skew) and skew > pack_limit
            else:
                consolidate = mode is not PlacementMode.SPREAD
            chosen = self._several(pool, gpus, consolidate)
        if chosen is None:
            return None
        self.take(chosen)
        return chosen

    def _strict(self, pool: int, gpus: int) -> list[tuple[int, int]] | None:
        """YARN-CS consolidation: at most the fewest nodes an empty pool would need
        (:meth:`ClusterState.fewest_nodes`), the ones with the most free GPUs."""
        if gpus > int(self._cluster.capacity[pool]):
            return None
        want = self._cluster.fewest_nodes(gpus, pool)
        if want == 1:
            single = self._best_fit(pool, gpus)
            return None if single is None else [(single, gpus)]
        buckets = self._bucketed()[pool]
        chosen: list[tuple[int, int]] = []
        need = gpus
        for k in range(len(buckets) - 1, 0, -1):
            for node in buckets[k]:
                take = min(k, need)
                chosen.append((node, take))
                need -= take
                if need == 0:
                    return chosen
                if len(chosen) == want:
                    return None
        return None


def _fewest(nodes: list[tuple[int, int]], gpus: int) -> list[tuple[int, int]] | None:
    """Fewest nodes holding ``gpus`` GPUs, from (node, free) sorted by free GPUs, most first: take the fullest
    nodes until the rest fits on one node, then best-fit that rest."""
    chosen: list[tuple[int, int]] = []
    need = gpus
    i = 0
    while need > 0 and i < len(nodes):
        fits = [j for j in range(i, len(nodes)) if nodes[j][1] >= need]
        if fits:
            node, _ = nodes[fits[-1]]  # the smallest node that still holds the rest
            chosen.append((node, need))
            return chosen
        node, free = nodes[i]
        chosen.append((node, free))
        need -= free
        i += 1
    return None


@dataclass(frozen=True, slots=True)
class PlacementSample:
    """One observation for refitting PACKLIMIT: a job of ``model`` with ``skew`` ran at ``speed`` (iterations
    per second, any consistent unit) when placed on one node (``consolidated``) or on several."""

    model: str
    skew: float
    consolidated: bool
    speed: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.skew) and math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"placement sample of {self.model!r}: skew and speed must be finite, speed > 0")


def fit_pack_limit(
    samples: Sequence[PlacementSample], *, tolerance: float = 1.1, current: float = DEFAULT_PACK_LIMIT
) -> float:
    """Refit PACKLIMIT from (placement, speed) pairs with a one-feature linear classifier (§3.3.2).

    For every model observed both consolidated and spread, the label is "sensitive" when the mean consolidated
    speed is at least ``tolerance`` times the mean spread speed; the feature is its mean skew. The classifier
    is the threshold on skew (w·x + b = 0 in one dimension) with the fewest misclassified models, ties broken by
    the widest margin; PACKLIMIT is that threshold. With only one class observed there is nothing to separate
    and ``current`` is returned.
    """
    if not tolerance >= 1.0:
        raise ValueError(f"tolerance must be >= 1, got {tolerance!r}")
    by_model: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for sample in samples:
        skews, packed, spread = by_model.setdefault(sample.model, ([], [], []))
        skews.append(sample.skew)
        (packed if sample.consolidated else spread).append(sample.speed)
    points: list[tuple[float, bool]] = []
    for skews, packed, spread in by_model.values():
        if packed and spread:
            ratio = (sum(packed) / len(packed)) / (sum(spread) / len(spread))
            points.append((sum(skews) / len(skews), ratio >= tolerance))
    if not points or all(label for _, label in points) or not any(label for _, label in points):
        return current
    points.sort()
    xs = [x for x, _ in points]
    best: tuple[int, float, float] | None = None
    # Candidate thresholds: between consecutive distinct skews (and below/above all of them).
    candidates = [xs[0] - 1.0] + [(a + b) / 2 for a, b in itertools.pairwise(xs) if b > a] + [xs[-1] + 1.0]
    for thr in candidates:
        errors = sum(1 for x, label in points if (x > thr) != label)
        margin = min(abs(x - thr) for x in xs)
        key = (errors, -margin, thr)
        if best is None or key < best:
            best = key
    if best is None:  # pragma: no cover - candidates is never empty
        return current
    return best[2]
