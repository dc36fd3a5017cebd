"""How a job balances its workers (``hpc-elastic submit --balance``, ``HPC_ELASTIC_BALANCE``), and which mode a job
that did not choose gets (pure; no torch)."""

from __future__ import annotations

from enum import StrEnum

from hpc_elastic.choices import parse_choice
from hpc_elastic.est.levels import DeterminismLevel


class BalanceMode(StrEnum):
    """- ``none``: every process keeps the ESTs it was given (contiguous blocks);
    - ``est``: Alg. 2 with whole ESTs as the step: faster processes run more ESTs, slower ones fewer; the ESTs move
      with their contexts at step boundaries, so the bits are those of the run that never moved them (D1/D2);
    - ``lbbsp``: LB-BSP's paper mode: one worker per process with x_i samples per iteration and the gradient
      weighted by n·x_i/X; bitwise identity is not promised."""

    NONE = "none"
    EST = "est"
    LBBSP = "lbbsp"

    @classmethod
    def parse(cls, value: str | BalanceMode) -> BalanceMode:
        return parse_choice(cls, value, "balance mode")


def check_balance(mode: BalanceMode | None, level: DeterminismLevel | None) -> None:
    """``est`` moves ESTs between processes, which keeps the bits only where the sum of the N gradients is exact:
    a ValueError at D0 (whose fp32 sums depend on where each EST runs)."""
    if mode is BalanceMode.EST and level is DeterminismLevel.D0:
        raise ValueError("balance mode est needs determinism level d1 or d2 (at d0 the bits depend on the placement)")


def resolve_balance(
    requested: BalanceMode | None, num_ests: int, num_procs: int, level: DeterminismLevel
) -> BalanceMode:
    """The mode a job runs: the requested one, else ``est`` where there are ESTs to move (N > M) and the sum is
    exact (D1, D2), else ``none``.  With N == M every process runs one EST and keeps it (a process never runs
    fewer than one), so ``est`` has nothing to move: the balancer is not started, no reading is exchanged."""
    check_balance(requested, level)
    if requested is BalanceMode.EST or (requested is None and level is not DeterminismLevel.D0):
        return BalanceMode.EST if num_ests > num_procs else BalanceMode.NONE
    return requested if requested is not None else BalanceMode.NONE
