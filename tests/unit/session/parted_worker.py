"""A training process whose forward shrinks, in place and outside the optimizer, the rows of a lookup table its
batch reads (as ``nn.Embedding(max_norm=...)`` renormalises them): each process changes only the rows its own ESTs
read, so the processes' copies part. Commits every step; exits 3 with the runtime's message on stderr when a
commit refuses."""

from __future__ import annotations

import sys

import torch
from torch import nn

import hpc_elastic
from hpc_elastic.errors import HpcElasticError


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.linspace(-1, 1, 16 * 3).reshape(16, 3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.rows[idx] *= 0.5  # the rows this EST reads, on this process only
        out: torch.Tensor = self.rows[idx].sum()
        return out


def main() -> int:
    session = hpc_elastic.init(seed=0)
    model = Table()
    state = session.state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.plan_data(16, 2)
    try:
        while state.step < 3:
            for idx in state.batches():
                model(torch.tensor(idx)).backward()
            state.finish_step()
            state.commit()
    except HpcElasticError as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
