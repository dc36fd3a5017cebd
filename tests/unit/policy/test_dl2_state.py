"""DL²'s state, action space, mask, inference loop and exploration (DL² §4.1, §4.3), with hand-made slots."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import numpy.typing as npt
import pytest

from hpc_elastic.policy.dl2 import (
    EXTRA_COLUMNS,
    Dl2Policy,
    FloatArray,
    Layers,
    Network,
    StateSpec,
    decide,
    greedy,
    in_training_range,
    infer,
    initial_state,
    manual_action,
    sampler,
    teacher_steps,
)
from hpc_elastic.policy.slots import (
    JOB_ACTIONS,
    JobType,
    Packing,
    Servers,
    SlotAction,
    SlotDecision,
    SlotInput,
    SlotJob,
    SpeedModel,
)

GPU_TYPE = JobType("gpu", 1, 2, 2, SpeedModel.ASYNC, (1.0, 0.5, 0.1, 0.05), 100.0)
CPU_TYPE = JobType("cpu", 0, 4, 4, SpeedModel.ASYNC, (2.0, 0.2, 0.1, 0.05), 10.0)
TYPES = (GPU_TYPE, CPU_TYPE)
SPEC = StateSpec(
    jobs=3,
    type_names=("gpu", "cpu"),
    slot_seconds=1200.0,
    slots_scale=10.0,
    epochs_scale=100.0,
    share_scale=0.5,
    tasks_scale=4.0,
    max_slots_run=20,
    max_epochs_left=200.0,
    max_tasks=8,
)


def slot(jobs: tuple[SlotJob, ...], servers: Servers | None = None) -> SlotInput:
    return SlotInput(0, 1200.0, TYPES, servers or Servers.uniform(2, 2, 8), jobs)


def two_jobs() -> SlotInput:
    return slot(
        (
            SlotJob(
                7,
                0,
                0,
                80.0,
                30.0,
                slots_run=5,
                workers=1,
                ps=2,
                request_workers=2,
                request_ps=1,
                max_workers=2,
                max_ps=4,
            ),
            SlotJob(9, 1, 3, 50.0, request_workers=1, request_ps=2, max_workers=3, max_ps=2),
        )
    )


def constant(logits: list[float]) -> FloatArray:
    return np.array(logits, dtype=np.float64)


def prefer(*order: int) -> FloatArray:
    """Logits ranking the given action indexes first (in that order), everything else last."""
    logits = np.zeros(SPEC.action_size)
    for rank, action in enumerate(order):
        logits[action] = 100.0 - rank
    return logits


def test_shapes_follow_jobs_and_types() -> None:
    assert SPEC.types == 2
    assert SPEC.columns == 2 + len(EXTRA_COLUMNS) == 11
    assert SPEC.state_size == 33
    assert SPEC.action_size == 10
    assert SPEC.void == 9


def test_state_values_of_a_hand_case() -> None:
    # After one +both on job 7: 1 worker (1 GPU, 2 cores) + 1 PS (2 cores) of 4 GPUs / 16 cores.
    seen: list[FloatArray] = []

    def scorer(state: FloatArray) -> FloatArray:
        seen.append(state)
        return prefer(2, SPEC.void)

    infer(SPEC, two_jobs(), scorer)
    first, second = (s.reshape(SPEC.jobs, SPEC.columns) for s in seen[:2])
    #                 gpu  cpu  slots      epochs left   share  w    p    req w   req p  prev w prev p
    assert first[0].tolist() == [1, 0, 5 / 10, 50 / 100, 0.0, 0.0, 0.0, 2 / 4, 1 / 4, 1 / 4, 2 / 4]
    assert first[1].tolist() == [0, 1, 0.0, 50 / 100, 0.0, 0.0, 0.0, 1 / 4, 2 / 4, 0.0, 0.0]
    assert first[2].tolist() == [0.0] * SPEC.columns
    share = max(1 / 4, 4 / 16)
    assert second[0].tolist() == pytest.approx([1, 0, 0.5, 0.5, share / 0.5, 1 / 4, 1 / 4, 0.5, 0.25, 0.25, 0.5])
    assert second[1].tolist() == first[1].tolist()


def test_mask_rows_beyond_the_jobs_maxima_and_fit() -> None:
    inp = two_jobs()
    masks: list[np.ndarray] = []

    def scorer(state: FloatArray) -> FloatArray:
        return prefer(0, SPEC.void)  # +1 worker on job 7 until its maximum of 2

    _, steps = infer(SPEC, inp, scorer)
    masks = [step.mask for step in steps]
    assert [step.action for step in steps] == [0, 0, SPEC.void]
    assert masks[0].tolist() == [True, True, True, True, True, True, False, False, False, True]
    # two workers: job 7 is at max_workers, only +PS is left for it
    assert masks[2][:3].tolist() == [False, True, False]
    assert all(mask[SPEC.void] for mask in masks)
    # a cluster without GPUs: the GPU job's worker actions never fit, the CPU job's do
    cpu_only = slot(inp.jobs, Servers.uniform(1, 0, 16))
    _, steps = infer(SPEC, cpu_only, lambda s: prefer(SPEC.void))
    assert steps[0].mask.tolist() == [False, True, False, True, True, True, False, False, False, True]


def test_no_masked_action_is_ever_chosen_and_decisions_fit() -> None:
    rng = np.random.default_rng(3)
    for trial in range(40):
        count = int(rng.integers(1, 8))
        jobs = tuple(
            SlotJob(
                k,
                int(rng.integers(0, 2)),
                k,
                float(rng.uniform(10, 100)),
                max_workers=int(rng.integers(1, 5)),
                max_ps=int(rng.integers(1, 5)),
            )
            for k in range(count)
        )
        inp = slot(jobs, Servers.uniform(int(rng.integers(1, 4)), 2, 8))
        choose = sampler(np.random.default_rng(trial), 0.5)
        decision, steps = infer(SPEC, inp, lambda s: rng.normal(size=SPEC.action_size) * 3, choose, explore=True)
        assert all(step.mask[step.action] for step in steps)
        used_gpu = used_cpu = 0
        for alloc in decision.allocations:
            job = next(j for j in jobs if j.job_id == alloc.job_id)
            kind = TYPES[job.job_type]
            assert alloc.workers <= job.max_workers and alloc.ps <= job.max_ps
            used_gpu += alloc.workers * kind.worker_gpus
            used_cpu += alloc.workers * kind.worker_cpus + alloc.ps * kind.ps_cpus
        assert used_gpu <= inp.servers.total_gpus and used_cpu <= inp.servers.total_cpus


def test_the_loop_stops_when_nothing_fits_without_a_void() -> None:
    inp = slot((SlotJob(1, 0, 0, 10.0, max_workers=16, max_ps=16),), Servers.uniform(1, 2, 8))
    decision, steps = infer(SPEC, inp, lambda s: prefer(2))
    # +both takes 1 GPU and 4 cores: twice, then no GPU-free action... +PS still fits (no core left: no)
    assert decision.of(1) == (2, 2)
    assert SlotAction.VOID not in [action for _, action in decision.actions]
    assert steps[-1].action == 2


def test_more_jobs_than_j_run_in_batches_in_arrival_order() -> None:
    jobs = tuple(SlotJob(k, 0, k, 20.0, max_workers=1, max_ps=1) for k in range(7))
    inp = slot(jobs, Servers.uniform(8, 2, 16))
    # void at once: one inference per batch of 3 (jobs 0-2, 3-5, 6)
    decision, steps = infer(SPEC, inp, lambda s: prefer(SPEC.void))
    assert len(steps) == 3 and decision.allocations == ()
    assert decision.actions == ((-1, SlotAction.VOID),) * 3
    last = steps[2].state.reshape(SPEC.jobs, SPEC.columns)
    assert last[0, 0] == 1.0 and not last[1:].any()
    # +both on the batch's first job, then its second, ...: every job gets 1/1, batch by batch
    decision, steps = infer(SPEC, inp, lambda s: prefer(2, 5, 8, SPEC.void))
    assert [alloc.job_id for alloc in decision.allocations] == list(range(7))
    rows = [row for row, action in decision.actions if action is SlotAction.BOTH]
    assert rows == list(range(7))


def test_batches_share_the_cluster() -> None:
    jobs = tuple(SlotJob(k, 0, k, 20.0, max_workers=4, max_ps=4) for k in range(4))
    inp = slot(jobs, Servers.uniform(1, 2, 16))  # room for two +both of the GPU type
    decision, _ = infer(SPEC, inp, lambda s: prefer(2, SPEC.void))
    assert decision.of(0) == (2, 2)
    assert decision.of(3) == (0, 0)


def test_poor_states_get_their_manual_actions() -> None:
    mask = np.ones(SPEC.action_size, dtype=np.bool_)
    ps, worker = JOB_ACTIONS.index(SlotAction.PS), JOB_ACTIONS.index(SlotAction.WORKER)

    def manual(workers: list[int], pss: list[int], allowed: np.ndarray = mask) -> int:
        return manual_action(np.array(workers), np.array(pss), allowed)

    assert manual([1, 0], [1, 0]) == -1  # balanced
    assert manual([1], [0]) == -1  # one worker without PS yet: not "multiple"
    assert manual([0, 2], [0, 0]) == 3 * 1 + ps  # (i) workers without PS -> a PS
    assert manual([0, 0], [0, 3]) == 3 * 1 + worker  # (ii) PS without workers -> a worker
    assert manual([11], [1]) == ps  # (iii) w > 10 p -> a PS
    assert manual([10], [1]) == -1  # exactly the threshold: not poor
    assert manual([1], [11]) == worker  # (iii) p > 10 w -> a worker
    blocked = mask.copy()
    blocked[ps] = False
    assert manual([3, 2], [0, 0], blocked) == 3 + ps  # the first poor job's action is masked: the next one


def test_exploration_takes_the_manual_action_with_probability_epsilon() -> None:
    logits = prefer(0)
    mask = np.ones(SPEC.action_size, dtype=np.bool_)
    always = sampler(np.random.default_rng(0), 1.0)
    assert always(logits, mask, 4) == (4, True)
    never = sampler(np.random.default_rng(0), 0.0)
    assert never(logits, mask, 4) == (0, False)
    half = sampler(np.random.default_rng(1), 0.4)
    manual = sum(half(logits, mask, 4)[1] for _ in range(2000))
    assert 700 < manual < 900
    with pytest.raises(ValueError, match="epsilon"):
        sampler(np.random.default_rng(0), 1.5)


def test_exploring_inference_applies_the_manual_action() -> None:
    inp = slot((SlotJob(1, 0, 0, 10.0, max_workers=8, max_ps=8),), Servers.uniform(2, 2, 16))
    _, steps = infer(SPEC, inp, lambda s: prefer(0, SPEC.void), sampler(np.random.default_rng(0), 1.0), explore=True)
    # worker, worker -> poor (2 workers, no PS) -> the manual +PS
    assert [(s.action, s.manual) for s in steps[:3]] == [(0, False), (0, False), (1, True)]


def test_greedy_takes_the_best_allowed_action() -> None:
    mask = np.array([False, True, True, False, False, False, False, False, False, True])
    assert greedy(constant([9, 1, 2, 0, 0, 0, 0, 0, 0, 0]), mask, -1) == (2, False)


def test_teacher_steps_replay_a_decision() -> None:
    inp = two_jobs()
    packing = Packing(inp)
    for row, action in ((0, SlotAction.BOTH), (1, SlotAction.BOTH), (0, SlotAction.WORKER), (-1, SlotAction.VOID)):
        assert packing.add(row, action)
    steps = teacher_steps(SPEC, inp, packing.decision())
    assert steps is not None
    assert [step.action for step in steps] == [2, 5, 0, SPEC.void]
    assert steps[3].state.reshape(SPEC.jobs, SPEC.columns)[0, 2 + 3] == 2 / 4  # two workers before the void
    many = slot(tuple(SlotJob(k, 0, k, 20.0) for k in range(4)))
    assert teacher_steps(SPEC, many, SlotDecision(())) is None


def fixed(logits: FloatArray, spec: StateSpec = SPEC) -> Network:
    """A network whose logits are ``logits`` whatever the state (one layer, zero weights)."""
    weight = np.zeros((spec.action_size, spec.state_size), dtype=np.float32)
    return Network([(weight, logits.astype(np.float32))], [], spec.columns)


def test_policy_decides_like_the_greedy_loop() -> None:
    inp = two_jobs()
    network = fixed(prefer(5, 2, SPEC.void))
    policy = Dl2Policy(network, SPEC)
    assert policy.name == "dl2"
    assert policy.allocate(inp) == infer(SPEC, inp, network)[0]
    # job 9 (a worker and a PS of 4 cores each) twice fills both servers' cores: no void, nothing else fits
    assert policy.allocate(inp).actions == ((1, SlotAction.BOTH), (1, SlotAction.BOTH))
    other = dataclasses.replace(SPEC, jobs=4)
    with pytest.raises(ValueError, match="states of 4 x 11, the spec's are 3 x 11"):
        Dl2Policy(fixed(np.zeros(other.action_size), other), SPEC).allocate(inp)


def test_a_network_refuses_layers_that_do_not_chain() -> None:
    w = np.zeros((SPEC.action_size, SPEC.state_size), dtype=np.float32)
    b = np.zeros(SPEC.action_size, dtype=np.float32)
    with pytest.raises(ValueError, match="not 3J \\+ 1"):
        Network([(w[:-1], b[:-1])], [], SPEC.columns)
    with pytest.raises(ValueError, match="takes 33 inputs, it is given 30"):
        Network([(w, b)], [], 10)
    with pytest.raises(ValueError, match="bias"):
        Network([(w, b[:-1])], [], SPEC.columns)
    with pytest.raises(ValueError, match="rows give 4 outputs, expected 3"):
        Network([(w, b)], [(np.zeros((4, SPEC.columns + 1), dtype=np.float32), np.zeros(4, dtype=np.float32))], 11)
    with pytest.raises(ValueError, match="columns"):
        Network([(w, b)], [], 0)
    with pytest.raises(ValueError, match="a state of 5 values, expected 33"):
        Network([(w, b)], [], SPEC.columns)(np.zeros(5))


def test_training_range() -> None:
    inp = two_jobs()
    assert in_training_range(SPEC, inp) is None
    assert in_training_range(SPEC, dataclasses.replace(inp, types=(GPU_TYPE,), jobs=inp.jobs[:1])) is None
    assert "job types" in str(in_training_range(SPEC, dataclasses.replace(inp, types=(*TYPES, GPU_TYPE))))
    renamed = dataclasses.replace(CPU_TYPE, name="other")
    assert "'other'" in str(in_training_range(SPEC, dataclasses.replace(inp, types=(GPU_TYPE, renamed))))
    assert "slot of 600" in str(in_training_range(SPEC, dataclasses.replace(inp, slot_seconds=600.0)))
    old = dataclasses.replace(inp.jobs[0], slots_run=31)
    assert "ran 31 slots" in str(in_training_range(SPEC, dataclasses.replace(inp, jobs=(old, inp.jobs[1]))))
    ok = dataclasses.replace(inp.jobs[0], slots_run=30)  # 1.5 x 20: the margin
    assert in_training_range(SPEC, dataclasses.replace(inp, jobs=(ok, inp.jobs[1]))) is None
    long = dataclasses.replace(inp.jobs[1], epochs_total=400.0)
    assert "epochs left" in str(in_training_range(SPEC, dataclasses.replace(inp, jobs=(inp.jobs[0], long))))
    wide = dataclasses.replace(inp.jobs[1], max_workers=9)
    assert "9 workers" in str(in_training_range(SPEC, dataclasses.replace(inp, jobs=(inp.jobs[0], wide))))


def test_spec_round_trip_and_validation() -> None:
    assert StateSpec.from_dict(SPEC.to_dict()) == SPEC
    raw = SPEC.to_dict()
    del raw["jobs"]
    with pytest.raises(ValueError, match="missing field 'jobs'"):
        StateSpec.from_dict(raw)
    with pytest.raises(ValueError, match="expected an int"):
        StateSpec.from_dict({**SPEC.to_dict(), "jobs": "3"})
    with pytest.raises(ValueError, match="jobs"):
        StateSpec(jobs=0, type_names=("a",), slot_seconds=1.0)
    with pytest.raises(ValueError, match="type_names"):
        StateSpec(jobs=1, type_names=("a", "a"), slot_seconds=1.0)
    with pytest.raises(ValueError, match="share_scale"):
        StateSpec(jobs=1, type_names=("a",), slot_seconds=1.0, share_scale=0.0)


def random_network(rng: np.random.Generator, depth: int, head: bool, spread: float) -> Network:
    """Small integer weights (many ties between actions) over a few layers, with or without the per-job head."""
    widths = [SPEC.state_size, *(int(rng.integers(2, 9)) for _ in range(depth - 1)), SPEC.action_size]

    def layer(inputs: int, outputs: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        weight = rng.integers(-2, 3, size=(outputs, inputs)) * (rng.random((outputs, inputs)) < 0.5)
        return weight.astype(np.float32), np.round(rng.normal(size=outputs) * spread).astype(np.float32)

    layers = [layer(a, b) for a, b in itertools.pairwise(widths)]
    rows = [layer(SPEC.columns + 1, 4), layer(4, 3)] if head else []
    return Network(layers, rows, SPEC.columns)


def test_the_compiled_greedy_decision_is_the_inference_loops() -> None:
    """``decide`` (the loop in C, one row refreshed per action) against ``infer`` with the greedy chooser (the
    network called on each whole state): the same actions on the same servers, over random slots with more jobs
    than ``J`` (batches), full clusters, jobs at their maxima and ties between logits."""
    rng = np.random.default_rng(11)
    for trial in range(120):
        count = int(rng.integers(1, 10))
        jobs = tuple(
            SlotJob(
                k,
                int(rng.integers(0, 2)),
                k,
                float(rng.uniform(10, 100)),
                slots_run=int(rng.integers(0, 5)),
                workers=int(rng.integers(0, 3)),
                request_workers=int(rng.integers(1, 3)),
                max_workers=int(rng.integers(2, 6)),
                max_ps=int(rng.integers(2, 6)),
            )
            for k in range(count)
        )
        inp = slot(jobs, Servers.uniform(int(rng.integers(1, 5)), int(rng.integers(0, 3)), 8))
        network = random_network(rng, depth=1 + trial % 3, head=trial % 2 == 0, spread=2.0 if trial % 4 else 0.1)
        assert decide(SPEC, inp, network) == infer(SPEC, inp, network)[0], trial


def reference_forward(layers: Layers, rows: Layers, columns: int, state: FloatArray) -> FloatArray:
    """The network's definition in numpy float32, one rounded product and one rounded sum at a time: every dense
    layer sums in increasing input order from +0, then adds its bias; the first global layer sums each job row's
    inputs, then the rows in increasing order; ReLU between layers; the per-job head's three outputs add to its
    row's logits."""

    def dense(
        x: npt.NDArray[np.float32], w: npt.NDArray[np.float32], b: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]:
        acc = np.zeros(w.shape[0], dtype=np.float32)
        for k in range(w.shape[1]):
            acc = acc + x[k] * w[:, k]
        out: npt.NDArray[np.float32] = acc + b
        return out

    def relu(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return np.where(x > 0, x, np.float32(0.0)).astype(np.float32)

    x = state.astype(np.float32)
    w0, b0 = layers[0]
    jobs = (layers[-1][0].shape[0] - 1) // 3
    h = np.zeros(w0.shape[0], dtype=np.float32)
    for r in range(jobs):
        part = slice(r * columns, (r + 1) * columns)
        h = h + dense(x[part], w0[:, part], np.zeros(w0.shape[0], dtype=np.float32))
    h = h + b0
    for w, b in layers[1:]:
        h = dense(relu(h), w, b)
    out = h.copy()
    for r in range(jobs):
        y = np.concatenate((x[r * columns : (r + 1) * columns], [np.float32(r) / np.float32(jobs)])).astype(np.float32)
        for k, (w, b) in enumerate(rows):
            y = dense(y if k == 0 else relu(y), w, b)
        if rows:
            out[3 * r : 3 * r + 3] = out[3 * r : 3 * r + 3] + y
    return out.astype(np.float64)


def normal_layers(rng: np.random.Generator, *widths: int) -> Layers:
    """Layers of normal float32 weights and biases from ``widths[0]`` inputs through each width in turn."""
    return [
        (rng.normal(size=(b, a)).astype(np.float32), rng.normal(size=b).astype(np.float32))
        for a, b in itertools.pairwise(widths)
    ]


def test_the_compiled_forward_pass_is_the_fixed_order_definition() -> None:
    rng = np.random.default_rng(3)
    layers = normal_layers(rng, SPEC.state_size, 7, 5, SPEC.action_size)
    rows = normal_layers(rng, SPEC.columns + 1, 6, 3)
    for head in (rows, []):
        network = Network(layers, head, SPEC.columns)
        for _ in range(20):
            state = rng.random(SPEC.state_size) * (rng.random(SPEC.state_size) < 0.6)
            assert np.array_equal(network(state), reference_forward(layers, head, SPEC.columns, state))


def test_a_batch_built_in_numpy_has_the_bits_of_the_per_job_formula() -> None:
    """Every row of a batch's first state, job by job in Python floats (the one-hot, then EXTRA_COLUMNS' order):
    the batch builds them column-wise in numpy and must give the same bits, or a model would see other states
    in deployment than in training."""
    rng = np.random.default_rng(5)
    for _ in range(40):
        count = int(rng.integers(1, 3 * SPEC.jobs))
        jobs = tuple(
            SlotJob(
                k,
                int(rng.integers(0, 2)),
                k,
                float(rng.uniform(10, 100)),
                epochs_done=float(rng.uniform(0, 9)),
                slots_run=int(rng.integers(0, 30)),
                workers=int(rng.integers(0, 5)),
                ps=int(rng.integers(0, 5)),
                request_workers=int(rng.integers(1, 5)),
                request_ps=int(rng.integers(1, 5)),
            )
            for k in range(count)
        )
        servers = Servers.uniform(int(rng.integers(1, 5)), int(rng.integers(0, 3)), 8)
        inp = slot(jobs, servers)
        rows = initial_state(SPEC, inp).reshape(SPEC.jobs, SPEC.columns)
        for k, job in enumerate(jobs[: SPEC.jobs]):
            expected = [0.0] * SPEC.types + [
                job.slots_run / SPEC.slots_scale,
                job.epochs_left / SPEC.epochs_scale,
                inp.dominant_share(job, 0, 0) / SPEC.share_scale,
                0 / SPEC.tasks_scale,
                0 / SPEC.tasks_scale,
                job.request_workers / SPEC.tasks_scale,
                job.request_ps / SPEC.tasks_scale,
                job.workers / SPEC.tasks_scale,
                job.ps / SPEC.tasks_scale,
            ]
            expected[job.job_type] = 1.0
            assert rows[k].tobytes() == np.array(expected, dtype=np.float64).tobytes(), (k, rows[k], expected)
        assert not rows[len(jobs) :].any()  # the rows of a short batch stay zero
