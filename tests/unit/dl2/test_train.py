"""DL²'s training in the slot simulator (§4.2, §4.3): supervised match with DRF, online improvement over the
supervised policy, determinism, and the ``hpc-elastic dl2`` commands."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch", reason="DL² training needs torch")

import torch

from hpc_elastic.cli.main import cli
from hpc_elastic.dl2 import model_file
from hpc_elastic.dl2.net import NetShape, PolicyNet, inference_network, masked_log_softmax, to_arrays
from hpc_elastic.dl2.train import (
    Teacher,
    TrainConfig,
    TrainResult,
    base_spec,
    immediate_gains,
    load_networks,
    save_model,
    score,
    temperature_for,
    train,
    validation,
)
from hpc_elastic.policy.dl2 import infer, sampler
from hpc_elastic.policy.drf import Drf
from hpc_elastic.policy.optimus import OptimusLike
from hpc_elastic.policy.slots import JOB_ACTIONS, Servers, SlotInput, SlotJob
from hpc_elastic.ps.model import MODEL_NAME
from hpc_elastic.sim.ps_jobs import CPU_JOB_TYPES, CPU_SERVERS, JOB_TYPES, SLOT_SECONDS, Arrival, generate
from hpc_elastic.sim.slots import SlotSimulator

#: a few seconds of training: 2 small traces, 2 supervised epochs, 1 episode
TINY = TrainConfig(
    seed=7,
    jobs=12,
    traces=2,
    held_out=1,
    validation_jobs=12,
    servers=(2, 4, 16),
    max_jobs=8,
    width_factor=0.25,
    hidden=16,
    row_hidden=8,
    supervised_epochs=2,
    rl_episodes=1,
    eval_every=5,
    batch=32,
    replay=512,
)


def model_bytes(result: TrainResult) -> bytes:
    meta = {"curve": [dataclasses.asdict(point) for point in result.curve]}
    return model_file.encode(result.spec, result.config.to_dict(), meta, to_arrays(result.policy, result.value))


def test_the_same_seeds_give_the_same_model_bits() -> None:
    first, second = train(TINY), train(TINY)
    assert len(first.curve) > 1  # the online phase ran and was validated
    assert model_bytes(first) == model_bytes(second)
    other = train(dataclasses.replace(TINY, seed=8))
    assert model_bytes(other) != model_bytes(first)


def test_model_file_of_a_run_loads_into_the_same_networks(tmp_path: Path) -> None:
    result = train(dataclasses.replace(TINY, rl_episodes=0))
    path = tmp_path / "m.dl2"
    save_model(path, result)
    loaded = model_file.load(path)
    assert loaded.spec == result.spec
    config, policy, value = load_networks(loaded)
    assert config == result.config
    arrays, again = to_arrays(result.policy, result.value), to_arrays(policy, value)
    assert all(np.array_equal(arrays[name], again[name]) for name in arrays)
    assert loaded.meta["supervised"]["samples"] == result.supervised.samples


def test_training_configuration_is_checked() -> None:
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        TrainConfig(jobs=0)
    with pytest.raises(ValueError, match="epsilon"):
        TrainConfig(epsilon=2.0)
    with pytest.raises(ValueError, match="unknown training setting"):
        TrainConfig.from_dict({"nope": 1})
    with pytest.raises(ValueError, match="bootstrap must be one of drf, optimus, got 'yarn'"):
        TrainConfig(bootstrap="yarn")  # type: ignore[arg-type]  # a model file's config holds a name
    assert TrainConfig.from_dict({"bootstrap": "optimus"}).bootstrap is Teacher.OPTIMUS
    for fractions in ((), (0.0,), (0.5, 1.5), (float("nan"),), (True,)):
        with pytest.raises(ValueError, match="load_fractions"):
            TrainConfig(load_fractions=fractions)
    with pytest.raises(ValueError, match="immediate must be a number >= 0, got -1"):
        TrainConfig(immediate=-1)
    for confidence in (0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"online_confidence must be in \(0, 1\]"):
            TrainConfig(online_confidence=confidence)
    config = TrainConfig(load_fractions=(0.25, 1.0), immediate=0.5, online_confidence=0.3)
    assert TrainConfig.from_dict(config.to_dict()) == config


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["dl2", *args])
    return result.exit_code, result.output + result.stderr


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "m.dl2"
    for args, message in (
        (["--jobs", "0"], "jobs must be an int >= 1"),
        (["--servers", "4x4"], "servers"),
        (["--max-jobs", "0"], "max_jobs"),
        (["--teacher", "optimus", "--since", "2026-11-27"], "go with --teacher sacct"),
        (["--online-confidence", "0"], "online_confidence must be in (0, 1]"),
        (["--plot", str(tmp_path / "curve.xyz")], "must be an image file name ending in .png"),
        (["--plot", str(tmp_path / "curve")], "must be an image file name"),
        (["--plot", str(tmp_path / "no" / "curve.png")], "does not exist"),
    ):
        code, text = run("train", "--out", str(out), *args)
        assert code == 2 and message in text, text
    code, text = run("train", "--out", str(tmp_path / "no" / "m.dl2"))
    assert code == 2 and "does not exist" in text, text
    assert list(tmp_path.iterdir()) == []
    bad = tmp_path / "bad.dl2"
    bad.write_bytes(b"not a model")
    code, text = run("evaluate", str(bad))
    assert code == 2 and "not a DL² model file" in text, text
    code, text = run("evaluate", str(tmp_path / "missing.dl2"))
    assert code == 2 and "cannot read" in text, text


#: ``dl2 train``'s options for a few seconds of supervised training on a small cluster
CLI_SMALL = [
    "--jobs", "10", "--traces", "1", "--validation-jobs", "10", "--servers", "2x4x16", "--max-jobs", "8",
    "--supervised-epochs", "1", "--rl-episodes", "0",
]  # fmt: skip


def test_cli_trains_and_evaluates(tmp_path: Path) -> None:
    out = tmp_path / "m.dl2"
    code, text = run("train", "--out", str(out), "--seed", "3", *CLI_SMALL)
    assert code == 0, text
    assert "held_out_match" in text
    code, text = run("evaluate", str(out), "--jobs", "10", "--policy", "drf", "--json")
    assert code == 0, text
    assert '"dl2"' in text and '"drf"' in text


def test_cli_trains_from_the_optimus_like_teacher(tmp_path: Path) -> None:
    out = tmp_path / "m.dl2"
    code, text = run("train", "--out", str(out), "--seed", "3", "--teacher", "optimus", *CLI_SMALL)
    assert code == 0, text
    assert "teacher: optimus" in text
    assert model_file.load(out).config["bootstrap"] == "optimus"


#: a small contended case: 4 servers, J = 16, 24 training traces of 40 jobs, 2 held-out traces
SMALL = TrainConfig(
    seed=1,
    jobs=40,
    traces=24,
    held_out=2,
    validation_jobs=20,
    servers=(4, 4, 16),
    max_jobs=16,
    width_factor=0.05,
    hidden=4,
    row_hidden=32,
    supervised_epochs=40,
    supervised_lr=1e-2,
    rl_episodes=2,
    eval_every=10,
    batch=64,
)


@pytest.fixture(scope="module")
def small() -> TrainResult:
    return train(SMALL)


def test_supervised_phase_reproduces_drf_on_held_out_traces() -> None:
    """Trained to convergence: 60 epochs matched DRF on 0.967-0.984 of the held-out samples for seeds 1-4 on an AMD
    EPYC host.  ``SMALL``'s 40 epochs, the online tests' imperfect start, are still moving at Adam's step of 1e-2:
    where they end depends on the CPU's float rounding (0.834 held out on that host; this check passed on the Intel
    hosts of earlier runs)."""
    report = train(dataclasses.replace(SMALL, supervised_epochs=60, rl_episodes=0)).supervised
    assert report.held_out_samples > 1000
    assert report.held_out_match >= 0.9
    assert report.losses[-1] < report.losses[0] / 5


def test_the_optimus_bootstrap_imitates_the_optimus_like_policy() -> None:
    """§4.2 from another teacher: the supervised policy's validation JCT is Optimus-like's (within 5 %), which is
    below DRF's on this case; bootstrapped from DRF it is not."""
    result = train(dataclasses.replace(SMALL, bootstrap=Teacher.OPTIMUS, rl_episodes=0))
    assert result.supervised.held_out_match >= 0.8  # against Optimus-like's decisions on the held-out traces
    checks = validation(SMALL)
    optimus = checks.jct(OptimusLike())
    assert optimus < checks.drf_jct
    assert abs(result.supervised_jct / optimus - 1.0) < 0.05


def greedy_confidence(policy: PolicyNet, states: torch.Tensor, masks: torch.Tensor) -> float:
    """The mean probability of the greedy action over ``states``."""
    with torch.no_grad():
        return float(masked_log_softmax(policy(states), masks).exp().max(dim=1).values.mean())


def test_the_temperature_brings_the_greedy_actions_mean_probability_to_the_target() -> None:
    spec = dataclasses.replace(base_spec(TINY), max_slots_run=10, max_epochs_left=100, max_tasks=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        policy = PolicyNet(spec, TINY.shape)
        states = torch.rand(300, spec.state_size)
        masks = torch.rand(300, spec.action_size) < 0.3
    masks[:, spec.void] = True
    policy.temper(0.01)  # a sure policy, as a supervised phase leaves it
    sure = greedy_confidence(policy, states, masks)
    assert sure > 0.95
    for target in (0.8, 0.5, 0.2):
        temperature = temperature_for(policy, states, masks, target, chunk=64)
        assert temperature > 1
        tempered = copy.deepcopy(policy)
        tempered.temper(temperature)
        assert greedy_confidence(tempered, states, masks) == pytest.approx(target, abs=1e-3)
    # as sure as asked already: left alone (the test's mean is float32, the function's float64: a margin for rounding)
    assert temperature_for(policy, states, masks, sure + 1e-4) == 1.0
    assert temperature_for(policy, states, masks, 1.0) == 1.0
    assert temperature_for(policy, states[:0], masks[:0], 0.5) == 1.0


def test_tempering_keeps_the_supervised_policys_decisions() -> None:
    """The online phase starts from the supervised policy's logits divided by the calibrated temperature: the
    same greedy decisions (the same validation JCT, to the bit), a flatter softmax."""
    config = dataclasses.replace(TINY, supervised_epochs=20, rl_episodes=0)
    plain = train(dataclasses.replace(config, online_confidence=1.0))
    tempered = train(config)
    assert plain.supervised.temperature == 1.0
    temperature = tempered.supervised.temperature
    assert temperature > 1
    assert tempered.supervised_jct == plain.supervised_jct
    assert tempered.supervised.train_match == plain.supervised.train_match
    states = torch.rand(50, plain.spec.state_size)
    with torch.no_grad():
        assert torch.allclose(tempered.policy(states) * temperature, plain.policy(states), rtol=1e-4, atol=1e-3)


def test_online_phase_validates_and_keeps_its_best_policy(small: TrainResult) -> None:
    curve = small.curve
    assert curve[0].update == 0 and len(curve) >= 3
    assert [p.update for p in curve[1:]] == list(range(SMALL.eval_every, curve[-1].update + 1, SMALL.eval_every))
    assert small.best.avg_jct <= small.supervised_jct
    # the returned policy is the best validated one: running it again gives its JCT to the bit
    checks = validation(SMALL)
    assert len(checks.runs) == len(SMALL.load_fractions)
    assert checks.drf_jct == small.drf_validation_jct
    assert checks.evaluate(inference_network(small.policy), small.spec) == small.best.avg_jct


def test_the_cpu_catalogue_generates_ps_jobs_that_fit_a_cpu_partition_and_names_the_ps_model() -> None:
    trace = generate(5, jobs=40, servers=CPU_SERVERS, types=CPU_JOB_TYPES)
    (kind,) = CPU_JOB_TYPES
    assert kind.name == MODEL_NAME and kind.worker_gpus == 0
    for job in trace:  # each request fits the partition's 16 cores (2 nodes of 8)
        assert job.request_workers * kind.worker_cpus + job.request_ps * kind.ps_cpus <= CPU_SERVERS.total_cpus
    assert len({job.arrival for job in trace}) > 1  # arrivals spread over slots at a load in cores
    assert TrainConfig(catalogue="cpu", servers=(2, 0, 8)).types == CPU_JOB_TYPES
    with pytest.raises(ValueError, match="'gpu'"):
        TrainConfig(catalogue="gpu")


def test_cli_trains_on_the_cpu_catalogue_and_evaluates_on_it(tmp_path: Path) -> None:
    out = tmp_path / "cpu.dl2"
    args = ["--jobs", "10", "--traces", "1", "--validation-jobs", "8", "--supervised-epochs", "1", "--rl-episodes", "0"]
    code, text = run("train", "--out", str(out), "--catalogue", "cpu", "--servers", "2x0x8", "--max-jobs", "4", *args)
    assert code == 0, text
    assert model_file.load(out).spec.type_names == (MODEL_NAME,)
    code, text = run("evaluate", str(out), "--jobs", "8", "--policy", "drf", "--json")  # on the model's catalogue
    assert code == 0, text
    assert '"dl2"' in text and '"drf"' in text
    code, text = run("train", "--out", str(out), "--catalogue", "gpu")
    assert code == 2 and "'gpu'" in text, text


def test_immediate_gains_of_a_slots_inferences_add_up_to_each_jobs_eq1_term() -> None:
    """Each inference's gain, summed over a job's actions in the order taken, is that job's Eq. 1 term of the slot
    at the allocation it ends with (the type's speed model, capped at the epochs left); batches of J jobs are
    followed, and rows beyond a batch's jobs and void gain nothing."""
    servers = Servers.uniform(16, 4, 16)
    trace = generate(5, 21, servers, arrival=Arrival.BATCH)
    jobs = tuple(
        SlotJob(
            job.job_id,
            job.job_type,
            0,
            job.epochs_total,
            epochs_done=job.epochs_total * (0.97 if k % 3 == 0 else 0.0),  # some finish within the slot: the cap
            request_workers=job.request_workers,
            request_ps=job.request_ps,
            max_workers=job.max_workers,
            max_ps=job.max_ps,
        )
        for k, job in enumerate(trace)
    )
    inp = SlotInput(0, SLOT_SECONDS, JOB_TYPES, servers, jobs)
    spec = base_spec(dataclasses.replace(TINY, servers=(4, 4, 16)))  # J = 8: three batches
    network = inference_network(PolicyNet(spec, NetShape(0.25, 8, 8)))
    decision, steps = infer(spec, inp, network, sampler(np.random.default_rng(3), 0.4), explore=True)
    assert len({step.start for step in steps}) == 3
    gains = immediate_gains(spec, inp, steps)
    assert gains.shape == (len(steps), spec.action_size)
    assert not gains[:, spec.void].any()
    last = steps[-1]
    assert not gains[-1, 3 * (len(jobs) - last.start) : 3 * spec.jobs].any()  # the last batch has 5 jobs of 8

    own: dict[int, float] = {}
    for step, row in zip(steps, gains, strict=True):
        if step.action != spec.void:
            index = step.start + step.action // 3
            own[index] = own.get(index, 0.0) + float(row[step.action])
    for index, job in enumerate(jobs):
        w, p = decision.of(job.job_id)
        speed = JOB_TYPES[job.job_type].epochs_per_second(w, p) if w and p else 0.0
        term = min(job.epochs_left, speed * SLOT_SECONDS) / job.epochs_total
        assert own.get(index, 0.0) == pytest.approx(term, rel=1e-9, abs=1e-12)
    assert any(own.values())
    assert {JOB_ACTIONS[step.action % 3] for step in steps if step.action != spec.void} >= set(JOB_ACTIONS[:2])


def test_the_validation_traces_run_at_each_load_fraction() -> None:
    """One validation trace per fraction of the load (a site's load varies): the lighter one spreads its arrivals
    over more slots, and DRF's validation JCT is over all their jobs."""
    config = dataclasses.replace(TINY, load_fractions=(0.25, 1.0), validation_jobs=40)
    checks = validation(config)
    (light, _), (heavy, _) = checks.runs
    assert len(light) == len(heavy) == 40
    assert max(job.arrival for job in light) > 2 * max(job.arrival for job in heavy)
    drf = [score(SlotSimulator(sim, trace).run(Drf()), trace, SLOT_SECONDS) for trace, sim in checks.runs]
    assert checks.drf_jct == pytest.approx(sum(drf) / 2, rel=1e-12)


def test_the_online_phase_improves_on_its_supervised_policy() -> None:
    """§4.3 within a fixed budget (6 episodes of the small case, the critic's warm-up cut to 50 updates): the kept
    policy's validation JCT is at least 5 % below the supervised policy's (16 % on this host; 11 % untempered,
    ``online_confidence=1``)."""
    result = train(dataclasses.replace(SMALL, rl_episodes=6, value_warmup=50))
    assert result.best.update > 0
    assert result.best.avg_jct < 0.95 * result.supervised_jct
