"""Parameter-server jobs for the slotted simulator: DL²'s job catalogue and synthetic workload (DL² §6.2).

**Catalogue** (:data:`JOB_TYPES`): the eight models of DL² Table 1. §6.2: a worker uses at most 2 GPUs and 1-4
cores, a PS 1-4 cores. Each model's training speed is Optimus' function of (workers w, PS p) (EuroSys'18 §3.2),
asynchronous ``w / (θ0 + θ1 w/p + θ2 w + θ3 p)`` or synchronous ``1 / (θ0 M/w + θ1 + θ2 w/p + θ3 w + θ4 p)``.
The coefficients are not fitted to measurements (there are none here); they are derived from each model's size so
that the functions have the shapes Optimus reports (its Fig. 3-4):

- θ0 (compute): the time of one worker's mini-batch (async) or of one sample on one worker (sync, times the
  global batch M over w workers), from the model's cost per sample on a GTX 1080Ti-class GPU;
- the w/p term (communication): every step each worker pushes and pulls the whole parameter set, which the p
  PS share, so a PS's link carries ``w/p`` copies: ``2 x parameter bytes / 6 GB/s`` (the testbed's 50 GbE),
  times 2 for framework overhead (MXNet's serialisation). A PS-starved job (w/p large) slows down;
- the w term: per-worker overhead (synchronisation barrier, straggling), a few milliseconds;
- the p term: per-PS overhead (one more connection and message per step), a few milliseconds: too many PS cost
  a little.

Hence diminishing returns in workers (the compute term shrinks as 1/w while the others grow), a large-model job
(VGG-16, Seq2Seq, DSSM's embeddings) needs several PS, and a small one (ResNeXt-110 on CIFAR10, CTC) runs well
on one. ``steps_per_epoch`` downscales the datasets (§6.2) so that one epoch takes ``epoch_seconds`` at 2 workers
and 1 PS: a job of the trace's durations then trains tens to hundreds of epochs.

**Workload** (:func:`generate`): arrivals per 20-minute slot following a day/night cycle (§6.2, Fig. 8a), a
uniformly drawn model per job (or a given mix), a heavy-tailed (log-normal) duration at the requested allocation
with a mean of 147 minutes (Fig. 8b: over half the jobs run for more than an hour, some for days), turned into
the job's epochs; the user's request is a few workers and PS. :func:`from_gpu_trace` turns the shared GPU traces
into PS jobs, for validation traces of other shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from hpc_elastic.policy.slot_tiresias import gang_fits
from hpc_elastic.policy.slots import JobType, Servers, SpeedModel
from hpc_elastic.ps.model import MODEL_NAME
from hpc_elastic.sim.trace import TraceJob

#: bytes per second of a PS's link (the testbed's 50 GbE NICs, §6.2)
_LINK = 6.0e9
#: framework overhead on the raw transfer time (serialisation, MXNet's KVStore)
_OVERHEAD = 2.0
#: the allocation at which an epoch takes ``epoch_seconds``
_REFERENCE = (2, 1)


#: the most slots a generated trace's arrivals may span (38 years of 20-minute slots; drawn one slot at a time)
MAX_ARRIVAL_SLOTS = 1_000_000


def _comm(params_mb: float) -> float:
    """Seconds per step for one worker's push and pull of the parameters through one PS."""
    return _OVERHEAD * 2.0 * params_mb * 1e6 / _LINK


def _job_type(
    name: str,
    model: SpeedModel,
    gpus: int,
    cpus: int,
    ps_cpus: int,
    *,
    compute: float,
    params_mb: float,
    epoch_seconds: float,
    batch: int = 1,
) -> JobType:
    """A Table 1 model: ``compute`` is θ0 (seconds per mini-batch, async; per sample, sync)."""
    if model is SpeedModel.ASYNC:
        theta: tuple[float, ...] = (compute, _comm(params_mb), 0.002, 0.01)
    else:
        theta = (compute, 0.01, _comm(params_mb), 0.003, 0.02)
    draft = JobType(name, gpus, cpus, ps_cpus, model, theta, 1.0, batch)
    steps = draft.steps_per_second(*_REFERENCE) * epoch_seconds
    return JobType(name, gpus, cpus, ps_cpus, model, theta, steps, batch)


#: DL² Table 1 (§6.2), sync and async models mixed; the reasoning behind each θ is in the module docstring.
JOB_TYPES: tuple[JobType, ...] = (
    # 25.6 M parameters (98 MB), ~5 ms a 224px image: compute-heavy, moderate traffic
    _job_type("resnet-50", SpeedModel.SYNC, 1, 2, 2, compute=0.005, params_mb=98, epoch_seconds=90, batch=256),
    # 138 M parameters (528 MB) on 2 GPUs: the heaviest traffic, needs several PS
    _job_type("vgg-16", SpeedModel.SYNC, 2, 2, 4, compute=0.004, params_mb=528, epoch_seconds=120, batch=256),
    # 1.7 M parameters (7 MB) on CIFAR10: small model, cheap steps, one PS is enough
    _job_type("resnext-110", SpeedModel.ASYNC, 1, 1, 1, compute=0.12, params_mb=7, epoch_seconds=60),
    # 11 M parameters (45 MB): medium
    _job_type("inception-bn", SpeedModel.ASYNC, 1, 2, 2, compute=0.15, params_mb=45, epoch_seconds=75),
    # ~50 M parameters (200 MB) with large vocab embeddings, 2 GPUs per worker
    _job_type("seq2seq", SpeedModel.SYNC, 2, 3, 3, compute=0.003, params_mb=200, epoch_seconds=100, batch=128),
    # small recurrent model (10 MB), cheap steps, CPU-light
    _job_type("ctc", SpeedModel.ASYNC, 1, 1, 1, compute=0.05, params_mb=10, epoch_seconds=45),
    # large sparse embeddings (120 MB), CPU-heavy input pipeline
    _job_type("dssm", SpeedModel.ASYNC, 1, 4, 2, compute=0.06, params_mb=120, epoch_seconds=60),
    # word language model on PTB: 80 MB of embeddings and softmax, synchronous
    _job_type("wlm", SpeedModel.SYNC, 1, 2, 2, compute=0.002, params_mb=80, epoch_seconds=50, batch=128),
)

#: the CPU partition's catalogue (``hpc-elastic dl2 train --catalogue cpu``): the model ps-mode jobs train on a CPU
#: partition (:data:`hpc_elastic.ps.model.MODEL_NAME`, Wide & Deep: ``hpc-elastic submit --mode ps`` has no other),
#: workers and PS of 2 cores each and no GPU. Its coefficients, by the same reasoning as Table 1's, from what this
#: project measured of it (README, "PS mode"): a worker's mini-batch (the MLP 221->64->32->1 and the wide part on a
#: few hundred records, in torch on one core) takes ~10 ms; per step it pulls and pushes ~60 KB of dense parameters
#: and a few thousand embedding rows of 9 floats (~130 KB each way), which gRPC moves at ~85 MB/s (the transport
#: table's 64 KB rows), ~3 ms through one PS; per-worker and per-PS overheads as Table 1's asynchronous models. So
#: communication is small beside compute: workers help almost linearly and one PS is enough, as for ``ctc``.
#: ``steps_per_epoch`` downscales its dataset as Table 1's, to an epoch of 30 s at 2 workers and 1 PS.
CPU_JOB_TYPES: tuple[JobType, ...] = (
    JobType(
        MODEL_NAME,
        0,
        2,
        2,
        SpeedModel.ASYNC,
        (0.010, 0.003, 0.002, 0.01),
        JobType(MODEL_NAME, 0, 2, 2, SpeedModel.ASYNC, (0.010, 0.003, 0.002, 0.01), 1.0).steps_per_second(*_REFERENCE)
        * 30.0,
    ),
)
#: a CPU partition like the dev cluster's ``cpu``: 2 nodes of 8 cores, no GPU
CPU_SERVERS = Servers.uniform(2, 0, 8)


class Catalogue(StrEnum):
    """The job catalogues a DL² model may be trained on."""

    #: DL² Table 1's eight models on GPU servers (:data:`JOB_TYPES`)
    TABLE1 = "table1"
    #: the ps-mode model on a CPU partition (:data:`CPU_JOB_TYPES`)
    CPU = "cpu"

    @property
    def types(self) -> tuple[JobType, ...]:
        return JOB_TYPES if self is Catalogue.TABLE1 else CPU_JOB_TYPES


#: every job type by name, from both catalogues (the daemon builds a slot's types from a model's type names)
TYPES_BY_NAME: dict[str, JobType] = {kind.name: kind for kind in (*JOB_TYPES, *CPU_JOB_TYPES)}

#: DL²'s time slot (§6.2: 20 minutes)
SLOT_SECONDS = 1200.0
#: the trace's mean job duration (§6.2, Fig. 8b)
MEAN_MINUTES = 147.0
#: the fewest and most epochs a generated job trains (§6.2: "tens to hundreds")
MIN_EPOCHS = 10
MAX_EPOCHS = 2000


@dataclass(frozen=True, slots=True)
class SlotTraceJob:
    """One PS job of a slotted trace. ``speed_factor`` scales its type's speed (DL² §6.4's variation): the
    simulator applies it, policies never see it."""

    job_id: int
    job_type: int
    arrival: int
    epochs_total: float
    request_workers: int
    request_ps: int
    max_workers: int
    max_ps: int
    speed_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.job_id < 0 or self.job_type < 0 or self.arrival < 0:
            raise ValueError(f"job {self.job_id}: job_id, job_type and arrival must be >= 0")
        if not (math.isfinite(self.epochs_total) and self.epochs_total > 0):
            raise ValueError(f"job {self.job_id}: epochs_total must be > 0, got {self.epochs_total!r}")
        if not 1 <= self.request_workers <= self.max_workers or not 1 <= self.request_ps <= self.max_ps:
            raise ValueError(
                f"job {self.job_id}: request {self.request_workers}w/{self.request_ps}ps must be >= 1 and within "
                f"its maximum {self.max_workers}w/{self.max_ps}ps"
            )
        if not (math.isfinite(self.speed_factor) and self.speed_factor > 0):
            raise ValueError(f"job {self.job_id}: speed_factor must be > 0, got {self.speed_factor!r}")


class Arrival(StrEnum):
    """How jobs arrive over the slots."""

    #: a day/night cycle (DL² Fig. 8a): the rate swings by ``diurnal`` around its mean over 72 slots (a day)
    DIURNAL = "diurnal"
    #: a constant Poisson rate
    POISSON = "poisson"
    #: every job in the first slot (a batch: the pure scheduling problem, no arrivals)
    BATCH = "batch"


#: 20-minute slots in a day
SLOTS_PER_DAY = 72
#: a small contended cluster (16 servers of 4 GPUs and 16 cores): jobs wait at the default load
DEFAULT_SERVERS = Servers.uniform(16, 4, 16)
#: what a user requests, drawn uniformly: workers and PS
REQUEST_WORKERS: tuple[int, ...] = (1, 2, 2, 4, 4, 8)
REQUEST_PS: tuple[int, ...] = (1, 1, 2, 2, 4)


#: the most jobs :func:`generate` makes or an experiment takes from a trace (more is a typo, not a workload)
MAX_JOBS = 1_000_000
#: the most servers, GPUs per server or cores per server ``parse_servers`` takes
MAX_SERVER_COUNT = 100_000


def parse_servers(spec: str) -> Servers:
    """``NxGxC``: N servers of G GPUs and C cores each (``16x4x16``)."""
    parts = spec.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"servers must be NxGxC (servers x GPUs x cores), got {spec!r}")
    count, gpus, cpus = (int(part) for part in parts)
    if count < 1 or cpus < 1:
        raise ValueError(f"servers {spec!r}: need at least one server and one core per server")
    if max(count, gpus, cpus) > MAX_SERVER_COUNT:
        raise ValueError(f"servers {spec!r}: each of N, G and C must be at most {MAX_SERVER_COUNT:,}")
    return Servers.uniform(count, gpus, cpus)


def fit_request(kind: JobType, workers: int, ps: int, servers: Servers | None) -> tuple[int, int]:
    """Shrink a request (workers first, PS kept at the request's ratio, then PS; both at least 1) until it places
    as one gang on the empty servers (:func:`~hpc_elastic.policy.slot_tiresias.gang_fits`): a gang scheduler
    would otherwise never start the job (the cluster's totals are not enough: a task does not span servers)."""
    if servers is None:
        return workers, ps
    ratio = ps / workers
    w, p = workers, ps
    while not gang_fits(servers, kind, w, p):
        if w > 1:
            w -= 1
            p = max(1, min(ps, math.ceil(w * ratio)))
        elif p > 1:
            p -= 1
        else:
            break  # one worker and one PS do not fit: the job's type does not fit this cluster at all
    return w, p


def _limits(request_workers: int, request_ps: int) -> tuple[int, int]:
    """What any policy may give a job: 4 times its request, at least 4 and at most 16 of each (the elastic
    policies' room; DRF and Tiresias never exceed the request)."""
    return min(16, max(4, 4 * request_workers)), min(16, max(4, 4 * request_ps))


def _weights(types: Sequence[JobType], type_weights: Sequence[float] | None) -> npt.NDArray[np.float64]:
    if type_weights is None:
        return np.full(len(types), 1.0 / len(types))
    w = np.asarray(type_weights, dtype=np.float64)
    if w.shape != (len(types),) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"type_weights must be {len(types)} weights >= 0 with a positive sum, got {type_weights!r}")
    out: npt.NDArray[np.float64] = w / w.sum()
    return out


def _epochs(kind: JobType, workers: int, ps: int, seconds: float) -> float:
    """Whole epochs that take ``seconds`` at the type's speed with ``workers``/``ps``, in [MIN, MAX]_EPOCHS."""
    return float(min(MAX_EPOCHS, max(MIN_EPOCHS, round(seconds * kind.epochs_per_second(workers, ps)))))


def generate(
    seed: int,
    jobs: int = 200,
    servers: Servers | None = None,
    *,
    arrival: Arrival | str = Arrival.DIURNAL,
    load: float = 3.0,
    diurnal: float = 0.6,
    mean_minutes: float = MEAN_MINUTES,
    duration_sigma: float = 1.2,
    type_weights: Sequence[float] | None = None,
    variation: float = 0.0,
    types: tuple[JobType, ...] = JOB_TYPES,
    slot_seconds: float = SLOT_SECONDS,
) -> tuple[SlotTraceJob, ...]:
    """DL² §6.2's synthetic workload of ``jobs`` PS jobs, from a seeded numpy Generator (same seed, same trace).

    ``load`` scales the arrival rate to the cluster: the mean rate is ``load`` times the jobs per slot the
    cluster's GPUs can serve at the jobs' requested allocations (so ``load > 1`` makes jobs wait). ``arrival``,
    ``diurnal`` (the day/night swing, 0-1), ``duration_sigma`` (the log-normal's spread), ``type_weights`` (the
    mix of :data:`JOB_TYPES`) and ``variation`` (§6.4: each job's speed factor uniform in [1 - v, 1 + v]) change
    the trace's shape. A request that does not place as one gang on the empty cluster is shrunk
    (:func:`fit_request`). Durations are log-normal with mean ``mean_minutes`` at the requested allocation and the
    type's nominal speed; the variation changes the true speed, not the epochs (§6.4).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"jobs must be 1..{MAX_JOBS:,}, got {jobs!r}")
    pattern = Arrival(arrival)
    for name, value, low, high in (
        ("load", load, 0.0, math.inf),
        ("mean_minutes", mean_minutes, 0.0, math.inf),
        ("duration_sigma", duration_sigma, -1.0, 5.0),
        ("slot_seconds", slot_seconds, 0.0, math.inf),
    ):
        if not (math.isfinite(value) and low < value <= high):
            raise ValueError(f"{name} must be in ({low}, {high}], got {value!r}")
    if not 0.0 <= diurnal <= 1.0:
        raise ValueError(f"diurnal must be in [0, 1], got {diurnal!r}")
    if not 0.0 <= variation < 1.0:
        raise ValueError(f"variation must be in [0, 1), got {variation!r}")
    servers = DEFAULT_SERVERS if servers is None else servers
    weights = _weights(types, type_weights)
    rng = np.random.default_rng(seed)

    kinds = rng.choice(len(types), size=jobs, p=weights)
    req_w = rng.choice(np.asarray(REQUEST_WORKERS), size=jobs)
    req_p = rng.choice(np.asarray(REQUEST_PS), size=jobs)
    # log-normal with the given mean: mu = ln(mean) - sigma^2 / 2
    mu = math.log(mean_minutes * 60.0) - duration_sigma**2 / 2.0
    seconds = rng.lognormal(mu, duration_sigma, size=jobs)
    factors = rng.uniform(1.0 - variation, 1.0 + variation, size=jobs) if variation > 0 else np.ones(jobs)

    # the mean rate: load x (cluster GPU-seconds per slot) / (mean GPU-seconds a job requests); in cores when the
    # types use no GPU (a CPU partition's catalogue)
    gpus_per_job = float(np.mean(REQUEST_WORKERS)) * float(np.dot(weights, [t.worker_gpus for t in types]))
    capacity = float(servers.total_gpus)
    if gpus_per_job <= 0 or capacity <= 0:
        gpus_per_job = float(np.mean(REQUEST_WORKERS)) * float(np.dot(weights, [t.worker_cpus for t in types]))
        gpus_per_job += float(np.mean(REQUEST_PS)) * float(np.dot(weights, [t.ps_cpus for t in types]))
        capacity = float(servers.total_cpus)
    rate = load * capacity * slot_seconds / (gpus_per_job * mean_minutes * 60.0)
    if pattern is not Arrival.BATCH and jobs / rate > MAX_ARRIVAL_SLOTS:
        raise ValueError(
            f"load {load!r} is too low: {jobs} jobs would arrive over ~{jobs / rate:.3g} slots, at most "
            f"{MAX_ARRIVAL_SLOTS}"
        )
    arrivals = _arrivals(rng, pattern, jobs, rate, diurnal)

    out = []
    for j in range(jobs):
        kind = types[int(kinds[j])]
        w, p = fit_request(kind, int(req_w[j]), int(req_p[j]), servers)
        max_w, max_p = _limits(w, p)
        epochs = _epochs(kind, w, p, float(seconds[j]))
        out.append(SlotTraceJob(j, int(kinds[j]), int(arrivals[j]), epochs, w, p, max_w, max_p, float(factors[j])))
    return tuple(out)


def _arrivals(
    rng: np.random.Generator, pattern: Arrival, jobs: int, rate: float, diurnal: float
) -> npt.NDArray[np.int64]:
    """The arrival slot of each of ``jobs`` jobs (non-decreasing)."""
    if pattern is Arrival.BATCH:
        return np.zeros(jobs, dtype=np.int64)
    out = np.empty(jobs, dtype=np.int64)
    count, slot = 0, 0
    while count < jobs:
        lam = rate
        if pattern is Arrival.DIURNAL:  # peak in the afternoon, trough at night (Fig. 8a)
            lam = rate * (1.0 + diurnal * math.sin(2.0 * math.pi * (slot % SLOTS_PER_DAY) / SLOTS_PER_DAY))
        k = min(int(rng.poisson(lam)), jobs - count)
        out[count : count + k] = slot
        count += k
        slot += 1
    return out


#: trace model names (their start, without dashes) that train a catalogue model's kind of network
MODEL_ALIASES: dict[str, str] = {
    "resnet": "resnet-50",
    "imagenet": "resnet-50",
    "yolo": "resnet-50",
    "vgg": "vgg-16",
    "alexnet": "vgg-16",
    "cifar": "resnext-110",
    "inception": "inception-bn",
    "googlenet": "inception-bn",
    "bert": "seq2seq",
    "transformer": "seq2seq",
    "gnmt": "seq2seq",
    "deepspeech": "ctc",
    "ncf": "dssm",
    "recommend": "dssm",
    "lstm": "wlm",
    "lm": "wlm",
}


def model_type(model: str, types: tuple[JobType, ...] = JOB_TYPES) -> int | None:
    """The catalogue index of a trace's model name: a catalogue name (without dashes) it contains, else the
    first alias it starts with (:data:`MODEL_ALIASES`) whose type is in ``types``; None when nothing maps."""
    key = model.replace("-", "").replace("_", "").lower()
    if not key:
        return None
    names = [kind.name.replace("-", "").lower() for kind in types]
    for k, name in enumerate(names):
        if name in key:
            return k
    for alias, target in MODEL_ALIASES.items():
        target_key = target.replace("-", "")
        if key.startswith(alias) and target_key in names:
            return names.index(target_key)
    return None


def from_gpu_trace(
    jobs: Sequence[TraceJob],
    *,
    seed: int = 0,
    servers: Servers | None = None,
    types: tuple[JobType, ...] = JOB_TYPES,
    slot_seconds: float = SLOT_SECONDS,
    time_scale: float = 1.0,
    variation: float = 0.0,
) -> tuple[SlotTraceJob, ...]:
    """PS jobs from a GPU trace (:func:`hpc_elastic.sim.trace.load_trace`), in submission order.

    Rules: a job's model maps to a type by :func:`model_type` (``resnet50`` -> ResNet-50, ``deepspeech2`` ->
    CTC), else by a seeded draw; its workers are the GPUs it requests divided by the type's GPUs per worker (at
    least 1, at most 16); its PS are one per two workers (at least 1), the pair shrunk to fit ``servers`` when
    given (:func:`fit_request`); its epochs are its trace duration (times
    ``time_scale``) at that allocation (at least :data:`MIN_EPOCHS`); its arrival is its submit time (relative to
    the first, times ``time_scale``) in slots. ``variation`` draws speed factors as :func:`generate` does.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
    if not 0.0 <= variation < 1.0:
        raise ValueError(f"variation must be in [0, 1), got {variation!r}")
    rng = np.random.default_rng(seed)
    ordered = sorted(jobs, key=lambda job: job.submit)
    first = ordered[0].submit if ordered else 0.0
    out = []
    for j, job in enumerate(ordered):
        kind_index = model_type(job.model, types)
        if kind_index is None:
            kind_index = int(rng.integers(len(types)))
        kind = types[kind_index]
        w = min(16, max(1, job.gpus // max(1, kind.worker_gpus)))
        w, p = fit_request(kind, w, max(1, w // 2), servers)
        max_w, max_p = _limits(w, p)
        max_w, max_p = max(max_w, w), max(max_p, p)
        factor = float(rng.uniform(1.0 - variation, 1.0 + variation)) if variation > 0 else 1.0
        arrival = int((job.submit - first) * time_scale // slot_seconds)
        epochs = _epochs(kind, w, p, job.duration * time_scale)
        out.append(SlotTraceJob(j, kind_index, arrival, epochs, w, p, max_w, max_p, factor))
    return tuple(out)
