"""A training process for the paper-mode tests (``--balance lbbsp``): a Linear/ReLU model on fixed tensors (no
augmentation, so one process can redo the training on the same global batches), plain SGD, optionally a slowed rank
(a sleep in its batch), a stop with a checkpoint at a given step.  Every rank appends the dataset indices of its
batches to ``trace-<rank>.jsonl`` next to ``--result``; rank 0 writes the result (sizes of every iteration, final
parameters)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import hpc_elastic

FEATURES, CLASSES, DATASET = 8, 3, 96


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(DATASET, FEATURES, generator=g)
    return TensorDataset(x, (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1))


def model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--stop-at", type=int, default=0)
    args = p.parse_args(argv)
    session = hpc_elastic.init(seed=0)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
    state = session.state(net, optimizer, data=dataset(), batch_size=args.batch_size)
    restored = state.restore()
    trace = args.result.parent / f"trace-{session.rank}.jsonl"
    sizes = []
    with trace.open("a") as out:
        while state.step < args.steps:
            if state.paper is not None:
                sizes.append(list(state.paper.sizes))
            for x, y in state.batches():
                used = list(state.paper.indices()) if state.paper is not None else []
                out.write(json.dumps({"step": state.step, "rank": session.rank, "indices": used}) + "\n")
                F.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
                if session.rank == args.slow_rank:
                    time.sleep(args.slow_ms / 1000.0)
            state.finish_step()
            if args.stop_at and state.step == args.stop_at:
                break
    state.commit_if_needed()
    if session.is_root:
        result = {
            "step": state.step,
            "restored_from": restored.step if restored else None,
            "balance": session.balance.value,
            "sizes": sizes,
            "position": state.paper.to_json() if state.paper is not None else None,
            "params": [t.detach().reshape(-1).tolist() for t in state.params],
        }
        args.result.write_text(json.dumps(result))
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
