"""Weighted gradient aggregation (LB-BSP §3.4, Eq. 7) equals the full-batch gradient in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hpc_elastic.balance.aggregate import aggregation_factor, aggregation_factors, float64_bound, weighted_mean
from hpc_elastic.balance.apportion import apportion


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def flat_grad(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])


def mean_grad(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
    return flat_grad(net).clone()


@pytest.mark.parametrize("weights", [[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], [1.0, 7.0, 0.5, 30.0]])
def test_weighted_aggregate_is_the_full_batch_gradient(weights: list[float]) -> None:
    total = 256
    sizes = apportion(weights, total)
    n = len(sizes)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(total, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (total,), generator=g)
    net = model()
    full = mean_grad(net, x, y)
    per_sample = torch.stack([mean_grad(net, x[i : i + 1], y[i : i + 1]) for i in range(total)])
    abs_mean = per_sample.abs().mean(dim=0).numpy()

    # each worker: mean gradient of its x_i samples, scaled by n·x_i/X; the reducer averages over n (Alg. 3)
    bounds = np.cumsum((0, *sizes))
    pushed = []
    means = []
    for i in range(n):
        xi, yi = x[bounds[i] : bounds[i + 1]], y[bounds[i] : bounds[i + 1]]
        gi = mean_grad(net, xi, yi)
        means.append(gi.numpy())
        pushed.append(aggregation_factor(sizes, i) * gi)
    aggregate = torch.stack(pushed).sum(dim=0) / n

    bound = float64_bound(sizes, abs_mean)
    error = (aggregate - full).abs().numpy()
    print(f"sizes {sizes}: max |error| {error.max():.2e}, max error/bound {(error / bound).max():.3f}")
    assert (error <= bound).all()
    np.testing.assert_array_less(np.abs(weighted_mean(sizes, means) - full.numpy()), bound + 1e-300)
    if len(set(sizes)) > 1:  # the plain BSP average (Eq. 5) is biased, far outside the bound
        naive = torch.stack([torch.from_numpy(m) for m in means]).mean(dim=0)
        assert ((naive - full).abs().numpy() > 1e6 * bound).any()


def test_factors() -> None:
    assert aggregation_factors([1, 1]) == (1.0, 1.0)
    assert aggregation_factors([26, 51, 77, 102]) == (26 / 64, 51 / 64, 77 / 64, 102 / 64)
    assert sum(aggregation_factors([3, 5, 9])) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="positive integers"):
        aggregation_factors([3, 0])
    with pytest.raises(ValueError, match="worker 2"):
        aggregation_factor([1, 1], 2)
