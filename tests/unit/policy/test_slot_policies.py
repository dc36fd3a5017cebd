"""The slot policies on small cases computed by hand: DRF, Optimus-like, Tiresias' 2D-LAS (gang, elastic)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpc_elastic.policy.drf import Drf, next_task
from hpc_elastic.policy.mlfq import MlfqConfig
from hpc_elastic.policy.optimus import OptimusLike, marginal_gain, remaining_seconds
from hpc_elastic.policy.slot_registry import SLOT_POLICY_NAMES, make_slot_policy, slot_policy_names
from hpc_elastic.policy.slot_tiresias import SlotTiresiasLas, SlotTiresiasLasElastic, las_order
from hpc_elastic.policy.slots import JobType, Packing, Servers, SlotAction, SlotInput, SlotJob, SpeedModel

B, W, P, V = SlotAction.BOTH, SlotAction.WORKER, SlotAction.PS, SlotAction.VOID

# X: a worker is 1 GPU and 1 core, a PS 1 core; Y: a worker is 1 GPU and 4 cores, a PS 2 cores
X = JobType("x", 1, 1, 1, SpeedModel.ASYNC, (1.0, 0.1, 0.0, 0.0), 100.0)
Y = JobType("y", 1, 4, 2, SpeedModel.ASYNC, (1.0, 0.1, 0.0, 0.0), 100.0)


def _job(
    job_id: int,
    kind: int,
    request: tuple[int, int],
    *,
    arrival: int = 0,
    service: float = 0.0,
    max_workers: int = 16,
    max_ps: int = 16,
) -> SlotJob:
    return SlotJob(
        job_id,
        kind,
        arrival,
        10.0,
        request_workers=request[0],
        request_ps=request[1],
        max_workers=max_workers,
        max_ps=max_ps,
        service=service,
    )


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


# --- Optimus ------------------------------------------------------------------------------------------------------


def test_optimus_greedy_by_hand() -> None:
    """3 GPUs, 6 cores; f = w / (1 + 0.1 w/p) steps/s, 100 steps an epoch; A has 10 epochs left, B 1.
    Both get 1w/1ps (T_A = 1100 s, T_B = 110 s). Gains per dominant share (a worker 1/3, a PS 1/6):
    A worker (1100 - 600) x 3 = 1500, A PS (1100 - 1050) x 6 = 300, B worker 150, B PS 30: A's worker. Then no GPU
    is left: A PS (600 - 550) x 6 = 300 beats B PS 30; then no core is left either."""
    inp = _inp(Servers.uniform(1, 3, 6), _job(0, 0, (1, 1)), _job(1, 0, (1, 1), arrival=1))
    inp = SlotInput(0, 1200.0, inp.types, inp.servers, (inp.jobs[0], replace(inp.jobs[1], epochs_total=1.0)))
    assert remaining_seconds(inp, inp.jobs[0], 1, 1) == pytest.approx(1100.0)
    assert marginal_gain(inp, inp.jobs[0], 1, 1, W) == pytest.approx(1500.0)
    assert marginal_gain(inp, inp.jobs[1], 1, 1, P) == pytest.approx(30.0)
    decision = OptimusLike().allocate(inp)
    assert decision.actions == ((0, B), (1, B), (0, W), (0, P))
    assert decision.of(0) == (2, 2) and decision.of(1) == (1, 1)


def test_optimus_stops_without_a_positive_gain() -> None:
    """A synchronous job whose per-worker and per-PS costs dominate only slows down with more tasks: VOID."""
    slow = JobType("slow", 1, 1, 1, SpeedModel.SYNC, (0.001, 0.0, 0.0, 1.0, 1.0), 100.0)
    inp = SlotInput(0, 1200.0, (slow,), Servers.uniform(1, 8, 32), (SlotJob(0, 0, 0, 10.0),))
    assert OptimusLike().allocate(inp).actions == ((0, B), (-1, V))


def test_optimus_skips_a_job_whose_first_pair_does_not_fit() -> None:
    inp = _inp(Servers.uniform(1, 1, 8), _job(0, 1, (1, 1)), _job(1, 0, (1, 1), arrival=1))
    decision = OptimusLike().allocate(inp)
    assert decision.of(0)[0] == 1 and decision.of(1) == (0, 0)  # B never gets its first pair (no GPU left)


# --- Tiresias -----------------------------------------------------------------------------------------------------


def test_las_order_uses_the_mlfq_queues() -> None:
    jobs = (_job(0, 0, (1, 1), service=50_000), _job(1, 0, (1, 1), arrival=1), _job(2, 0, (1, 1), arrival=2))
    inp = _inp(Servers.uniform(1, 4, 16), *jobs)
    assert las_order(MlfqConfig((3200.0,)), inp) == [1, 2, 0]  # 50,000 GPU-s is past 3200: second queue
    assert las_order(MlfqConfig((100_000.0,)), inp) == [0, 1, 2]
    assert las_order(SlotTiresiasLas().mlfq, inp) == [1, 2, 0]  # SLOT_THRESHOLDS: 50,000 is in the second queue


def test_tiresias_gangs_all_or_nothing() -> None:
    """5 GPUs; priority B (4w/2ps), C (2w/1ps), A (1w/1ps, demoted). B takes 4 GPUs; C's pair fits the last GPU but
    its second worker does not: C gets nothing (rolled back); A's gang fits."""
    inp = _inp(
        Servers.uniform(1, 5, 16),
        _job(0, 0, (1, 1), service=50_000),
        _job(1, 0, (4, 2), arrival=1),
        _job(2, 0, (2, 1), arrival=2),
    )
    decision = SlotTiresiasLas().allocate(inp)
    assert decision.of(1) == (4, 2) and decision.of(2) == (0, 0) and decision.of(0) == (1, 1)
    assert decision.actions == ((1, B), (1, B), (1, W), (1, W), (0, B), (-1, V))


def test_tiresias_elastic_grows_in_priority_order_keeping_the_ratio() -> None:
    """8 GPUs, 16 cores; B (2w/1ps, first) and A (1w/1ps, demoted) get their gangs, then B grows with one PS per
    two workers: (3, 2), (4, 2), (5, 3), (6, 3), (7, 4), and the GPUs are gone."""
    inp = _inp(
        Servers.uniform(1, 8, 16),
        _job(0, 0, (1, 1), service=50_000, max_workers=4, max_ps=4),
        _job(1, 0, (2, 1), arrival=1, max_workers=8, max_ps=4),
    )
    decision = SlotTiresiasLasElastic().allocate(inp)
    assert decision.of(1) == (7, 4) and decision.of(0) == (1, 1)
    assert decision.actions == ((1, B), (1, W), (0, B), (1, B), (1, W), (1, B), (1, W), (1, B), (-1, V))
    gang = SlotTiresiasLas().allocate(inp)
    assert gang.of(1) == (2, 1) and gang.of(0) == (1, 1)


def test_packing_rollback() -> None:
    inp = _inp(Servers.uniform(1, 2, 4), _job(0, 0, (1, 1)))
    packing = Packing(inp)
    assert packing.add(0, B)
    mark = packing.mark()
    assert packing.add(0, W) and packing.add(0, P)
    packing.rollback(mark)
    assert (packing.workers(0), packing.ps(0), packing.free_gpus, packing.free_cpus) == (1, 1, 1, 2)
    assert packing.decision().actions == ((0, B),)


# --- registry -----------------------------------------------------------------------------------------------------


def test_registry() -> None:
    assert SLOT_POLICY_NAMES == ("drf", "optimus", "tiresias-las", "tiresias-las+elastic")
    for name in SLOT_POLICY_NAMES:
        assert make_slot_policy(name).name == name
    with pytest.raises(ValueError, match="unknown slot policy 'nope'; choose from drf, optimus"):
        make_slot_policy("nope")
    assert isinstance(make_slot_policy("mine", {"mine": Drf}), Drf)
    assert slot_policy_names({"mine": Drf}) == (*SLOT_POLICY_NAMES, "mine")


def test_drf_keeps_what_a_running_job_holds() -> None:
    """Static DRF (YARN without preemption): B arrived later and holds 2w/2ps from the last slot; A, waiting with the
    lower dominant share, does not take B's tasks: B is granted its holding first (pairs), A gets what is left."""
    held = SlotJob(1, 1, 1, 10.0, workers=2, ps=2, request_workers=2, request_ps=2)
    inp = _inp(Servers.uniform(1, 3, 18), _job(0, 0, (3, 1)), held)
    decision = Drf().allocate(inp)
    assert decision.of(1) == (2, 2)
    assert decision.of(0) == (1, 1)
    assert decision.actions[:2] == ((1, B), (1, B))
    # without the holding, progressive filling alone would give A two workers before B's second pair
    fresh = _inp(Servers.uniform(1, 3, 18), _job(0, 0, (3, 1)), _job(1, 1, (2, 2), arrival=1))
    assert Drf().allocate(fresh).of(0) == (2, 1)
