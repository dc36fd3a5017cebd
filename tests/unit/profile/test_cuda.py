"""The profiler on a CUDA device: peak memory from torch's allocator, identity from pynvml / torch."""

from __future__ import annotations

import pytest
import torch

from hpc_elastic.profile.measure import ProfileRequest, run_profile
from hpc_elastic.profile.meters import CudaPeakMeter, in_process_step_peak
from hpc_elastic.profile.model import load_model
from hpc_elastic.profile.options import parse_device
from hpc_elastic.profile.schema import DeviceKind, MemoryMethod
from hpc_elastic.profile.step import StepRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


SPEC = "hpc_elastic.models:mlp"


def peak_at_batch_1() -> int:
    """What one step at batch 1 reserves, as the profiler measures it: parameters, momentum and the cuBLAS
    workspace (more than 64 MiB together on an H200 with torch 2.11), so the test's cap is set above it."""
    device = torch.device("cuda", 0)
    runner = StepRunner(load_model(SPEC), device, seed=0)
    runner.step(*runner.batch(1))
    runner.sync()
    runner.snapshot()
    peak = in_process_step_peak(runner, CudaPeakMeter(device))(1)
    assert peak is not None
    return peak


def test_profile_on_cuda() -> None:
    cap = peak_at_batch_1() + (32 << 20)  # 32 MiB above batch 1: the search stops below max_batch
    request = ProfileRequest(
        model_spec=SPEC,
        device=parse_device("cuda:0"),
        batch_sizes=(1, 64, 1024),
        iters=3,
        warmup=2,
        repeats=3,
        max_batch=1 << 16,
        memory_cap_bytes=cap,
    )
    profile = run_profile(request)
    assert profile.device.kind is DeviceKind.CUDA
    assert profile.device.memory_bytes is not None and profile.device.memory_bytes > 1 << 30
    limit = profile.memory_limit
    assert limit is not None and limit.method is MemoryMethod.CUDA_PEAK
    assert limit.batch_size is not None and not limit.capped
    fitted = [probe for probe in limit.probes if probe.fits]
    assert fitted and all(probe.peak_bytes is not None and probe.peak_bytes <= cap for probe in fitted)
    assert all(point.peak_memory_bytes for point in profile.points)
    assert profile.gamma is not None
