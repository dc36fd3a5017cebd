"""DL²'s policy network as a slot policy (DL², §4.1 and §4.3): state, action space, mask and inference loop.

The network itself is a function ``state -> action logits`` given to this module (:data:`Scorer`): the torch
networks and their training live in :mod:`hpc_elastic.dl2`; here is only what a daemon or the simulator needs to
turn a slot's input into decisions with a trained network, in numpy.

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
each batch its own loop on the resources the earlier batches left.

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

from hpc_elastic.policy.slots import JOB_ACTIONS, Packing, SlotAction, SlotDecision, SlotInput, SlotPolicy

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
    """One inference: its state, mask, chosen action index, and whether the action was the manual one (§4.3)."""

    state: FloatArray
    mask: BoolArray
    action: int
    manual: bool = False


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
        "workers",
    )

    def __init__(
        self, spec: StateSpec, inp: SlotInput, packing: Packing, start: int, dead: set[tuple[int, SlotAction]]
    ) -> None:
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
        # the rows in numpy, column by column: the same float64 operations as :meth:`_update` and
        # :meth:`SlotInput.dominant_share` make one job at a time, so the same bits
        n, base = len(jobs), spec.types
        matrix = np.zeros((spec.jobs, spec.columns), dtype=np.float64)
        matrix[np.arange(n), types] = 1.0
        fields = np.array(
            [(j.slots_run, j.epochs_left, j.request_workers, j.request_ps, j.workers, j.ps) for j in jobs],
            dtype=np.float64,
        ).reshape(n, 6)
        matrix[:n, base] = fields[:, 0] / spec.slots_scale
        matrix[:n, base + 1] = fields[:, 1] / spec.epochs_scale
        matrix[:n, base + 5 : base + 9] = fields[:, 2:] / spec.tasks_scale
        demand = np.array([(t.worker_gpus, t.worker_cpus, t.ps_cpus) for t in inp.types], dtype=np.int64)[types]
        servers = inp.servers
        gpu = self.workers * demand[:, 0] / servers.total_gpus if servers.total_gpus else np.zeros(n, dtype=np.float64)
        cpu = (self.workers * demand[:, 1] + self.ps * demand[:, 2]) / servers.total_cpus
        matrix[:n, base + 2] = np.maximum(gpu, cpu) / spec.share_scale
        matrix[:n, base + 3] = self.workers / spec.tasks_scale
        matrix[:n, base + 4] = self.ps / spec.tasks_scale
        self.matrix = matrix

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

    def allows(self, action: int) -> bool:
        """Whether the mask would allow job action ``action`` (one :meth:`Packing.fits` at most)."""
        k, a = divmod(action, 3)
        if k >= len(self._rows):
            return False
        kind = JOB_ACTIONS[a]
        if (kind is not SlotAction.PS and self.workers[k] >= self._max_w[k]) or (
            kind is not SlotAction.WORKER and self.ps[k] >= self._max_p[k]
        ):
            return False
        key = (int(self._types[k]), kind)
        if key in self._dead:
            return False
        if self._packing.fits(self._rows[k], kind):
            return True
        self._dead.add(key)  # free resources only shrink during a slot: it never fits again
        return False

    def exhausted(self) -> bool:
        """True when no job action of this batch can fit any more (every type and action of it is dead)."""
        return all((int(self._types[m[0]]), action) in self._dead for m in self._by_type for action in JOB_ACTIONS)

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
            steps.append(Step(state, mask, action, was_manual))
            if action == spec.void:
                packing.add(-1, SlotAction.VOID)
                break
            batch.apply(action)
    return packing.decision(), tuple(steps)


def decide(spec: StateSpec, inp: SlotInput, scorer: Scorer) -> SlotDecision:
    """The greedy decision of :func:`infer` (the same decision and action sequence), faster: instead of the
    whole mask, the actions are tried in decreasing logit order until one is allowed, so an inference costs
    one or two :meth:`Packing.fits` instead of one per job type and action. The whole mask is computed once per
    batch, when void comes first, to tell a void (something else still fits) from a full cluster."""
    packing = Packing(inp)
    dead: set[tuple[int, SlotAction]] = set()
    for batch in _batches(spec, inp, packing, dead):
        while not batch.exhausted():
            logits = np.asarray(scorer(batch.state()), dtype=np.float64)
            if logits.shape != (spec.action_size,):
                raise ValueError(f"the scorer gave {logits.shape} logits, expected ({spec.action_size},)")
            # argmax's tie rule (the lowest index first) in a stable descending sort
            for action in np.argsort(-logits, kind="stable"):
                if action == spec.void:
                    if batch.mask()[: spec.void].any():
                        packing.add(-1, SlotAction.VOID)
                    break
                if batch.allows(int(action)):
                    batch.apply(int(action))
                    break
            else:  # pragma: no cover - void is always among the actions
                break
            if action == spec.void:
                break
    return packing.decision()


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


#: (weight, bias) per linear layer
Layers = list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]


def _mlp(layers: Layers, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    last = len(layers) - 1
    for k, (w, b) in enumerate(layers):
        x = x @ w + b
        if k < last:
            x = np.maximum(x, 0.0)
    return x


class NumpyScorer:
    """The policy network's forward pass in numpy (float32, as torch computes it) from its weights: ``layers``
    the MLP's (weight, bias) pairs (torch's ``(out, in)`` weights), ``rows`` the per-job head's (may be empty)."""

    __slots__ = ("_columns", "_layers", "_position", "_rows")

    def __init__(self, layers: Layers, rows: Layers, columns: int) -> None:
        self._layers = [(np.ascontiguousarray(w.T, dtype=np.float32), b.astype(np.float32)) for w, b in layers]
        self._rows = [(np.ascontiguousarray(w.T, dtype=np.float32), b.astype(np.float32)) for w, b in rows]
        self._columns = columns
        jobs = layers[-1][0].shape[0] // 3
        self._position = (np.arange(jobs, dtype=np.float32) / np.float32(jobs)).reshape(-1, 1)

    def __call__(self, state: FloatArray) -> FloatArray:
        x = state.astype(np.float32)
        out = _mlp(self._layers, x)
        if self._rows:
            rows: npt.NDArray[np.float32] = np.concatenate((x.reshape(-1, self._columns), self._position), axis=1)
            local = _mlp(self._rows, rows).reshape(-1)
            out[: len(local)] += local
        result: FloatArray = out.astype(np.float64)
        return result


class Dl2Policy(SlotPolicy):
    """DL²'s trained policy network deciding slots greedily (deployment, §4.1)."""

    name: ClassVar[str] = "dl2"

    def __init__(self, scorer: Scorer, spec: StateSpec) -> None:
        self.scorer = scorer
        self.spec = spec

    def allocate(self, inp: SlotInput) -> SlotDecision:
        return decide(self.spec, inp, self.scorer)
