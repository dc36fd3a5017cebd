"""The measuring half of the profiler: :func:`run_profile` loads a MODEL (:mod:`hpc_elastic.profile.model`), reads
its tensor sizes (skew, Tiresias §3.3), searches the memory limit x^o (LB-BSP §3.3.1(4), with the meters of
:mod:`hpc_elastic.profile.meters`), times one training step at each batch size to get Γ(x) and throughput C
(LB-BSP §3.1, :mod:`hpc_elastic.profile.step`), fits Γ (:mod:`hpc_elastic.profile.curve`), identifies the device
(:mod:`hpc_elastic.profile.device`) and returns a validated :class:`~hpc_elastic.profile.schema.Profile`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, cast

from hpc_elastic import __version__
from hpc_elastic.profile.curve import fit_gamma
from hpc_elastic.profile.device import identify_device
from hpc_elastic.profile.memory import find_memory_limit, format_size
from hpc_elastic.profile.meters import (
    ChildProcessStepPeak,
    CudaPeakMeter,
    RssPeakMeter,
    StepPeak,
    fits_under,
    in_process_step_peak,
    psutil_module,
)
from hpc_elastic.profile.model import ProfileRunError, load_model, model_info, torch_module
from hpc_elastic.profile.options import DeviceSpec, auto_batch_sizes
from hpc_elastic.profile.schema import (
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    DeviceInfo,
    DeviceKind,
    GammaFitInfo,
    Measurement,
    MemoryLimitInfo,
    MemoryProbe,
    Profile,
    StepClock,
)
from hpc_elastic.profile.skew import DEFAULT_SHARD_COUNTS
from hpc_elastic.profile.step import PeakMeter, Progress, StepRunner, measure_curve

if TYPE_CHECKING:
    import torch

OPTIMIZER = "sgd(lr=0.001, momentum=0.9)"
DEFAULT_CPU_CAP_FRACTION = 0.5  # of the host memory available when profiling starts
MEMORY_RESOLUTION = 1 / 32  # bisection stops within ~3 %: the peak RSS of one step varies by a few % run to run


#: the largest batch size or PS shard count a profile measures (a larger one is a typo, not a workload)
MAX_COUNT = 1 << 24


@dataclass(frozen=True)
class ProfileRequest:
    """Everything ``hpc-elastic profile run`` was asked to do."""

    model_spec: str
    device: DeviceSpec = field(default_factory=lambda: DeviceSpec(DeviceKind.CPU))
    batch_sizes: tuple[int, ...] | None = None  # None: powers of two up to min(x^o, max_batch)
    iters: int = 3
    warmup: int = 2
    repeats: int = 5
    max_batch: int = 1024
    memory_cap_bytes: int | None = None  # None: half the available host memory (CPU), all of it (GPU)
    measure_memory: bool = True
    shard_counts: tuple[int, ...] = DEFAULT_SHARD_COUNTS
    name: str | None = None
    device_type: str | None = None
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None: torch's default (one per core)
    clock: StepClock = StepClock.WALL

    def __post_init__(self) -> None:
        for label, value, low in (
            ("iters", self.iters, 1),
            ("warmup", self.warmup, 0),
            ("repeats", self.repeats, 1),
            ("max_batch", self.max_batch, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes < 1:
            raise ValueError(f"memory cap must be positive, got {self.memory_cap_bytes!r}")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"batch sizes must be positive integers, got {self.batch_sizes!r}")
        if (largest := max((*(self.batch_sizes or ()), self.max_batch))) > MAX_COUNT:
            raise ValueError(f"batch sizes must be at most {MAX_COUNT:,}, got {largest}")
        if self.name is not None and not re.match(NAME_PATTERN, self.name):
            raise ValueError(f"a profile name takes letters, digits, _ . + - and one @, got {self.name!r}")
        for label, text in (("a profile name", self.name), ("a device type", self.device_type)):
            if text is not None and len(text) > MAX_NAME_LENGTH:
                raise ValueError(f"{label} may have at most {MAX_NAME_LENGTH} characters, got {len(text)}")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if self.clock is StepClock.PROCESS and self.device.kind is DeviceKind.CUDA:
            raise ValueError("--clock process times CPU work; a CUDA profile needs the wall clock")
        if not self.shard_counts or min(self.shard_counts) < 1:
            raise ValueError(f"shard counts must be positive integers, got {self.shard_counts!r}")
        if max(self.shard_counts) > MAX_COUNT:
            raise ValueError(f"shard counts must be at most {MAX_COUNT:,}, got {max(self.shard_counts)}")


def _resolve_device(request: ProfileRequest) -> torch.device:
    lib = torch_module()
    if request.device.kind is DeviceKind.CUDA:
        if not lib.cuda.is_available():
            raise ProfileRunError(f"device {request.device.torch_name} asked for, but torch sees no CUDA device")
        if (request.device.index or 0) >= lib.cuda.device_count():
            raise ProfileRunError(
                f"device {request.device.torch_name} asked for, but torch sees {lib.cuda.device_count()} GPU(s)"
            )
    return cast("torch.device", lib.device(request.device.torch_name))


def _load_average() -> float | None:
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0]
    return None


def _default_cap(device_info: DeviceInfo) -> int:
    if device_info.kind is DeviceKind.CPU:
        return int(psutil_module().virtual_memory().available * DEFAULT_CPU_CAP_FRACTION)
    if device_info.memory_bytes is None:
        raise ProfileRunError("cannot tell the GPU's memory size; give --memory-cap")
    return device_info.memory_bytes


def run_profile(request: ProfileRequest, progress: Progress | None = None) -> Profile:
    """Measure a profile as ``request`` says (see the module docstring)."""
    report: Progress = progress or (lambda description, done, total: None)
    began = time.perf_counter()
    load_start = _load_average()
    torch = torch_module()
    if request.threads is not None:
        # On a shared host, fewer threads than cores avoids OpenMP barriers waiting on descheduled threads.
        torch.set_num_threads(request.threads)
    device = _resolve_device(request)
    torch.manual_seed(request.seed)
    loaded = load_model(request.model_spec)
    info = model_info(request.model_spec, loaded.name, loaded.module, request.shard_counts)
    device_info = identify_device(request.device, request.device_type)
    name = request.name or f"{info.name}@{device_info.type}"
    if len(name) > MAX_NAME_LENGTH:  # (a model's or a device's name): refused before anything is measured
        raise ValueError(f"profile name {name[:40]!r}... has {len(name)} characters, more than {MAX_NAME_LENGTH}")
    meter: PeakMeter = CudaPeakMeter(device) if device.type == "cuda" else RssPeakMeter()
    runner = StepRunner(loaded, device, request.seed)
    runner.step(*runner.batch(1))  # creates the momentum buffers, so every probe sees the same state
    runner.sync()
    runner.snapshot()

    memory_limit: MemoryLimitInfo | None = None
    limit_batch = request.max_batch
    if request.measure_memory:
        cap = request.memory_cap_bytes or _default_cap(device_info)
        if device_info.kind is DeviceKind.CPU and device_info.memory_bytes and cap > device_info.memory_bytes:
            raise ValueError(
                f"memory cap {format_size(cap)} is above this host's memory {format_size(device_info.memory_bytes)}"
            )
        peaks: dict[int, int | None] = {}
        step_peak: StepPeak
        if device.type == "cuda":
            step_peak = in_process_step_peak(runner, meter)
        else:
            step_peak = ChildProcessStepPeak(request.model_spec, request.seed, request.threads)
        fits = fits_under(step_peak, cap, peaks)
        probes_done = 0

        def counted(batch_size: int) -> bool:
            nonlocal probes_done
            report(f"memory limit: batch {batch_size}", probes_done, None)
            fitted = fits(batch_size)
            probes_done += 1
            return fitted

        search = find_memory_limit(counted, max_batch=request.max_batch, resolution=MEMORY_RESOLUTION)
        memory_limit = MemoryLimitInfo(
            batch_size=search.limit,
            capped=search.capped,
            max_batch=search.max_batch,
            first_failing_batch=search.first_failing,
            cap_bytes=cap,
            method=meter.method,
            probes=[MemoryProbe(batch_size=b, fits=f, peak_bytes=peaks.get(b)) for b, f in search.probes],
        )
        if search.limit is None:
            raise ProfileRunError(
                f"MODEL {request.model_spec!r}: not even batch 1 fits under the memory cap {format_size(cap)}"
            )
        limit_batch = search.limit

    sizes = request.batch_sizes if request.batch_sizes is not None else auto_batch_sizes(limit_batch)
    sizes = tuple(size for size in sizes if size <= limit_batch) if request.measure_memory else sizes
    if not sizes:
        raise ProfileRunError(
            f"every batch size asked for is above the memory limit x^o = {limit_batch}; ask for smaller ones"
        )
    points = measure_curve(
        runner,
        sorted(sizes),
        warmup=request.warmup,
        iters=request.iters,
        repeats=request.repeats,
        meter=meter,
        progress=report,
        clock=request.clock,
    )

    gamma: GammaFitInfo | None = None
    if len(points) >= 2:
        fit = fit_gamma([(point.batch_size, point.step_time_s) for point in points])
        gamma = GammaFitInfo(
            launch_overhead_s=fit.launch_overhead_s,
            flat_time_s=fit.flat_time_s,
            per_sample_s=fit.per_sample_s,
            saturation_batch=fit.saturation_batch,
            rms_relative_error=fit.rms_relative_error,
        )
    return Profile(
        schema_version=1,
        name=name,
        model=info,
        device=device_info,
        measurement=Measurement(
            created_at=datetime.now(UTC),
            hpc_elastic_version=__version__,
            warmup=request.warmup,
            iters=request.iters,
            repeats=request.repeats,
            optimizer=OPTIMIZER,
            seed=request.seed,
            clock=request.clock,
            duration_s=time.perf_counter() - began,
            load_average_start=load_start,
            load_average_end=_load_average(),
        ),
        points=points,
        gamma=gamma,
        memory_limit=memory_limit,
    )
