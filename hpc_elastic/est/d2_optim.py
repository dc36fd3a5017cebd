"""D2 optimizer updates: SGD, Adam and AdamW whose parameter bits do not depend on the device (EasyScale §3.3's D2
carried from the operators to the update that follows the deterministic allreduce).

torch's own updates are not such. On an H200 (torch 2.11) against the same wheel's CPU kernels, three steps of
``torch.optim.Adam``, ``AdamW`` and ``RMSprop`` gave other bits on CUDA than on the CPU, ``foreach`` on and off
(measured once, not kept as a test: it says nothing about our code). torch's SGD gave the same bits there, but by
torch's source its ``add_(d, alpha=-lr)`` forms ``p + alpha * d`` with ``fmadd``: one rounding on a CPU build with
FMA, two on one without, so its bits depend on the CPU.

The classes below keep torch's classes, options, ``param_groups`` and state (``state_dict`` loads either way), and
replace ``step`` with updates built only from torch's eager element-wise kernels that run one IEEE operation per
element: ``*`` and ``+``/``-`` by a tensor or a Python number (never ``alpha=``, which a kernel may fuse), ``/`` by
a tensor (CUDA divides by a Python number as a multiplication by its reciprocal), ``neg``, ``maximum``, each
correctly rounded in float32 on the CPU and on CUDA, and the square root of :func:`hpc_elastic.est.d2_math.det_sqrt`
(torch's float32 ``sqrt`` on the CPU is not correctly rounded). So every device gives the same bits. Python numbers
(learning rate, bias corrections) are formed in double precision on the host, the same on every device, and rounded
once to float32 by the kernel.

:func:`hpc_elastic.est.d2.optimizer_to_d2` swaps a torch optimizer's class for its D2 twin in place;
:func:`hpc_elastic.est.d2.scan_optimizer` says whether D2 holds for an optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hpc_elastic.est.d2_math import det_sqrt


def _sgd_update(p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """torch.optim.SGD's update (its documented algorithm), one rounding per operation."""
    lr, momentum, dampening = float(group["lr"]), float(group["momentum"]), float(group["dampening"])
    weight_decay = float(group["weight_decay"])
    d = grad.neg() if group["maximize"] else grad
    if weight_decay != 0.0:
        d = torch.add(d, torch.mul(p, weight_decay))
    if momentum != 0.0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = torch.clone(d).detach()
            state["momentum_buffer"] = buf
        else:
            buf.mul_(momentum)
            buf.add_(d if dampening == 0.0 else torch.mul(d, 1.0 - dampening))
        d = torch.add(d, torch.mul(buf, momentum)) if group["nesterov"] else buf
    p.sub_(torch.mul(d, lr))


def _adam_update(p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """Adam (Kingma & Ba, Algorithm 1, with torch's eps placement and amsgrad) and AdamW (decoupled weight decay,
    Loshchilov & Hutter), one rounding per operation."""
    lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    step = int(state["step"].item())
    g = grad.neg() if group["maximize"] else grad
    if weight_decay != 0.0:
        if group.get("decoupled_weight_decay", False):
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = torch.add(g, torch.mul(p, weight_decay))
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.mul_(beta1)
    exp_avg.add_(torch.mul(g, 1.0 - beta1))
    exp_avg_sq.mul_(beta2)
    exp_avg_sq.add_(torch.mul(torch.mul(g, g), 1.0 - beta2))
    second = exp_avg_sq
    if group["amsgrad"]:
        torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
        second = state["max_exp_avg_sq"]
    denom = det_sqrt(second)
    denom.mul_(1.0 / math.sqrt(1.0 - beta2**step))
    denom.add_(eps)
    update = torch.div(exp_avg, denom)
    update.mul_(lr / (1.0 - beta1**step))
    p.sub_(update)


def _step(
    optimizer: torch.optim.Optimizer,
    update: Callable[[Tensor, Tensor, dict[str, Any], dict[str, Any]], None],
    closure: Callable[[], float] | None,
) -> float | None:
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(optimizer).__name__} does not support sparse gradients")
                update(p, p.grad, optimizer.state[p], group)
    return loss


class DetSGD(torch.optim.SGD):
    """torch.optim.SGD with the device-independent update (see the module docstring)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return _step(self, _sgd_update, closure)


class DetAdam(torch.optim.Adam):
    """torch.optim.Adam with the device-independent update (see the module docstring)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return _step(self, _adam_update, closure)


class DetAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with the device-independent update (see the module docstring)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return _step(self, _adam_update, closure)


def optimizer_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the D2 twin cannot take ``optimizer``'s options over, or None."""
    for group in optimizer.param_groups:
        for option in ("fused", "capturable", "differentiable"):
            if group.get(option):
                return f"{option}=True"
        if isinstance(group.get("lr"), Tensor):
            return "a tensor learning rate"
        if any(isinstance(b, Tensor) for b in group.get("betas", ())):
            return "tensor betas"
    return None
