"""EST mode with real processes (gloo): N = 8 ESTs on 3 and 4 processes whose ESTs move between them mid-run, by
hand (:meth:`State.rebalance`) and by the balancer against a slowed rank, and across a checkpoint and a restart.

Why bitwise equality may be asserted: an EST's whole context (RNG streams, BatchNorm buffers, data cursor) moves
with it, and the runtime's sum of the N gradients is exact, so where an EST runs changes no float operation of the
training.  The reference is one process running all 8 ESTs without a move."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers
from tests.unit.session.launch import Run, base_env

N = 8
STEPS = 12  # 96 samples / (8 ESTs x 4): 3 steps per epoch, four epochs
WORKER = Path(__file__).with_name("rebalance_worker.py")


def train(
    tmp: Path, name: str, procs: int, balance: BalanceMode, *args: str, job: Path | None = None
) -> dict[str, Any]:
    out = tmp / name
    out.mkdir()
    result = out / "result.json"
    step = WorkerStep(
        command=(sys.executable, str(WORKER), "--steps", str(STEPS), "--result", str(result), *args),
        ntasks=procs,
        num_ests=N,
        job_dir=job if job is not None else out / "job",
        backend=Backend.TORCH,
        launcher=Launcher.LOCAL,
        balance=balance,
    )
    run = Run(start_workers(step, environ=base_env(), logs=out), out, result)
    assert run.wait() == 0, "\n".join(run.outputs)
    return run.result()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = train(tmp_path_factory.mktemp("reference"), "m1", 1, BalanceMode.NONE)
    assert result["step"] == STEPS and result["rebalances"] == [] and result["balance"] == "none"
    return result


def test_forced_moves_keep_the_bits_and_hand_the_contexts_over(reference: dict[str, Any], tmp_path: Path) -> None:
    result = train(tmp_path, "m4", 4, BalanceMode.NONE, "--force", "3:1,2,2,3", "--force", "7:3,1,1,3")
    assert [step for step, _ in result["rebalances"]] == [3, 7]
    assert result["rebalances"][0][1] == [0, 3, 1, 1, 2, 2, 3, 3]  # EST 1 alone went from process 0 to 3
    assert sorted(Counter(result["placement"]).values()) == [1, 1, 3, 3]
    # every EST's context (RNG states, buffers, cursor) is the same before and after the move: handed over, not
    # started afresh (the state fingerprint covers every context)
    for step, before, after in result["handovers"]:
        assert before == after, f"contexts changed at the move of step {step}"
    assert result["params_sha256"] == reference["params_sha256"]
    assert result["state_sha256"] == reference["state_sha256"]


def test_the_balancer_moves_ests_off_a_slowed_rank(reference: dict[str, Any], tmp_path: Path) -> None:
    result = train(tmp_path, "m4-slow", 4, BalanceMode.EST, "--slow-rank", "3", "--slow-ms", "60")
    print(json.dumps({k: result[k] for k in ("rebalances", "placement", "outcomes")}))
    assert result["balance"] == "est" and result["rebalances"], result["outcomes"]
    assert Counter(result["placement"])[3] == 1  # from 2 ESTs to the one every process keeps
    assert result["params_sha256"] == reference["params_sha256"]
    assert result["state_sha256"] == reference["state_sha256"]


def test_a_restart_after_a_move_continues_bit_for_bit(reference: dict[str, Any], tmp_path: Path) -> None:
    job = tmp_path / "job"
    first = train(tmp_path, "m3", 3, BalanceMode.NONE, "--force", "2:1,2,5", "--stop-at", "5", job=job)
    assert first["step"] == 5 and first["rebalances"] == [[2, [0, 2, 2, 1, 1, 2, 2, 2]]]
    second = train(tmp_path, "m4", 4, BalanceMode.NONE, "--force", "8:2,1,2,3", job=job)
    assert second["restored_from"] == 5 and second["step"] == STEPS
    assert second["params_sha256"] == reference["params_sha256"]
    assert second["state_sha256"] == reference["state_sha256"]
