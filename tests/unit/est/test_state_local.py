"""The runtime in one process (M = 1): exactness of the reduction, checkpoint/restore, D0/D2, misuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.detsum import cpu_kernels, reference_allreduce
from hpc_elastic.est.example import AugmentedBlobs, build_model
from hpc_elastic.est.kernels import TensorKernels
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.session import Session
from hpc_elastic.state import RuntimeConfig, State


class RecordingKernels(TensorKernels):
    """The C kernels, remembering every EST gradient deposited or folded in, and every reduced result."""

    def __init__(self) -> None:
        k = cpu_kernels()
        super().__init__(k.name, k, torch.Tensor.numpy)
        self.deposits: list[np.ndarray] = []
        self.results: list[np.ndarray] = []

    def deposit(self, grad: torch.Tensor, *args: Any, **kw: Any) -> None:
        self.deposits.append(grad.numpy().copy())
        super().deposit(grad, *args, **kw)

    def fold(self, grad: torch.Tensor, *args: Any, **kw: Any) -> None:
        self.deposits.append(grad.numpy().copy())
        super().fold(grad, *args, **kw)

    def finalize(self, v: torch.Tensor, gtops: torch.Tensor, out: torch.Tensor, **kw: Any) -> None:
        super().finalize(v, gtops, out, **kw)
        self.results.append(out.numpy().copy())


def make(
    n: int = 4,
    level: DeterminismLevel = DeterminismLevel.D1,
    kernels: TensorKernels | None = None,
    job_dir: Path | None = None,
    seed: int = 3,
) -> tuple[State, torch.nn.Module]:
    """A one-process session of N ESTs and its state on the bundled example's model and data."""
    session = Session.local(job_dir, num_workers=n, seed=seed, level=level)
    model = build_model("bn-dropout" if level is not DeterminismLevel.D2 else "mlp", 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = session.state(model, opt, data=AugmentedBlobs(64), batch_size=4, kernels=kernels)
    return state, model


def train(state: State, model: torch.nn.Module, steps: int, commit_every: int = 0) -> None:
    while state.step < steps:
        for x, y in state.batches():
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        state.finish_step()
        if commit_every and state.step % commit_every == 0:
            state.commit()


def test_reduced_gradient_is_the_exact_mean_of_the_est_gradients() -> None:
    rec = RecordingKernels()
    state, model = make(kernels=rec)
    train(state, model, 2)
    assert len(rec.deposits) == 8 and len(rec.results) == 2
    for step in range(2):
        mine = rec.deposits[step * 4 : step * 4 + 4]
        expected = reference_allreduce(mine, 4, state.layout.chunk, 4.0)
        assert np.array_equal(rec.results[step].view(np.uint32), expected.view(np.uint32))
    # each EST saw different data and dropout masks
    assert not np.array_equal(rec.deposits[0], rec.deposits[1])


def test_restore_continues_bitwise(tmp_path: Path) -> None:
    straight, model = make(job_dir=tmp_path / "a")
    train(straight, model, 4, commit_every=2)
    resumed, model2 = make(job_dir=tmp_path / "b")
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    src = tmp_path / "a" / "checkpoints" / "ckpt-000000000002"
    src.rename(tmp_path / "b" / "checkpoints" / src.name)
    assert resumed.restore() is not None and resumed.step == 2
    train(resumed, model2, 4)
    assert resumed.params_sha256() == straight.params_sha256()
    assert resumed.state_sha256() == straight.state_sha256()
    other, _ = make(n=2, job_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="written for 4 logical workers \\(ESTs\\), this job has 2"):
        other.restore()


def test_d0_runs_and_differs_from_d1_only_by_rounding() -> None:
    d0, m0 = make(level=DeterminismLevel.D0)
    d1, m1 = make(level=DeterminismLevel.D1)
    train(d0, m0, 3)
    train(d1, m1, 3)
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_d2_converts_linear_layers_and_refuses_uncovered_models() -> None:
    state, model = make(level=DeterminismLevel.D2)
    train(state, model, 2)
    assert all(type(m).__name__ != "Linear" for m in model.modules())
    bn = build_model("bn-dropout", 16)
    with pytest.raises(HpcElasticError, match="D2 does not hold for this model: Dropout at '3'"):
        State(bn, torch.optim.SGD(bn.parameters(), lr=0.1), RuntimeConfig(num_ests=2, level=DeterminismLevel.D2))


def test_indices_only_plan_for_in_memory_data() -> None:
    session = Session.local(num_workers=3, seed=1)
    model = torch.nn.Linear(2, 1)
    state = session.state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plan = state.plan_data(30, 2)
    seen: list[tuple[int, ...]] = []
    for _ in range(plan.steps_per_epoch):
        for idx in state.batches():
            assert isinstance(idx, tuple) and len(idx) == 2
            seen.append(idx)
            model(torch.ones(len(idx), 2)).sum().backward()
        state.finish_step()
    flat = [i for idx in seen for i in idx]
    assert len(flat) == len(set(flat)) == 30  # every sample once in the epoch
    assert state.epoch == 1


def test_misuse_is_reported() -> None:
    state, model = make()
    with pytest.raises(RuntimeError, match="outside an EST"):
        state.next_batch()
    with pytest.raises(ValueError, match="EST 7 does not run on process 0"), state.activate(7):
        pass
    with state.activate(0), pytest.raises(RuntimeError, match="ESTs do not nest"), state.activate(1):
        pass
    with pytest.raises(RuntimeError, match=r"ESTs \[1, 2, 3\] of this process did not run"):
        state.finish_step()
    with pytest.raises(ValueError, match="num_ests must be an integer >= 1, got 0"):
        RuntimeConfig(num_ests=0)
    with pytest.raises(HpcElasticError, match="HPC_ELASTIC_JOB_DIR is not set"):
        state.commit()
    with pytest.raises(ValueError, match="data= needs batch_size="):
        Session.local().state(model, torch.optim.SGD(model.parameters(), lr=0.1), data=AugmentedBlobs(8))
