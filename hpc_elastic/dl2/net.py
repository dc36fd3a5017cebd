"""DL²'s policy and value networks (§4.1 "NN architecture", §4.3 "Actor-critic").

Both: the flattened state -> a fully connected layer with ReLU whose width is proportional to the state size
(``width_factor x state_size``) -> a hidden fully connected layer with ReLU -> the output. The policy network
outputs one logit per action (the softmax of §4.1 is applied by whoever reads them: the masked choice, the
losses); the value network has the same body and one linear output neuron (§4.3).

Inference outside training runs in numpy from the weights (:class:`NumpyScorer`): a torch call's overhead is
several times the work of a forward pass this small, and a slot takes one pass per allocated task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hpc_elastic.policy.dl2 import FloatArray, StateSpec


@dataclass(frozen=True, slots=True)
class NetShape:
    """The layer widths: the first ``width_factor x state_size`` (at least 16), then ``hidden``."""

    width_factor: float = 1.0
    hidden: int = 128

    def __post_init__(self) -> None:
        if not 0 < self.width_factor <= 16:
            raise ValueError(f"width_factor must be in (0, 16], got {self.width_factor!r}")
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 1:
            raise ValueError(f"hidden must be an int >= 1, got {self.hidden!r}")

    def first(self, spec: StateSpec) -> int:
        return max(16, round(self.width_factor * spec.state_size))


def _body(spec: StateSpec, shape: NetShape, outputs: int) -> nn.Sequential:
    first = shape.first(spec)
    return nn.Sequential(
        nn.Linear(spec.state_size, first),
        nn.ReLU(),
        nn.Linear(first, shape.hidden),
        nn.ReLU(),
        nn.Linear(shape.hidden, outputs),
    )


class PolicyNet(nn.Module):
    """States ``(batch, state_size)`` -> action logits ``(batch, 3J + 1)``."""

    def __init__(self, spec: StateSpec, shape: NetShape) -> None:
        super().__init__()
        self.layers = _body(spec, shape, spec.action_size)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(states)
        return out


class ValueNet(nn.Module):
    """States ``(batch, state_size)`` -> V(s) ``(batch,)``, a linear output (§4.3)."""

    def __init__(self, spec: StateSpec, shape: NetShape) -> None:
        super().__init__()
        self.layers = _body(spec, shape, 1)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(states).squeeze(-1)
        return out


def masked_log_softmax(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """log π(a|s) over the allowed actions (masked ones get a very low logit, finite to keep gradients finite)."""
    return torch.log_softmax(logits.masked_fill(~masks, -1e9), dim=-1)


class NumpyScorer:
    """The policy network's forward pass in numpy (float32, as torch computes it) from its weights."""

    __slots__ = ("_layers",)

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self._layers = [(np.ascontiguousarray(w.T, dtype=np.float32), b.astype(np.float32)) for w, b in layers]

    @classmethod
    def of(cls, net: PolicyNet) -> NumpyScorer:
        linears = [m for m in net.layers if isinstance(m, nn.Linear)]
        return cls([(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in linears])

    def __call__(self, state: FloatArray) -> FloatArray:
        x = state.astype(np.float32)
        last = len(self._layers) - 1
        for k, (w, b) in enumerate(self._layers):
            x = x @ w + b
            if k < last:
                x = np.maximum(x, 0.0)
        out: FloatArray = x.astype(np.float64)
        return out


class TorchScorer:
    """The policy network's forward pass in torch, one state at a time (to compare with :class:`NumpyScorer`)."""

    __slots__ = ("_net",)

    def __init__(self, net: PolicyNet) -> None:
        self._net = net

    def __call__(self, state: FloatArray) -> FloatArray:
        with torch.no_grad():
            out = self._net(torch.from_numpy(state.astype(np.float32)).unsqueeze(0))[0]
        result: FloatArray = out.numpy().astype(np.float64)
        return result
