"""Which balance mode a job runs (pure)."""

from __future__ import annotations

import pytest

from hpc_elastic.balance.mode import BalanceMode, check_balance, resolve_balance
from hpc_elastic.env import read_job_environment
from hpc_elastic.est.levels import DeterminismLevel

D0, D1, D2 = DeterminismLevel.D0, DeterminismLevel.D1, DeterminismLevel.D2


@pytest.mark.parametrize(
    ("requested", "n", "m", "level", "expected"),
    [
        (None, 8, 4, D1, BalanceMode.EST),  # the default where there are ESTs to move and the sum is exact
        (None, 8, 4, D2, BalanceMode.EST),
        (None, 4, 4, D1, BalanceMode.NONE),  # one EST per process: nothing can move
        (None, 8, 4, D0, BalanceMode.NONE),  # fp32 sums depend on the placement
        (BalanceMode.EST, 4, 4, D1, BalanceMode.NONE),
        (BalanceMode.NONE, 8, 4, D1, BalanceMode.NONE),
        (BalanceMode.LBBSP, 8, 4, D0, BalanceMode.LBBSP),
    ],
)
def test_resolve(requested: BalanceMode | None, n: int, m: int, level: DeterminismLevel, expected: BalanceMode) -> None:
    assert resolve_balance(requested, n, m, level) is expected


def test_est_is_refused_at_d0() -> None:
    with pytest.raises(ValueError, match="balance mode est needs determinism level d1 or d2"):
        resolve_balance(BalanceMode.EST, 8, 4, D0)
    check_balance(BalanceMode.EST, None)  # the level left to the script: checked when the job starts


def test_parse_and_environment() -> None:
    assert BalanceMode.parse(" EST ") is BalanceMode.EST
    with pytest.raises(ValueError, match="balance mode must be one of none, est, lbbsp, got 'fast'"):
        BalanceMode.parse("fast")
    assert read_job_environment({"HPC_ELASTIC_BALANCE": "lbbsp"}).balance is BalanceMode.LBBSP
    assert read_job_environment({}).balance is None
    with pytest.raises(ValueError, match="HPC_ELASTIC_BALANCE: balance mode must be one of"):
        read_job_environment({"HPC_ELASTIC_BALANCE": "x"})
