"""Pure planning for ESTs: EST-to-process placement and gradient buckets.  No I/O, no torch.

EasyScale §3.2: N logical workers (ESTs) keep the *virtual rank* they were given at submit time whatever
process runs them; §3.3 (D1): "assign a constant virtual communication rank to each EST and store the
indices that make up the gradient buckets in the checkpoint".  This module computes both from explicit
inputs, so that the later heterogeneity planner can hand over any EST-to-device map.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_elastic.balance.apportion import apportion
from hpc_elastic.est.detsum import DEFAULT_CHUNK, MAX_ESTS

DEFAULT_BUCKET_ELEMENTS = 1 << 22  # 16 MiB of fp32 per bucket


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


@dataclass(frozen=True)
class Placement:
    """Which process runs which EST: ``owner[v]`` is the process of virtual rank ``v``.

    Each process runs its ESTs in increasing virtual-rank order at every global step.
    """

    owner: tuple[int, ...]
    num_procs: int

    def __post_init__(self) -> None:
        _int("num_procs", self.num_procs, 1)
        n = len(self.owner)
        _int("number of ESTs", n, 1, MAX_ESTS)
        if self.num_procs > n:
            raise ValueError(f"num_procs ({self.num_procs}) must not exceed the number of ESTs ({n})")
        for v, p in enumerate(self.owner):
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_procs:
                raise ValueError(f"EST {v} is placed on process {p!r}, outside [0, {self.num_procs})")
        idle = sorted(set(range(self.num_procs)) - set(self.owner))
        if idle:
            raise ValueError(f"process {idle[0]} has no EST; every process needs at least one")

    @property
    def num_ests(self) -> int:
        return len(self.owner)

    @property
    def max_local_ests(self) -> int:
        """The most ESTs any one process runs."""
        return max(Counter(self.owner).values())

    def local_ests(self, proc: int) -> tuple[int, ...]:
        _int("process", proc, 0, self.num_procs - 1)
        return tuple(v for v, p in enumerate(self.owner) if p == proc)

    def as_map(self) -> dict[int, list[int]]:
        return {p: list(self.local_ests(p)) for p in range(self.num_procs)}

    def counts(self) -> tuple[int, ...]:
        """How many ESTs each process runs."""
        found = Counter(self.owner)
        return tuple(found[p] for p in range(self.num_procs))

    def with_counts(self, counts: Sequence[int]) -> Placement:
        """The placement closest to this one in which process ``p`` runs ``counts[p]`` ESTs: a process that shrinks
        gives up its highest virtual ranks, and the ESTs given up go, in increasing virtual rank, to the processes
        that grow, in process order.  Only the ESTs that must move do."""
        if len(counts) != self.num_procs:
            raise ValueError(f"expected {self.num_procs} EST counts, got {len(counts)}")
        for c in counts:
            _int("EST count", c, 1)
        if sum(counts) != self.num_ests:
            raise ValueError(f"EST counts {list(counts)} add up to {sum(counts)}, the job has {self.num_ests} ESTs")
        owner = list(self.owner)
        freed: list[int] = []
        for p in range(self.num_procs):
            freed.extend(self.local_ests(p)[counts[p] :])
        freed.sort()
        gone = set(freed)
        now = Counter(owner[v] for v in range(self.num_ests) if v not in gone)
        for p in range(self.num_procs):
            for _ in range(counts[p] - now[p]):
                owner[freed.pop(0)] = p
        return Placement(tuple(owner), self.num_procs)

    @classmethod
    def contiguous(cls, num_ests: int, num_procs: int) -> Placement:
        """Balanced contiguous blocks: the first ``num_ests % num_procs`` processes get one EST more."""
        _int("num_ests", num_ests, 1, MAX_ESTS)
        _int("num_procs", num_procs, 1)
        if num_procs > num_ests:
            raise ValueError(f"num_procs ({num_procs}) must not exceed num_ests ({num_ests})")
        base, extra = divmod(num_ests, num_procs)
        owner: list[int] = []
        for p in range(num_procs):
            owner.extend([p] * (base + (1 if p < extra else 0)))
        return cls(tuple(owner), num_procs)

    @classmethod
    def by_capability(cls, num_ests: int, capabilities: Sequence[float]) -> Placement:
        """ESTs per process in proportion to its device's capability C_i (EasyScale §3.4, Eq. 1d: a step waits for
        the process with the most ESTs per unit of capability, so the faster devices take more), in contiguous
        blocks: the largest-remainder apportionment of ``num_ests``, every process at least one EST (taken from the
        process with the most ESTs per unit of capability)."""
        _int("num_ests", num_ests, 1, MAX_ESTS)
        procs = len(capabilities)
        _int("num_procs", procs, 1)
        if procs > num_ests:
            raise ValueError(f"num_procs ({procs}) must not exceed num_ests ({num_ests})")
        for c in capabilities:
            if isinstance(c, bool) or not isinstance(c, int | float) or not (math.isfinite(c) and c > 0):
                raise ValueError(f"capabilities must be finite and > 0, got {c!r}")
        counts = list(apportion(capabilities, num_ests))
        for p in range(procs):
            if counts[p] == 0:
                donor = max(range(procs), key=lambda q: (counts[q] / capabilities[q] if counts[q] > 1 else -1, -q))
                counts[donor] -= 1
                counts[p] = 1
        owner: list[int] = []
        for p, count in enumerate(counts):
            owner.extend([p] * count)
        return cls(tuple(owner), procs)

    @classmethod
    def from_map(cls, mapping: Mapping[int, Sequence[int]]) -> Placement:
        """From an explicit ``{process: [virtual ranks]}`` map (e.g. from a heterogeneity planner)."""
        if not mapping:
            raise ValueError("the EST-to-process map is empty")
        procs = sorted(mapping)
        if procs != list(range(len(procs))):
            raise ValueError(f"process ids must be 0..{len(procs) - 1}, got {procs}")
        seen: dict[int, int] = {}
        for p in procs:
            for v in mapping[p]:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"virtual rank {v!r} on process {p} is not a non-negative integer")
                if v in seen:
                    raise ValueError(f"EST {v} is placed twice (processes {seen[v]} and {p})")
                seen[v] = p
        n = len(seen)
        missing = sorted(set(range(n)) - set(seen))
        if missing:
            raise ValueError(f"virtual ranks must be 0..{n - 1}; EST {missing[0]} is missing")
        return cls(tuple(seen[v] for v in range(n)), len(procs))

    @classmethod
    def parse(cls, text: str, num_ests: int) -> Placement:
        """Parse ``"0,1;2,3"`` (ESTs of process 0; of process 1; ...)."""
        mapping: dict[int, list[int]] = {}
        for p, group in enumerate(text.split(";")):
            try:
                mapping[p] = [int(tok) for tok in group.split(",") if tok.strip()]
            except ValueError:
                raise ValueError(f"bad EST map {text!r}: expected e.g. '0,1;2,3'") from None
        placement = cls.from_map(mapping)
        if placement.num_ests != num_ests:
            raise ValueError(f"EST map {text!r} places {placement.num_ests} ESTs, expected {num_ests}")
        return placement


@dataclass(frozen=True)
class ParamSlot:
    """Where parameter ``index`` lives in its bucket's flat gradient."""

    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[ParamSlot, ...]
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """Gradient buckets fixed by parameter index (paper §3.3, D1), plus the chunk of the exact sum."""

    buckets: tuple[Bucket, ...]
    chunk: int

    def to_json(self) -> dict[str, object]:
        return {
            "chunk": self.chunk,
            "buckets": [[[s.index, s.offset, s.numel] for s in b.slots] for b in self.buckets],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> BucketLayout:
        try:
            chunk = int(data["chunk"])  # type: ignore[call-overload]
            raw = data["buckets"]
            buckets = []
            for b in raw:  # type: ignore[attr-defined]
                slots = tuple(ParamSlot(int(i), int(o), int(n)) for i, o, n in b)
                buckets.append(Bucket(slots, sum(s.numel for s in slots)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed bucket layout: {exc}") from None
        return cls(tuple(buckets), chunk)


def plan_buckets(
    param_numels: Sequence[int], bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, chunk: int = DEFAULT_CHUNK
) -> BucketLayout:
    """Pack parameters, in index order, into buckets of at most ``bucket_elements`` (one larger parameter
    gets a bucket of its own).  The layout depends only on the parameter sizes, never on the order in
    which gradients become ready, so it is the same for every M and every restart."""
    _int("bucket_elements", bucket_elements, 1)
    _int("chunk", chunk, 1)
    buckets: list[Bucket] = []
    slots: list[ParamSlot] = []
    size = 0
    for i, n in enumerate(param_numels):
        _int(f"numel of parameter {i}", n, 0)
        if slots and size + n > bucket_elements:
            buckets.append(Bucket(tuple(slots), size))
            slots, size = [], 0
        slots.append(ParamSlot(i, size, n))
        size += n
    if slots:
        buckets.append(Bucket(tuple(slots), size))
    return BucketLayout(tuple(buckets), chunk)
