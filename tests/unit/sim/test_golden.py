"""Pinned outcomes: the simulator's results on small replays do not change when its code does (for speed).

``golden.json`` holds, per case of :mod:`.golden_cases` and policy, the average JCT, counts, GPU-seconds and a
digest of every job's first start, end and queueing delay (to the microsecond), as written by the code before a
change. A change that means to alter results rewrites the file (``python -m tests.unit.sim.golden_cases``) and
says why in its commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_elastic.policy import POLICY_NAMES

from .golden_cases import cases, run_case

GOLDEN = json.loads((Path(__file__).with_name("golden.json")).read_text(encoding="utf-8"))


def test_golden_covers_every_case_and_policy() -> None:
    assert set(GOLDEN) == set(cases())
    for per_policy in GOLDEN.values():
        assert set(per_policy) == set(POLICY_NAMES)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("case", sorted(cases()))
def test_replay_matches_golden(case: str, policy: str) -> None:
    assert run_case(case, policy) == GOLDEN[case][policy]
