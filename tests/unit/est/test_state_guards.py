"""What the runtime keeps and refuses beyond the trainable parameters: frozen parameters (kept in checkpoints,
refused when their requires_grad changes), parameters changed in a forward (refused), a restore into another
optimizer, scheduler or sample stream (refused), modules with hooks at D2 (not covered), and the buffers the live
module holds between steps (those of the process's lowest EST)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.d2 import D2Status, scan_model
from hpc_elastic.est.example import AugmentedBlobs, build_model
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.session import Session
from hpc_elastic.state import RuntimeConfig, State


class Distilled(nn.Module):
    """A student and an EMA teacher whose parameters are frozen (a mean teacher, as BYOL and DINO keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.teacher = nn.Linear(4, 3)
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.student(x) - 0.1 * self.teacher(x)
        return out


def distilled(job_dir: Path | None, seed: int = 5) -> tuple[State, Distilled]:
    torch.manual_seed(seed)
    model = Distilled()
    session = Session.local(job_dir, num_workers=3, seed=seed)
    state = session.state(model, torch.optim.SGD(model.student.parameters(), lr=0.1))
    state.plan_data(24, 2)
    return state, model


def train_distilled(state: State, model: Distilled, steps: int, before: Callable[[int], None] = lambda s: None) -> None:
    data = torch.linspace(-1, 1, 24 * 4).reshape(24, 4)
    while state.step < steps:
        before(state.step)
        for idx in state.batches():
            model(data[list(idx)]).square().mean().backward()
        state.finish_step()
        with torch.no_grad():  # the teacher follows the student, outside the optimizer
            for t, s in zip(model.teacher.parameters(), model.student.parameters(), strict=True):
                t.mul_(0.9).add_(s, alpha=0.1)


def test_frozen_parameters_are_checkpointed_and_restored(tmp_path: Path) -> None:
    straight, model = distilled(tmp_path / "a")
    train_distilled(straight, model, 4)
    assert straight.frozen_names == ["teacher.weight", "teacher.bias"]
    stopped, first = distilled(tmp_path / "b")
    train_distilled(stopped, first, 2)
    stopped.commit()
    resumed, second = distilled(tmp_path / "b")
    assert not torch.equal(second.teacher.weight, first.teacher.weight)  # a fresh model's teacher
    assert resumed.restore() is not None
    assert torch.equal(second.teacher.weight, first.teacher.weight)  # before, the restart reset the teacher
    train_distilled(resumed, second, 4)
    for a, b in zip(model.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert resumed.state_sha256() == straight.state_sha256()


def test_a_parameter_unfrozen_or_frozen_after_the_state_is_built_is_refused() -> None:
    state, model = distilled(None)

    def unfreeze(step: int) -> None:
        if step == 1:
            model.teacher.requires_grad_(True)

    with pytest.raises(HpcElasticError, match="parameter teacher.weight was frozen when the State was built"):
        train_distilled(state, model, 3, unfreeze)
    state, model = distilled(None)
    model.student.bias.requires_grad_(False)
    with pytest.raises(HpcElasticError, match="parameter student.bias was trainable when the State was built"):
        train_distilled(state, model, 1)


def test_an_embedding_renormalised_in_its_forward_is_refused() -> None:
    model = nn.Sequential(nn.Embedding(20, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(HpcElasticError, match="Embedding at '0' has max_norm=1.0: it renormalises its weight"):
        State(model, torch.optim.SGD(model.parameters(), lr=0.1), RuntimeConfig(num_ests=2))
    bag = nn.EmbeddingBag(20, 4, max_norm=2.0)
    with pytest.raises(HpcElasticError, match="EmbeddingBag at '<root>' has max_norm=2.0"):
        State(bag, torch.optim.SGD(bag.parameters(), lr=0.1), RuntimeConfig(num_ests=2))


def example(job_dir: Path, optimizer: str = "sgd", scheduler: bool = False, batch: int = 4, steps: int = 2) -> State:
    session = Session.local(job_dir, num_workers=2, seed=3)
    model = build_model("bn-dropout", 16)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 2) if scheduler else None
    state = session.state(model, opt, scheduler=sched, data=AugmentedBlobs(64), batch_size=batch)
    for _ in range(steps):
        for x, y in state.batches():
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        state.finish_step()
    return state


def test_a_restore_into_another_optimizer_scheduler_or_sample_stream_is_refused(tmp_path: Path) -> None:
    example(tmp_path).commit()
    cases = [
        ({"optimizer": "adam"}, "written with optimizer='SGD', now 'Adam'"),
        ({"scheduler": True}, "written with scheduler=None, now 'StepLR'"),
        ({"batch": 2}, "trained on 64 samples, batch 4 per EST, shuffled, now 64 samples, batch 2 per EST"),
    ]
    for options, message in cases:
        with pytest.raises(HpcElasticError, match=message):
            example(tmp_path, **options).restore()  # type: ignore[arg-type]
    state = example(tmp_path)
    assert state.restore() is not None and state.step == 2
    with pytest.raises(HpcElasticError, match="batch 4 per EST, shuffled, now 64 samples, batch 4 per EST, in order"):
        state.plan_data(64, 4, shuffle=False)  # a plan attached after the restore is checked too
    state.plan_data(64, 4)


def test_modules_with_hooks_are_not_covered_at_d2() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert scan_model(plain).holds_after_conversion
    for hooked in (
        nn.utils.weight_norm(nn.Linear(4, 4)),  # the classic form: still nn.Linear, a forward pre-hook
        nn.utils.spectral_norm(nn.Linear(4, 4)),
    ):
        report = scan_model(nn.Sequential(hooked, nn.ReLU()))
        (problem,) = report.problems()
        assert problem.path == "0" and problem.status is D2Status.UNKNOWN and "hook(s)" in problem.note
        with pytest.raises(HpcElasticError, match="D2 does not hold for this model: DetLinear at '<root>' is unknown"):
            State(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), RuntimeConfig(2, level=DeterminismLevel.D2))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model[1].register_forward_hook(lambda module, args, out: out / out.norm())
    assert [p.path for p in scan_model(model).problems()] == ["0", "1"]  # "0": convertible, not yet converted
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert not scan_model(plain).holds_after_conversion
    finally:
        handle.remove()


def test_between_steps_the_module_holds_the_buffers_of_the_lowest_est(tmp_path: Path) -> None:
    """On M = 1 the ESTs run 0, 1, 2, 3: the module is left with EST 0's BatchNorm statistics, which are the same
    bits on whichever process runs EST 0 whatever M, instead of the last EST's."""
    state = example(tmp_path)
    model = state.model
    live = dict(model.named_buffers())
    assert live and state.local_ests == (0, 1)
    for name, buf in live.items():
        assert torch.equal(buf, state.contexts[0].buffers[name])
    assert any(not torch.equal(live[n], state.contexts[1].buffers[n]) for n in live if "running" in n)
    state.commit()
    resumed = example(tmp_path, steps=0)
    assert any(not torch.equal(b, state.contexts[0].buffers[n]) for n, b in resumed.model.named_buffers())
    assert resumed.restore() is not None
    for name, buf in resumed.model.named_buffers():
        assert torch.equal(buf, state.contexts[0].buffers[name])
