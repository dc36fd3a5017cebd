#!/usr/bin/env python3
"""A tiny MLP on synthetic in-memory data, trained on hpc-elastic's one runtime (``hpc_elastic.init()``).

The same script runs on the torch (gloo/nccl), mpi and horovod backends: the wrapper (or a person) sets
HPC_ELASTIC_BACKEND, HPC_ELASTIC_JOB_DIR, HPC_ELASTIC_WORKERS and, for torch, HPC_ELASTIC_RANK /
HPC_ELASTIC_WORLD_SIZE / MASTER_ADDR / MASTER_PORT (mpirun, srun and horovodrun give MPI and Horovod their ranks).

The job has N logical workers (EasyScale threads, ESTs) whatever its number of processes M <= N.  Each EST reads its
own mini-batch (its dataset indices come from the runtime's data plan: the tensors live in memory here) and
computes the gradient of its mean squared error; the runtime sums the N gradients exactly and takes the optimizer
step.  So the parameters after any number of steps are the same bits whatever M is, and whatever restarts and
resizes happened in between.

On a stop request it checkpoints, rank 0 writes ``control/ack.json`` and it exits 0.  At the end rank 0 prints
``final-params-sha256 <hex>`` and one ``RESULT <json>`` line (also written to ``--result FILE``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

import hpc_elastic
from hpc_elastic import hvd_elastic
from hpc_elastic.checkpoint import Checkpoint
from hpc_elastic.session import Session
from hpc_elastic.state import State

IN_FEATURES = 8
HIDDEN = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps of the run")
    p.add_argument("--dataset", type=int, default=44, help="synthetic samples")
    p.add_argument("--batch", type=int, default=4, help="mini-batch per logical worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0, help="commit every K steps (0: only when stopping)")
    p.add_argument("--async-ckpt", action="store_true", help="persist periodic checkpoints in the background")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--trace", type=Path, default=None, help="directory for per-process JSONL traces of samples")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step (demos, tests)")
    p.add_argument("--result", type=Path, default=None, help="rank 0 also writes the RESULT JSON to this file")
    p.add_argument(
        "--horovod-elastic",
        action="store_true",
        help="under horovodrun's elastic mode: workers may leave or join mid-run (hvd.elastic.run; a commit in "
        "memory every step, on the shared filesystem every --ckpt-every steps)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "dataset", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def synthetic_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def train_step(state: State, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, trace: TextIO | None) -> None:
    """One global step: each EST of this process on its own mini-batch, then the exact sum and the optimizer."""
    for indices in state.batches():  # this EST's dataset indices; its context is switched in
        idx = list(indices)
        ((model(x[idx]) - y[idx]) ** 2).mean().backward()
        if trace is not None and state.active is not None:
            record = {"step": state.step, "epoch": state.epoch, "worker": state.active.vrank, "indices": idx}
            trace.write(json.dumps(record) + "\n")
    state.finish_step()
    if trace is not None:
        trace.flush()


def checkpoint_due(args: argparse.Namespace, step: int) -> bool:
    """A durable checkpoint after this step (not after the last one: the run ends there)."""
    return bool(args.ckpt_every) and step % args.ckpt_every == 0 and step < args.steps


def stop_now(session: Session, state: State) -> None:
    """The stop request: checkpoint, acknowledge (rank 0), say so."""
    path = session.checkpoint_and_acknowledge(state)
    if session.is_root:
        reason = session.stop_request.reason.value if session.stop_request else "unknown"
        print(f"stop ({reason}) at step {state.step}: checkpoint {path}", flush=True)


def train_plain(args: argparse.Namespace, session: Session, state: State, step: Callable[[], None]) -> bool:
    """``step()`` until the end of the run; True when a stop request ended it first."""
    while state.step < args.steps:
        if session.should_stop():
            stop_now(session, state)
            return True
        step()
        if checkpoint_due(args, state.step):
            state.commit()
        if args.step_delay:
            time.sleep(args.step_delay)
    return False


def train_elastic(
    args: argparse.Namespace,
    session: Session,
    state: State,
    step: Callable[[], None],
) -> tuple[bool, int, Checkpoint | None, int]:
    """The run under Horovod's elastic mode (hpc_elastic.hvd_elastic): ``step()`` until the end or a stop request,
    a commit in memory after every step.  Returns (stopped, start step, checkpoint resumed from, membership
    changes)."""
    hstate = hvd_elastic.elastic_state(session, state)  # its first sync restores the newest checkpoint
    started: list[int] = []

    def train() -> bool:
        if not started:
            started.append(state.step)
            if session.is_root:
                where = hstate.restored.path if hstate.restored else "nothing"
                print(f"rank 0 of {session.world_size} (horovod elastic); restored from {where}", flush=True)
        while state.step < args.steps:
            if session.should_stop():
                stop_now(session, state)
                return True
            step()
            # in memory after every step; raises HostsUpdatedInterrupt when workers are to leave or join
            hstate.commit(persist=checkpoint_due(args, state.step))
            if args.step_delay:
                time.sleep(args.step_delay)
        return False

    stopped = hvd_elastic.run(hstate, train)
    return stopped, started[0], hstate.restored, int(hstate.resets)


def main(
    argv: list[str] | None = None,
    build_model: Callable[[], torch.nn.Module] = mlp,
    make_data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = synthetic_data,
) -> int:
    """Train ``build_model()`` on ``make_data(samples, seed)`` (``train_cnn.py`` passes its own)."""
    args = parse_args(argv)
    session = hpc_elastic.init(seed=args.seed, keep=args.keep)  # identical initial parameters on every rank
    model = build_model().to(session.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    x, y = (t.to(session.device) for t in make_data(args.dataset, args.seed))
    state = session.state(model, optimizer, mode="async" if args.async_ckpt else "sync")
    state.plan_data(args.dataset, args.batch)  # the data are in memory: the runtime hands out indices
    trace: TextIO | None = None
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        trace = open(args.trace / f"trace-{time.time_ns()}-rank{session.rank}.jsonl", "a")  # noqa: SIM115

    def step() -> None:
        train_step(state, model, x, y, trace)

    changes = 0
    if args.horovod_elastic:  # restores (and reports) at its first sync
        stopped, start_step, restored, changes = train_elastic(args, session, state, step)
    else:
        restored = state.restore()
        start_step = state.step
        if session.is_root:
            print(
                f"rank 0 of {session.world_size} ({session.backend.value}, {session.device}); logical workers "
                f"{session.num_workers}; restored from {restored.path if restored else 'nothing'} at step {start_step}",
                flush=True,
            )
        stopped = train_plain(args, session, state, step)
    state.wait()
    if trace is not None:
        trace.close()
    sha = state.params_sha256()
    if session.is_root:
        if not stopped:
            print(f"final-params-sha256 {sha}", flush=True)
        result = {
            "sha256": sha,
            "step": state.step,
            "start_step": start_step,
            "epoch": state.epoch,
            "stopped": stopped,
            "world_size": session.world_size,
            "num_workers": session.num_workers,
            "backend": session.backend.value,
            "restored_from": str(restored.path) if restored else None,
        }
        if args.horovod_elastic:
            result["membership_changes"] = changes
        print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
        if args.result is not None:
            args.result.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.result.with_name(args.result.name + ".tmp")
            tmp.write_text(json.dumps(result, sort_keys=True) + "\n")
            tmp.replace(args.result)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
