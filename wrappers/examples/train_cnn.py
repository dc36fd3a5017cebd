#!/usr/bin/env python3
"""A small CNN on synthetic 12x12 single-channel images, with the training loop of ``train_mlp.py``.

Convolution, pooling and a linear head on the same runtime (``hpc_elastic.init()``, ESTs, one State), so it is
preempted, requeued, resized and resumed exactly like the MLP, on the torch, mpi and horovod backends::

    hpc-elastic submit wrappers/examples/train_cnn.py --gpus 4 -- --steps 200 --ckpt-every 20

Options are those of ``train_mlp.py`` (``--steps``, ``--batch``, ``--ckpt-every``, ``--result``...).
"""

from __future__ import annotations

import sys

import torch
from train_mlp import main  # the example next to this one: its loop, checkpointing and stop handling

SIDE = 12
CHANNELS = 4


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, CHANNELS, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(CHANNELS, CHANNELS, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(CHANNELS * (SIDE // 2) ** 2, 1),
    )


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images whose target is the brightness of their upper-left quadrant."""
    g = torch.Generator().manual_seed(20_000 + seed)
    x = torch.rand(n, 1, SIDE, SIDE, generator=g)
    y = x[:, :, : SIDE // 2, : SIDE // 2].mean(dim=(1, 2, 3)).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


if __name__ == "__main__":
    sys.exit(main(build_model=cnn, make_data=images))
