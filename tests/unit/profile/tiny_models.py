"""MODEL factories for the CLI tests (the protocol of hpc_elastic.models)."""

from __future__ import annotations

import torch
from torch import nn

from hpc_elastic.models import ModelBundle


def _batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))


def tiny() -> ModelBundle:
    """An 8 -> 16 -> 4 classifier."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), _batch


def tiny_with_loss() -> ModelBundle:
    """The same with an explicit loss function (the 3-tuple form)."""
    net = nn.Sequential(nn.Linear(8, 4))

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, targets)

    return net, _batch, loss


def not_a_module() -> tuple[str, str]:
    """Breaks the protocol: no nn.Module."""
    return "model", "batch"


def raises() -> ModelBundle:
    """A factory that fails."""
    raise RuntimeError("weights missing")


NOT_CALLABLE = 3
