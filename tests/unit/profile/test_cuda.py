"""The profiler on a CUDA device: peak memory from torch's allocator, identity from pynvml / torch."""

from __future__ import annotations

import pytest
import torch

from hpc_elastic.profile.measure import ProfileRequest, run_profile
from hpc_elastic.profile.options import parse_device
from hpc_elastic.profile.schema import DeviceKind, MemoryMethod

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_profile_on_cuda() -> None:
    request = ProfileRequest(
        model_spec="hpc_elastic.models:mlp",
        device=parse_device("cuda:0"),
        batch_sizes=(1, 64, 1024),
        iters=3,
        warmup=2,
        repeats=3,
        max_batch=1 << 16,
        memory_cap_bytes=64 << 20,  # 64 MiB: small enough that the search stops below max_batch
    )
    profile = run_profile(request)
    assert profile.device.kind is DeviceKind.CUDA
    assert profile.device.memory_bytes is not None and profile.device.memory_bytes > 1 << 30
    limit = profile.memory_limit
    assert limit is not None and limit.method is MemoryMethod.CUDA_PEAK
    assert limit.batch_size is not None and not limit.capped
    fitted = [probe for probe in limit.probes if probe.fits]
    assert fitted and all(probe.peak_bytes is not None and probe.peak_bytes <= 64 << 20 for probe in fitted)
    assert all(point.peak_memory_bytes for point in profile.points)
    assert profile.gamma is not None
