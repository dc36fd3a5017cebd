"""D2 optimizer updates: the bits of a float32 reference with one rounding per operation, torch's results within
rounding, state dicts interchangeable with torch's, the scanner's verdicts, and the same bits on CUDA as on the CPU
where a GPU is present."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hpc_elastic import models
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.d2 import D2Status, optimizer_to_d2, scan_optimizer
from hpc_elastic.est.d2_optim import DetAdam, DetAdamW, DetSGD
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.session import Session

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F32 = np.float32

SGD_OPTIONS: list[dict[str, Any]] = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    {"momentum": 0.5, "maximize": True},
]
ADAM_OPTIONS: list[dict[str, Any]] = [
    {},
    {"weight_decay": 1e-2},
    {"amsgrad": True, "betas": (0.8, 0.99), "eps": 1e-6},
    {"maximize": True, "weight_decay": 1e-3},
]


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.int32).numpy().tobytes()


def problem(seed: int = 1) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Two parameters and three steps' gradients of very different scales."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(1031, generator=gen), torch.randn(37, 5, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) * 10.0**e for p in params] for e in (-3, 0, 2)]
    return params, grads


def run(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], device: str = "cpu", steps: int = 3
) -> list[torch.Tensor]:
    params, grads = problem()
    ps = [p.clone().to(device).requires_grad_() for p in params]
    opt = make(ps)
    for gs in grads[:steps]:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.to(device)
        opt.step()
    return [p.detach().cpu() for p in ps]


def ref_sgd(options: dict[str, Any], lr: float) -> list[np.ndarray]:
    """torch's SGD algorithm in NumPy float32, every operation rounded on its own."""
    momentum, dampening = options.get("momentum", 0.0), options.get("dampening", 0.0)
    wd, nesterov, maximize = options.get("weight_decay", 0.0), options.get("nesterov", False), options.get("maximize")
    params, grads = problem()
    out = []
    for i, p0 in enumerate(params):
        p, buf = p0.numpy().copy(), None
        for gs in grads:
            d = gs[i].numpy()
            d = -d if maximize else d
            if wd:
                d = d + p * F32(wd)
            if momentum:
                buf = (
                    d.copy() if buf is None else buf * F32(momentum) + (d if not dampening else d * F32(1 - dampening))
                )
                d = d + buf * F32(momentum) if nesterov else buf
            p = p - d * F32(lr)
        out.append(p)
    return out


def ref_adam(options: dict[str, Any], lr: float, decoupled: bool) -> list[np.ndarray]:
    """Adam / AdamW in NumPy float32, every operation rounded on its own."""
    b1, b2 = options.get("betas", (0.9, 0.999))
    eps, wd = options.get("eps", 1e-8), options.get("weight_decay", 1e-2 if decoupled else 0.0)
    amsgrad, maximize = options.get("amsgrad", False), options.get("maximize", False)
    params, grads = problem()
    out = []
    for i, p0 in enumerate(params):
        p = p0.numpy().copy()
        m, v, vmax = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
        for t, gs in enumerate(grads, start=1):
            g = gs[i].numpy()
            g = -g if maximize else g
            if wd and decoupled:
                p = p * F32(1.0 - lr * wd)
            elif wd:
                g = g + p * F32(wd)
            m = m * F32(b1) + g * F32(1 - b1)
            v = v * F32(b2) + (g * g) * F32(1 - b2)
            vmax = np.maximum(vmax, v)
            denom = np.sqrt(vmax if amsgrad else v) * F32(1.0 / math.sqrt(1.0 - b2**t)) + F32(eps)
            p = p - (m / denom) * F32(lr / (1.0 - b1**t))
        out.append(p)
    return out


@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_det_sgd_is_the_one_rounding_per_operation_reference_and_torch_within_rounding(options: dict[str, Any]) -> None:
    got = run(lambda ps: DetSGD(ps, lr=0.05, **options))
    want = ref_sgd(options, 0.05)
    assert [bits(t) for t in got] == [w.tobytes() for w in want]
    stock = run(lambda ps: torch.optim.SGD(ps, lr=0.05, **options))
    for a, b in zip(got, stock, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=str)
def test_det_adam_is_the_one_rounding_per_operation_reference_and_torch_within_rounding(
    options: dict[str, Any], decoupled: bool
) -> None:
    det, stock = (DetAdamW, torch.optim.AdamW) if decoupled else (DetAdam, torch.optim.Adam)
    got = run(lambda ps: det(ps, lr=1e-3, **options))
    want = ref_adam(options, 1e-3, decoupled)
    assert [bits(t) for t in got] == [w.tobytes() for w in want]
    for a, b in zip(got, run(lambda ps: stock(ps, lr=1e-3, **options)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dicts_move_between_torch_and_d2_optimizers() -> None:
    """Two steps of torch's Adam, its state loaded into DetAdam for the third: the reference up to rounding, and
    DetAdam's state loads back into torch's Adam."""
    params, grads = problem()
    ps = [p.clone().requires_grad_() for p in params]
    stock = torch.optim.Adam(ps, lr=1e-3, amsgrad=True)
    for gs in grads[:2]:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g
        stock.step()
    det = DetAdam(ps, lr=1e-3, amsgrad=True)
    det.load_state_dict(stock.state_dict())
    for p, g in zip(ps, grads[2], strict=True):
        p.grad = g
    det.step()
    assert int(det.state[ps[0]]["step"].item()) == 3
    for a, b in zip(ps, run(lambda q: torch.optim.Adam(q, lr=1e-3, amsgrad=True)), strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    back = torch.optim.Adam(ps, lr=1e-3, amsgrad=True)
    back.load_state_dict(det.state_dict())
    assert torch.equal(back.state[ps[1]]["max_exp_avg_sq"], det.state[ps[1]]["max_exp_avg_sq"])


def test_scanner_converts_sgd_adam_adamw_and_names_what_it_cannot() -> None:
    p = [torch.zeros(3, requires_grad=True)]
    for stock, det in (
        (torch.optim.SGD(p, lr=0.1), DetSGD),
        (torch.optim.Adam(p), DetAdam),
        (torch.optim.AdamW(p), DetAdamW),
    ):
        assert scan_optimizer(stock).status is D2Status.CONVERTIBLE
        assert type(optimizer_to_d2(stock)) is det
        assert scan_optimizer(stock).status is D2Status.COVERED
    rms = torch.optim.RMSprop(p)
    assert optimizer_to_d2(rms) is rms and type(rms) is torch.optim.RMSprop
    finding = scan_optimizer(rms)
    assert finding.status is D2Status.NOT_COVERED and finding.kind == "RMSprop" and "no D2 update" in finding.note
    diff = torch.optim.Adam(p, differentiable=True)
    assert type(optimizer_to_d2(diff)) is torch.optim.Adam
    assert scan_optimizer(diff).status is D2Status.NOT_COVERED and "differentiable=True" in scan_optimizer(diff).note
    tensor_lr = torch.optim.SGD(p, lr=torch.tensor(0.1))
    assert "tensor learning rate" in scan_optimizer(tensor_lr).note
    with pytest.raises(ValueError, match="scan_optimizer needs a torch.optim.Optimizer, got int"):
        scan_optimizer(3)  # type: ignore[arg-type]


def test_the_runtime_at_d2_swaps_torch_sgd_and_refuses_an_uncovered_optimizer() -> None:
    model = models.resnet_like()[0]
    session = Session.local(None, num_workers=2, seed=5, level=DeterminismLevel.D2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session.state(model, opt)
    assert type(opt) is DetSGD
    other = models.resnet_like()[0]
    with pytest.raises(HpcElasticError, match=r"D2 does not hold for this optimizer \(RMSprop\): no D2 update"):
        session.state(other, torch.optim.RMSprop(other.parameters()))
    d1 = Session.local(None, num_workers=2, seed=5, level=DeterminismLevel.D1)
    plain = torch.optim.RMSprop(other.parameters())
    d1.state(other, plain)  # below D2 the optimizer is the job's own
    assert type(plain) is torch.optim.RMSprop


CUDA_CASES = (
    [(f"sgd {o}", lambda ps, o=o: DetSGD(ps, lr=0.05, **o)) for o in SGD_OPTIONS]
    + [(f"adam {o}", lambda ps, o=o: DetAdam(ps, lr=1e-3, **o)) for o in ADAM_OPTIONS]
    + [(f"adamw {o}", lambda ps, o=o: DetAdamW(ps, lr=1e-3, **o)) for o in ADAM_OPTIONS]
)


@needs_cuda
@pytest.mark.parametrize(("name", "make"), CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_cuda_d2_optimizers_give_the_cpu_bits(
    name: str, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
) -> None:  # pragma: no cover - needs a GPU
    assert [bits(t) for t in run(make, "cuda")] == [bits(t) for t in run(make, "cpu")], name
