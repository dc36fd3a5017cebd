"""D2, heterogeneous determinism (EasyScale §3.3): hardware-agnostic operators and a model scanner.

Covered operators (identical bits on any CPU and, through ``kernels/detreduce_cuda.cu``, on any CUDA
GPU):

- ``nn.Linear`` -> :class:`DetLinear`: forward and all three backward products run the fixed-order
  8-lane dot product of ``kernels/`` (no BLAS, no FMA contraction, no thread-count dependence); the bias
  add is one IEEE addition per element;
- ``nn.ReLU``, ``nn.Identity``, ``nn.Flatten``, ``nn.Unflatten``: exact (comparisons and copies);
- containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) whose children are covered.

So MLP blocks made of Linear and ReLU are covered.  Everything else is reported: BatchNorm and LayerNorm
(reductions in backend-specific order), Dropout (CPU and CUDA generators draw different masks),
convolutions (vendor algorithm choice, §3.3), activations computed with transcendental functions (libm and
CUDA's math library round differently), and modules with their own ``forward`` code, which the scanner
cannot see (:func:`register_d2_module` vouches for such a class).  The loss function is outside the scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import nn

from hpc_elastic.est.detsum import cpu_kernels
from hpc_elastic.est.gpu import cuda_extension


def det_matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` with the fixed summation order of ``kernels/`` (float32, 2-D)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"det_matmul_nt needs [m, k] and [n, k] matrices, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"det_matmul_nt supports float32 only, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"operands on different devices: {a.device} and {b.device}")
    a = a.detach().contiguous()
    b = b.detach().contiguous()
    if a.device.type == "cuda":
        out_gpu: torch.Tensor = cuda_extension().matmul_nt(a, b)
        return out_gpu
    if a.device.type != "cpu":
        raise ValueError(f"no D2 kernel for device {a.device}")
    out = torch.empty((a.shape[0], b.shape[0]), dtype=torch.float32)
    an: np.ndarray[Any, Any] = a.numpy()
    cpu_kernels().matmul_nt(an, b.numpy(), out.numpy())
    return out


class _DetLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = det_matmul_nt(x2, weight)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.lead = lead
        return out.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, weight.shape[0]).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = det_matmul_nt(g2, weight.t().contiguous()).reshape(*ctx.lead, weight.shape[1])
        gt = g2.t().contiguous() if (ctx.needs_input_grad[1] or ctx.has_bias) else None
        if ctx.needs_input_grad[1] and gt is not None:
            gw = det_matmul_nt(gt, x2.t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2] and gt is not None:
            ones = torch.ones((1, g2.shape[0]), dtype=torch.float32, device=g2.device)
            gb = det_matmul_nt(ones, gt).reshape(weight.shape[0])
        return gx, gw, gb


class DetLinear(nn.Linear):
    """``nn.Linear`` computed by the deterministic kernels (same parameters, same state dict)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _DetLinearFn.apply(input, self.weight, self.bias)  # type: ignore[no-untyped-call]
        return out


class D2Status(StrEnum):
    COVERED = "covered"
    CONVERTIBLE = "convertible"  # nn.Linear: to_d2() swaps in DetLinear
    NOT_COVERED = "not-covered"
    UNKNOWN = "unknown"  # own forward code the scanner cannot inspect


_EXACT: tuple[type[nn.Module], ...] = (nn.ReLU, nn.Identity, nn.Flatten, nn.Unflatten)
_CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_REASONS: tuple[tuple[tuple[type[nn.Module], ...], str], ...] = (
    (
        (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm),
        "normalisation reduces in a backend-specific order",
    ),
    ((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout), "CPU and CUDA generators draw different masks"),
    ((nn.modules.conv._ConvNd,), "convolution algorithms are chosen by the vendor library"),
    (
        (nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Softmax, nn.LogSoftmax, nn.ELU, nn.Softplus, nn.Mish),
        "transcendental functions round differently in libm and CUDA",
    ),
    ((nn.MultiheadAttention, nn.RNNBase, nn.Embedding), "no deterministic kernel in kernels/ yet"),
)
_VOUCHED: set[type[nn.Module]] = set()


def register_d2_module(cls: type[nn.Module]) -> type[nn.Module]:
    """Declare that ``cls.forward`` only composes its (scanned) children with exact element-wise ops."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"register_d2_module needs an nn.Module subclass, got {cls!r}")
    _VOUCHED.add(cls)
    return cls


@dataclass(frozen=True)
class D2Finding:
    path: str
    kind: str
    status: D2Status
    note: str


@dataclass(frozen=True)
class D2Report:
    findings: tuple[D2Finding, ...]

    @property
    def holds(self) -> bool:
        """D2 holds now: every module is covered."""
        return all(f.status is D2Status.COVERED for f in self.findings)

    @property
    def holds_after_conversion(self) -> bool:
        """D2 would hold after :func:`to_d2`."""
        return all(f.status in (D2Status.COVERED, D2Status.CONVERTIBLE) for f in self.findings)

    def problems(self) -> list[D2Finding]:
        return [f for f in self.findings if f.status is not D2Status.COVERED]

    def first_problem(self) -> str:
        p = self.problems()
        if not p:
            return "none"
        f = p[0]
        more = f" (+{len(p) - 1} more)" if len(p) > 1 else ""
        return f"{f.kind} at '{f.path or '<root>'}' is {f.status.value}: {f.note}{more}"

    def lines(self) -> list[str]:
        return [f"{f.status.value:12s} {f.path or '<root>'} ({f.kind}): {f.note}" for f in self.findings]


def _classify(module: nn.Module) -> tuple[D2Status, str]:
    cls = type(module)
    if isinstance(module, DetLinear):
        return D2Status.COVERED, "deterministic 8-lane kernel (kernels/detreduce.c, detreduce_cuda.cu)"
    if cls is nn.Linear:
        return D2Status.CONVERTIBLE, "to_d2() replaces it by DetLinear"
    if cls in _EXACT:
        return D2Status.COVERED, "exact on every device"
    if cls in _CONTAINERS:
        return D2Status.COVERED, "container"
    if cls in _VOUCHED:
        return D2Status.COVERED, "registered with register_d2_module"
    for types, reason in _REASONS:
        if isinstance(module, types):
            return D2Status.NOT_COVERED, reason
    return D2Status.UNKNOWN, "own forward code; register_d2_module() if it only composes covered children"


def scan_model(model: nn.Module) -> D2Report:
    """Report, module by module, whether D2 holds for ``model``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"scan_model needs an nn.Module, got {type(model).__name__}")
    findings = []
    for path, module in model.named_modules():
        status, note = _classify(module)
        findings.append(D2Finding(path, type(module).__name__, status, note))
    return D2Report(tuple(findings))


def to_d2(model: nn.Module) -> nn.Module:
    """Swap every plain ``nn.Linear`` of ``model`` for :class:`DetLinear` in place (parameters, hooks and
    optimizer references are kept: only the class changes)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DetLinear
    return model
