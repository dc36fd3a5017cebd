"""Module-level functions that tests submit with ``hpc_elastic.submit`` (pickled by reference: the workers import
this module, so it stays light: the runtime and torch only)."""

from __future__ import annotations

import time
from typing import Any

import torch

from hpc_elastic.session import Session


def train_linear(session: Session, steps: int, ckpt_every: int = 10, step_delay: float = 0.0) -> dict[str, Any]:
    """A linear model on 32 fixed samples through the runtime; checkpoints every ``ckpt_every`` steps, stops (and
    acknowledges) when the wrapper asks.  Returns what rank 0 saw."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = session.state(model, optimizer)
    state.plan_data(len(x), 4)
    restored = state.restore()
    while state.step < steps:
        if session.should_stop():
            session.checkpoint_and_acknowledge(state)
            break
        for indices in state.batches():
            idx = list(indices)
            ((model(x[idx]) - y[idx]) ** 2).mean().backward()
        state.finish_step()
        if state.step % ckpt_every == 0 and state.step < steps:
            state.commit()
        if step_delay:
            time.sleep(step_delay)
    return {
        "step": state.step,
        "world_size": session.world_size,
        "workers": session.num_workers,
        "restored": restored.step if restored is not None else None,
        "sha256": state.params_sha256(),
    }


def fail(session: Session, message: str) -> None:
    """Raise on every rank."""
    raise ValueError(message)
