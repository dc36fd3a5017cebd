"""Elastic jobs for the simulator: GPU ranges and throughput per GPU count.

Throughputs come from Gavel's measurements (stanford-futuredata/gavel @ c4fa400 :
scheduler/simulation_throughputs.json, MIT; ``../shared/traces/gavel_simulation_throughputs.json``): for each
job type and scale factor k, the throughput of the job on k consolidated GPUs of a type, summed over its k workers
(Gavel derives a job's steps as run time x this throughput). The speedup on k GPUs is throughput(k) /
throughput(1); :class:`ScalingCurve` caps it at k (a few consolidated measurements are above linear) and
continues it past the last measured k with Amdahl's law.

An elastic job runs N ESTs (EasyScale's elastic training threads, N = its maximum GPU count) on its M GPUs:
each GPU runs ceil(N / M) or floor(N / M) of them one after the other and a step waits for the busiest GPU, so
the job runs at the curve's speedup on M GPUs times (N / M) / ceil(N / M), the share of its GPUs' time that is
busy (:func:`with_ests`): 8 ESTs run no faster on 5, 6 or 7 GPUs than on 4.

Models map to the Gavel job type closest to them (:data:`GAVEL_JOB_TYPES`); a model Gavel measured on one GPU
only (recommendation) stays rigid. A model the trace does not name (Alibaba openb pods, Philly rows) gets the
median speedup of Gavel's distributed job types at each measured k.

Heterogeneous clusters (:func:`make_heterogeneous`): a job's capability ``C_i`` per GPU type (k80, p100, v100) is
its Gavel job type's throughput alone on one GPU of the type (:func:`load_gavel_capabilities`; the same model ->
job type mapping, the median job type's speeds for the models Gavel lacks), and the simulator runs it at Eq. 1d's
throughput of its plan (EasyScale §3.4) relative to its requested GPUs of its requested type.
"""

from __future__ import annotations

import ast
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.files import loads_json, read_text_input
from hpc_elastic.policy.hetero import est_profile
from hpc_elastic.policy.types import LINEAR, ScalingCurve
from hpc_elastic.sim.trace import TraceJob

#: Model of a trace -> Gavel job type. Tiresias's CNNs (Table 6) without a huge tensor are ResNet-50-like (the
#: VGG family and AlexNet have no counterpart in Gavel and get the median curve); the Pollux applications as in
#: Pollux's artifact (cifar10 = ResNet-18, imagenet = ResNet-50, bert = a Transformer, deepspeech2 = recurrent
#: like the LM, yolov3 = a ResNet backbone, ncf = recommendation, measured on one GPU only).
GAVEL_JOB_TYPES: dict[str, str] = {
    "resnet50": "ResNet-50 (batch size 64)",
    "resnet101": "ResNet-50 (batch size 64)",
    "resnet152": "ResNet-50 (batch size 64)",
    "inception3": "ResNet-50 (batch size 64)",
    "inception4": "ResNet-50 (batch size 64)",
    "googlenet": "ResNet-50 (batch size 64)",
    "cifar10": "ResNet-18 (batch size 128)",
    "imagenet": "ResNet-50 (batch size 128)",
    "bert": "Transformer (batch size 64)",
    "deepspeech2": "LM (batch size 80)",
    "yolov3": "ResNet-50 (batch size 32)",
    "ncf": "Recommendation (batch size 2048)",
}

#: Key of the curve given to jobs whose model is not in :data:`GAVEL_JOB_TYPES`.
MEDIAN = "median"


def _gavel_json(file: Path) -> object:
    """The parsed throughputs file (Gavel's ``simulation_throughputs.json``); ``ValueError`` naming the problem."""
    return loads_json(read_text_input(file, "throughputs from"), f"throughputs file {str(file)!r}")


def _gavel_entries(file: Path, data: object, gpu_type: str) -> list[tuple[str, int, float]]:
    """``(job type, GPUs, iterations per second)`` of every entry of ``gpu_type`` (its key ``"('<job type>',
    <GPUs>)"``, its value's ``null`` the job alone) with a positive, finite throughput; ``ValueError`` naming the
    first entry that is not one, or a GPU count outside 1..MAX_ESTS."""
    table = data.get(gpu_type) if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise ValueError(f"{file}: no throughputs for GPU type {gpu_type!r}")
    entries = []
    for key, value in table.items():
        try:
            job_type, scale = ast.literal_eval(key)
            raw = value["null"]
            if not isinstance(job_type, str) or type(scale) is not int or not 1 <= scale <= MAX_ESTS:
                raise ValueError(key)
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                raise ValueError(raw)
            throughput = float(raw)
        except (ValueError, SyntaxError, TypeError, KeyError, OverflowError, RecursionError, MemoryError):
            raise ValueError(f"{file}: unexpected entry {key[:80]!r} for {gpu_type}") from None
        if throughput > 0 and math.isfinite(throughput):
            entries.append((job_type, scale, throughput))
    return entries


def load_gavel_curves(path: str | Path, gpu_type: str = "v100") -> dict[str, ScalingCurve]:
    """Speedup curves per Gavel job type measured on more than one GPU, plus :data:`MEDIAN`."""
    file = Path(path)
    by_type: dict[str, dict[int, float]] = {}
    for job_type, scale, throughput in _gavel_entries(file, _gavel_json(file), gpu_type):
        by_type.setdefault(job_type, {})[scale] = throughput
    curves: dict[str, ScalingCurve] = {}
    for job_type, points in by_type.items():
        if 1 not in points or len(points) < 2:
            continue
        counts = tuple(sorted(points))
        curves[job_type] = ScalingCurve(counts, tuple(points[k] / points[1] for k in counts))
    if not curves:
        raise ValueError(f"{file}: no job type measured on more than one {gpu_type} GPU")
    measured = sorted({k for curve in curves.values() for k in curve.gpus})
    median = [statistics.median(c.at(k) for c in curves.values() if k in c.gpus) for k in measured]
    curves[MEDIAN] = ScalingCurve(tuple(measured), tuple(median))
    return curves


def curve_for(model: str, curves: Mapping[str, ScalingCurve]) -> ScalingCurve | None:
    """The scaling curve of a trace's model (None: not measured on several GPUs, the job stays rigid)."""
    name = model.strip().lower()
    if name in GAVEL_JOB_TYPES:
        return curves.get(GAVEL_JOB_TYPES[name])
    return curves.get(MEDIAN)


def with_ests(curve: ScalingCurve, ests: int) -> ScalingCurve:
    """The speedup of a job of ``ests`` ESTs on 1..``ests`` GPUs: the ``curve``'s where M divides N, and
    speedup(M) x (N / M) / ceil(N / M) in between (the GPUs with fewer ESTs wait for those with ceil(N / M))."""
    if isinstance(ests, bool) or not isinstance(ests, int) or ests < 1:
        raise ValueError(f"a job runs at least one EST, got {ests!r}")
    counts = tuple(range(1, ests + 1))
    speedups = tuple(curve.at(m) * (ests / m) / -(-ests // m) for m in counts)
    return ScalingCurve(counts, speedups)


#: the largest ``--elastic`` factor: a job's ESTs (its GPUs x F) are a table the replay keeps per job
MAX_ELASTIC_FACTOR = 64.0


def make_elastic(
    jobs: Sequence[TraceJob], factor: float, curves: Mapping[str, ScalingCurve] | None
) -> tuple[TraceJob, ...]:
    """Every job whose scaling is known may run on [ceil(its GPUs / ``factor``), ceil(its GPUs x ``factor``)]
    GPUs with as many ESTs as its maximum (:func:`with_ests`); without ``curves`` every job is elastic with
    linear scaling between the counts that divide its ESTs (an optimistic bound)."""
    if not (math.isfinite(factor) and 1 <= factor <= MAX_ELASTIC_FACTOR):
        raise ValueError(f"the elastic factor must be a number in [1, {MAX_ELASTIC_FACTOR:g}], got {factor!r}")
    out: list[TraceJob] = []
    for job in jobs:
        curve = curve_for(job.model, curves) if curves is not None else None
        if curves is not None and curve is None:
            out.append(job)
            continue
        top = max(job.gpus, math.ceil(job.gpus * factor))
        if top > MAX_ESTS:
            raise ValueError(
                f"job {job.name!r} (line {job.line}) would run {top} ESTs at elastic factor {factor:g}, more than the "
                f"runtime's {MAX_ESTS}"
            )
        scaling = with_ests(curve or LINEAR, top)
        out.append(replace(job, min_gpus=math.ceil(job.gpus / factor), max_gpus=top, scaling=scaling))
    return tuple(out)


#: The GPU types of Gavel's throughput table.
GAVEL_GPU_TYPES: tuple[str, ...] = ("k80", "p100", "v100")


def load_gavel_capabilities(path: str | Path) -> dict[str, dict[str, float]]:
    """Gavel job type -> GPU type -> iterations per second of the job alone on one GPU of the type (its ``null``
    entry at scale factor 1: EasyScale's ``C_i`` with one EST per iteration), for the job types measured on every
    type of :data:`GAVEL_GPU_TYPES`; plus :data:`MEDIAN`: per type, v100's median speed times the median over job
    types of the type's speed relative to v100."""
    file = Path(path)
    data = _gavel_json(file)
    by_job: dict[str, dict[str, float]] = {}
    for gpu_type in GAVEL_GPU_TYPES:
        for job_type, scale, throughput in _gavel_entries(file, data, gpu_type):
            if scale == 1:
                by_job.setdefault(job_type, {})[gpu_type] = throughput
    out = {job: caps for job, caps in by_job.items() if len(caps) == len(GAVEL_GPU_TYPES)}
    if not out:
        raise ValueError(f"{file}: no job type measured on every one of {', '.join(GAVEL_GPU_TYPES)}")
    v100 = statistics.median(caps["v100"] for caps in out.values())
    ratios = {t: statistics.median(caps[t] / caps["v100"] for caps in out.values()) for t in GAVEL_GPU_TYPES}
    out[MEDIAN] = {t: v100 * ratio for t, ratio in ratios.items()}
    return out


def capability_for(model: str, capabilities: Mapping[str, Mapping[str, float]]) -> Mapping[str, float]:
    """The capability per GPU type of a trace's model: its Gavel job type's (:data:`GAVEL_JOB_TYPES`), else the
    median's."""
    job_type = GAVEL_JOB_TYPES.get(model.strip().lower(), MEDIAN)
    return capabilities.get(job_type) or capabilities[MEDIAN]


def make_heterogeneous(
    jobs: Sequence[TraceJob],
    factor: float,
    curves: Mapping[str, ScalingCurve],
    capabilities: Mapping[str, Mapping[str, float]],
    base_type: str,
) -> tuple[TraceJob, ...]:
    """The jobs of :func:`make_elastic` (the same GPU ranges; a model Gavel measured on one GPU only stays rigid)
    with the speed model of heterogeneous clusters: an :class:`~hpc_elastic.policy.hetero.EstProfile` of its
    capability per GPU type (:func:`capability_for`), as many ESTs as its maximum, requested on ``base_type`` (its
    trace duration is its work on its requested GPUs of that type)."""
    out: list[TraceJob] = []
    for job in make_elastic(jobs, factor, curves):
        top = job.max_gpus if job.max_gpus is not None else job.gpus
        profile = est_profile(capability_for(job.model, capabilities), top, base_type)
        out.append(replace(job, scaling=profile))
    return tuple(out)
