"""Versioned, validated JSON schema of a profile (one file per model × device type).

A profile records what ``hpc-elastic profile run`` measured for one model on one device type: the tensor
sizes and skew (Tiresias §3.3), throughput C and the Γ(x) curve with launch overhead Γ(0) and saturation
point x^s (LB-BSP §3.1, §3.2.1, §3.3.1), and the memory limit x^o (LB-BSP §3.3.1(4)). Derived numbers are
checked against the raw ones on load, so a hand-edited file that contradicts itself is rejected.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpc_elastic.profile.curve import GammaFit
from hpc_elastic.profile.skew import largest_tensor_share, shard_skew

SCHEMA_VERSION = 1
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*(@[A-Za-z0-9][A-Za-z0-9_.+-]*)?$"
#: the longest profile name: its file ``<name>.json`` and that file's temporary while it is written
#: (``.<name>.json.tmp-<pid>-<16 hex>``) must fit a file name of 255 bytes
MAX_NAME_LENGTH = 200
DEVICE_TYPE_PATTERN = r"^[a-z0-9][a-z0-9_.+-]*$"
_RELATIVE_TOLERANCE = 1e-6


class DeviceKind(StrEnum):
    """Kind of device a profile was measured on."""

    CPU = "cpu"
    CUDA = "cuda"


class MemoryMethod(StrEnum):
    """How the peak memory of a step was measured."""

    RSS = "rss"  # peak resident set size of the profiling process (psutil; kernel VmHWM on Linux)
    CUDA_PEAK = "cuda-peak"  # torch.cuda.max_memory_reserved after reset_peak_memory_stats


class StepClock(StrEnum):
    """Which clock timed the training steps."""

    WALL = "wall"  # time.perf_counter: elapsed time, what a dedicated device delivers
    PROCESS = "process"  # time.process_time: CPU time of the profiling process (shared hosts, CPU only)


def slugify(text: str) -> str:
    """Lower-case ``text`` and turn every run of other characters than [a-z0-9_.+] into one ``-``."""
    slug = re.sub(r"[^a-z0-9_.+]+", "-", text.lower()).strip("-.")
    if not slug:
        raise ValueError(f"cannot make a name out of {text!r}")
    return slug


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_RELATIVE_TOLERANCE, abs_tol=1e-12)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class TensorInfo(_Strict):
    """One parameter tensor, in model order (the order of round-robin assignment)."""

    name: str = Field(min_length=1)
    shape: list[int]
    bytes: int = Field(ge=0)


class ShardSkew(_Strict):
    """Load skew over K parameter-server shards under round-robin tensor assignment (Tiresias §3.3)."""

    shards: int = Field(ge=1)
    skew: float = Field(ge=1.0)


class ModelInfo(_Strict):
    """What the model is made of: tensor sizes and the skew derived from them."""

    spec: str = Field(min_length=1)
    name: str = Field(pattern=DEVICE_TYPE_PATTERN.replace("a-z", "A-Za-z"))
    num_parameters: int = Field(ge=1)
    parameter_bytes: int = Field(ge=1)
    tensors: list[TensorInfo] = Field(min_length=1)
    largest_tensor_share: float = Field(gt=0.0, le=1.0)
    shard_skew: list[ShardSkew] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> ModelInfo:
        sizes = [tensor.bytes for tensor in self.tensors]
        if sum(sizes) != self.parameter_bytes:
            raise ValueError(
                f"parameter_bytes {self.parameter_bytes} is not the sum of the tensor bytes ({sum(sizes)})"
            )
        if sum(math.prod(tensor.shape) for tensor in self.tensors) != self.num_parameters:
            raise ValueError(f"num_parameters {self.num_parameters} is not the sum of the tensor shapes")
        share = largest_tensor_share(sizes)
        if not _close(share, self.largest_tensor_share):
            raise ValueError(f"largest_tensor_share {self.largest_tensor_share} does not match the tensors ({share})")
        seen: set[int] = set()
        for entry in self.shard_skew:
            if entry.shards in seen:
                raise ValueError(f"shard count {entry.shards} appears twice in shard_skew")
            seen.add(entry.shards)
            expected = shard_skew(sizes, entry.shards)
            if not _close(expected, entry.skew):
                raise ValueError(f"shard_skew for {entry.shards} shards is {entry.skew}, the tensors give {expected}")
        return self

    @property
    def placement_skew(self) -> float:
        """S_J for Tiresias placement (§3.3.2): the largest tensor's share of the model, in (0, 1].

        This is the quantity of Tiresias Table 6 ("for the VGG family and AlexNet, the size of each model is
        dominated by its largest tensor") and the scale of PACKLIMIT (``DEFAULT_PACK_LIMIT = 0.5`` in
        :mod:`hpc_elastic.policy.placement`). It does not depend on the number of shards or workers; the
        round-robin shard skew :meth:`skew_for` lies in [1, K] and must not be compared with PACKLIMIT.
        """
        return self.largest_tensor_share

    def skew_for(self, shards: int) -> float:
        """Recorded skew for K shards, or computed from the tensor sizes when K was not recorded."""
        for entry in self.shard_skew:
            if entry.shards == shards:
                return entry.skew
        return shard_skew([tensor.bytes for tensor in self.tensors], shards)


class DeviceInfo(_Strict):
    """Identity of the device the profile was measured on."""

    kind: DeviceKind
    type: str = Field(pattern=DEVICE_TYPE_PATTERN)  # lookup key, e.g. "cpu-amd-epyc" or a Slurm GPU type
    name: str = Field(min_length=1)  # as reported: CPU model or GPU name
    index: int | None = Field(default=None, ge=0)
    memory_bytes: int | None = Field(default=None, ge=1)  # GPU memory, or host memory for a CPU
    cpu_model: str
    cpu_count: int = Field(ge=1)  # logical CPUs this process may run on
    torch_threads: int = Field(ge=1)
    host: str
    torch_version: str
    cuda_version: str | None = None
    driver_version: str | None = None


class Measurement(_Strict):
    """How the measurement was run."""

    created_at: datetime
    hpc_elastic_version: str
    warmup: int = Field(ge=0)
    iters: int = Field(ge=1)
    repeats: int = Field(ge=1)
    optimizer: str
    seed: int
    clock: StepClock = StepClock.WALL
    duration_s: float = Field(ge=0.0)
    load_average_start: float | None = Field(default=None, ge=0.0)  # host 1-minute load: other work skews timings
    load_average_end: float | None = Field(default=None, ge=0.0)

    @model_validator(mode="after")
    def _aware(self) -> Measurement:
        if self.created_at.tzinfo is None:
            raise ValueError("created_at needs a time zone")
        return self


class CurvePoint(_Strict):
    """Γ(x) and throughput C at one batch size: median over repeats of the mean step time, and its range."""

    batch_size: int = Field(ge=1)
    step_time_s: float = Field(gt=0.0)
    step_time_min_s: float = Field(gt=0.0)
    step_time_max_s: float = Field(gt=0.0)
    batches_per_s: float = Field(gt=0.0)
    samples_per_s: float = Field(gt=0.0)
    peak_memory_bytes: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> CurvePoint:
        if not self.step_time_min_s <= self.step_time_s <= self.step_time_max_s:
            raise ValueError(
                f"step_time_s {self.step_time_s} is outside [{self.step_time_min_s}, {self.step_time_max_s}]"
            )
        if not _close(self.batches_per_s, 1.0 / self.step_time_s):
            raise ValueError(f"batches_per_s {self.batches_per_s} is not 1 / step_time_s")
        if not _close(self.samples_per_s, self.batch_size / self.step_time_s):
            raise ValueError(f"samples_per_s {self.samples_per_s} is not batch_size / step_time_s")
        return self


class GammaFitInfo(_Strict):
    """Fitted Γ(x) (see :mod:`hpc_elastic.profile.curve`)."""

    launch_overhead_s: float = Field(ge=0.0)
    flat_time_s: float
    per_sample_s: float = Field(ge=0.0)
    saturation_batch: int | None = Field(default=None, ge=1)
    rms_relative_error: float = Field(ge=0.0)

    def to_fit(self) -> GammaFit:
        """The fit as a :class:`~hpc_elastic.profile.curve.GammaFit`, whose ``predict(x)`` is Γ(x)."""
        return GammaFit(
            self.launch_overhead_s, self.flat_time_s, self.per_sample_s, self.saturation_batch, self.rms_relative_error
        )


class MemoryProbe(_Strict):
    """One probe of the memory-limit search."""

    batch_size: int = Field(ge=1)
    fits: bool
    peak_bytes: int | None = Field(default=None, ge=0)


class MemoryLimitInfo(_Strict):
    """x^o: the largest batch that fits under ``cap_bytes`` (LB-BSP §3.3.1(4))."""

    batch_size: int | None = Field(ge=1)
    capped: bool  # the search stopped at max_batch, which fitted: x^o >= batch_size
    max_batch: int = Field(ge=1)
    first_failing_batch: int | None = Field(ge=1)  # smallest batch seen not to fit; None when capped
    cap_bytes: int = Field(ge=1)
    method: MemoryMethod
    probes: list[MemoryProbe]

    @model_validator(mode="after")
    def _consistent(self) -> MemoryLimitInfo:
        if self.capped and self.batch_size != self.max_batch:
            raise ValueError(f"a capped search ends at max_batch {self.max_batch}, not {self.batch_size}")
        if self.batch_size is not None and self.batch_size > self.max_batch:
            raise ValueError(f"memory limit {self.batch_size} is above max_batch {self.max_batch}")
        if self.capped != (self.first_failing_batch is None):
            raise ValueError("first_failing_batch is given exactly when the search was not capped")
        if self.first_failing_batch is not None and self.first_failing_batch <= (self.batch_size or 0):
            raise ValueError(
                f"first_failing_batch {self.first_failing_batch} must be above the limit {self.batch_size}"
            )
        return self


class Profile(_Strict):
    """A profile of one model on one device type, schema version 1."""

    schema_version: Literal[1]  # == SCHEMA_VERSION
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)
    model: ModelInfo
    device: DeviceInfo
    measurement: Measurement
    points: list[CurvePoint] = Field(min_length=1)
    gamma: GammaFitInfo | None = None
    memory_limit: MemoryLimitInfo | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        batches = [point.batch_size for point in self.points]
        if batches != sorted(set(batches)):
            raise ValueError(f"points must have increasing, distinct batch sizes, got {batches}")
        if self.gamma is not None and len(self.points) < 2:
            raise ValueError("a Γ(x) fit needs at least two points")
        return self

    @property
    def placement_skew(self) -> float:
        """S_J of the model for placement against PACKLIMIT: :attr:`ModelInfo.placement_skew`."""
        return self.model.placement_skew

    def step_time(self, batch_size: float) -> float:
        """Γ(x) in seconds (LB-BSP §3.1) from the fitted curve; x = 0 gives the launch overhead Γ(0)."""
        if self.gamma is None:
            raise ValueError(f"profile {self.name} has no Γ(x) fit (fewer than two batch sizes were measured)")
        return self.gamma.to_fit().predict(batch_size)

    @property
    def best_point(self) -> CurvePoint:
        """The point with the highest samples/s."""
        return max(self.points, key=lambda point: point.samples_per_s)

    def point(self, batch_size: int) -> CurvePoint | None:
        """The measured point at ``batch_size``, if any."""
        for point in self.points:
            if point.batch_size == batch_size:
                return point
        return None
