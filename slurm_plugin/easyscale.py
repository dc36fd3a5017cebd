"""What ``tiresias-las+easyscale`` needs of the jobs in the daemon (pure): each elastic job's speed model.

The policy (:class:`~hpc_elastic.policy.hetero.TiresiasLasEasyScale`) reads an elastic job's
:class:`~hpc_elastic.policy.hetero.EstProfile`: its ESTs (the marker's workers, maxP), its capability C_i per GPU
type and the observation of its last scale-out (Role 3). Here:

- C_i: the estimate is the job's profile (§3.4: the companion's per-type capability of the model): the throughput
  that ``hpc-elastic profile`` measured for its model on each GPU type, relative to each other
  (:func:`profiled_rates`, :func:`prior_capability`); a type without a profile, or a job without one, is
  estimated at 1 (the profiled types' mean). The companion's correction (§3.4,
  :func:`~hpc_elastic.policy.easyscale.correct_capability`) then replaces the types the job observed (its
  telemetry, ``apply.capabilities``): the job's own observation wins over the profile. A type it has not run on
  keeps its estimate scaled by the mean ratio observed / estimated of the types it has run on, so that observed
  and estimated values share one unit;
- Role 3: when the daemon grows a job it records the job's throughput then (Eq. 1d of Role 1's top-1 plan with the
  observed C_i on its GPUs) and the GPUs it had (:class:`ScaleOutWatch`); once the grown job reports from its new
  incarnation on more GPUs than before, its throughput there is the "after" of the
  :class:`~hpc_elastic.policy.hetero.ScaleOut` the policy falls back on when it is worse (:func:`observe_grow`).
  A grow observed worse is stamped with the pass that saw it (the fallback's time) and carries how many grows in a
  row before it were worse: the policy's cap on growing again lapses after a hold that doubles with them
  (:meth:`~hpc_elastic.policy.hetero.ScaleOut.capped`). The daemon keeps the record in its state store, the
  functions here only take and return it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.spec import JobMarker
from hpc_elastic.policy.easyscale import correct_capability
from hpc_elastic.policy.hetero import EstProfile, ScaleOut, est_profile
from hpc_elastic.profile.schema import Profile
from hpc_elastic.slurm import Job

Capability = tuple[tuple[str, float], ...]
Gpus = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class ScaleOutWatch:
    """A grow the daemon carried out (Role 3's record, §3.4): the job's throughput before it, on ``previous`` GPUs
    per type, its restart count then (the grown job reports from a later incarnation), and ``after``: its
    throughput on the grown GPUs once it reported from there (None until then) and ``grown``: those GPUs per type.
    ``at``: the pass that first saw ``after`` worse than ``before`` (the fallback's time; None otherwise);
    ``earlier``: the grows in a row before this one observed worse (Role 3's back-off). The daemon keeps it in its
    state store, so that a restarted daemon goes on watching, can still fall back, and holds the cap on that
    configuration as long as it was to last."""

    before: float
    previous: Gpus
    restart_count: int
    after: float | None = None
    at: float | None = None
    earlier: int = 0
    grown: Gpus = ()

    def __post_init__(self) -> None:
        for name, value in (("before", self.before), ("after", self.after)):
            if value is None and name == "after":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"a grow's throughput {name} must be finite and >= 0, got {value!r}")
        if isinstance(self.restart_count, bool) or not isinstance(self.restart_count, int) or self.restart_count < 0:
            raise ValueError(f"a grow's restart count must be an integer >= 0, got {self.restart_count!r}")
        if self.at is not None and (
            isinstance(self.at, bool) or not isinstance(self.at, int | float) or not math.isfinite(self.at)
        ):
            raise ValueError(f"a grow's fallback time must be finite, got {self.at!r}")
        if isinstance(self.earlier, bool) or not isinstance(self.earlier, int) or self.earlier < 0:
            raise ValueError(f"a grow's earlier failures must be an integer >= 0, got {self.earlier!r}")
        for name, gpus in (("previous", self.previous), ("grown", self.grown)):
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for _, n in gpus):
                raise ValueError(f"a grow's {name} GPUs must be positive counts per type, got {gpus!r}")

    @property
    def scale_out(self) -> ScaleOut | None:
        """What the policy's Role 3 reads: before and after, once observed (with the fallback's time and the
        failures in a row before it)."""
        if self.after is None:
            return None
        return ScaleOut(self.before, self.after, self.previous, self.at, self.earlier, self.grown)

    @property
    def failures(self) -> int:
        """Grows in a row observed worse up to this one (this one counts once observed)."""
        seen = self.scale_out
        return seen.failures if seen is not None else self.earlier


def profiled_rates(profiles: Mapping[str, Profile]) -> dict[str, float]:
    """The model's measured throughput on each GPU type (§3.4's C_i before any observation): mini-batches per
    second of one process at the largest batch size measured on every type (one batch size, so that the types
    compare). ``profiles``: the model's profile per type. ``ValueError`` when they share no batch size or a rate
    is not finite and positive."""
    if not profiles:
        return {}
    common = set.intersection(*({p.batch_size for p in profile.points} for profile in profiles.values()))
    if not common:
        raise ValueError(f"the profiles of {sorted(profiles)} share no measured batch size")
    batch = max(common)
    rates: dict[str, float] = {}
    for gpu_type, profile in profiles.items():
        point = profile.point(batch)
        rate = point.batches_per_s if point is not None else math.nan
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"profile {profile.name}: throughput {rate!r} at batch size {batch}")
        rates[gpu_type] = float(rate)
    return rates


def prior_capability(types: tuple[str, ...], rates: Mapping[str, float]) -> dict[str, float]:
    """C_i per type of the cluster from the profiled ``rates``, relative to each other: scaled so that their
    geometric mean is 1; a type without a rate is 1 (the default model, as fast as the profiled types' mean)."""
    if not types:
        raise ValueError("no GPU type to estimate a capability for")
    known = {t: r for t, r in rates.items() if t in types}
    for gpu_type, rate in known.items():
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"profiled throughput of {gpu_type!r} must be finite and positive, got {rate!r}")
    mean = math.exp(sum(math.log(r) for r in known.values()) / len(known)) if known else 1.0
    return {t: known[t] / mean if t in known else 1.0 for t in types}


def estimated_capability(
    types: tuple[str, ...], observed: Mapping[str, float], profiled: Mapping[str, float] | None = None
) -> dict[str, float]:
    """C_i per type of the cluster: the profile's (:func:`prior_capability`; 1 each without one), corrected by the
    observed values (§3.4); a type not observed takes the mean ratio observed / estimated (geometric) of those
    observed, 1 when none was."""
    estimate = prior_capability(types, profiled or {})
    seen = {t: c for t, c in observed.items() if t in estimate}
    if not seen:
        return estimate
    corrected = correct_capability(estimate, seen)
    scale = math.exp(sum(math.log(c / estimate[t]) for t, c in seen.items()) / len(seen))
    return {t: corrected[t] if t in seen else estimate[t] * scale for t in types}


def job_gpus(job: Job) -> Gpus:
    """The GPUs per type a job holds or asks for (sorted; an untyped request is left out)."""
    counts: dict[str, int] = {}
    for gpu_type, count in job.gpus.by_type:
        if gpu_type and count > 0:
            counts[gpu_type] = counts.get(gpu_type, 0) + count
    return tuple(sorted(counts.items()))


def job_profile(
    marker: JobMarker,
    job: Job,
    types: tuple[str, ...],
    observed: Capability,
    scale_out: ScaleOut | None = None,
    *,
    mixed: bool = False,
    profiled: Capability = (),
) -> EstProfile:
    """The speed model of an elastic job: maxP = its workers, C_i from :func:`estimated_capability` (its profile's
    ``profiled`` rates per type, corrected by what it ``observed``), requested on the type it holds (else the
    marker's, else the cluster's first); ``mixed``: its plans may span GPU types (the D2 guard,
    :func:`may_span_types`)."""
    capability = estimated_capability(types, dict(observed), dict(profiled))
    held = [t for t, _ in job_gpus(job) if t in capability]
    base = held[0] if held else (marker.gpu_type if marker.gpu_type in capability else types[0])
    return replace(est_profile(capability, marker.workers, base), scale_out=scale_out, mixed=mixed)


def may_span_types(marker: JobMarker, reports_d2: bool) -> bool:
    """EasyScale §3.3's guard on a plan across GPU types: the job was submitted at D2 (its marker) and its current
    run reports that it trains at D2, which the runtime allows only when the model scanner covers every operator
    of its model (:class:`~hpc_elastic.jobdir.Progress` ``d2``). Anything else keeps one type."""
    return marker.level is DeterminismLevel.D2 and reports_d2


def watch_grow(profile: EstProfile, job: Job, last: ScaleOutWatch | None = None) -> ScaleOutWatch:
    """What to remember when the daemon grows ``job``: its throughput on its GPUs now (Role 3's "before"), and the
    grows in a row observed worse so far (``last``: the job's previous record)."""
    gpus = job_gpus(job)
    earlier = last.failures if last is not None else 0
    return ScaleOutWatch(profile.throughput(dict(gpus)), gpus, job.restart_count, earlier=earlier)


def observe_grow(watch: ScaleOutWatch, profile: EstProfile, job: Job, reported: bool, now: float) -> ScaleOutWatch:
    """Role 3's observation of a grow (§3.4): once the job runs again on more GPUs than before the grow and
    ``reported`` its capability from this incarnation, its throughput there is the "after" (updated while it runs
    so); the pass at ``now`` that first sees it worse is the fallback's time. A later run on no more GPUs than
    before (the fallback itself, a shrink) leaves the observation as it was: it says nothing about the grow."""
    gpus = job_gpus(job)
    if not reported or job.restart_count <= watch.restart_count:
        return watch
    if sum(n for _, n in gpus) <= sum(n for _, n in watch.previous):
        return watch
    seen = replace(watch, after=profile.throughput(dict(gpus)), grown=gpus)
    worse = seen.scale_out is not None and seen.scale_out.worse
    at = (watch.at if watch.at is not None else now) if worse else None
    return replace(seen, at=at)


#: at most this many candidate nodes are searched for a split (the subsets are enumerated)
SPAN_SEARCH_NODES = 16


def node_order_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Slurm's node order for equal weights: the configuration's, which names like node1, node2, node10 follow."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def span_nodes(
    split: Mapping[str, int], free: Sequence[tuple[str, str, int]]
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The nodes that give a pending job exactly ``split`` GPUs per type (a plan of §3.4 Role 1, on several types
    or one) with untyped ``--gpus-per-task=1`` tasks, and the other candidate nodes to exclude; None when no set
    of nodes does.

    ``free``: (node, its GPU type, its free GPUs) of the job's partition, the job's own GPUs counted free. Slurm
    22.05 fills the required nodes in its order, each with all its free GPUs before the next (block distribution,
    measured on the dev cluster), so every chosen node but the last in that order gives all its free GPUs and the
    last at least one. The fewest nodes win, then the earliest in Slurm's order."""
    want = {t: n for t, n in split.items() if n > 0}
    if not want or any(isinstance(n, bool) or not isinstance(n, int) for n in want.values()):
        raise ValueError(f"a split needs positive GPU counts per type, got {dict(split)!r}")
    names = [name for name, _, _ in free]
    if len(set(names)) != len(names):
        raise ValueError(f"a node appears twice in the free GPUs: {sorted({n for n in names if names.count(n) > 1})}")
    usable = sorted(((n, t, f) for n, t, f in free if t in want and f > 0), key=lambda row: node_order_key(row[0]))
    if len(usable) > SPAN_SEARCH_NODES:  # the nodes with the most free GPUs of each type
        usable = sorted(usable, key=lambda row: -row[2])[:SPAN_SEARCH_NODES]
        usable.sort(key=lambda row: node_order_key(row[0]))
    for size in range(1, len(usable) + 1):
        for chosen in itertools.combinations(usable, size):
            got: dict[str, int] = {}
            for _, gpu_type, count in chosen[:-1]:
                got[gpu_type] = got.get(gpu_type, 0) + count
            _, last_type, last_free = chosen[-1]
            rest = want.get(last_type, 0) - got.get(last_type, 0)
            if not 1 <= rest <= last_free:
                continue
            got[last_type] = got.get(last_type, 0) + rest
            if got == want:
                picked = tuple(name for name, _, _ in chosen)
                others = tuple(sorted((n for n in names if n not in picked), key=node_order_key))
                return picked, others
    return None


def split_text(split: Mapping[str, int]) -> str:
    """``a100:2,v100:3``: a split as the daemon's store keeps it (sorted by type)."""
    return ",".join(f"{t}:{n}" for t, n in sorted(split.items()) if n > 0)


_SPLIT = re.compile(r"[A-Za-z0-9_.-]{1,32}:[1-9]\d{0,5}(,[A-Za-z0-9_.-]{1,32}:[1-9]\d{0,5}){0,15}")


def parse_split(text: str) -> dict[str, int]:
    """:func:`split_text` back ({} for ''); ``ValueError`` naming a bad value."""
    if not text:
        return {}
    if not _SPLIT.fullmatch(text):
        raise ValueError(f"bad GPU split {text!r}")
    out: dict[str, int] = {}
    for item in text.split(","):
        gpu_type, count = item.rsplit(":", 1)
        if gpu_type in out:
            raise ValueError(f"GPU type {gpu_type!r} twice in split {text!r}")
        out[gpu_type] = int(count)
    return out
