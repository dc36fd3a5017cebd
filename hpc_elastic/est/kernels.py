"""The kernels of the deterministic allreduce on tensors: the C extension (or its NumPy reference) on CPU tensors,
the CUDA twin on CUDA tensors (:mod:`hpc_elastic.est.detsum` defines the loops, ``kernels/`` implements them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hpc_elastic.est.detsum import Kernels, cpu_kernels
from hpc_elastic.est.gpu import cuda_extension


def _as_numpy(t: torch.Tensor) -> Any:
    return t.numpy()  # zero-copy view of a CPU tensor


def _as_tensor(t: torch.Tensor) -> Any:
    return t


class TensorKernels:
    """The loops of the deterministic allreduce (:mod:`hpc_elastic.est.detsum`) on tensors.

    Forwards every call to ``impl`` — a :class:`~hpc_elastic.est.detsum.Kernels` (C extension or NumPy
    reference) or the CUDA extension, which share argument names — after ``to_arg`` has turned each tensor
    into what ``impl`` takes (a NumPy view on CPU, the tensor itself on CUDA).
    """

    def __init__(self, name: str, impl: Any, to_arg: Callable[[torch.Tensor], Any] = _as_tensor) -> None:
        self.name = name
        self._impl = impl
        self._arg = to_arg

    @classmethod
    def for_cpu(cls, kernels: Kernels | None = None) -> TensorKernels:
        """The CPU kernels (the C extension unless ``kernels`` says otherwise) on CPU tensors."""
        k = kernels if kernels is not None else cpu_kernels()
        return cls(k.name, k, _as_numpy)

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
        a = self._arg
        self._impl.deposit(a(grad), a(hi), a(lo), a(tops), chunk=chunk, width=width, first=first, clear=clear)

    def combine(
        self, hi: torch.Tensor, lo: torch.Tensor, ltops: torch.Tensor, gtops: torch.Tensor, *, chunk: int, width: int
    ) -> None:
        a = self._arg
        self._impl.combine(a(hi), a(lo), a(ltops), a(gtops), chunk=chunk, width=width)

    def tops(self, grad: torch.Tensor, tops: torch.Tensor, *, chunk: int, width: int) -> None:
        a = self._arg
        self._impl.tops(a(grad), a(tops), chunk=chunk, width=width)

    def fold(
        self,
        grad: torch.Tensor,
        hi: torch.Tensor,
        lo: torch.Tensor,
        bin_tops: torch.Tensor,
        gtops: torch.Tensor,
        *,
        chunk: int,
        width: int,
        have_bins: bool,
    ) -> None:
        a = self._arg
        self._impl.fold(a(grad), a(hi), a(lo), a(bin_tops), a(gtops), chunk=chunk, width=width, have_bins=have_bins)

    def finalize(
        self, v: torch.Tensor, gtops: torch.Tensor, out: torch.Tensor, *, chunk: int, width: int, divisor: float
    ) -> None:
        a = self._arg
        self._impl.finalize(a(v), a(gtops), a(out), chunk=chunk, width=width, divisor=float(divisor))

    def owner_sum(self, rows: torch.Tensor, acc: torch.Tensor, tops: torch.Tensor, *, chunk: int, width: int) -> None:
        a = self._arg
        self._impl.owner_sum(a(rows), a(acc), a(tops), chunk=chunk, width=width)


def tensor_kernels(device: torch.device) -> TensorKernels:
    if device.type == "cpu":
        return TensorKernels.for_cpu()
    if device.type == "cuda":
        return TensorKernels("cuda", cuda_extension())
    raise ValueError(f"no deterministic-allreduce kernels for device {device}")
