"""Golden bits of D2 training steps of the reference CNNs (EasyScale §3.3: D2's operators give the same bits on every
device): the sha256 of every layer's forward output, the loss, the gradients of the input and of every parameter,
the updated running statistics and an evaluation-mode forward, for ``hpc_elastic.models``' ``resnet_like`` and
``vgg_like`` on seeded inputs.

The digests were computed once with the operators as they were before any change for speed: work that makes the
CPU path faster (fewer passes, fewer copies, packing, loops moved into C) must keep every one of these bits, since
the CUDA twin of the kernels is checked against the same definitions and must keep agreeing with the CPU.  The
weights and inputs come from NumPy's seeded generator (not torch's, whose vectorised normal sampler may differ
between instruction sets), so the digests depend on the D2 operators only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from hpc_elastic import models
from hpc_elastic.est import detsum
from hpc_elastic.est.d2 import to_d2
from hpc_elastic.est.d2_ops import det_cross_entropy

#: (model, batch) -> sha256 of the step's tensors (see :func:`step_digest`), computed before the speed work
GOLDEN = {
    ("resnet_like", 32): "051ca8a8d2489ed53bef17aef18ec602395f2697603c590420f3aa46b07d6b9e",
    ("resnet_like", 5): "d183bd45d07afdcc9c4409d403902332a91376b3e97c34500c9fd6582650a632",
    ("vgg_like", 32): "f87cd18bce8a5cf63ccef30289808443f6e36388f22e52a03d2c0e8926b61599",
    ("vgg_like", 5): "6449ed6768cf14797ae7f09ae971603c913e0ef48e3c3b3d3a9a26b49f0f4db9",
}


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _seeded(name: str) -> nn.Module:
    """The model converted to D2, every parameter and buffer drawn from NumPy's generator (seed 17): weights
    ~ N(0, 1/fan_in), batch norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2), running statistics left at torch's
    initial values."""
    model = to_d2({"resnet_like": models.resnet_like, "vgg_like": models.vgg_like}[name]()[0])
    rng = np.random.default_rng(17)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                fan_in = p[0].numel()
                values = rng.standard_normal(p.shape) / np.sqrt(fan_in)
            elif pname.endswith("weight"):
                values = 1.0 + 0.1 * rng.standard_normal(p.shape)
            else:
                values = 0.1 * rng.standard_normal(p.shape)
            p.copy_(torch.from_numpy(values.astype(np.float32)))
    return model


def step_digest(name: str, batch: int) -> dict[str, str]:
    """sha256 per tensor of one D2 training step and an evaluation forward of ``name`` on a seeded batch."""
    model = _seeded(name)
    rng = np.random.default_rng(1000 + batch)
    x = torch.from_numpy(rng.standard_normal((batch, *models.IMAGE_SHAPE)).astype(np.float32)).requires_grad_()
    y = torch.from_numpy(rng.integers(0, models.NUM_CLASSES, batch).astype(np.int64))
    outputs: list[tuple[str, torch.Tensor]] = []
    hooks = [
        module.register_forward_hook(lambda _m, _i, out, n=mname: outputs.append((f"out:{n}", out.detach().clone())))
        for mname, module in model.named_modules()
        if not list(module.children())
    ]
    loss = det_cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    for hook in hooks:
        hook.remove()
    tensors = [*outputs, ("loss", loss.detach()), ("grad:input", x.grad)]
    tensors += [(f"grad:{n}", p.grad) for n, p in model.named_parameters()]
    tensors += [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    model.eval()
    with torch.no_grad():
        tensors.append(("eval", model(x.detach())))
    return {
        n: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()  # type: ignore[union-attr]
        for n, t in tensors
    }


def combined(digests: dict[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{n} {d}" for n, d in digests.items()).encode()).hexdigest()


@pytest.mark.parametrize(("name", "batch"), list(GOLDEN))
@pytest.mark.parametrize("threads", [1, 3])
def test_d2_step_keeps_its_golden_bits(name: str, batch: int, threads: int) -> None:
    torch.set_num_threads(threads)
    assert combined(step_digest(name, batch)) == GOLDEN[(name, batch)]


@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_d2_step_keeps_its_golden_bits_on_every_product_path(path: str) -> None:
    ext = detsum.c_extension()
    if path not in ext._matmul_paths():
        pytest.skip(f"this CPU does not run the {path} product")
    torch.set_num_threads(1)
    try:
        ext._matmul_path(path)
        assert combined(step_digest("resnet_like", 5)) == GOLDEN[("resnet_like", 5)]
    finally:
        ext._matmul_path("auto")
