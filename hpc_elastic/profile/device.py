"""The identity of the device a profile was measured on: CPU model and cores, or GPU name, memory and driver
(pynvml when installed, else torch)."""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
from pathlib import Path
from typing import Any

from hpc_elastic.profile.meters import psutil_module
from hpc_elastic.profile.model import torch_module
from hpc_elastic.profile.options import DeviceSpec
from hpc_elastic.profile.schema import DeviceInfo, DeviceKind, slugify


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return " ".join(line.split(":", 1)[1].split())
    return platform.processor() or platform.machine() or "unknown cpu"


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_identity(torch: Any, index: int) -> tuple[str | None, int | None, str | None]:
    """(name, total memory, driver version) from pynvml, or Nones when pynvml is missing or fails."""
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return None, None, None
    try:
        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            name = pynvml.nvmlDeviceGetName(handle)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            driver = pynvml.nvmlSystemGetDriverVersion()
            return _text(name), memory, _text(driver)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml is optional: any NVML failure falls back to torch's view
        return None, None, None


def identify_device(device: DeviceSpec, device_type: str | None) -> DeviceInfo:
    """CPU model and cores, or GPU name and memory (pynvml when installed, else torch)."""
    torch = torch_module()
    cpu = _cpu_model()
    common: dict[str, Any] = {
        "cpu_model": cpu,
        "cpu_count": _cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node() or "unknown",
        "torch_version": str(torch.__version__),
    }
    if device.kind is DeviceKind.CPU:
        memory = int(psutil_module().virtual_memory().total)
        return DeviceInfo(
            kind=DeviceKind.CPU,
            type=slugify(device_type) if device_type else slugify(f"cpu {cpu}"),
            name=cpu,
            memory_bytes=memory,
            **common,
        )
    index = device.index or 0
    properties = torch.cuda.get_device_properties(index)
    name, memory_total, driver = _nvml_identity(torch, index)
    gpu_name = name or str(properties.name)
    return DeviceInfo(
        kind=DeviceKind.CUDA,
        type=slugify(device_type) if device_type else slugify(gpu_name),
        name=gpu_name,
        index=index,
        memory_bytes=memory_total or int(properties.total_memory),
        cuda_version=torch.version.cuda,
        driver_version=driver,
        **common,
    )
