from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpc_elastic.est import example
from hpc_elastic.est.d2 import D2Status, register_d2_module, scan_model, to_d2
from hpc_elastic.est.d2_math import det_matmul_nt
from hpc_elastic.est.d2_ops import DetLinear, det_cross_entropy
from hpc_elastic.est.detsum import ref_matmul_nt
from hpc_elastic.est.example import build_model


def same(a: torch.Tensor, b: np.ndarray) -> bool:
    return np.array_equal(a.detach().numpy().view(np.uint32), np.ascontiguousarray(b).view(np.uint32))


def test_det_linear_forward_and_backward_follow_the_fixed_order() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(19, 5)
    ref = nn.Linear(19, 5)
    ref.load_state_dict(lin.state_dict())
    to_d2(lin)
    assert isinstance(lin, DetLinear)
    x = torch.randn(6, 19, requires_grad=True)
    y = lin(x)
    g = torch.randn(6, 5)
    y.backward(g)
    xn, wn, gn = x.detach().numpy(), lin.weight.detach().numpy(), g.numpy()
    assert same(y, ref_matmul_nt(xn, wn) + lin.bias.detach().numpy())
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    assert same(x.grad, ref_matmul_nt(gn, np.ascontiguousarray(wn.T)))
    assert same(lin.weight.grad, ref_matmul_nt(np.ascontiguousarray(gn.T), np.ascontiguousarray(xn.T)))
    assert same(lin.bias.grad, ref_matmul_nt(np.ones((1, 6), np.float32), np.ascontiguousarray(gn.T)).reshape(5))
    xr = x.detach().clone().requires_grad_(True)
    ref(xr).backward(g)
    torch.testing.assert_close(y, ref(xr))
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def test_det_linear_handles_extra_leading_dims() -> None:
    lin = to_d2(nn.Linear(4, 3))
    out = lin(torch.randn(2, 5, 4))
    assert out.shape == (2, 5, 3)
    with pytest.raises(ValueError, match="float32 only"):
        det_matmul_nt(torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))


def test_scanner_reports_what_d2_covers() -> None:
    report = scan_model(build_model("bn-dropout", 8))
    status = {f.kind: f.status for f in report.findings}
    assert status["BatchNorm1d"] is D2Status.CONVERTIBLE
    assert status["Dropout"] is D2Status.NOT_COVERED
    assert status["Linear"] is D2Status.CONVERTIBLE
    assert not report.holds and not report.holds_after_conversion
    mlp = build_model("mlp", 8)
    assert scan_model(mlp).holds_after_conversion and not scan_model(mlp).holds
    assert scan_model(to_d2(mlp)).holds
    assert any("convertible" in line for line in report.lines())


def test_custom_modules_are_unknown_until_registered() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.relu(self.fc(x)) + x
            return out

    block = to_d2(Block())
    report = scan_model(block)
    assert [f.status for f in report.findings] == [D2Status.UNKNOWN, D2Status.COVERED]
    assert "Block at '<root>' is unknown" in report.first_problem()
    register_d2_module(Block)
    assert scan_model(block).holds
    with pytest.raises(ValueError, match="needs an nn.Module subclass"):
        register_d2_module(int)  # type: ignore[arg-type]


@pytest.mark.parametrize(("level", "det_loss"), [("d2", True), ("d1", False)])
def test_the_bundled_example_takes_the_d2_loss_at_d2_only(
    level: str, det_loss: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The stock cross-entropy's log-softmax rounds differently on CPU and CUDA: at D2 the example trains with
    det_cross_entropy, and with F.cross_entropy below D2."""
    calls: list[str] = []

    def counting(fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
        def wrapped(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr("hpc_elastic.est.example.det_cross_entropy", counting(det_cross_entropy, "d2"))
    monkeypatch.setattr("torch.nn.functional.cross_entropy", counting(F.cross_entropy, "stock"))
    for key in [k for k in os.environ if k.startswith(("SLURM_", "HPC_ELASTIC_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HPC_ELASTIC_LEVEL", level)
    monkeypatch.setenv("HPC_ELASTIC_WORKERS", "2")
    monkeypatch.setenv("HPC_ELASTIC_JOB_DIR", str(tmp_path / "job"))
    assert example.main(["--model=mlp", "--steps=1", "--dataset-size=16", "--loader-workers=0"]) == 0
    assert calls == (["d2"] if det_loss else ["stock"]) * 2  # one mini-batch per EST
