"""The slotted PS-job model: speed functions, packing, the job catalogue and generator, the slot simulator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import cli
from hpc_elastic.policy.drf import Drf
from hpc_elastic.policy.slot_tiresias import SlotTiresiasLas, gang_fits
from hpc_elastic.policy.slots import (
    Allocation,
    JobType,
    Packing,
    Servers,
    SlotAction,
    SlotDecision,
    SlotInput,
    SlotJob,
    SlotPolicy,
    SpeedModel,
)
from hpc_elastic.sim.ps_jobs import (
    DEFAULT_SERVERS,
    JOB_TYPES,
    MIN_EPOCHS,
    Arrival,
    SlotTraceJob,
    fit_request,
    from_gpu_trace,
    generate,
    model_type,
    parse_servers,
)
from hpc_elastic.sim.slots import SlotConfig, SlotOutcome, SlotSimulator
from hpc_elastic.sim.trace import TraceJob, load_trace
from tests.unit.sim.helpers import TRACES, needs_traces

# one GPU and one core per worker, one core per PS; f(p, w) = w steps/s, 100 steps an epoch: w/100 epochs/s
LINEAR = JobType("linear", 1, 1, 1, SpeedModel.ASYNC, (1.0, 0.0, 0.0, 0.0), 100.0)


class Scripted(SlotPolicy):
    """Allocates what a script says per slot: ``{slot: {job_id: (workers, ps)}}``, placed by :class:`Packing`."""

    name = "scripted"

    def __init__(self, script: dict[int, dict[int, tuple[int, int]]]) -> None:
        self.script = script

    def allocate(self, inp: SlotInput) -> SlotDecision:
        packing = Packing(inp)
        plan = self.script.get(inp.slot, {})
        for row, job in enumerate(inp.jobs):
            w, p = plan.get(job.job_id, (0, 0))
            for _ in range(w):
                assert packing.add(row, SlotAction.WORKER)
            for _ in range(p):
                assert packing.add(row, SlotAction.PS)
        return packing.decision()


class Fixed(SlotPolicy):
    """Returns one given decision every slot (to feed the validator bad decisions)."""

    name = "fixed"

    def __init__(self, decision: SlotDecision) -> None:
        self.decision = decision

    def allocate(self, inp: SlotInput) -> SlotDecision:
        return self.decision


def _job(job_id: int, arrival: int, epochs: float, request: tuple[int, int] = (1, 1), **kw: float) -> SlotTraceJob:
    return SlotTraceJob(job_id, 0, arrival, epochs, request[0], request[1], 4, 4, **kw)


def _config(**kw: float) -> SlotConfig:
    base: dict[str, float] = {"slot_seconds": 100.0, "start_seconds": 10.0, "rescale_seconds": 5.0}
    base.update(kw)
    return SlotConfig(Servers.uniform(1, 2, 8), (LINEAR,), **base)  # type: ignore[arg-type]


# --- speed functions ----------------------------------------------------------------------------------------------


def test_speed_functions_by_hand() -> None:
    fast = JobType("a", 1, 1, 1, SpeedModel.ASYNC, (1.0, 2.0, 0.5, 0.25), 10.0)
    assert fast.steps_per_second(2, 1) == pytest.approx(2 / (1 + 2 * 2 + 0.5 * 2 + 0.25 * 1))
    assert fast.epochs_per_second(2, 1) == pytest.approx(0.32 / 10)
    sync = JobType("s", 1, 1, 1, SpeedModel.SYNC, (0.01, 0.1, 0.2, 0.05, 0.1), 10.0, batch=100)
    assert sync.steps_per_second(2, 1) == pytest.approx(1 / (0.01 * 100 / 2 + 0.1 + 0.2 * 2 + 0.05 * 2 + 0.1))
    assert fast.steps_per_second(0, 3) == 0.0 and fast.steps_per_second(3, 0) == 0.0


@pytest.mark.parametrize("kind", JOB_TYPES, ids=lambda kind: kind.name)
def test_catalogue_shapes(kind: JobType) -> None:
    """Optimus' shapes: diminishing returns in workers, a PS-starved job slows down, too many PS cost a little."""
    speed = kind.epochs_per_second
    assert speed(8, 4) < 2 * speed(4, 2)  # diminishing returns
    assert speed(16, 1) < speed(16, 4)  # starved of PS
    best = max(range(1, 17), key=lambda ps: speed(4, ps))
    assert best < 16 and speed(4, 16) < speed(4, best)  # too many PS
    assert 1 <= kind.worker_gpus <= 2 and 1 <= kind.worker_cpus <= 4 and 1 <= kind.ps_cpus <= 4  # §6.2


def test_catalogue_is_table_1_with_both_models() -> None:
    assert len(JOB_TYPES) == 8 and len({kind.name for kind in JOB_TYPES}) == 8
    assert {kind.model for kind in JOB_TYPES} == {SpeedModel.SYNC, SpeedModel.ASYNC}


# --- packing ------------------------------------------------------------------------------------------------------


def test_packing_balances_and_refuses() -> None:
    inp = SlotInput(0, 100.0, (LINEAR,), Servers((2, 1), (4, 4)), (SlotJob(0, 0, 0, 1.0, max_workers=4),))
    packing = Packing(inp)
    assert packing.add(0, SlotAction.BOTH)  # worker on server 0 (2 free GPUs); PS on the server with most cores
    assert packing.add(0, SlotAction.WORKER)  # both servers have 1 free GPU: the first
    assert packing.add(0, SlotAction.WORKER)
    assert not packing.add(0, SlotAction.WORKER)  # no GPU left
    decision = packing.decision()
    (alloc,) = decision.allocations
    assert (alloc.workers, alloc.ps) == (3, 1)
    assert sorted(alloc.worker_servers) == [0, 0, 1] and alloc.ps_servers == (1,)
    assert decision.actions == ((0, SlotAction.BOTH), (0, SlotAction.WORKER), (0, SlotAction.WORKER))


def test_an_add_does_what_fits_says_and_a_refused_one_changes_nothing() -> None:
    """``add`` chooses its servers itself (one ``_server`` per task): it must agree with ``fits`` in every state,
    place a worker + PS on the servers ``fits`` tried, and leave a refused action without a trace."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        servers = Servers(tuple(int(g) for g in rng.integers(0, 3, 3)), tuple(int(c) for c in rng.integers(1, 9, 3)))
        jobs = tuple(
            SlotJob(k, int(rng.integers(0, len(JOB_TYPES))), k, 1.0, max_workers=3, max_ps=2) for k in range(4)
        )
        packing = Packing(SlotInput(0, 100.0, JOB_TYPES, servers, jobs))
        for _ in range(40):
            row, action = int(rng.integers(0, 4)), list(SlotAction)[int(rng.integers(0, 4))]
            before = packing.decision(), packing.free_gpus, packing.free_cpus
            fits = packing.fits(row, action)
            assert packing.add(row, action) is fits
            if not fits:
                assert (packing.decision(), packing.free_gpus, packing.free_cpus) == before
        for alloc in packing.decision().allocations:  # every task where the resources allowed it
            kind = JOB_TYPES[jobs[[j.job_id for j in jobs].index(alloc.job_id)].job_type]
            for server in alloc.worker_servers:
                assert servers.gpus[server] >= kind.worker_gpus
        used_cpu = np.zeros(3, dtype=np.int64)
        for alloc in packing.decision().allocations:
            kind = JOB_TYPES[jobs[[j.job_id for j in jobs].index(alloc.job_id)].job_type]
            for server in alloc.worker_servers:
                used_cpu[server] += kind.worker_cpus
            for server in alloc.ps_servers:
                used_cpu[server] += kind.ps_cpus
        assert (used_cpu <= np.array(servers.cpus)).all()


# --- generator ----------------------------------------------------------------------------------------------------


def _durations(trace: tuple[SlotTraceJob, ...]) -> np.ndarray:
    return np.array(
        [
            job.epochs_total / JOB_TYPES[job.job_type].epochs_per_second(job.request_workers, job.request_ps)
            for job in trace
        ]
    )


def test_generate_is_seeded_and_has_the_trace_shape() -> None:
    trace = generate(7, 3000)
    assert trace == generate(7, 3000) and trace != generate(8, 3000)
    minutes = _durations(trace) / 60
    assert 120 <= minutes.mean() <= 175  # §6.2: 147 minutes on average
    assert np.median(minutes) > 30 and minutes.max() > 24 * 60  # heavy-tailed: some run for days
    epochs = np.array([job.epochs_total for job in trace])
    assert epochs.min() >= MIN_EPOCHS and np.median(epochs) >= 20
    arrivals = [job.arrival for job in trace]
    assert arrivals == sorted(arrivals) and [job.job_id for job in trace] == list(range(3000))
    assert {job.job_type for job in trace} == set(range(len(JOB_TYPES)))
    assert all(job.speed_factor == 1.0 for job in trace)


def test_generate_shapes_differ() -> None:
    day = generate(1, 2000)
    per_slot = np.bincount([job.arrival for job in day])
    days = len(per_slot) // 72
    assert days >= 2
    hours = per_slot[: days * 72].reshape(days, 72).sum(axis=0)
    assert hours[:36].sum() > 1.5 * hours[36:].sum()  # the day/night cycle (rate x (1 + 0.6 sin))
    assert all(job.arrival == 0 for job in generate(1, 50, arrival=Arrival.BATCH))
    busy = generate(1, 2000, load=12.0)  # four times the default rate
    assert busy[-1].arrival < day[-1].arrival / 3
    vgg = generate(1, 200, type_weights=[0, 1, 0, 0, 0, 0, 0, 0])
    assert {job.job_type for job in vgg} == {1}
    varied = generate(1, 500, variation=0.3)
    factors = [job.speed_factor for job in varied]
    assert min(factors) >= 0.7 and max(factors) <= 1.3 and len(set(factors)) > 400
    assert [job.epochs_total for job in varied] == [job.epochs_total for job in generate(1, 500)]


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"jobs": 0}, "jobs"), ({"load": -1.0}, "load"), ({"variation": 1.0}, "variation"), ({"arrival": "x"}, "x")],
)
def test_generate_rejects_bad_parameters(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(1, **kw)  # type: ignore[arg-type]


# --- simulator ----------------------------------------------------------------------------------------------------


def test_two_jobs_by_hand() -> None:
    """slot 0: A 1w1p, start 10 s, 90 s x 0.01 = 0.9 epochs; slot 1: A 2w1p, rescale 5 s, 95 x 0.02 = 1.9 (2.8);
    slot 2: A 1w1p, rescale 5 s, the last 0.2 epochs in 20 s: done at 225 s; B 1w1p starts: 0.9 epochs;
    slot 3: B the last 0.6 epochs in 60 s: done at 360 s, 260 s after its arrival at slot 1."""
    jobs = [_job(0, 0, 3.0), _job(1, 1, 1.5)]
    script = {0: {0: (1, 1)}, 1: {0: (2, 1)}, 2: {0: (1, 1), 1: (1, 1)}, 3: {1: (1, 1)}}
    seen: list[tuple[int, tuple[int, int], SlotOutcome]] = []

    def observe(inp: SlotInput, decision: SlotDecision, outcome: SlotOutcome) -> None:
        seen.append((inp.slot, (len(inp.jobs), sum(job.workers for job in inp.jobs)), outcome))

    result = SlotSimulator(_config(), jobs).run(Scripted(script), observe)
    assert dict(result.jct) == pytest.approx({0: 225.0, 1: 260.0})
    assert result.avg_jct == pytest.approx(242.5)
    assert result.makespan == pytest.approx(360.0)
    assert result.rescales == 2 and result.starts == 2 and result.unfinished == () and result.slots == 4
    assert result.rewards == pytest.approx((0.3, 1.9 / 3, 0.2 / 3 + 0.6, 0.4))
    assert result.gpu_util == pytest.approx((100 + 200 + 25 + 100 + 60) / (2 * 360))
    assert result.cpu_util == pytest.approx((200 + 300 + 50 + 200 + 120) / (8 * 360))
    # the slot input carries last slot's allocation; slot 2 saw A's 2 workers, slot 3 only B (A finished)
    assert [(slot, shape) for slot, shape, _ in seen] == [(0, (1, 0)), (1, (2, 1)), (2, (2, 2)), (3, (1, 1))]
    assert seen[2][2].finished == (0,) and dict(seen[2][2].epochs) == pytest.approx({0: 0.2, 1: 0.9})


def test_speed_factor_and_service() -> None:
    """A job at half speed takes twice as long; its attained service is GPU-seconds held."""
    services: list[float] = []

    def observe(inp: SlotInput, decision: SlotDecision, outcome: SlotOutcome) -> None:
        services.extend(job.service for job in inp.jobs)

    result = SlotSimulator(_config(start_seconds=0.0), [_job(0, 0, 1.4, speed_factor=0.5)]).run(
        Scripted({k: {0: (1, 1)} for k in range(5)}), observe
    )
    assert dict(result.jct) == pytest.approx({0: 280.0})
    assert services == pytest.approx([0.0, 100.0, 200.0])


def test_idle_slots_are_skipped_and_max_slots_bounds() -> None:
    result = SlotSimulator(_config(), [_job(0, 0, 0.5), _job(1, 50_000, 0.5)]).run(Drf())
    assert result.slots == 2 and dict(result.jct) == pytest.approx({0: 60.0, 1: 60.0})
    stuck = SlotSimulator(_config(max_slots=20), [_job(0, 0, 0.5)]).run(Scripted({}))
    assert stuck.unfinished == (0,) and stuck.jct == () and math.isnan(stuck.avg_jct) and stuck.slots == 20


@pytest.mark.parametrize(
    ("alloc", "match"),
    [
        (Allocation(5, 1, 1, (0,), (0,)), "job 5: not a job of this slot"),
        (Allocation(0, 5, 1, (0,) * 5, (0,)), "job 0: 5w/1ps outside"),
        (Allocation(0, 3, 1, (0, 0, 0), (0,)), "job 0: server 0 over capacity"),
        (Allocation(0, 1, 1, (), (0,)), "job 0: 1w/1ps placed on 0"),
        (Allocation(0, 1, 1, (3,), (0,)), "job 0: server 3 is not one of 1"),
    ],
)
def test_invalid_decisions_are_rejected(alloc: Allocation, match: str) -> None:
    simulator = SlotSimulator(_config(), [_job(0, 0, 1.0)])
    with pytest.raises(ValueError, match=f"policy 'fixed', slot 0, {match}"):
        simulator.run(Fixed(SlotDecision((alloc,))))


def test_a_job_allocated_twice_is_rejected() -> None:
    alloc = Allocation(0, 1, 1, (0,), (0,))
    with pytest.raises(ValueError, match="job 0: allocated twice"):
        SlotSimulator(_config(), [_job(0, 0, 1.0)]).run(Fixed(SlotDecision((alloc, alloc))))


def test_same_trace_same_digest() -> None:
    trace = generate(3, 150, variation=0.2)
    config = SlotConfig(DEFAULT_SERVERS)
    first = SlotSimulator(config, trace).run(Drf())
    again = SlotSimulator(config, generate(3, 150, variation=0.2)).run(Drf())
    assert first == again and len(first.digest) == 64
    other = SlotSimulator(config, generate(4, 150, variation=0.2)).run(Drf())
    assert other.digest != first.digest
    assert not first.unfinished and sum(first.rewards) == pytest.approx(150.0)
    summary = first.summary()
    assert summary["finished"] == 150 and summary["avg_jct_s"] == first.avg_jct and 0 < summary["gpu_util"] <= 1


def test_bad_config_and_trace() -> None:
    with pytest.raises(ValueError, match="rescale_seconds"):
        _config(rescale_seconds=-1.0)
    with pytest.raises(ValueError, match="unique"):
        SlotSimulator(_config(), [_job(0, 0, 1.0), _job(0, 1, 1.0)])
    with pytest.raises(ValueError, match="job_type 3"):
        SlotSimulator(_config(), [SlotTraceJob(0, 3, 0, 1.0, 1, 1, 4, 4)])
    with pytest.raises(ValueError, match="request"):
        SlotTraceJob(0, 0, 0, 1.0, 5, 1, 4, 4)


def test_a_job_that_fits_no_server_is_refused_up_front() -> None:
    # LINEAR: a worker of 1 GPU and 1 core, a PS of 1 core
    assert gang_fits(Servers((1,), (2,)), LINEAR, 1, 1)  # both on the one server
    assert gang_fits(Servers((1, 0), (1, 1)), LINEAR, 1, 1)  # the worker on the GPU server, the PS beside it
    assert not gang_fits(Servers((1,), (1,)), LINEAR, 1, 1)  # one core for two tasks
    assert not gang_fits(Servers((0, 0), (8, 8)), LINEAR, 1, 1)  # no GPU for the worker
    for servers in (Servers((1,), (1,)), Servers((0, 0), (8, 8))):
        with pytest.raises(ValueError, match=r"1 job\(s\) can never run on these servers: .* of linear .*job 7"):
            SlotSimulator(SlotConfig(servers, (LINEAR,)), [_job(7, 0, 1.0)])
    result = CliRunner().invoke(cli, ["simulate-ps", "--jobs", "5", "--servers", "2x0x16"])
    assert result.exit_code == 2 and "can never run on these servers" in result.output
    assert len(result.output.strip().splitlines()) == 1


# --- GPU traces as PS jobs ----------------------------------------------------------------------------------------


def test_from_gpu_trace_rules() -> None:
    jobs = [
        TraceJob("b", 3600.0, 8, 1800.0, model="vgg16"),  # 2 GPUs a worker: 4 workers, 2 PS
        TraceJob("a", 1000.0, 4, 3600.0, model="ResNet-50"),
        TraceJob("c", 5000.0, 1, 600.0, model="deepspeech2"),
        TraceJob("d", 9000.0, 2, 60.0, model="mystery"),
    ]
    out = from_gpu_trace(jobs, seed=1)
    assert [job.job_id for job in out] == [0, 1, 2, 3]
    resnet, vgg, ctc, mystery = out
    assert (resnet.job_type, resnet.request_workers, resnet.request_ps, resnet.arrival) == (0, 4, 2, 0)
    assert (vgg.job_type, vgg.request_workers, vgg.request_ps, vgg.arrival) == (1, 4, 2, 2)  # (3600-1000)/1200
    assert ctc.job_type == 5 and (ctc.request_workers, ctc.request_ps) == (1, 1)
    assert resnet.epochs_total == round(3600 * JOB_TYPES[0].epochs_per_second(4, 2))
    assert mystery.epochs_total == MIN_EPOCHS  # a minute of training is fewer than the fewest epochs
    assert out == from_gpu_trace(jobs, seed=1)
    stretched = from_gpu_trace(jobs, seed=1, time_scale=2.0)
    assert stretched[1].arrival == 4 and stretched[0].epochs_total == round(7200 * JOB_TYPES[0].epochs_per_second(4, 2))
    assert model_type("inception3") == 3 and model_type("") is None and model_type("mystery") is None


@needs_traces
def test_from_shared_traces() -> None:
    tiresias = from_gpu_trace(load_trace(TRACES / "tiresias_60_job.csv", "tiresias").jobs, time_scale=20.0)
    assert len(tiresias) == 60 and {JOB_TYPES[job.job_type].name for job in tiresias} >= {"resnet-50", "vgg-16"}
    pollux = from_gpu_trace(load_trace(TRACES / "pollux_workloads" / "workload-1.csv", "pollux").jobs)
    assert len(pollux) == 160 and max(job.request_workers for job in pollux) == 16
    result = SlotSimulator(SlotConfig(DEFAULT_SERVERS), pollux).run(Drf())
    assert not result.unfinished and sum(result.rewards) == pytest.approx(160.0)


def test_parse_servers() -> None:
    assert parse_servers("3x4x16") == Servers.uniform(3, 4, 16)
    for bad in ("3x4", "axbxc", "0x4x4", "2x2x0"):
        with pytest.raises(ValueError, match="servers"):
            parse_servers(bad)


# --- the CLI ------------------------------------------------------------------------------------------------------


def test_cli_runs_and_prints_json() -> None:
    args = ["simulate-ps", "--jobs", "30", "--seed", "2", "--policy", "drf", "--policy", "optimus", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) == {"drf", "optimus"} and out["drf"]["finished"] == 30
    text = CliRunner().invoke(cli, ["simulate-ps", "--jobs", "10", "--policy", "tiresias-las"])
    assert text.exit_code == 0 and "tiresias-las" in text.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--servers", "3x4"], "servers must be NxGxC"),
        (["--policy", "nope"], "unknown slot policy 'nope'"),
        (["--trace", "x.csv"], "a trace file needs its format"),
        (["--load", "-1"], "load must be"),
        (["--load", "1e-9"], "load 1e-09 is too low: 5 jobs would arrive over"),  # (not slot after empty slot)
        (["--variation", "2"], "variation must be"),
        (["--servers", "99999999999999999999x4x16"], "each of N, G and C must be at most 100,000"),
        (["--jobs", "99999999999999999999"], "jobs must be 1..1,000,000, got 99999999999999999999"),
        (["--jobs", "x"], "'x' is not a valid integer range"),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["simulate-ps", "--jobs", "5", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_a_request_shrinks_until_its_gang_places_not_until_the_totals_hold_it() -> None:
    # dssm-like: a worker of 1 GPU and 4 cores, a PS of 2 cores. 7 workers and 2 PS use 7 of 8 GPUs and all 32
    # cores of two 4-GPU, 16-core servers, but the placement (each task on the server with the most free units
    # of what it needs most, worker-and-PS pairs first) strands cores, so that gang would never start
    kind = JobType("dssm-like", 1, 4, 2, SpeedModel.ASYNC, (1.0, 0.0, 0.0, 0.0), 100.0)
    servers = Servers.uniform(2, 4, 16)
    assert not gang_fits(servers, kind, 7, 2)
    w, p = fit_request(kind, 7, 2, servers)
    assert gang_fits(servers, kind, w, p) and (w, p) == (6, 2)
    job = SlotTraceJob(0, 0, 0, 50.0, w, p, 16, 8)
    result = SlotSimulator(SlotConfig(servers, (kind,)), [job]).run(SlotTiresiasLas())
    assert not result.unfinished


def test_requests_shrink_to_fit_the_cluster() -> None:
    vgg = JOB_TYPES[1]  # a worker: 2 GPUs and 2 cores; a PS: 4 cores
    assert fit_request(vgg, 8, 4, Servers.uniform(1, 4, 64)) == (2, 1)
    assert fit_request(vgg, 8, 4, Servers.uniform(4, 4, 16)) == (8, 4)  # 16 of 16 GPUs, 32 of 64 cores
    assert fit_request(vgg, 8, 4, None) == (8, 4)
    small = Servers.uniform(1, 4, 16)
    for job in generate(1, 300, small):
        kind = JOB_TYPES[job.job_type]
        assert job.request_workers * kind.worker_gpus <= 4
        assert job.request_workers * kind.worker_cpus + job.request_ps * kind.ps_cpus <= 16
    big = TraceJob("big", 0.0, 32, 3600.0, model="resnet50")
    (job,) = from_gpu_trace([big], servers=small)
    assert (job.request_workers, job.request_ps) == (4, 2)


def test_a_job_whose_summed_epochs_round_to_its_total_finishes_in_that_slot() -> None:
    """A slot's epochs a hair below what a job has left can still round its running sum up to the total; the job
    then finishes in that slot. Before, the simulator kept it for the next slot, where its input had nothing left
    and the run raised (here tiresias-las on a generated trace at load 2: job 16, 398 epochs)."""
    servers = Servers.uniform(16, 4, 16)
    jobs = generate(121, 200, servers, load=2.0)
    result = SlotSimulator(SlotConfig(servers), jobs).run(SlotTiresiasLas())
    assert not result.unfinished
    assert len(result.jct) == 200
    assert all(jct > 0 for _, jct in result.jct)
