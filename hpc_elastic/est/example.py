"""The bundled training script (``hpc-elastic verify-determinism`` runs it by default; ``hpc-elastic submit`` takes
this file like any script): a small classifier with BatchNorm and dropout, fed by a shuffling loader whose worker
processes augment every sample with Python's ``random``, NumPy and torch.  Everything that makes elastic training
non-deterministic elsewhere is here, and the runtime keeps the bits anyway.

    python -m hpc_elastic.est.example --steps 40            # under hpc-elastic-run, srun, mpirun or alone

Options: ``--steps`` (global steps of the whole run, across restarts), ``--model`` ``bn-dropout`` (default) or ``mlp``
(Linear/ReLU only: D2 covers it; at D2 the loss is :func:`hpc_elastic.est.d2_ops.det_cross_entropy`, the same bits on
every device, else ``F.cross_entropy``), ``--batch-size`` (per EST), ``--dataset-size``, ``--loader-workers``,
``--hidden``, ``--lr``, ``--seed``, ``--ckpt-every`` (periodic commits), ``--step-delay`` (seconds after each step:
tests and demos), ``--slow-rank``/``--slow-ms`` (a sleep inside each EST of one rank: a straggler for demos of
``--balance est``). The job's balance mode (``hpc-elastic submit --balance``) is the runtime's: in EST mode a line
``balance est: ...`` is logged (rank 0) whenever ESTs move. ``--loss-log DIR``: each process appends, after every
step, the sum of its ESTs' losses and their count to ``DIR/loss-<requeues>-<rank>.jsonl`` (the mean over the N ESTs is
the sum over the processes of one step divided by N: ``make demo`` plots it). It commits its final state, prints
``final-params-sha256 <hex>`` and one ``RESULT <json>`` line (rank 0, with the balance mode, the final EST placement
and the moves), and on a stop request checkpoints, acknowledges and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import hpc_elastic
from hpc_elastic.est.d2_ops import det_cross_entropy
from hpc_elastic.est.levels import DeterminismLevel

FEATURES = 16
CLASSES = 4
MODELS = ("bn-dropout", "mlp")


class AugmentedBlobs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian blobs; ``__getitem__`` augments with torch noise, a NumPy gain and a Python-random mask."""

    def __init__(self, size: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 2.0
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)
        self.points = centers[self.labels] + torch.randn(size, FEATURES, generator=g)

    def __len__(self) -> int:
        return int(self.labels.numel())

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.points[i] + 0.1 * torch.randn(FEATURES)
        x = x * float(np.random.uniform(0.8, 1.2))
        keep = torch.tensor([random.random() > 0.1 for _ in range(FEATURES)], dtype=torch.float32)
        return x * keep, self.labels[i]


def build_model(kind: str, hidden: int) -> nn.Module:
    if kind == "bn-dropout":
        return nn.Sequential(
            nn.Linear(FEATURES, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, CLASSES),
        )
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
        )
    raise ValueError(f"model must be one of {', '.join(MODELS)}, got {kind!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="global steps of the whole run")
    p.add_argument("--model", choices=MODELS, default="bn-dropout")
    p.add_argument("--batch-size", type=int, default=8, help="mini-batch of each EST")
    p.add_argument("--dataset-size", type=int, default=96)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0, help="commit every K steps (0: at the end and when stopped)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--slow-rank", type=int, default=-1, help="the rank whose ESTs each sleep --slow-ms")
    p.add_argument("--slow-ms", type=float, default=0.0, help="milliseconds of sleep inside each EST of --slow-rank")
    p.add_argument("--loss-log", type=Path, default=None, help="directory for each process's losses per step")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "dataset_size", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    session = hpc_elastic.init(seed=args.seed)
    model = build_model(args.model, args.hidden).to(session.device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = det_cross_entropy if session.level is DeterminismLevel.D2 else F.cross_entropy
    state = session.state(
        model,
        optimizer,
        data=AugmentedBlobs(args.dataset_size),
        batch_size=args.batch_size,
        loader_workers=args.loader_workers,
    )
    restored = state.restore()
    start = state.step
    if session.is_root:
        where = f"{restored.path} at step {start}" if restored else "nothing"
        print(
            f"rank 0 of {session.world_size} ({session.backend.value}, {session.device}, "
            f"{'+'.join(session.device_types)}); ESTs {session.num_workers}, here {list(session.workers)}; "
            f"level {session.level.value}; balance {session.balance.value}; restored from {where}",
            flush=True,
        )
    if args.loss_log is not None:
        args.loss_log.mkdir(parents=True, exist_ok=True)
    stopped = False
    while state.step < args.steps:
        if session.should_stop():
            path = session.checkpoint_and_acknowledge(state)
            if session.is_root:
                reason = session.stop_request.reason.value if session.stop_request else "unknown"
                print(f"stop ({reason}) at step {state.step}: checkpoint {path}", flush=True)
            stopped = True
            break
        loss_sum, ests = 0.0, 0
        for x, y in state.batches():
            loss = loss_fn(model(x.to(session.device)), y.to(session.device))
            loss.backward()  # type: ignore[no-untyped-call]
            if args.loss_log is not None:
                loss_sum, ests = loss_sum + float(loss.detach()), ests + 1
            if session.rank == args.slow_rank:
                time.sleep(args.slow_ms / 1000.0)
        state.finish_step()
        if args.loss_log is not None:
            record = {"step": state.step, "loss_sum": loss_sum, "ests": ests, "world_size": session.world_size}
            with open(args.loss_log / f"loss-{session.restart_count}-{session.rank}.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
        if args.ckpt_every and state.step % args.ckpt_every == 0 and state.step < args.steps:
            state.commit()
        if args.step_delay:
            time.sleep(args.step_delay)
    if not stopped:
        state.commit_if_needed()  # the final state: what verify-determinism compares
    sha = state.params_sha256()
    full = state.state_sha256()
    if session.is_root:
        if not stopped:
            print(f"final-params-sha256 {sha}", flush=True)
        result = {
            "params_sha256": sha,
            "state_sha256": full,
            "step": state.step,
            "start_step": start,
            "stopped": stopped,
            "world_size": session.world_size,
            "num_workers": session.num_workers,
            "backend": session.backend.value,
            "device_types": list(session.device_types),
            "restored_from": str(restored.path) if restored else None,
            "balance": session.balance.value,
            "placement": list(state.placement.owner),
            "rebalances": [[step, list(placement.owner)] for step, placement in state.rebalances],
        }
        print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
