"""A training process for the EST-mode tests: the bundled example's model and augmenting dataset, N ESTs on this
process group, optionally a slowed rank (a sleep inside each of its ESTs), forced placements at given steps, a
stop with a checkpoint at a given step.  Rank 0 writes one JSON result to ``--result``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hpc_elastic
from hpc_elastic.balancer import ESTBalanceConfig
from hpc_elastic.est.example import AugmentedBlobs, build_model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--force", action="append", default=[], help="STEP:c0,c1,... EST counts from step STEP on")
    p.add_argument("--stop-at", type=int, default=0, help="commit at this step and exit")
    p.add_argument("--every", type=int, default=2)
    args = p.parse_args(argv)
    session = hpc_elastic.init(seed=0, balance_config=ESTBalanceConfig(every=args.every, fast_window=2, fine_window=3))
    model = build_model("bn-dropout", 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = session.state(model, optimizer, data=AugmentedBlobs(96), batch_size=4, loader_workers=0)
    restored = state.restore()
    forced = {}
    for item in args.force:
        at, _, counts = item.partition(":")
        forced[int(at)] = tuple(int(c) for c in counts.split(","))
    handovers = []
    while state.step < args.steps:
        if state.step in forced:
            before = state.state_sha256()
            state.rebalance(state.placement.with_counts(forced[state.step]))
            handovers.append([state.step, before, state.state_sha256()])
        for x, y in state.batches():
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            if session.rank == args.slow_rank:
                time.sleep(args.slow_ms / 1000.0)
        state.finish_step()
        if args.stop_at and state.step == args.stop_at:
            break
    state.commit_if_needed()
    sha, full = state.params_sha256(), state.state_sha256()
    if session.is_root:
        decisions = state.balancer.decisions if state.balancer is not None else []
        result = {
            "params_sha256": sha,
            "state_sha256": full,
            "step": state.step,
            "restored_from": restored.step if restored else None,
            "balance": session.balance.value,
            "placement": list(state.placement.owner),
            "rebalances": [[step, list(pl.owner)] for step, pl in state.rebalances],
            "handovers": handovers,
            "outcomes": [d.outcome.value for _, d in decisions],
        }
        args.result.write_text(json.dumps(result))
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
