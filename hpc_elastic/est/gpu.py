"""CUDA twin of the CPU kernels, compiled on first use from ``kernels/detreduce_cuda.cu``.

Imported lazily (only when a tensor lives on a CUDA device); nothing here runs at import time.
Where nvcc is installed, tests/unit/kernels/test_cuda_build.py compiles it to PTX and checks its float arithmetic;
on a GPU the CUDA tests of tests/unit/kernels and tests/unit/est compare its bits with the CPU kernels' (they
passed on an H200 with torch 2.11; they skip without CUDA).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from hpc_elastic.errors import HpcElasticError

SOURCE_NAME = "detreduce_cuda.cu"
#: no FMA contraction, IEEE division, no flush to zero: the bits must equal the CPU kernels' (the PTX is checked for
#: it in tests/unit/kernels/test_cuda_build.py)
NVCC_FLAGS = ("--fmad=false", "-prec-div=true", "-ftz=false")

T = TypeVar("T")


def source_path() -> Path:
    """``kernels/detreduce_cuda.cu`` of the source tree this package was installed from (editable)."""
    return Path(__file__).resolve().parents[2] / "kernels" / SOURCE_NAME


@lru_cache(maxsize=1)
def cuda_extension() -> Any:
    """Build (once, cached by torch under ~/.cache/torch_extensions) and load ``kernels/detreduce_cuda.cu``:
    ``deposit``, ``combine``, ``finalize`` (argument names as the C kernels') and ``matmul_nt(a, b)``."""
    if not torch.cuda.is_available():
        raise HpcElasticError("CUDA kernels requested but torch sees no CUDA device")
    src = source_path()
    if not src.is_file():
        raise HpcElasticError(f"CUDA kernel source {src} not found (install hpc-elastic from its source tree)")
    # imported when a build is asked for: it pulls in setuptools (0.2 s per process here)
    cpp_extension = importlib.import_module("torch.utils.cpp_extension")
    ext = cpp_extension.load(
        name="hpc_elastic_detreduce_cuda",
        sources=[str(src)],
        extra_cuda_cflags=list(NVCC_FLAGS),
        verbose=False,
    )
    return ext


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and the current stream is capturing a CUDA graph (host reads of device values
    are not allowed then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class CapturedStep(Generic[T]):
    """A step captured in a CUDA graph: :meth:`replay` runs its kernels again on the same memory (new inputs are
    copied into the tensors the step read when it was captured) and returns what the captured run returned, whose
    tensors the replay overwrites."""

    graph: torch.cuda.CUDAGraph
    outputs: T

    def replay(self) -> T:
        self.graph.replay()
        return self.outputs


def capture_step(step: Callable[[], T], warmup: int = 3) -> CapturedStep[T]:
    """Capture ``step`` (a D2 forward, loss and backward on fixed-shape CUDA tensors) in one CUDA graph.

    A D2 step on a GPU runs some 2,000 small single-operation kernels (one per IEEE operation, so that every device
    gets the same bits), and launching them from Python costs more than running them; a graph replays them with one
    launch.  The kernels and their order are the eager step's, so a replay gives its bits.  ``step`` runs ``warmup``
    times eagerly on a side stream first (the CUDA extension's build, the allocator's pools), as torch's whole-network
    capture does; set the parameters' ``.grad`` to None before, so that the backward allocates them in the graph's
    memory and each replay writes them afresh."""
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 eager run, got {warmup}")
    if not torch.cuda.is_available():
        raise HpcElasticError("a CUDA graph needs a CUDA device, and torch sees none")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return CapturedStep(graph, outputs)
