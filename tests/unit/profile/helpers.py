"""Shared builders for the profile tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from torch import nn

from hpc_elastic.profile import schema
from hpc_elastic.profile.skew import shard_skew


def point(batch: int, seconds: float) -> schema.CurvePoint:
    return schema.CurvePoint(
        batch_size=batch,
        step_time_s=seconds,
        step_time_min_s=seconds * 0.9,
        step_time_max_s=seconds * 1.2,
        batches_per_s=1 / seconds,
        samples_per_s=batch / seconds,
        peak_memory_bytes=1000 + batch,
    )


def make_profile(
    model: str = "toy",
    device_type: str = "cpu-test",
    created_at: datetime | None = None,
    name: str | None = None,
) -> schema.Profile:
    sizes = [48, 12, 24, 8]  # float32 tensors of 12, 3, 6 and 2 elements
    tensors = [
        schema.TensorInfo(name="a.weight", shape=[4, 3], bytes=48),
        schema.TensorInfo(name="a.bias", shape=[3], bytes=12),
        schema.TensorInfo(name="b.weight", shape=[2, 3], bytes=24),
        schema.TensorInfo(name="b.bias", shape=[2], bytes=8),
    ]
    return schema.Profile(
        schema_version=1,
        name=name or f"{model}@{device_type}",
        model=schema.ModelInfo(
            spec=f"tests.unit.profile.tiny_models:{model}",
            name=model,
            num_parameters=12 + 3 + 6 + 2,
            parameter_bytes=sum(sizes),
            tensors=tensors,
            largest_tensor_share=48 / 92,
            shard_skew=[schema.ShardSkew(shards=k, skew=shard_skew(sizes, k)) for k in (2, 4)],
        ),
        device=schema.DeviceInfo(
            kind=schema.DeviceKind.CPU,
            type=device_type,
            name="Test CPU",
            memory_bytes=1 << 30,
            cpu_model="Test CPU",
            cpu_count=2,
            torch_threads=2,
            host="testhost",
            torch_version="2.13.0",
        ),
        measurement=schema.Measurement(
            created_at=created_at or datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
            hpc_elastic_version="0.1.0",
            warmup=1,
            iters=2,
            repeats=3,
            optimizer="sgd",
            seed=0,
            duration_s=1.5,
        ),
        points=[point(1, 0.002), point(4, 0.003), point(16, 0.008)],
        gamma=schema.GammaFitInfo(
            launch_overhead_s=0.0017,
            flat_time_s=0.0017,
            per_sample_s=0.0004,
            saturation_batch=None,
            rms_relative_error=0.01,
        ),
        memory_limit=schema.MemoryLimitInfo(
            batch_size=40,
            capped=False,
            max_batch=64,
            first_failing_batch=41,
            cap_bytes=1 << 20,
            method=schema.MemoryMethod.RSS,
            probes=[schema.MemoryProbe(batch_size=64, fits=False, peak_bytes=2 << 20)],
        ),
    )


def profile_dict(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = make_profile().model_dump(mode="json")
    data.update(overrides)
    return data


class TwoLinear(nn.Module):
    """Known tensor sizes: 12 + 3 + 6 + 2 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2)
