"""The slot policies on small cases computed by hand: DRF."""

from __future__ import annotations

import pytest

from hpc_elastic.policy.drf import Drf, next_task
from hpc_elastic.policy.slots import JobType, Servers, SlotAction, SlotInput, SlotJob, SpeedModel

B, W, P, V = SlotAction.BOTH, SlotAction.WORKER, SlotAction.PS, SlotAction.VOID

# X: a worker is 1 GPU and 1 core, a PS 1 core; Y: a worker is 1 GPU and 4 cores, a PS 2 cores
X = JobType("x", 1, 1, 1, SpeedModel.ASYNC, (1.0, 0.1, 0.0, 0.0), 100.0)
Y = JobType("y", 1, 4, 2, SpeedModel.ASYNC, (1.0, 0.1, 0.0, 0.0), 100.0)


def _job(job_id: int, kind: int, request: tuple[int, int], *, arrival: int = 0, **kw: int) -> SlotJob:
    return SlotJob(job_id, kind, arrival, 10.0, request_workers=request[0], request_ps=request[1], **kw)


def _inp(servers: Servers, *jobs: SlotJob) -> SlotInput:
    return SlotInput(0, 1200.0, (X, Y), servers, jobs)


def test_next_task() -> None:
    assert next_task(0, 0, 2, 1) is B
    assert next_task(1, 1, 2, 1) is W
    assert next_task(1, 1, 1, 3) is P
    assert next_task(2, 1, 2, 1) is None


def test_drf_progressive_filling_by_hand() -> None:
    """6 GPUs and 18 cores; A (type X) asks 4w/2ps, B (type Y) 2w/2ps. Dominant shares after each task:
    A BOTH -> A 1/6 (GPU); B BOTH -> B 6/18 (cores); A BOTH -> A 2/6; A and B tie at 1/3: A (earlier) WORKER ->
    A 3/6; B BOTH -> B 12/18, has its request; A WORKER -> A 4/6. Every GPU and core is taken: no VOID."""
    inp = _inp(Servers.uniform(1, 6, 18), _job(0, 0, (4, 2)), _job(1, 1, (2, 2)))
    decision = Drf().allocate(inp)
    assert decision.actions == ((0, B), (1, B), (0, B), (0, W), (1, B), (0, W))
    assert decision.of(0) == (4, 2) and decision.of(1) == (2, 2)
    assert inp.dominant_share(inp.jobs[0], 4, 2) == pytest.approx(4 / 6)
    assert inp.dominant_share(inp.jobs[1], 2, 2) == pytest.approx(12 / 18)


def test_drf_partial_requests_and_void() -> None:
    """2 GPUs, 20 cores; A and B (type X) both ask 2w/1ps: each gets a worker and a PS, then neither's next worker
    fits; PS would still fit, so DRF's stop is an explicit VOID."""
    inp = _inp(Servers.uniform(1, 2, 20), _job(0, 0, (2, 1)), _job(1, 0, (2, 1), arrival=1))
    decision = Drf().allocate(inp)
    assert decision.actions == ((0, B), (1, B), (-1, V))
    assert decision.of(0) == (1, 1) and decision.of(1) == (1, 1)


def test_drf_never_exceeds_the_request_and_skips_what_does_not_fit() -> None:
    """A big request that does not fit does not block a later small job (DRF fills whoever fits)."""
    inp = _inp(
        Servers.uniform(2, 2, 8),
        _job(0, 1, (1, 1), max_workers=8),  # Y: 1 GPU + 6 cores
        _job(1, 1, (3, 1), arrival=1),  # Y: its BOTH fits one server, a second worker needs 4 more cores
        _job(2, 0, (1, 1), arrival=2),  # X: 1 GPU + 2 cores
    )
    decision = Drf().allocate(inp)
    assert decision.of(0) == (1, 1)  # its request, though more would fit
    w, p = decision.of(1)
    assert (w, p) == (1, 1)
    assert decision.of(2) == (1, 1)
    assert decision.actions[:3] == ((0, B), (1, B), (2, B)) and decision.actions[-1] == (-1, V)


def test_drf_empty_slot() -> None:
    assert Drf().allocate(_inp(Servers.uniform(1, 2, 2))).actions == ()
