"""DL²'s policy and value networks (§4.1 "NN architecture", §4.3 "Actor-critic").

Both: the flattened state -> a fully connected layer with ReLU whose width is proportional to the state size
(``width_factor x state_size``) -> a hidden fully connected layer with ReLU -> the output. The policy network
outputs one logit per action (the softmax of §4.1 is applied by whoever reads them: the masked choice, the
losses); the value network has the same body and one linear output neuron (§4.3).

Inference outside training runs from the weights in C (:class:`~hpc_elastic.policy.dl2.Network`): a torch call's
overhead is several times the work of a forward pass this small, and a slot takes one pass per allocated task.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from hpc_elastic.policy.dl2 import FloatArray, Layers, Network, StateSpec


@dataclass(frozen=True, slots=True)
class NetShape:
    """The layer widths: the first ``width_factor x state_size`` (at least 16), then ``hidden``."""

    width_factor: float = 1.0
    hidden: int = 128
    #: width of the per-job head's hidden layer (0: no per-job head, the paper's plain MLP)
    row_hidden: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.width_factor <= 16:
            raise ValueError(f"width_factor must be in (0, 16], got {self.width_factor!r}")
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 1:
            raise ValueError(f"hidden must be an int >= 1, got {self.hidden!r}")
        if isinstance(self.row_hidden, bool) or not isinstance(self.row_hidden, int) or self.row_hidden < 0:
            raise ValueError(f"row_hidden must be an int >= 0, got {self.row_hidden!r}")

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
    """States ``(batch, state_size)`` -> action logits ``(batch, 3J + 1)``.

    The paper's MLP, plus (``row_hidden > 0``) a small per-job head: the same two layers applied to every job's
    row of the state give that job's three action logits, added to the MLP's. A rule that depends on the job's
    own row (the teacher's "lowest dominant share first" compares one number per job) is then learnt once for
    all ``J`` rows instead of once per row, which the plain MLP needs data at every row position for.
    """

    def __init__(self, spec: StateSpec, shape: NetShape) -> None:
        super().__init__()
        self.jobs, self.columns = spec.jobs, spec.columns
        self.layers = _body(spec, shape, spec.action_size)
        self.rows: nn.Sequential | None = None
        if shape.row_hidden > 0:
            self.rows = nn.Sequential(
                nn.Linear(spec.columns + 1, shape.row_hidden), nn.ReLU(), nn.Linear(shape.row_hidden, 3)
            )
        #: the per-job head also sees the row's position (its arrival rank, k / J): ties go to the earlier job
        self.register_buffer("position", torch.arange(spec.jobs, dtype=torch.float32).unsqueeze(1) / spec.jobs)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(states)
        if self.rows is None:
            return out
        rows = states.reshape(-1, self.jobs, self.columns)
        position = self.get_buffer("position").expand(rows.shape[0], -1, -1)
        local = self.rows(torch.cat((rows, position), dim=2)).reshape(-1, 3 * self.jobs)
        return out + torch.nn.functional.pad(local, (0, 1))

    def temper(self, temperature: float) -> None:
        """Divide every logit by ``temperature`` (> 0): the output layers' weights and biases, so the greedy
        action (the argmax) stays the same while the softmax flattens; ``ValueError`` naming a bad value."""
        number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not number or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        outputs = [self.layers[-1]] + ([self.rows[-1]] if self.rows is not None else [])
        with torch.no_grad():
            for layer in outputs:
                assert isinstance(layer, nn.Linear)
                layer.weight.div_(temperature)
                layer.bias.div_(temperature)


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


def inference_network(net: PolicyNet) -> Network:
    """The network for inference (:class:`Network`), from a copy of its current weights."""
    rows = linears(net.rows) if net.rows is not None else []
    return Network(linears(net.layers), rows, net.columns)


def linears(module: nn.Sequential) -> Layers:
    """(weight, bias) of each linear layer, as numpy copies."""
    return [
        (m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in module if isinstance(m, nn.Linear)
    ]


class TorchScorer:
    """The policy network's forward pass in torch, one state at a time (to compare with :class:`Network`)."""

    __slots__ = ("_net",)

    def __init__(self, net: PolicyNet) -> None:
        self._net = net

    def __call__(self, state: FloatArray) -> FloatArray:
        with torch.no_grad():
            out = self._net(torch.from_numpy(state.astype(np.float32)).unsqueeze(0))[0]
        result: FloatArray = out.numpy().astype(np.float64)
        return result


def to_arrays(policy: PolicyNet, value: ValueNet) -> dict[str, npt.NDArray[np.float32]]:
    """Both networks' parameters as numpy copies, named ``policy.<param>`` and ``value.<param>``."""
    out: dict[str, npt.NDArray[np.float32]] = {}
    for prefix, net in (("policy", policy), ("value", value)):
        for name, param in net.named_parameters():
            out[f"{prefix}.{name}"] = param.detach().numpy().astype(np.float32)
    return out


def load_arrays(net: nn.Module, prefix: str, arrays: Mapping[str, npt.NDArray[np.float32]]) -> None:
    """Set ``net``'s parameters from ``arrays`` (as :func:`to_arrays` names them); ``ValueError`` on a missing,
    extra or misshapen one."""
    state: dict[str, torch.Tensor] = {}
    names = {name for name, _ in net.named_parameters()}
    extra = {k for k in arrays if k.startswith(f"{prefix}.")} - {f"{prefix}.{n}" for n in names}
    if extra:
        raise ValueError(f"model file: unexpected {prefix} weights {sorted(extra)}")
    for name, param in net.named_parameters():
        array = arrays.get(f"{prefix}.{name}")
        if array is None:
            raise ValueError(f"model file: missing {prefix}.{name}")
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(f"model file: {prefix}.{name} is {array.shape}, the network needs {tuple(param.shape)}")
        state[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    with torch.no_grad():
        for name, param in net.named_parameters():
            param.copy_(state[name])
