"""D2, heterogeneous determinism (EasyScale §3.3): the model scanner and the conversion to D2 operators.

Covered operators (identical bits on any CPU and any CUDA GPU by construction: see
:mod:`hpc_elastic.est.d2_math` for why, :mod:`hpc_elastic.est.d2_ops` for the operators):

- after :func:`to_d2`, which swaps the class of each module (parameters, buffers and state dict unchanged):
  ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` (zero padding, any groups), ``nn.BatchNorm1d/2d/3d``,
  ``nn.LayerNorm``, ``nn.GroupNorm``,
  ``nn.Embedding`` (no max_norm, dense gradients), ``nn.MaxPool2d`` (no ceil_mode), ``nn.AdaptiveAvgPool2d``
  (output sizes dividing the input's; others fail at the forward), ``nn.Sigmoid``, ``nn.Tanh``, ``nn.SiLU``,
  ``nn.GELU``, ``nn.Softmax`` and ``nn.LogSoftmax`` (with a dim), ``nn.MultiheadAttention`` (no dropout, bias_kv
  or zero attention), ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` (ReLU, GELU or a module
  as activation) and ``nn.TransformerEncoder`` (their forwards without torch's fused inference paths),
  ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` (no dropout, projections or packed sequences), ``nn.Dropout`` with
  ``p = 0``;
- exact as they are: ``nn.ReLU``, ``nn.Identity``, ``nn.Flatten``, ``nn.Unflatten`` (comparisons and copies);
- containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``), ``nn.TransformerDecoder`` and
  ``nn.Transformer`` (forwards that pass tensors between their children), and the classes vouched for by
  :func:`register_d2_module` (forward code that only composes covered children with exact element-wise ops; the
  reference models of :mod:`hpc_elastic.models` listed in ``D2_COMPOSITE_MODULES`` are vouched for here).

Everything else is reported with its reason: Dropout with ``p > 0`` (CPU and CUDA generators draw different masks),
InstanceNorm, other convolutions, RNN cells (no D2 kernel), other activations, and modules with their own ``forward``
code, which the scanner cannot see.  The loss function is outside the scan: use
:func:`hpc_elastic.est.d2_ops.det_cross_entropy`.

The optimizer's update is scanned apart (:func:`scan_optimizer`): torch's SGD, Adam and AdamW become their D2 twins
of :mod:`hpc_elastic.est.d2_optim` (:func:`optimizer_to_d2`, the class swapped, options and state kept); any other
optimizer, or one with ``fused``, ``capturable``, ``differentiable`` or a tensor learning rate, is not covered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from hpc_elastic.est import d2_ops, d2_optim
from hpc_elastic.models import D2_COMPOSITE_MODULES


class D2Status(StrEnum):
    COVERED = "covered"
    CONVERTIBLE = "convertible"  # to_d2() swaps in the D2 operator
    NOT_COVERED = "not-covered"
    UNKNOWN = "unknown"  # own forward code the scanner cannot inspect


_EXACT: tuple[type[nn.Module], ...] = (nn.ReLU, nn.Identity, nn.Flatten, nn.Unflatten)
_CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
#: torch modules whose forward only passes tensors between their children (shape checks, a host-side comparison of a
#: mask with the causal one): covered when the children are
_TORCH_COMPOSITES: tuple[type[nn.Module], ...] = (nn.TransformerDecoder, nn.Transformer)


def _always(module: Any) -> str | None:
    return None


#: stock class -> (its D2 operator, why a given instance cannot be converted or None)
_CONVERSIONS: dict[type[nn.Module], tuple[type[nn.Module], Callable[[Any], str | None]]] = {
    nn.Linear: (d2_ops.DetLinear, _always),
    nn.Conv1d: (d2_ops.DetConv1d, d2_ops.conv2d_unsupported),
    nn.Conv2d: (d2_ops.DetConv2d, d2_ops.conv2d_unsupported),
    nn.BatchNorm1d: (d2_ops.DetBatchNorm1d, _always),
    nn.BatchNorm2d: (d2_ops.DetBatchNorm2d, _always),
    nn.BatchNorm3d: (d2_ops.DetBatchNorm3d, _always),
    nn.LayerNorm: (d2_ops.DetLayerNorm, _always),
    nn.GroupNorm: (d2_ops.DetGroupNorm, _always),
    nn.Embedding: (d2_ops.DetEmbedding, d2_ops.embedding_unsupported),
    nn.MaxPool2d: (d2_ops.DetMaxPool2d, d2_ops.maxpool2d_unsupported),
    nn.AdaptiveAvgPool2d: (d2_ops.DetAdaptiveAvgPool2d, _always),
    nn.Sigmoid: (d2_ops.DetSigmoid, _always),
    nn.Tanh: (d2_ops.DetTanh, _always),
    nn.SiLU: (d2_ops.DetSiLU, _always),
    nn.GELU: (d2_ops.DetGELU, _always),
    nn.Softmax: (d2_ops.DetSoftmax, d2_ops.softmax_unsupported),
    nn.LogSoftmax: (d2_ops.DetLogSoftmax, d2_ops.softmax_unsupported),
    nn.Dropout: (d2_ops.DetDropout, d2_ops.dropout_unsupported),
    nn.MultiheadAttention: (d2_ops.DetMultiheadAttention, d2_ops.mha_unsupported),
    nn.modules.linear.NonDynamicallyQuantizableLinear: (d2_ops.DetLinear, _always),  # attention's out_proj
    nn.TransformerEncoderLayer: (d2_ops.DetTransformerEncoderLayer, d2_ops.transformer_layer_unsupported),
    nn.TransformerEncoder: (d2_ops.DetTransformerEncoder, _always),
    nn.TransformerDecoderLayer: (d2_ops.DetTransformerDecoderLayer, d2_ops.transformer_layer_unsupported),
    nn.RNN: (d2_ops.DetRNN, d2_ops.rnn_unsupported),
    nn.LSTM: (d2_ops.DetLSTM, d2_ops.rnn_unsupported),
    nn.GRU: (d2_ops.DetGRU, d2_ops.rnn_unsupported),
}
_D2_CLASSES: frozenset[type[nn.Module]] = frozenset(det for det, _ in _CONVERSIONS.values())
_REASONS: tuple[tuple[tuple[type[nn.Module], ...], str], ...] = (
    (
        (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout),
        "CPU and CUDA generators draw different masks",
    ),
    (
        (nn.modules.instancenorm._InstanceNorm, nn.SyncBatchNorm, nn.LocalResponseNorm),
        "no D2 operator for this normalisation",
    ),
    ((nn.modules.conv._ConvNd,), "no D2 operator for this convolution (Conv1d and Conv2d are covered)"),
    ((nn.RNNBase, nn.RNNCellBase), "no D2 operator (RNN, LSTM and GRU are covered, their cells are not)"),
    (
        (nn.ELU, nn.Softplus, nn.Mish, nn.CELU, nn.SELU, nn.Hardswish, nn.LogSigmoid, nn.Softmin, nn.Softmax2d),
        "no D2 operator for this activation (transcendental functions round differently in libm and CUDA)",
    ),
    ((nn.modules.pooling._AvgPoolNd, nn.modules.pooling._MaxPoolNd), "no D2 operator for this pooling"),
)
_VOUCHED: set[type[nn.Module]] = set(D2_COMPOSITE_MODULES)


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
    if cls in _D2_CLASSES:
        return D2Status.COVERED, "D2 operator (hpc_elastic/est/d2_ops.py)"
    conversion = _CONVERSIONS.get(cls)
    if conversion is not None:
        det, unsupported = conversion
        reason = unsupported(module)
        if reason is None:
            return D2Status.CONVERTIBLE, f"to_d2() replaces it by {det.__name__}"
        return D2Status.NOT_COVERED, f"{det.__name__} does not support {reason}"
    if cls in _EXACT:
        return D2Status.COVERED, "exact on every device"
    if cls in _CONTAINERS:
        return D2Status.COVERED, "container"
    if cls in _TORCH_COMPOSITES:
        return D2Status.COVERED, "composes its children (torch's forward)"
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
        hooks = _hooks(module)
        if hooks and status in (D2Status.COVERED, D2Status.CONVERTIBLE):
            # nn.utils.weight_norm / spectral_norm keep the class and reparametrise in a forward pre-hook
            status, note = D2Status.UNKNOWN, f"{hooks} hook(s) run code the scanner cannot inspect"
        findings.append(D2Finding(path, type(module).__name__, status, note))
    if _global_hooks():
        findings.append(
            D2Finding("", "module hooks", D2Status.UNKNOWN, "global module hooks run code the scanner cannot inspect")
        )
    return D2Report(tuple(findings))


def _hooks(module: nn.Module) -> int:
    """How many forward and backward hooks ``module`` has (its own; torch's private tables, read only)."""
    tables = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return sum(len(getattr(module, table, None) or ()) for table in tables)


def _global_hooks() -> bool:
    """Whether ``torch.nn.modules.module.register_module_forward_hook`` and its kin hooked every module."""
    tables = (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    )
    return any(getattr(torch_module, table, None) for table in tables)


def to_d2(model: nn.Module) -> nn.Module:
    """Swap, in place, every module of a class D2 converts (and in a configuration it supports) for its D2 operator:
    parameters, buffers, hooks and optimizer references are kept, only the class changes."""
    for module in model.modules():
        conversion = _CONVERSIONS.get(type(module))
        if conversion is not None and conversion[1](module) is None:
            module.__class__ = conversion[0]
    return model


#: torch optimizer class -> its D2 twin (the same class with a device-independent ``step``)
_OPTIMIZER_CONVERSIONS: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {
    torch.optim.SGD: d2_optim.DetSGD,
    torch.optim.Adam: d2_optim.DetAdam,
    torch.optim.AdamW: d2_optim.DetAdamW,
}
_D2_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(_OPTIMIZER_CONVERSIONS.values())


def scan_optimizer(optimizer: torch.optim.Optimizer) -> D2Finding:
    """Whether D2 holds for ``optimizer``'s update (path ``optimizer``, kind its class)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"scan_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls = type(optimizer)
    if cls in _D2_OPTIMIZERS:
        status, note = D2Status.COVERED, "D2 update (hpc_elastic/est/d2_optim.py)"
    elif cls in _OPTIMIZER_CONVERSIONS:
        det = _OPTIMIZER_CONVERSIONS[cls]
        reason = d2_optim.optimizer_unsupported(optimizer)
        if reason is None:
            status, note = D2Status.CONVERTIBLE, f"optimizer_to_d2() replaces it by {det.__name__}"
        else:
            status, note = D2Status.NOT_COVERED, f"{det.__name__} does not support {reason}"
    else:
        status, note = (
            D2Status.NOT_COVERED,
            "no D2 update for this optimizer (torch's CUDA and CPU updates round differently): use SGD, Adam or AdamW",
        )
    return D2Finding("optimizer", cls.__name__, status, note)


def optimizer_to_d2(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Swap, in place, ``optimizer``'s class for its D2 twin when it has one and supports its options: the
    parameter groups, options and state are kept, only ``step`` changes."""
    det = _OPTIMIZER_CONVERSIONS.get(type(optimizer))
    if det is not None and d2_optim.optimizer_unsupported(optimizer) is None:
        optimizer.__class__ = det
    return optimizer
