"""CUDA twin of the CPU kernels, compiled on first use from ``kernels/detreduce_cuda.cu``.

Imported lazily (only when a tensor lives on a CUDA device); nothing here runs at import time.
UNTESTED ON A GPU: no GPU was available while this was written; the unit tests skip without CUDA.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from hpc_elastic.errors import HpcElasticError

SOURCE_NAME = "detreduce_cuda.cu"


def source_path() -> Path:
    """``kernels/detreduce_cuda.cu`` of the source tree this package was installed from (editable)."""
    return Path(__file__).resolve().parents[2] / "kernels" / SOURCE_NAME


class CudaKernels:
    name = "cuda"

    def __init__(self, ext: Any) -> None:
        self._x = ext

    def deposit(
        self,
        grad: torch.Tensor,
        hi: torch.Tensor,
        lo: torch.Tensor,
        tops: torch.Tensor,
        *,
        chunk: int,
        width: int,
        first: bool,
        clear: bool,
    ) -> None:
        self._x.deposit(grad, hi, lo, tops, chunk, width, first, clear)

    def combine(
        self, hi: torch.Tensor, lo: torch.Tensor, ltops: torch.Tensor, gtops: torch.Tensor, *, chunk: int, width: int
    ) -> None:
        self._x.combine(hi, lo, ltops, gtops, chunk, width)

    def finalize(
        self, v: torch.Tensor, gtops: torch.Tensor, out: torch.Tensor, *, chunk: int, width: int, divisor: float
    ) -> None:
        self._x.finalize(v, gtops, out, chunk, width, float(divisor))

    def matmul_nt(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._x.matmul_nt(a, b)
        return out


@lru_cache(maxsize=1)
def cuda_kernels() -> CudaKernels:
    """Build (once, cached by torch under ~/.cache/torch_extensions) and load the CUDA kernels."""
    if not torch.cuda.is_available():
        raise HpcElasticError("CUDA kernels requested but torch sees no CUDA device")
    src = source_path()
    if not src.is_file():
        raise HpcElasticError(f"CUDA kernel source {src} not found (install hpc-elastic from its source tree)")
    from torch.utils.cpp_extension import load

    ext = load(
        name="hpc_elastic_detreduce_cuda",
        sources=[str(src)],
        # no FMA contraction and IEEE division/sqrt: the bits must equal the CPU kernels'
        extra_cuda_cflags=["--fmad=false", "-prec-div=true", "-ftz=false"],
        verbose=False,
    )
    return CudaKernels(ext)
