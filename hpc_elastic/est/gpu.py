"""CUDA twin of the CPU kernels, compiled on first use from ``kernels/detreduce_cuda.cu``.

Imported lazily (only when a tensor lives on a CUDA device); nothing here runs at import time.
Where nvcc is installed, tests/unit/kernels/test_cuda_build.py compiles it to PTX and checks its float arithmetic;
on a GPU the CUDA tests of tests/unit/kernels and tests/unit/est compare its bits with the CPU kernels' (they
passed on an H200 with torch 2.11; they skip without CUDA).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from hpc_elastic.errors import HpcElasticError

SOURCE_NAME = "detreduce_cuda.cu"
#: no FMA contraction, IEEE division, no flush to zero: the bits must equal the CPU kernels' (the PTX is checked for
#: it in tests/unit/kernels/test_cuda_build.py)
NVCC_FLAGS = ("--fmad=false", "-prec-div=true", "-ftz=false")


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
