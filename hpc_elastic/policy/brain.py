"""DLRover Brain's automatic resource configuration of parameter-server jobs on CPU partitions (DLRover §4).

Model (§4.1). A PS job has ``N_w`` workers of ``w`` cores and ``N_ps`` parameter servers of ``s`` cores. A worker
uses ``ŵ`` cores to compute its gradients; every worker's push costs the PS ``ŝ`` cores of update work, so the PS
keep up with ``N_w`` workers when ``N_w · ŝ ≤ s_total = N_ps · s`` (Eq. 4). Under a budget of ``C_total`` cores
(Eq. 3) the job's throughput is largest with as many workers as the budget feeds (Eq. 7-9), which gives

- Eq. 10: ``N_w = C_total / (ŵ + ŝ)``,
- Eq. 11: ``s_total = C_total − N_w · ŵ``, cut into PS of ``s`` cores (the paper's ``s = 16`` on its 32-core pods:
  half a node; here half the partition's cores per node).

Stages (§4.2), each a function from observations to a :class:`ResourcePlan`:

- :func:`sample_plan`: one worker with a whole node's cores (``C_max``) and a few PS, to measure ``ŵ`` and ``ŝ``;
- :func:`optimize`: Eq. 10-11 from the sample's :class:`Usage` (:func:`estimate`);
- :func:`adjust`: the running job's problems: an out-of-memory worker or PS gets twice the memory (a PS that
  cannot get more memory on a node is doubled in number, as the paper does); a hot PS is replaced by a larger one,
  ``s = min(ŝ_hot / ŝ_total · ŝ · N_w, C_max)``, at least one core more than it had; idle PS cores get more
  workers, ``ΔN_w = min(s_total / ŝ, √K) − N_w``;
- :func:`fall_back` (ours: §4.2 adjusts from observations but is silent on a plan that measures slower): a plan
  whose measured throughput is below the best observed plan's by more than a tolerance is left for that plan, and
  not tried again (:class:`PlanRecord`).

The paper leaves ``K`` undefined; we read it as the job's total number of steps, the bound ``√K`` on the number of
asynchronous workers under which asynchronous SGD keeps its linear speedup (Lian et al., NeurIPS 2015).

Every plan stays inside the job's ranges (``--workers-range``, ``--ps-range``), inside a node (``C_max`` cores and
the node's memory per process) and inside what the partition can give: the cores the job holds now plus the
partition's free cores. Adjust may go past ``C_total`` (the paper lets such extra workers run at low priority) but
never past the partition.

Pure: frozen dataclasses in, frozen dataclasses out; no clock, command or file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

#: the paper's PS size, s = 16 cores, was half of its 32-core pods (Table 1's sampling worker has C_max = 32)
PS_SHARE_OF_NODE = 0.5
#: a PS whose CPU use reaches this share of its cores is hot (DLRover's ``optimizer.ps.cpu.hot-threshold``)
DEFAULT_HOT_THRESHOLD = 0.8
#: PS the sample stage starts with ("a few parameter servers", §4.2)
DEFAULT_SAMPLE_PS = 2
#: memory a new worker gets over the largest resident set observed (the paper: "from the observation")
MEMORY_MARGIN = 1.25
#: a plan measured more than this share below the best observed plan's samples/s is left for that one
#: (:func:`fall_back`); within it the two are alike (a 10 % goal against the grid's best, windows' noise)
DEFAULT_FALLBACK_TOLERANCE = 0.1


class Stage(StrEnum):
    SAMPLE = "sample"
    OPTIMIZE = "optimize"
    ADJUST = "adjust"
    FALLBACK = "fallback"  # ours: back to the best observed plan (:func:`fall_back`)


class Role(StrEnum):
    WORKER = "worker"
    PS = "ps"


def _count(name: str, value: object, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _amount(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Range:
    """An inclusive ``[low, high]`` count (``--workers-range A:B``, ``--ps-range C:D``)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _count("range low", self.low, 1)
        _count("range high", self.high, 1)
        if self.low > self.high:
            raise ValueError(f"range {self.low}:{self.high} is empty (low > high)")

    @classmethod
    def parse(cls, text: str) -> Range:
        """``"A:B"`` or ``"A"``; ValueError naming the text otherwise."""
        low, sep, high = text.partition(":")
        try:
            return cls(int(low), int(high) if sep else int(low))
        except ValueError as exc:
            if "range" in str(exc) or "must be" in str(exc):
                raise ValueError(f"bad range {text!r}: {exc}") from None
            raise ValueError(f"bad range {text!r}: expected A:B with integers 1 <= A <= B") from None

    def clamp(self, n: int) -> int:
        return min(max(n, self.low), self.high)


@dataclass(frozen=True)
class Partition:
    """The CPU partition: one node's cores (``C_max``) and memory, and the cores free in the partition now."""

    cores_per_node: int
    mem_per_node_mb: int
    free_cores: int

    def __post_init__(self) -> None:
        _count("cores_per_node", self.cores_per_node, 1)
        _count("mem_per_node_mb", self.mem_per_node_mb, 1)
        _count("free_cores", self.free_cores)

    @property
    def ps_cores(self) -> int:
        """``s``: the paper's 16 cores of a 32-core node, scaled to this partition's nodes."""
        return max(1, int(self.cores_per_node * PS_SHARE_OF_NODE))


@dataclass(frozen=True)
class JobLimits:
    """What the job allows: its core budget ``C_total`` (Eq. 3), its ranges, and ``K`` (its total steps; None when
    unknown, then only the range bounds the workers)."""

    c_total: int
    workers: Range
    ps: Range
    total_steps: int | None = None

    def __post_init__(self) -> None:
        _count("c_total (the job's core budget)", self.c_total, 2)
        if self.total_steps is not None:
            _count("total_steps", self.total_steps, 1)
        if self.workers.low + self.ps.low > self.c_total:
            raise ValueError(
                f"c_total {self.c_total} cannot hold the minimum {self.workers.low} workers and {self.ps.low} PS "
                "at one core each"
            )


@dataclass(frozen=True)
class Group:
    """``count`` processes of one role, each with ``cores`` cores and ``mem_mb`` MiB."""

    count: int
    cores: int
    mem_mb: int

    def __post_init__(self) -> None:
        _count("process count", self.count, 1)
        _count("cores per process", self.cores, 1)
        _count("memory per process (MiB)", self.mem_mb, 1)

    @property
    def total_cores(self) -> int:
        return self.count * self.cores


@dataclass(frozen=True)
class StepRequest:
    """Processes of one role and size as a Slurm request: ``srun --ntasks --cpus-per-task --mem-per-cpu`` (a task's
    memory divided over its cores, rounded up, so that ``--mem-per-cpu`` × cores covers it)."""

    role: Role
    ntasks: int
    cpus_per_task: int
    mem_per_cpu_mb: int


@dataclass(frozen=True)
class ResourcePlan:
    """A configuration of the job and why it was chosen: ``workers`` alike (the paper's assumption), and one entry
    of ``ps_cores`` per PS (a hot PS is replaced by a larger one, §4.2 Adjust, so PS may differ), each PS with
    ``ps_mem_mb``."""

    workers: Group
    ps_cores: tuple[int, ...]
    ps_mem_mb: int
    stage: Stage
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.ps_cores:
            raise ValueError("a PS job needs at least one PS")
        for c in self.ps_cores:
            _count("cores per PS", c, 1)
        _count("memory per PS (MiB)", self.ps_mem_mb, 1)

    @property
    def num_ps(self) -> int:
        return len(self.ps_cores)

    @property
    def shape(self) -> tuple[Group, tuple[int, ...], int]:
        """The processes the plan runs, whatever its stage and reasons: its workers, its PS' cores (in order of
        size) and their memory. Two plans of one shape are one configuration of the job."""
        return (self.workers, tuple(sorted(self.ps_cores, reverse=True)), self.ps_mem_mb)

    @property
    def ps_total_cores(self) -> int:
        """``s_total``."""
        return sum(self.ps_cores)

    @property
    def total_cores(self) -> int:
        return self.workers.total_cores + self.ps_total_cores

    def requests(self) -> tuple[StepRequest, ...]:
        """The plan as Slurm step requests: the workers, then the PS grouped by size (largest first)."""
        w = self.workers
        out = [StepRequest(Role.WORKER, w.count, w.cores, -(-w.mem_mb // w.cores))]
        for cores in sorted(set(self.ps_cores), reverse=True):
            out.append(StepRequest(Role.PS, self.ps_cores.count(cores), cores, -(-self.ps_mem_mb // cores)))
        return tuple(out)

    def check(self, partition: Partition, held_cores: int = 0) -> None:
        """ValueError naming what does not fit: a process larger than a node, or more cores than the job holds
        (``held_cores``) plus the partition's free cores."""
        for role, cores, mem in (
            (Role.WORKER, self.workers.cores, self.workers.mem_mb),
            (Role.PS, max(self.ps_cores), self.ps_mem_mb),
        ):
            if cores > partition.cores_per_node:
                raise ValueError(f"a {role.value} of {cores} cores exceeds a node ({partition.cores_per_node} cores)")
            if mem > partition.mem_per_node_mb:
                raise ValueError(f"a {role.value} of {mem} MiB exceeds a node ({partition.mem_per_node_mb} MiB)")
        available = held_cores + partition.free_cores
        if self.total_cores > available:
            raise ValueError(
                f"the plan needs {self.total_cores} cores; the job holds {held_cores} and the partition has "
                f"{partition.free_cores} free"
            )


@dataclass(frozen=True)
class Usage:
    """What a running job's processes use (the job master's readings): per worker and per PS, cores in use (CPU
    seconds per second) and resident memory; whether a worker or a PS died out of memory; the plan it runs."""

    plan: ResourcePlan
    worker_cpu: tuple[float, ...]
    worker_rss_mb: tuple[float, ...]
    ps_cpu: tuple[float, ...]
    worker_oom: bool = False
    ps_oom: bool = False

    def __post_init__(self) -> None:
        for name, values, n in (
            ("worker_cpu", self.worker_cpu, self.plan.workers.count),
            ("worker_rss_mb", self.worker_rss_mb, self.plan.workers.count),
            ("ps_cpu", self.ps_cpu, self.plan.num_ps),
        ):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} readings for {n} processes")
            for v in values:
                _amount(name, v)


@dataclass(frozen=True)
class Estimates:
    """``ŵ`` (cores a worker uses), ``ŝ`` (PS cores one worker's updates use) and a worker's memory need."""

    w_hat: float
    s_hat: float
    worker_mem_mb: int

    def __post_init__(self) -> None:
        if _amount("w_hat", self.w_hat) <= 0:
            raise ValueError(f"w_hat must be > 0, got {self.w_hat!r}")
        if _amount("s_hat", self.s_hat) <= 0:
            raise ValueError(f"s_hat must be > 0, got {self.s_hat!r}")
        _count("worker_mem_mb", self.worker_mem_mb, 1)


def sample_plan(
    limits: JobLimits, partition: Partition, *, mem_mb: int, sample_ps: int = DEFAULT_SAMPLE_PS, held_cores: int = 0
) -> ResourcePlan:
    """§4.2 Sample: the job's fewest workers (one, usually) with a whole node's cores ``C_max`` and a few PS of ``s``
    cores, with the default memory ``mem_mb`` each, shrunk (PS first: the worker's cores matter most for measuring
    ``ŵ``) to what the budget and the partition give."""
    _count("sample_ps", sample_ps, 1)
    _count("mem_mb", mem_mb, 1)
    budget = min(limits.c_total, held_cores + partition.free_cores)
    n_ps = limits.ps.clamp(sample_ps)
    n_w = limits.workers.low
    ps_cores = partition.ps_cores
    worker_cores = partition.cores_per_node
    while n_w * worker_cores + n_ps * ps_cores > budget and ps_cores > 1:
        ps_cores -= 1
    while n_w * worker_cores + n_ps * ps_cores > budget and worker_cores > 1:
        worker_cores -= 1
    while n_w * worker_cores + n_ps * ps_cores > budget and n_ps > limits.ps.low:  # a budget of a few cores
        n_ps -= 1
    plan = ResourcePlan(
        Group(n_w, worker_cores, mem_mb),
        (ps_cores,) * n_ps,
        mem_mb,
        Stage.SAMPLE,
        (f"sample: {n_w} worker(s) of {worker_cores} cores (C_max {partition.cores_per_node}), {n_ps} PS",),
    )
    plan.check(partition, held_cores)
    return plan


def estimate(usage: Usage) -> Estimates:
    """§4.2 Sample: ``ŵ`` the mean cores a worker uses, ``ŝ = ŝ_total / N_w`` the PS cores per worker's updates, and
    the largest worker's resident memory with a margin."""
    n_w = usage.plan.workers.count
    w_hat = max(sum(usage.worker_cpu) / n_w, 1e-3)
    s_hat = max(sum(usage.ps_cpu) / n_w, 1e-3)
    mem = math.ceil(max(usage.worker_rss_mb) * MEMORY_MARGIN)
    return Estimates(w_hat, s_hat, max(mem, 1))


def optimize(
    estimates: Estimates, limits: JobLimits, partition: Partition, *, ps_mem_mb: int, held_cores: int = 0
) -> ResourcePlan:
    """§4.1 Eq. 10-11 with the sample's estimates, rounded as the paper's Table 1 is: ``N_w = ⌊C / (ŵ + ŝ)⌋``
    workers of ``w = ⌈ŵ⌉`` cores (Eq. 6: integers), ``s_total = C − N_w · w``, ``N_ps = ⌊s_total / s⌋`` PS sharing
    ``s_total`` (at most ``C_max`` each); ``C`` is what the partition can give, at most ``C_total``; then the job's
    ranges. With C = 200 and C_max = 32 this gives Table 1's W&D (24 workers of 3 cores, 8 PS) and xDeepFM (8 workers
    of 20 cores, 2 PS). Eq. 3 holds; Eq. 4 (``N_w · ŝ ≤ s_total``) up to the rounding of ``ŵ`` to ``w``."""
    _count("ps_mem_mb", ps_mem_mb, 1)
    budget = min(limits.c_total, held_cores + partition.free_cores)
    w = min(max(1, math.ceil(estimates.w_hat - 1e-9)), partition.cores_per_node)
    # the job's fewest workers and PS must fit: a budget too small for ⌈ŵ⌉ cores gives the workers fewer
    w = min(w, (budget - limits.ps.low) // limits.workers.low)
    if w < 1:
        raise ValueError(
            f"{budget} cores cannot hold {limits.workers.low} workers and {limits.ps.low} PS of one core each"
        )
    n_w = limits.workers.clamp(max(1, math.floor(budget / (estimates.w_hat + estimates.s_hat) + 1e-9)))
    # every PS keeps at least one core: give back workers until the job's fewest PS fit
    while n_w > limits.workers.low and budget - n_w * w < limits.ps.low:
        n_w -= 1
    s_total = max(budget - n_w * w, limits.ps.low)
    n_ps = min(limits.ps.clamp(max(1, s_total // partition.ps_cores)), s_total)
    ps_cores = min(max(1, s_total // n_ps), partition.cores_per_node)
    plan = ResourcePlan(
        Group(n_w, w, min(estimates.worker_mem_mb, partition.mem_per_node_mb)),
        (ps_cores,) * n_ps,
        ps_mem_mb,
        Stage.OPTIMIZE,
        (
            f"Eq. 10: N_w = {budget} / ({estimates.w_hat:.2f} + {estimates.s_hat:.2f}) -> {n_w} workers of {w} cores",
            f"Eq. 11: s_total = {budget} - {n_w}*{w} = {budget - n_w * w} -> {n_ps} PS of {ps_cores} cores",
        ),
    )
    plan.check(partition, held_cores)
    return plan


def adjust(
    usage: Usage,
    estimates: Estimates,
    limits: JobLimits,
    partition: Partition,
    *,
    hot_threshold: float = DEFAULT_HOT_THRESHOLD,
) -> ResourcePlan | None:
    """§4.2 Adjust: the first problem found in the running job's ``usage``, fixed, or None when there is none.

    In order: an out-of-memory worker (twice the memory); an out-of-memory PS (twice the memory, or twice the PS when
    a node cannot hold that); hot PS, using ``hot_threshold`` of their cores (each replaced by a PS of
    ``min(ŝ_hot / ŝ_total · ŝ · N_w, C_max)`` cores, ``ŝ`` from the sample, and at least one core more than it has
    while a node holds that: a PS at its threshold is saturated, its reading below its need); idle PS cores
    (``ΔN_w = min(s_total / ŝ', √K) − N_w`` more workers, ``ŝ' = ŝ_total / N_w`` re-measured). The job holds its
    plan's cores; the partition's free cores bound any growth, and a growth that does not fit is no plan."""
    if isinstance(hot_threshold, bool) or not isinstance(hot_threshold, int | float) or not 0 < hot_threshold <= 1:
        raise ValueError(f"hot_threshold must be in (0, 1], got {hot_threshold!r}")
    plan = usage.plan
    held = plan.total_cores
    available = held + partition.free_cores
    workers = plan.workers
    if usage.worker_oom:
        return out_of_memory(plan, Role.WORKER, workers.mem_mb, limits, partition)
    if usage.ps_oom:
        return out_of_memory(plan, Role.PS, plan.ps_mem_mb, limits, partition)
    s_total_used = sum(usage.ps_cpu)
    hot = [j for j, used in enumerate(usage.ps_cpu) if used >= hot_threshold * plan.ps_cores[j]]
    if hot:
        cores = list(plan.ps_cores)
        for j in hot:
            need = usage.ps_cpu[j] / max(s_total_used, 1e-9) * estimates.s_hat * workers.count
            # at least one core more: a PS at its threshold is saturated, so its reading is below what it would use
            cores[j] = max(cores[j], min(max(math.ceil(need - 1e-9), cores[j] + 1), partition.cores_per_node))
        if tuple(cores) == plan.ps_cores or sum(cores) + workers.total_cores > available:
            return None
        return _adjusted(
            plan,
            "hot PS "
            + ", ".join(f"{j} ({usage.ps_cpu[j]:.2f} of {plan.ps_cores[j]} cores -> {cores[j]})" for j in hot),
            ps_cores=tuple(cores),
        )
    s_hat_now = s_total_used / workers.count
    if s_hat_now <= 0:
        return None
    target = plan.ps_total_cores / s_hat_now
    if limits.total_steps is not None:
        target = min(target, math.sqrt(limits.total_steps))
    delta = math.floor(target + 1e-9) - workers.count
    delta = min(delta, (available - plan.total_cores) // workers.cores, limits.workers.high - workers.count)
    if delta < 1:
        return None
    return _adjusted(
        plan,
        f"idle PS cores: {s_total_used:.2f} of {plan.ps_total_cores} in use, s^ = {s_hat_now:.2f} -> {delta} more "
        "workers",
        workers=replace(workers, count=workers.count + delta),
    )


def out_of_memory(
    plan: ResourcePlan, role: Role, mem_mb: int, limits: JobLimits, partition: Partition
) -> ResourcePlan | None:
    """§4.2 Adjust for a process of ``role`` that ran out of ``mem_mb`` MiB under ``plan``: its role's processes get
    twice that memory (never less than the plan gives them already). A PS that cannot get it on a node is doubled in
    number (as the paper does) when the job's PS range and the partition allow, else None; a worker that cannot get
    it: ``ValueError`` (no plan runs it)."""
    _count("mem_mb", mem_mb, 1)
    doubled = mem_mb * 2
    if role is Role.WORKER:
        if doubled > partition.mem_per_node_mb:
            raise ValueError(f"a worker needs more than {mem_mb} MiB and a node has {partition.mem_per_node_mb}")
        mem = max(doubled, plan.workers.mem_mb)
        return _adjusted(
            plan, f"worker out of memory: {mem_mb} -> {mem} MiB", workers=replace(plan.workers, mem_mb=mem)
        )
    if doubled <= partition.mem_per_node_mb:
        mem = max(doubled, plan.ps_mem_mb)
        return _adjusted(plan, f"PS out of memory: {mem_mb} -> {mem} MiB", ps_mem_mb=mem)
    count = min(plan.num_ps * 2, limits.ps.high)
    if count == plan.num_ps:
        raise ValueError(
            f"a PS needs more than {mem_mb} MiB, a node has {partition.mem_per_node_mb}, and the job may "
            f"not have more than {limits.ps.high} PS"
        )
    added = plan.ps_cores + (min(plan.ps_cores),) * (count - plan.num_ps)
    if sum(added) + plan.workers.total_cores > plan.total_cores + partition.free_cores:
        return None
    return _adjusted(plan, f"PS out of memory at a node's memory: {plan.num_ps} -> {count} PS", ps_cores=added)


def _adjusted(
    plan: ResourcePlan,
    reason: str,
    *,
    workers: Group | None = None,
    ps_cores: tuple[int, ...] | None = None,
    ps_mem_mb: int | None = None,
) -> ResourcePlan:
    return ResourcePlan(
        workers or plan.workers,
        ps_cores or plan.ps_cores,
        ps_mem_mb or plan.ps_mem_mb,
        Stage.ADJUST,
        (reason,),
    )


# -- falling back to the best observed plan (ours) ------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """A plan the job ran and the samples/s it measured under it (over a window after the change settled)."""

    plan: ResourcePlan
    samples_s: float

    def __post_init__(self) -> None:
        _amount("samples_s", self.samples_s)


@dataclass(frozen=True)
class PlanRecord:
    """The plans a job ran, by shape (:attr:`ResourcePlan.shape`), each with its latest measurement, and the shapes
    :func:`fall_back` left for a better one (``rejected``).

    §4.2 adjusts "based on the runtime statistics of the job" and keeps the plan it applied; what to do when an
    applied plan measures slower than one the job already ran, the paper does not say: this record and
    :func:`fall_back` are ours. A rejected shape is never tried again by the record's owner: one Brain run of a job
    (sample, optimize, at most a bounded number of adjusts), short beside a job's length; a hold that lapsed within
    it would only spend another window on a loss already measured, and the deterministic adjust proposes the same
    plan from the same readings, so retrying is how a loop would start."""

    observed: tuple[Observed, ...] = ()
    rejected: tuple[tuple[Group, tuple[int, ...], int], ...] = ()

    def observe(self, plan: ResourcePlan, samples_s: float) -> PlanRecord:
        """The record with ``plan`` measured at ``samples_s`` (replacing an earlier measurement of its shape: the
        latest reflects the machine now)."""
        new = Observed(plan, samples_s)
        kept = tuple(o for o in self.observed if o.plan.shape != plan.shape)
        return replace(self, observed=(*kept, new))

    def latest(self, plan: ResourcePlan) -> Observed | None:
        """The measurement of ``plan``'s shape, or None."""
        return next((o for o in self.observed if o.plan.shape == plan.shape), None)

    def rejects(self, plan: ResourcePlan) -> bool:
        """Whether ``plan``'s shape was left for a better one: not to be applied again."""
        return plan.shape in self.rejected

    def reject(self, plan: ResourcePlan) -> PlanRecord:
        return self if self.rejects(plan) else replace(self, rejected=(*self.rejected, plan.shape))


@dataclass(frozen=True)
class Fallback:
    """:func:`fall_back`'s decision: ``plan`` (the best observed one's processes, stage ``FALLBACK``, the reason) to
    apply instead of ``worse``, measured below ``best``; ``record`` with ``worse`` rejected."""

    plan: ResourcePlan
    worse: Observed
    best: Observed
    record: PlanRecord


def fall_back(
    record: PlanRecord,
    current: ResourcePlan,
    limits: JobLimits,
    partition: Partition,
    *,
    tolerance: float = DEFAULT_FALLBACK_TOLERANCE,
) -> Fallback | None:
    """After ``current`` ran its window (its measurement in ``record``): when its samples/s are below the best other
    observed plan's by more than ``tolerance`` (a share of the best's), go back to that plan; else None (keep it).
    Candidates are the observed plans not rejected, within the job's ranges and fitting ``partition`` with the
    cores ``current`` holds (:meth:`ResourcePlan.check`), so a fallback never goes where no plan may. The paper
    (§4.2) is silent here: this is ours, the same principle as a measured fallback elsewhere in the project (a
    model of speed from core counts can be wrong; a measurement of a plan the job ran is not a model). ValueError
    for a tolerance outside [0, 1) or a ``current`` not measured."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < 1:
        raise ValueError(f"fallback tolerance must be in [0, 1), got {tolerance!r}")
    now = record.latest(current)
    if now is None:
        raise ValueError(f"the plan {current.shape} has no measurement to compare")
    held = current.total_cores
    candidates: list[Observed] = []
    for o in record.observed:
        plan = o.plan
        if plan.shape == current.shape or record.rejects(plan):
            continue
        if (
            limits.workers.clamp(plan.workers.count) != plan.workers.count
            or limits.ps.clamp(plan.num_ps) != plan.num_ps
        ):
            continue
        try:
            plan.check(partition, held)
        except ValueError:
            continue
        candidates.append(o)
    if not candidates:
        return None
    best = max(candidates, key=lambda o: o.samples_s)
    if now.samples_s >= best.samples_s * (1 - tolerance):
        return None
    reason = (
        f"fallback: {now.samples_s:,.0f} samples/s under {_describe(current)} is below the "
        f"{best.samples_s:,.0f} of {_describe(best.plan)} by more than {tolerance:.0%}: back to it"
    )
    back = ResourcePlan(best.plan.workers, best.plan.ps_cores, best.plan.ps_mem_mb, Stage.FALLBACK, (reason,))
    return Fallback(back, now, best, record.reject(current))


def _describe(plan: ResourcePlan) -> str:
    w = plan.workers
    return f"{w.count} workers of {w.cores} cores and PS of {'+'.join(str(c) for c in plan.ps_cores)} cores"
