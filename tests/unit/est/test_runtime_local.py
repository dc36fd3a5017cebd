"""The EST runtime in one process (M = 1): exactness of the reduction, checkpoint/restore, misuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.checkpoint import checkpoint_at
from hpc_elastic.est.detsum import cpu_kernels, reference_allreduce
from hpc_elastic.est.example import AugmentedBlobs, build_model
from hpc_elastic.est.levels import DeterminismLevel, seed_everything
from hpc_elastic.est.reducer import TensorKernels
from hpc_elastic.est.runtime import ESTConfig, ESTRuntime


@pytest.fixture(autouse=True)
def _restore_torch_globals() -> Iterator[None]:
    det = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)


class RecordingKernels(TensorKernels):
    """The C kernels, remembering every EST gradient deposited and every reduced result."""

    def __init__(self) -> None:
        k = cpu_kernels()
        super().__init__(k.name, k, torch.Tensor.numpy)
        self.deposits: list[np.ndarray] = []
        self.results: list[np.ndarray] = []

    def deposit(self, grad: torch.Tensor, *args: Any, **kw: Any) -> None:
        self.deposits.append(grad.numpy().copy())
        super().deposit(grad, *args, **kw)

    def finalize(self, v: torch.Tensor, gtops: torch.Tensor, out: torch.Tensor, **kw: Any) -> None:
        super().finalize(v, gtops, out, **kw)
        self.results.append(out.numpy().copy())


def make(
    n: int = 4, level: DeterminismLevel = DeterminismLevel.D1, kernels: TensorKernels | None = None, **cfg: Any
) -> tuple[ESTRuntime, torch.nn.Module]:
    seed_everything(3)
    model = build_model("bn-dropout" if level is not DeterminismLevel.D2 else "mlp", 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rt = ESTRuntime(model, opt, ESTConfig(num_ests=n, seed=3, level=level, **cfg), kernels=kernels)
    rt.attach_data(AugmentedBlobs(64), 4)
    return rt, model


def train(rt: ESTRuntime, model: torch.nn.Module, steps: int) -> None:
    while rt.step < steps:
        for _ in rt.local_steps():
            x, y = rt.next_batch()
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        rt.finish_step()


def test_reduced_gradient_is_the_exact_mean_of_the_est_gradients() -> None:
    rec = RecordingKernels()
    rt, model = make(kernels=rec)
    train(rt, model, 2)
    assert len(rec.deposits) == 8 and len(rec.results) == 2
    for step in range(2):
        mine = rec.deposits[step * 4 : step * 4 + 4]
        expected = reference_allreduce(mine, 4, rt.layout.chunk, 4.0)
        assert np.array_equal(rec.results[step].view(np.uint32), expected.view(np.uint32))
    # each EST saw different data and dropout masks
    assert not np.array_equal(rec.deposits[0], rec.deposits[1])


def test_restore_continues_bitwise(tmp_path: Path) -> None:
    straight, model = make(checkpoint_dir=tmp_path / "a", checkpoint_every=2)
    train(straight, model, 4)
    resumed, model2 = make(checkpoint_dir=tmp_path / "a")
    assert resumed.restore(checkpoint_at(tmp_path / "a", 2))
    assert resumed.step == 2
    train(resumed, model2, 4)
    assert resumed.params_sha256() == straight.params_sha256()
    assert resumed.state_sha256() == straight.state_sha256()
    other, _ = make(n=2, checkpoint_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="has 4 ESTs, this job has 2"):
        other.restore()


def test_d0_runs_and_differs_from_d1_only_by_rounding() -> None:
    d0, m0 = make(level=DeterminismLevel.D0)
    d1, m1 = make(level=DeterminismLevel.D1)
    train(d0, m0, 3)
    train(d1, m1, 3)
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_d2_converts_linear_layers_and_refuses_uncovered_models() -> None:
    rt, model = make(level=DeterminismLevel.D2)
    train(rt, model, 2)
    assert all(type(m).__name__ != "Linear" for m in model.modules())
    seed_everything(3)
    bn = build_model("bn-dropout", 16)
    with pytest.raises(HpcElasticError, match="D2 does not hold for this model: BatchNorm1d at '1'"):
        ESTRuntime(bn, torch.optim.SGD(bn.parameters(), lr=0.1), ESTConfig(num_ests=2, level=DeterminismLevel.D2))


def test_misuse_is_reported() -> None:
    rt, model = make()
    with pytest.raises(RuntimeError, match="outside an EST"):
        rt.next_batch()
    with pytest.raises(ValueError, match="EST 7 does not run on process 0"), rt.activate(7):
        pass
    with rt.activate(0), pytest.raises(RuntimeError, match="ESTs do not nest"), rt.activate(1):
        pass
    with pytest.raises(RuntimeError, match=r"ESTs \[1, 2, 3\] of this process did not run"):
        rt.finish_step()
    with pytest.raises(ValueError, match="num_ests must be an integer >= 1, got 0"):
        ESTConfig(num_ests=0)
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        ESTConfig(num_ests=2, checkpoint_every=1)
    with pytest.raises(HpcElasticError, match="no checkpoint_dir"):
        ESTRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ESTConfig(num_ests=1)).save_checkpoint()
