"""DL²'s policy network as a slot policy (DL², §4.1 and §4.3): state, action space, mask and inference loop.

The torch networks and their training live in :mod:`hpc_elastic.dl2`; here is only what a daemon or the
simulator needs to turn a slot's input into decisions with a trained network: its weights as a :class:`Network`,
whose forward pass and greedy loop are C (``kernels/dl2.c``), and the loop for any ``state -> logits`` function
(:data:`Scorer`) and chooser, which training samples with.

**State** (§4.1, Fig. 6): a ``J x F`` matrix, one row per job in arrival order, rows beyond the jobs all zero,
flattened row by row. ``F = L + 9`` columns:

- ``L`` columns: the job type, one-hot (``x``);
- time slots the job has run (``d``), divided by :attr:`StateSpec.slots_scale`;
- remaining epochs (``e``), divided by :attr:`StateSpec.epochs_scale`;
- dominant share allocated to the job so far in this slot (``r``), divided by :attr:`StateSpec.share_scale`
  (a share of the cluster is small: a few tasks of a cluster of hundreds of GPUs);
- workers and PS allocated so far in this slot (``w``, ``u``), divided by :attr:`StateSpec.tasks_scale`;
- the user's requested workers and PS (§3.1: the owner states the job's demand), divided by
  :attr:`StateSpec.tasks_scale`. These two columns are not in the paper's figure; they are there because the
  supervised teacher (DRF as YARN runs it) allocates exactly the request, which the rest of the state does not
  show, so without them no network can reproduce the teacher's decisions (§4.2);
- the workers and PS the job ran with in the previous slot, divided by :attr:`StateSpec.tasks_scale`. Not in
  the paper's figure either: the teacher is static (a running job is granted again what it held), which the
  rest of the state cannot tell (held-out match 60 % without them on a small case).

**Actions** (§4.1): ``3 x J + 1``: for job row ``j``, ``3 j + k`` is :data:`JOB_ACTIONS` ``[k]`` (+1 worker,
+1 PS, +1 both), and the last one is void. The **mask** allows an action when its job row holds a job and
:meth:`Packing.fits` says the task fits (within the job's maxima and the free resources); void is always allowed.

**Inference** (§4.1): repeat {state -> logits -> masked choice -> :meth:`Packing.add`} until void or until no
job action fits. More than ``J`` jobs (§6.4 "Concurrent job number"): batches of ``J`` jobs in arrival order,
each batch its own loop on the resources the earlier batches left. :func:`infer` is the loop's definition;
:func:`decide`, the deployed greedy policy, runs the same loop in C, one inference per task placed.

**Exploration** (§4.3, job-aware ε-greedy): in a *poor* state (a job with several workers and no PS, several PS
and no worker, or workers and PS differing by more than a factor :data:`POOR_RATIO`), with probability ε the
chosen action is the manual one (a PS, a worker, or the scarcer of the two for that job) instead of the
network's sample. Entropy regularisation is a term of the training loss (:mod:`hpc_elastic.dl2.train`).

Pure: frozen dataclasses and arrays in, decisions out; the random generator used for sampling is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from hpc_elastic import _dl2
from hpc_elastic.policy.slots import (
    JOB_ACTIONS,
    Packing,
    SlotAction,
    SlotDecision,
    SlotInput,
    SlotJob,
    SlotPolicy,
    slot_decision,
)

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: A policy network: the flattened state (``StateSpec.state_size``) -> one logit per action (``action_size``).
Scorer = Callable[[FloatArray], FloatArray]

#: §4.3: workers and PS of a job "differ too much" beyond this ratio (10 in the paper's experiments)
POOR_RATIO = 10
#: the state's columns after the one-hot type
EXTRA_COLUMNS = (
    "slots_run",
    "epochs_left",
    "share",
    "workers",
    "ps",
    "request_workers",
    "request_ps",
    "previous_workers",
    "previous_ps",
)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """The shape and normalisation of DL²'s state, and the training range of a trained network.

    ``jobs`` is ``J`` (the jobs one inference sees), ``type_names`` the ``L`` job types (their order is the
    one-hot's). The ``max_*`` fields are the largest values the training traces showed (``range_margin``
    times them is still in range, see :func:`in_training_range`).
    """

    jobs: int
    type_names: tuple[str, ...]
    slot_seconds: float
    slots_scale: float = 100.0
    epochs_scale: float = 500.0
    share_scale: float = 0.05
    tasks_scale: float = 16.0
    max_slots_run: int = 1000
    max_epochs_left: float = 1000.0
    max_tasks: int = 16
    range_margin: float = 1.5

    def __post_init__(self) -> None:
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"StateSpec.jobs must be an int >= 1, got {self.jobs!r}")
        if not self.type_names or len(set(self.type_names)) != len(self.type_names):
            raise ValueError(f"StateSpec.type_names must be distinct and not empty, got {self.type_names!r}")
        for name in ("slot_seconds", "slots_scale", "epochs_scale", "share_scale", "tasks_scale", "range_margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"StateSpec.{name} must be a finite number > 0, got {value!r}")
        for name in ("max_slots_run", "max_tasks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StateSpec.{name} must be an int >= 0, got {value!r}")
        if not math.isfinite(self.max_epochs_left) or self.max_epochs_left <= 0:
            raise ValueError(f"StateSpec.max_epochs_left must be a finite number > 0, got {self.max_epochs_left!r}")

    @property
    def types(self) -> int:
        """``L``."""
        return len(self.type_names)

    @property
    def columns(self) -> int:
        """``F``: the state's columns per job."""
        return self.types + len(EXTRA_COLUMNS)

    @property
    def state_size(self) -> int:
        return self.jobs * self.columns

    @property
    def action_size(self) -> int:
        return 3 * self.jobs + 1

    @property
    def void(self) -> int:
        """The index of the void action."""
        return 3 * self.jobs

    def to_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "type_names": list(self.type_names),
            "slot_seconds": self.slot_seconds,
            "slots_scale": self.slots_scale,
            "epochs_scale": self.epochs_scale,
            "share_scale": self.share_scale,
            "tasks_scale": self.tasks_scale,
            "max_slots_run": self.max_slots_run,
            "max_epochs_left": self.max_epochs_left,
            "max_tasks": self.max_tasks,
            "range_margin": self.range_margin,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> StateSpec:
        """The inverse of :meth:`to_dict`; ``ValueError`` naming a missing or malformed field."""
        try:
            names = raw["type_names"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"StateSpec.type_names must be a list of names, got {names!r}")
            return cls(
                jobs=_as_int(raw["jobs"]),
                type_names=tuple(names),
                slot_seconds=_as_float(raw["slot_seconds"]),
                slots_scale=_as_float(raw["slots_scale"]),
                epochs_scale=_as_float(raw["epochs_scale"]),
                share_scale=_as_float(raw["share_scale"]),
                tasks_scale=_as_float(raw["tasks_scale"]),
                max_slots_run=_as_int(raw["max_slots_run"]),
                max_epochs_left=_as_float(raw["max_epochs_left"]),
                max_tasks=_as_int(raw["max_tasks"]),
                range_margin=_as_float(raw["range_margin"]),
            )
        except KeyError as exc:
            raise ValueError(f"StateSpec: missing field {exc.args[0]!r}") from None


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"StateSpec: expected an int, got {value!r}")
    return value


def _as_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"StateSpec: expected a number, got {value!r}")
    return float(value)


def in_training_range(spec: StateSpec, inp: SlotInput) -> str | None:
    """Why a trained network should not decide this slot, or None when it may.

    The rule: the slot length must be the training's; the job types must be the training's first ones, by name
    (a different or larger catalogue has no one-hot column); no job may show a value the training never came
    near: more than ``range_margin`` times the largest slots run or remaining epochs of the training traces, or
    a request or maximum of workers or PS beyond the largest the training saw. More jobs than ``J`` are in
    range (they run in batches). A daemon falls back to its default policy when this returns a reason.
    """
    if not math.isclose(inp.slot_seconds, spec.slot_seconds):
        return f"slot of {inp.slot_seconds:g} s, trained on {spec.slot_seconds:g} s slots"
    if len(inp.types) > spec.types:
        return f"{len(inp.types)} job types, trained on {spec.types}"
    for k, kind in enumerate(inp.types):
        if kind.name != spec.type_names[k]:
            return f"job type {k} is {kind.name!r}, trained with {spec.type_names[k]!r}"
    for job in inp.jobs:
        if job.slots_run > spec.range_margin * spec.max_slots_run:
            return f"job {job.job_id} ran {job.slots_run} slots, training saw at most {spec.max_slots_run}"
        if job.epochs_left > spec.range_margin * spec.max_epochs_left:
            return (
                f"job {job.job_id} has {job.epochs_left:g} epochs left, training saw at most {spec.max_epochs_left:g}"
            )
        tasks = max(job.max_workers, job.max_ps, job.request_workers, job.request_ps)
        if tasks > spec.max_tasks:
            return f"job {job.job_id} may have {tasks} workers or PS, training saw at most {spec.max_tasks}"
    return None


@dataclass(frozen=True, slots=True)
class Step:
    """One inference: its state, mask, chosen action index, whether the action was the manual one (§4.3), and
    where its batch of ``J`` jobs starts in the slot's jobs (row ``k`` of the state is job ``start + k``)."""

    state: FloatArray
    mask: BoolArray
    action: int
    manual: bool = False
    start: int = 0


#: chooses an action index from (logits, mask, manual action or -1)
Chooser = Callable[[FloatArray, BoolArray, int], tuple[int, bool]]


def masked(logits: FloatArray, mask: BoolArray) -> FloatArray:
    """The logits with the masked actions at -inf."""
    return np.where(mask, logits, -np.inf)


def greedy(logits: FloatArray, mask: BoolArray, manual: int) -> tuple[int, bool]:
    """Deployment: the most likely allowed action (the first on ties)."""
    return int(np.argmax(masked(logits, mask))), False


def sampler(rng: np.random.Generator, epsilon: float) -> Chooser:
    """Training: sample from the masked softmax; in a poor state, with probability ``epsilon`` the manual
    action instead (§4.3 job-aware exploration)."""
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")

    def choose(logits: FloatArray, mask: BoolArray, manual: int) -> tuple[int, bool]:
        explore = rng.random()
        if manual >= 0 and explore < epsilon:
            return manual, True
        return int(rng.choice(len(logits), p=softmax(masked(logits, mask)))), False

    return choose


def softmax(logits: FloatArray) -> FloatArray:
    top = np.max(logits)
    weights = np.exp(logits - top)
    total = float(weights.sum())
    probs: FloatArray = weights / total
    return probs


def manual_action(workers: npt.NDArray[np.int64], ps: npt.NDArray[np.int64], mask: BoolArray) -> int:
    """§4.3's manual action for the first job row in a poor state whose manual action is allowed, else -1.

    Poor states: (i) several workers and no PS -> +1 PS; (ii) several PS and no worker -> +1 worker;
    (iii) workers / PS > :data:`POOR_RATIO` -> +1 PS, PS / workers > :data:`POOR_RATIO` -> +1 worker.
    """
    ps_idx, worker_idx = JOB_ACTIONS.index(SlotAction.PS), JOB_ACTIONS.index(SlotAction.WORKER)
    for row in range(len(workers)):
        w, p = int(workers[row]), int(ps[row])
        if (w > 1 and p == 0) or (p > 0 and w > POOR_RATIO * p):
            action = 3 * row + ps_idx
        elif (p > 1 and w == 0) or (w > 0 and p > POOR_RATIO * w):
            action = 3 * row + worker_idx
        else:
            continue
        if mask[action]:
            return action
    return -1


def _rows(
    spec: StateSpec,
    inp: SlotInput,
    jobs: list[SlotJob],
    types: npt.NDArray[np.int64],
    *,
    workers: npt.NDArray[np.int64],
    ps: npt.NDArray[np.int64],
) -> FloatArray:
    """The state rows of ``jobs`` (``len(jobs) x F``) with ``workers`` and ``ps`` allocated so far, built column
    by column in numpy: the same float64 operations as :meth:`_Batch._update` and :meth:`SlotInput.dominant_share`
    make one job at a time, so the same bits."""
    n, base = len(jobs), spec.types
    matrix = np.zeros((n, spec.columns), dtype=np.float64)
    matrix[np.arange(n), types] = 1.0
    fields = np.array(
        [(j.slots_run, j.epochs_left, j.request_workers, j.request_ps, j.workers, j.ps) for j in jobs],
        dtype=np.float64,
    ).reshape(n, 6)
    matrix[:, base] = fields[:, 0] / spec.slots_scale
    matrix[:, base + 1] = fields[:, 1] / spec.epochs_scale
    matrix[:, base + 5 : base + 9] = fields[:, 2:] / spec.tasks_scale
    demand = np.array([(t.worker_gpus, t.worker_cpus, t.ps_cpus) for t in inp.types], dtype=np.int64)[types]
    servers = inp.servers
    gpu = workers * demand[:, 0] / servers.total_gpus if servers.total_gpus else np.zeros(n, dtype=np.float64)
    cpu = (workers * demand[:, 1] + ps * demand[:, 2]) / servers.total_cpus
    matrix[:, base + 2] = np.maximum(gpu, cpu) / spec.share_scale
    matrix[:, base + 3] = workers / spec.tasks_scale
    matrix[:, base + 4] = ps / spec.tasks_scale
    return matrix


class _Batch:
    """The state of one batch of at most ``J`` jobs while a slot's tasks are placed."""

    __slots__ = (
        "_by_type",
        "_dead",
        "_inp",
        "_max_p",
        "_max_w",
        "_packing",
        "_rows",
        "_spec",
        "_types",
        "matrix",
        "ps",
        "start",
        "workers",
    )

    def __init__(
        self, spec: StateSpec, inp: SlotInput, packing: Packing, start: int, dead: set[tuple[int, SlotAction]]
    ) -> None:
        self.start = start
        self._spec, self._inp, self._packing, self._dead = spec, inp, packing, dead
        self._rows = range(start, min(start + spec.jobs, len(inp.jobs)))
        jobs = [inp.jobs[row] for row in self._rows]
        types = np.array([job.job_type for job in jobs], dtype=np.int64)
        self._types = types
        #: the batch's jobs of each type present (indexes into the batch)
        self._by_type = [np.flatnonzero(types == t) for t in np.unique(types)]
        self._max_w = np.array([job.max_workers for job in jobs], dtype=np.int64)
        self._max_p = np.array([job.max_ps for job in jobs], dtype=np.int64)
        self.workers = np.array([packing.workers(row) for row in self._rows], dtype=np.int64)
        self.ps = np.array([packing.ps(row) for row in self._rows], dtype=np.int64)
        self.matrix = np.zeros((spec.jobs, spec.columns), dtype=np.float64)
        self.matrix[: len(jobs)] = _rows(spec, inp, jobs, types, workers=self.workers, ps=self.ps)

    def __len__(self) -> int:
        return len(self._rows)

    def _update(self, k: int) -> None:
        spec, base = self._spec, self._spec.types
        job = self._inp.jobs[self._rows[k]]
        w, p = int(self.workers[k]), int(self.ps[k])
        self.matrix[k, base + 2] = self._inp.dominant_share(job, w, p) / spec.share_scale
        self.matrix[k, base + 3] = w / spec.tasks_scale
        self.matrix[k, base + 4] = p / spec.tasks_scale

    def state(self) -> FloatArray:
        flat: FloatArray = self.matrix.reshape(-1).copy()
        return flat

    def mask(self) -> BoolArray:
        """Allowed actions now. :meth:`Packing.fits` depends on the job only through its maxima and its type's
        demands, so it is asked once per type and action, on a job of that type below its maxima."""
        spec = self._spec
        mask = np.zeros(spec.action_size, dtype=np.bool_)
        mask[spec.void] = True
        room_w = self.workers < self._max_w
        room_p = self.ps < self._max_p
        rooms = (room_w, room_p, room_w & room_p)  # in JOB_ACTIONS' order
        allowed = mask[: 3 * len(self._rows)].reshape(-1, 3)
        for members in self._by_type:
            for a, action in enumerate(JOB_ACTIONS):
                candidates = members[rooms[a][members]]
                if not len(candidates):
                    continue
                key = (int(self._types[members[0]]), action)
                if key in self._dead:
                    continue
                if self._packing.fits(self._rows[int(candidates[0])], action):
                    allowed[candidates, a] = True
                else:  # free resources only shrink during a slot: it never fits again
                    self._dead.add(key)
        return mask

    def apply(self, action: int) -> None:
        """Carry out a job action (not void) on the packing and the state."""
        k, a = divmod(action, 3)
        kind = JOB_ACTIONS[a]
        if not self._packing.add(self._rows[k], kind):
            raise ValueError(f"action {action} ({kind} on job row {k}) does not fit: the mask allowed it")
        if kind is not SlotAction.PS:
            self.workers[k] += 1
        if kind is not SlotAction.WORKER:
            self.ps[k] += 1
        self._update(k)


def _batches(spec: StateSpec, inp: SlotInput, packing: Packing, dead: set[tuple[int, SlotAction]]) -> Iterator[_Batch]:
    """The slot's batches of ``J`` jobs in order, less those with nothing left to place: the batches whose every
    job type and action is dead already (their inference loop would stop before its first inference) are not
    built, and once every type and action is dead the slot has none left. The same inferences as building them."""
    every = len(inp.types) * len(JOB_ACTIONS)
    for start in range(0, len(inp.jobs), spec.jobs):
        if len(dead) == every:
            return
        present = {job.job_type for job in inp.jobs[start : start + spec.jobs]}
        if all((t, action) in dead for t in present for action in JOB_ACTIONS):
            continue
        yield _Batch(spec, inp, packing, start, dead)


def infer(
    spec: StateSpec, inp: SlotInput, scorer: Scorer, choose: Chooser = greedy, *, explore: bool = False
) -> tuple[SlotDecision, tuple[Step, ...]]:
    """§4.1's inference loop over batches of ``J`` jobs; the decision and every inference's :class:`Step`.

    ``explore`` offers ``choose`` §4.3's manual action in poor states (training); without it the manual action
    is always -1.
    """
    packing = Packing(inp)
    steps: list[Step] = []
    dead: set[tuple[int, SlotAction]] = set()  # (type, action) that no longer fits anywhere this slot
    for batch in _batches(spec, inp, packing, dead):
        while True:
            mask = batch.mask()
            if not mask[: spec.void].any():
                break
            state = batch.state()
            logits = np.asarray(scorer(state), dtype=np.float64)
            if logits.shape != (spec.action_size,):
                raise ValueError(f"the scorer gave {logits.shape} logits, expected ({spec.action_size},)")
            manual = manual_action(batch.workers, batch.ps, mask) if explore else -1
            action, was_manual = choose(logits, mask, manual)
            if not mask[action]:
                raise ValueError(f"the chooser picked masked action {action}")
            steps.append(Step(state, mask, action, was_manual, batch.start))
            if action == spec.void:
                packing.add(-1, SlotAction.VOID)
                break
            batch.apply(action)
    return packing.decision(), tuple(steps)


def decide(spec: StateSpec, inp: SlotInput, network: Network) -> SlotDecision:
    """The decision of :func:`infer` with the :func:`greedy` chooser on ``network``: the same actions, each task on
    the same server. The whole loop runs in C (``kernels/dl2.c``, :mod:`hpc_elastic._dl2`): a slot of a large
    cluster takes one inference per task, thousands of them. An action changes one job's row of the state, so an
    inference recomputes that row's part of the first layer and its per-job head, and the rest of the network."""
    if (network.jobs, network.columns) != (spec.jobs, spec.columns):
        raise ValueError(
            f"the network takes states of {network.jobs} x {network.columns}, "
            f"the spec's are {spec.jobs} x {spec.columns}"
        )
    jobs, servers = inp.jobs, inp.servers
    n = len(jobs)
    fields = np.array([(j.job_type, j.max_workers, j.max_ps) for j in jobs], dtype=np.int64).reshape(n, 3)
    none = np.zeros(n, dtype=np.int64)
    rows = _rows(spec, inp, list(jobs), fields[:, 0], workers=none, ps=none)
    demands = np.array([(t.worker_gpus, t.worker_cpus, t.ps_cpus) for t in inp.types], dtype=np.int64).reshape(-1, 3)
    # every job action adds a task within the job's maxima; one void per batch at most
    out = np.empty((int(fields[:, 1:].sum()) + n // spec.jobs + 1, 4), dtype=np.int64)
    count = _dl2.decide(
        network.dims,
        network.weights,
        spec.jobs,
        spec.columns,
        spec.types,
        spec.share_scale,
        spec.tasks_scale,
        servers.total_gpus,
        servers.total_cpus,
        np.ascontiguousarray(rows),
        np.ascontiguousarray(fields),
        demands,
        np.array(servers.gpus, dtype=np.int64),
        np.array(servers.cpus, dtype=np.int64),
        out,
    )
    kinds = (*JOB_ACTIONS, SlotAction.VOID)
    workers: list[list[int]] = [[] for _ in jobs]
    ps: list[list[int]] = [[] for _ in jobs]
    actions: list[tuple[int, SlotAction]] = []
    for row, kind, worker, server in out[:count].tolist():
        actions.append((row, kinds[kind]))
        if worker >= 0:
            workers[row].append(worker)
        if server >= 0:
            ps[row].append(server)
    return slot_decision(inp, workers, ps, actions)


def initial_state(spec: StateSpec, inp: SlotInput) -> FloatArray:
    """The state of a slot's first inference: its first ``J`` jobs, nothing allocated yet."""
    return _Batch(spec, inp, Packing(inp), 0, set()).state()


def teacher_steps(spec: StateSpec, inp: SlotInput, decision: SlotDecision) -> tuple[Step, ...] | None:
    """A teacher's decision as DL²'s inferences (§4.2): the (state, mask, action) before each of its actions.

    None when the slot has more than ``J`` jobs (the teacher's actions cross batches and have no state of one
    batch) or when an action is not one the mask allows (the teacher did something DL² cannot).
    """
    if len(inp.jobs) > spec.jobs:
        return None
    packing = Packing(inp)
    batch = _Batch(spec, inp, packing, 0, set())
    steps: list[Step] = []
    for row, kind in decision.actions:
        mask = batch.mask()
        action = spec.void if kind is SlotAction.VOID else 3 * row + JOB_ACTIONS.index(kind)
        if not mask[action]:
            return None
        steps.append(Step(batch.state(), mask, action))
        if kind is SlotAction.VOID:
            break
        batch.apply(action)
    return tuple(steps)


#: (weight, bias) per linear layer, torch's ``(out, in)`` weights
Layers = list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]


class Network:
    """DL²'s policy network for inference: its weights in float32, run by ``kernels/dl2.c`` (no torch).

    ``layers`` are the MLP's (weight, bias) pairs, ``rows`` the per-job head's (may be empty: the paper's plain
    MLP), ``columns`` the state's ``F``; ``J`` follows from the last layer's ``3J + 1`` outputs. Calling it gives
    one state's logits (a :data:`Scorer`, for :func:`infer`); :func:`decide` runs the greedy loop on it. Each
    output is a sum in one fixed order (``kernels/dl2.c``), so both give the same bits.
    """

    __slots__ = ("columns", "dims", "jobs", "weights")

    def __init__(self, layers: Layers, rows: Layers, columns: int) -> None:
        if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
            raise ValueError(f"Network: columns must be an int >= 1, got {columns!r}")
        if not layers:
            raise ValueError("Network: no layers")
        outputs = int(layers[-1][0].shape[0])
        if outputs < 4 or (outputs - 1) % 3:
            raise ValueError(f"Network: {outputs} outputs, not 3J + 1 for a J >= 1")
        self.jobs, self.columns = (outputs - 1) // 3, columns
        _chain("layers", layers, self.jobs * columns, outputs)
        if rows:
            _chain("rows", rows, columns + 1, 3)
        self.dims = np.array(
            [len(layers), len(rows), *(n for w, _ in (*layers, *rows) for n in (w.shape[1], w.shape[0]))],
            dtype=np.int64,
        )
        self.weights = np.concatenate(
            [
                part
                for w, b in (*layers, *rows)
                for part in (np.ascontiguousarray(w.T, dtype=np.float32).reshape(-1), np.asarray(b, dtype=np.float32))
            ]
        )

    def __call__(self, state: FloatArray) -> FloatArray:
        x = np.ascontiguousarray(state, dtype=np.float32).reshape(-1)
        if x.size != self.jobs * self.columns:
            raise ValueError(f"Network: a state of {x.size} values, expected {self.jobs * self.columns}")
        out = np.empty(3 * self.jobs + 1, dtype=np.float32)
        _dl2.forward(self.dims, self.weights, self.jobs, self.columns, x, out)
        result: FloatArray = out.astype(np.float64)
        return result


def _chain(name: str, layers: Layers, inputs: int, outputs: int) -> None:
    """``ValueError`` unless the layers take ``inputs`` values, each the one before's outputs, and give ``outputs``."""
    for k, (w, b) in enumerate(layers):
        if w.ndim != 2 or b.shape != (w.shape[0],):
            raise ValueError(f"Network: {name}[{k}] is a {w.shape} weight with a {b.shape} bias")
        if w.shape[1] != inputs:
            raise ValueError(f"Network: {name}[{k}] takes {w.shape[1]} inputs, it is given {inputs}")
        inputs = int(w.shape[0])
    if inputs != outputs:
        raise ValueError(f"Network: {name} give {inputs} outputs, expected {outputs}")


class Dl2Policy(SlotPolicy):
    """DL²'s trained policy network deciding slots greedily (deployment, §4.1)."""

    name: ClassVar[str] = "dl2"

    def __init__(self, network: Network, spec: StateSpec) -> None:
        self.network = network
        self.spec = spec

    def allocate(self, inp: SlotInput) -> SlotDecision:
        return decide(self.spec, inp, self.network)
