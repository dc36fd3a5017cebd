"""Small reference models for ``hpc-elastic profile``.

The MODEL protocol
==================
``hpc-elastic profile run package.module:factory`` imports ``factory`` and calls it with no arguments.
The factory returns a tuple::

    (module, sample_batch)            or    (module, sample_batch, loss_fn)

- ``module``: a ``torch.nn.Module``. The profiler moves it to the device and trains it.
- ``sample_batch(batch_size: int) -> (inputs, targets)``: builds one synthetic mini-batch of exactly
  ``batch_size`` samples on the CPU. ``inputs`` is a tensor, or a tuple of tensors passed to the module
  positionally; ``targets`` is a tensor. The profiler builds each batch once per batch size, moves it to the
  device and reuses it, so data loading is not part of the measured step (LB-BSP §3.1 measures the
  computation time t^p = Γ(x), not input handling).
- ``loss_fn(outputs, targets) -> scalar tensor`` (optional): when omitted, the profiler uses cross-entropy
  for integer targets and mean-squared error otherwise.

One profiled *step* is forward + loss + backward + optimizer step (SGD with momentum), the unit of work that
LB-BSP §3.1 calls the batch processing (computation) time.

The reference models have different tensor-size shapes, which is what Tiresias §3.3 ties to placement
sensitivity (the skew of the tensor-size distribution):

- :func:`vgg_like`: a few small convolutions and one huge fully-connected tensor (like VGG's fc6 in
  Tiresias Table 6) → high skew;
- :func:`resnet_like`: a CIFAR-style residual network, many similar small tensors → low skew;
- :func:`resnet18`: the CIFAR ResNet-18 (11.2 M parameters), a model of realistic size for the runtime's benchmarks;
- :func:`transformer_small`: a 2-layer transformer encoder whose embedding table is the largest tensor;
- :func:`mlp`: equal-width fully-connected layers → tensors of equal size.

They are sized to profile on a 2-core CPU in well under a minute each. Building one draws its initial
weights from torch's global generator; the profiler seeds it first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Inputs = torch.Tensor | tuple[torch.Tensor, ...]
SampleBatch = Callable[[int], tuple[Inputs, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ModelBundle = tuple[nn.Module, SampleBatch] | tuple[nn.Module, SampleBatch, LossFn]

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
VOCAB_SIZE = 2000
SEQUENCE_LENGTH = 32
MLP_WIDTH = 256


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def _image_batch(batch_size: int) -> tuple[Inputs, torch.Tensor]:
    _check_batch_size(batch_size)
    inputs = torch.randn(batch_size, *IMAGE_SHAPE)
    targets = torch.randint(0, NUM_CLASSES, (batch_size,))
    return inputs, targets


class _VggLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(3, 16), block(16, 32), block(32, 64))  # 32x32 -> 4x4
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 2048),  # the huge tensor: 1024 x 2048 = 2,097,152 weights
            nn.ReLU(inplace=True),
            nn.Linear(2048, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(self.features(x))
        return out


def vgg_like() -> ModelBundle:
    """VGG-shaped CNN whose first fully-connected weight holds most parameters (high skew)."""
    return _VggLike(), _image_batch


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class _ResNetLike(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c_in = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(_BasicBlock(c_in, width, stride))
                c_in = width
        self.stages = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.stages(self.stem(x)))
        return out


def resnet_like() -> ModelBundle:
    """CIFAR-style ResNet-14 (3 stages x 2 basic blocks, widths 16/32/64): many small tensors (low skew)."""
    return _ResNetLike(), _image_batch


def resnet18() -> ModelBundle:
    """CIFAR ResNet-18: 4 stages x 2 basic blocks, widths 64/128/256/512 (11.2 M parameters)."""
    return _ResNetLike(widths=(64, 128, 256, 512)), _image_batch


class _TransformerSmall(nn.Module):
    def __init__(self, d_model: int = 128, heads: int = 4, layers: int = 2, ff: int = 256) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position = nn.Embedding(SEQUENCE_LENGTH, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # learned positions looked up for every token, so the sum has equal shapes (a broadcast add's gradient would
        # be a reduction over the batch); the first token's state classifies (BERT's pooling): no mean here either
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        hidden = self.encoder(self.embedding(tokens) + self.position(positions))
        out: torch.Tensor = self.head(hidden[:, 0])
        return out


class _LstmSmall(nn.Module):
    def __init__(self, d_model: int = 128, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.lstm = nn.LSTM(d_model, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embedding(tokens))
        out: torch.Tensor = self.head(hidden[:, -1])  # the last step's state classifies
        return out


#: modules whose own forward only composes their children with exact element-wise ops (ReLU, adds of two tensors of
#: one shape, selecting a token): the D2 scanner (hpc_elastic.est.d2) vouches for them
D2_COMPOSITE_MODULES: tuple[type[nn.Module], ...] = (_VggLike, _BasicBlock, _ResNetLike, _TransformerSmall, _LstmSmall)


def _token_batch(batch_size: int) -> tuple[Inputs, torch.Tensor]:
    _check_batch_size(batch_size)
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQUENCE_LENGTH))
    targets = torch.randint(0, NUM_CLASSES, (batch_size,))
    return tokens, targets


def transformer_small() -> ModelBundle:
    """2-layer transformer encoder classifier (d=128, 4 heads, 2000-token vocabulary, sequence 32)."""
    return _TransformerSmall(), _token_batch


def lstm_small() -> ModelBundle:
    """2-layer LSTM classifier (embedding 128, hidden 256) over the same token batches, from the last step's state."""
    return _LstmSmall(), _token_batch


def _mlp_batch(batch_size: int) -> tuple[Inputs, torch.Tensor]:
    _check_batch_size(batch_size)
    return torch.randn(batch_size, MLP_WIDTH), torch.randn(batch_size, MLP_WIDTH)


def mlp() -> ModelBundle:
    """Four equal 256x256 fully-connected layers trained as a regressor (MSE): equal-size tensors."""
    layers: list[nn.Module] = []
    for index in range(4):
        layers.append(nn.Linear(MLP_WIDTH, MLP_WIDTH))
        if index < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers), _mlp_batch
