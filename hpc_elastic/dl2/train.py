"""Training DL²'s networks in the slot simulator: supervised bootstrap from DRF (§4.2), then online actor-critic
(§4.3), keeping the policy with the best validation JCT.

**Supervised** (§4.2): DRF runs the training traces in :class:`SlotSimulator`; every one of its actions becomes
one sample (state, mask, DRF's action) through :func:`teacher_steps` (slots with more than ``J`` jobs have no
single-batch state and are left out, and counted). The policy network is trained on them with the cross entropy
of the masked softmax (Adam, mini-batches, ``supervised_epochs`` passes), and its *match rate* (greedy action ==
DRF's) is measured on DRF's trajectories of held-out traces (other seeds). §4.2 bootstraps from whatever scheduler
the cluster runs: ``bootstrap`` names the simulated one (:data:`BOOTSTRAP_TEACHERS`: DRF, the paper's, or the
Optimus-like policy), whose runs give the samples and the episode bounds; DRF stays the validation's baseline.

**Supervised from Slurm's history** (§4.2 at a Slurm site, :mod:`hpc_elastic.dl2.history`): the samples
come from the slots of sacct history instead of DRF's runs (the slots of the last fifth of the window, in time,
are the held-out ones); the ``bootstrap`` teacher still runs the training traces, for the online phase's episode
bounds and the training range.

**Online actor-critic** (§4.3): episodes of the simulator on the training traces, in turn. Each slot the policy
samples its inferences (masked softmax, job-aware ε-exploration); the slot's reward (Eq. 1, the simulator's
``SlotOutcome.reward``) is every inference's reward. Once ``n_step`` more slots have run, a slot's samples go
to a replay buffer of the latest ``replay`` samples with their discounted return ``G = sum_k γ^k r_{t+k}`` over
those slots and the state ``s'`` that starts the slot after them. After every slot one mini-batch drawn from the
buffer updates both networks: the value network by (n-step) temporal difference, target
``G + γ^n V(s')`` (``G`` alone at the episode's end), the policy network by the policy gradient with advantage
``G + γ^n V(s') - V(s)`` (the discounted return minus the value; normalised per mini-batch) plus ``entropy``
times the policy's entropy. The first ``value_warmup`` updates train the value network alone. Every
``eval_every`` updates the greedy policy runs the validation traces (one per load fraction: the traces' loads
vary, ``load_fractions``); the best average JCT over their jobs is kept (the supervised policy is the first point
of the curve).

**The immediate advantage** (ours, not the paper's): every inference of a slot shares that slot's return, so
one action's own effect is a small part of its signal. But Eq. 1's reward is a sum of per-job terms, and the
type's speed model tells how much of a job's term one added task makes: :func:`immediate_gains` gives, at every
inference, each action's marginal normalised epochs, and in the order taken a job's gains add up to its term of
the slot. The policy's advantage adds ``immediate`` times the chosen action's gain less the policy's expected
gain at that state (normalised per mini-batch). The slot's return still carries what the allocation does to
later slots (README, DL²: what each part changes, measured).

**The tempered start** (ours): the supervised policy matches its teacher by giving the teacher's action a
probability near 1 (logits tens apart). Sampled from as trained, the online phase's inferences repeat the teacher,
and the policy gradient through a saturated softmax is about 0 wherever the policy is sure. Before the online phase
the logits are divided by the temperature at which the greedy action's mean probability over the training samples
is ``online_confidence`` (:func:`temperature_for`, :meth:`~hpc_elastic.dl2.net.PolicyNet.temper`): every greedy
decision stays the teacher's, the sampled ones explore.

**A replay of the last slots**: the update weighs the replay's samples as the current policy's (no importance
weights), so ``replay`` holds only the last few dozen slots' samples (512). With 8,192 (hundreds of slots of older
policies) the greedy policy drifted, after its best, into ending slots with a void while tasks still fitted.

Deterministic: the traces come from seeds derived from ``seed``; the networks' initial weights from a seeded
torch generator, sampling and mini-batches from seeded numpy generators; torch runs one thread with
deterministic algorithms. The same configuration gives the same model bits.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_elastic.dl2 import model_file
from hpc_elastic.dl2.history import TeacherSlot
from hpc_elastic.dl2.net import (
    NetShape,
    PolicyNet,
    ValueNet,
    inference_network,
    load_arrays,
    masked_log_softmax,
    to_arrays,
)
from hpc_elastic.policy.dl2 import (
    Dl2Policy,
    FloatArray,
    Network,
    StateSpec,
    Step,
    infer,
    initial_state,
    sampler,
    teacher_steps,
)
from hpc_elastic.policy.drf import Drf
from hpc_elastic.policy.optimus import OptimusLike
from hpc_elastic.policy.slots import (
    JOB_ACTIONS,
    JobType,
    Servers,
    SlotAction,
    SlotDecision,
    SlotInput,
    SlotJob,
    SlotPolicy,
)
from hpc_elastic.sim.ps_jobs import SLOT_SECONDS, Catalogue, SlotTraceJob, generate
from hpc_elastic.sim.slots import SlotConfig, SlotOutcome, SlotResult, SlotSimulator

#: an episode may run this many times the slots its teacher needed on the trace before it is cut, an evaluation
#: this many times DRF's
SLOT_BOUND_FACTOR = 4


class Teacher(StrEnum):
    """Where the supervised phase's samples come from (DL² §4.2)."""

    #: DRF's decisions in the simulator (the paper's teacher)
    DRF = "drf"
    #: the Optimus-like policy's decisions in the simulator
    OPTIMUS = "optimus"
    #: Slurm's decisions, from its accounting (``sacct``: :mod:`hpc_elastic.dl2.sacct`)
    SACCT = "sacct"

    @classmethod
    def parse(cls, raw: str) -> Teacher:
        try:
            return cls(raw)
        except ValueError:
            raise ValueError(f"unknown --teacher {raw!r}: one of {', '.join(t.value for t in cls)}") from None


#: the simulated schedulers the supervised phase may imitate (§4.2): the teachers whose runs the simulator makes
BOOTSTRAP_TEACHERS: dict[Teacher, Callable[[], SlotPolicy]] = {Teacher.DRF: Drf, Teacher.OPTIMUS: OptimusLike}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (saved with the model)."""

    seed: int = 0
    #: jobs per training trace, the traces, the held-out traces of the supervised match rate
    jobs: int = 100
    traces: int = 24
    held_out: int = 2
    validation_jobs: int = 100
    #: the generator's load (arrival rate over the cluster's capacity, >1: jobs wait) and cluster
    load: float = 3.0
    #: the training, held-out and validation traces' loads as fractions of ``load``, in turn (one validation trace
    #: per fraction): a site's load varies, and a policy trained at one load only learns what pays there (at
    #: load 3 alone, to hold tasks back from long jobs, which costs at light load)
    load_fractions: tuple[float, ...] = (1 / 6, 1 / 3, 2 / 3, 1.0)
    servers: tuple[int, int, int] = (16, 4, 16)
    #: the job types (:class:`~hpc_elastic.sim.ps_jobs.Catalogue`): DL² Table 1's on GPU servers, or the ps-mode
    #: model on a CPU partition (``cpu``, with ``servers`` such as ``(2, 0, 8)``: a model the daemon can use there)
    catalogue: str = Catalogue.TABLE1.value
    #: the simulated scheduler the supervised phase imitates (:data:`BOOTSTRAP_TEACHERS`)
    bootstrap: Teacher = Teacher.DRF
    #: J, and the networks' shape
    max_jobs: int = 64
    width_factor: float = 0.05
    hidden: int = 16
    row_hidden: int = 64
    #: supervised phase (§4.2)
    supervised_epochs: int = 50
    supervised_lr: float = 1e-2
    #: online phase (§4.3)
    rl_episodes: int = 20
    #: the supervised policy's logits are divided by the temperature at which its greedy action's mean probability
    #: over the training samples is this (:func:`temperature_for`; 1: left as trained): the greedy decisions stay
    #: the teacher's, but the sampled inferences explore, and the policy gradient is not lost in a saturated softmax
    online_confidence: float = 0.5
    rl_lr: float = 3e-4
    value_lr: float = 1e-3
    gamma: float = 0.9
    #: the slots of reward summed before the value network's estimate takes over (n-step return)
    n_step: int = 10
    #: the first updates train the value network only (a random critic's advantages are noise)
    value_warmup: int = 200
    epsilon: float = 0.4
    entropy: float = 0.01
    #: weight of the immediate advantage: each inference's own share of its slot's Eq. 1 reward (the marginal
    #: normalised epochs of the task it adds, by the type's speed model) against the policy's expected share at
    #: that state; 0 leaves the slot's advantage alone (:func:`immediate_gains`)
    immediate: float = 1.0
    #: the replay buffer's samples, the latest (§4.3). Small: its samples are the policy's of the last slots, since
    #: the update weighs them as the current policy's (no importance weights); 8,192 (hundreds of slots of older
    #: policies) drifted the greedy policy into ending slots early, 512 did not (README, DL²)
    replay: int = 512
    batch: int = 64
    eval_every: int = 100

    def __post_init__(self) -> None:
        ints = {
            "seed": 0,
            "jobs": 1,
            "traces": 1,
            "held_out": 1,
            "validation_jobs": 1,
            "max_jobs": 1,
            "hidden": 1,
            "row_hidden": 0,
            "supervised_epochs": 0,
            "rl_episodes": 0,
            "replay": 1,
            "batch": 1,
            "eval_every": 1,
            "n_step": 1,
            "value_warmup": 0,
        }
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        for name in ("load", "width_factor", "supervised_lr", "rl_lr", "value_lr"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name in ("gamma", "epsilon"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        confidence = self.online_confidence
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence <= 1:
            raise ValueError(f"online_confidence must be in (0, 1], got {confidence!r}")
        for name in ("entropy", "immediate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        fractions = self.load_fractions
        if (
            not isinstance(fractions, tuple)
            or not fractions
            or any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1 for f in fractions)
        ):
            raise ValueError(f"load_fractions must be numbers in (0, 1], at least one, got {fractions!r}")
        if len(self.servers) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in self.servers):
            raise ValueError(f"servers must be (count, gpus, cores), got {self.servers!r}")
        Servers.uniform(*self.servers)
        Catalogue(self.catalogue)  # ValueError naming it
        if self.bootstrap not in BOOTSTRAP_TEACHERS:
            raise ValueError(f"bootstrap must be one of {', '.join(BOOTSTRAP_TEACHERS)}, got {self.bootstrap!r}")
        object.__setattr__(self, "bootstrap", Teacher(self.bootstrap))  # a model file's config holds the name
        NetShape(self.width_factor, self.hidden, self.row_hidden)

    @property
    def cluster(self) -> Servers:
        return Servers.uniform(*self.servers)

    @property
    def types(self) -> tuple[JobType, ...]:
        return Catalogue(self.catalogue).types

    @property
    def shape(self) -> NetShape:
        return NetShape(self.width_factor, self.hidden, self.row_hidden)

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["servers"] = list(self.servers)
        raw["load_fractions"] = list(self.load_fractions)
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown training setting(s) {sorted(unknown)}")
        values = dict(raw)
        for name in ("servers", "load_fractions"):
            if name in values and isinstance(values[name], list):
                values[name] = tuple(values[name])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class SupervisedReport:
    """§4.2's phase: samples, slots left out (more than J jobs), losses per epoch, match rates, and the temperature
    the online phase starts from."""

    samples: int
    held_out_samples: int
    skipped_slots: int
    losses: tuple[float, ...]
    train_match: float
    held_out_match: float
    #: what the logits were divided by before the online phase (``TrainConfig.online_confidence``)
    temperature: float = 1.0


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One validation of the greedy policy during the online phase (update 0: the supervised policy)."""

    update: int
    episode: int
    avg_jct: float
    episode_reward: float


@dataclass
class TrainResult:
    policy: PolicyNet
    value: ValueNet
    spec: StateSpec
    config: TrainConfig
    supervised: SupervisedReport
    curve: tuple[CurvePoint, ...]
    drf_validation_jct: float
    #: where the supervised samples came from, when not DRF in the simulator (saved in the model file's meta)
    teacher: dict[str, object] | None = None

    @property
    def supervised_jct(self) -> float:
        return self.curve[0].avg_jct

    @property
    def best(self) -> CurvePoint:
        return min(self.curve, key=lambda point: (point.avg_jct, point.update))


def seeds(seed: int, count: int) -> list[int]:
    """``count`` independent seeds derived from ``seed``."""
    return [int(v) for v in np.random.SeedSequence(seed).generate_state(count, dtype=np.uint32)]


@contextlib.contextmanager
def deterministic_torch(seed: int) -> Iterator[None]:
    """One thread, deterministic algorithms, the global generator seeded; all restored on exit."""
    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was)


def sim_config(config: TrainConfig, max_slots: int = 100_000) -> SlotConfig:
    return SlotConfig(config.cluster, config.types, SLOT_SECONDS, max_slots=max_slots)


def score(result: SlotResult, trace: Sequence[SlotTraceJob], slot_seconds: float) -> float:
    """Average JCT in seconds, an unfinished job counting from its arrival to the run's end (a lower bound)."""
    arrival = {job.job_id: job.arrival for job in trace}
    total = sum(jct for _, jct in result.jct)
    total += sum(max(0.0, result.makespan - arrival[job] * slot_seconds) for job in result.unfinished)
    return total / len(trace)


def compare(
    policy: SlotPolicy, baselines: Sequence[SlotPolicy], config: SlotConfig, trace: Sequence[SlotTraceJob]
) -> dict[str, float]:
    """Average JCT (s, :func:`score`) of ``policy`` and each baseline on ``trace``, by policy name. Every run is
    cut after :data:`SLOT_BOUND_FACTOR` times the slots DRF needs (a policy that starves jobs ends, scored)."""
    bounded = dataclasses.replace(config, max_slots=_bound(SlotSimulator(config, trace).run(Drf())))
    simulator = SlotSimulator(bounded, trace)
    return {p.name: score(simulator.run(p), trace, config.slot_seconds) for p in (policy, *baselines)}


# -- supervised (§4.2) -------------------------------------------------------------------------------------------


@dataclass
class _Samples:
    states: list[FloatArray] = dataclasses.field(default_factory=list)
    masks: list[np.ndarray] = dataclasses.field(default_factory=list)
    actions: list[int] = dataclasses.field(default_factory=list)
    skipped: int = 0
    max_slots_run: int = 0
    max_epochs_left: float = 0.0
    max_tasks: int = 0

    def observe(self, spec: StateSpec, inp: SlotInput, decision: SlotDecision) -> None:
        for job in inp.jobs:
            self.max_slots_run = max(self.max_slots_run, job.slots_run)
            self.max_epochs_left = max(self.max_epochs_left, job.epochs_left)
            self.max_tasks = max(self.max_tasks, job.max_workers, job.max_ps)
        steps = teacher_steps(spec, inp, decision)
        if steps is None:
            self.skipped += 1
            return
        for step in steps:
            self.states.append(step.state)
            self.masks.append(step.mask)
            self.actions.append(step.action)

    def tensors(self, spec: StateSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.actions:
            return (
                torch.zeros((0, spec.state_size)),
                torch.zeros((0, spec.action_size), dtype=torch.bool),
                torch.zeros(0, dtype=torch.int64),
            )
        return (
            torch.from_numpy(np.stack(self.states).astype(np.float32)),
            torch.from_numpy(np.stack(self.masks)),
            torch.tensor(self.actions, dtype=torch.int64),
        )


def _teacher_run(
    spec: StateSpec, config: SlotConfig, trace: Sequence[SlotTraceJob], into: _Samples, teacher: SlotPolicy
) -> SlotResult:
    return SlotSimulator(config, trace).run(teacher, lambda inp, decision, _: into.observe(spec, inp, decision))


def match_rate(policy: PolicyNet, states: torch.Tensor, masks: torch.Tensor, actions: torch.Tensor) -> float:
    """The fraction of samples where the greedy masked action is the teacher's."""
    if len(actions) == 0:
        return math.nan
    with torch.no_grad():
        chosen = policy(states).masked_fill(~masks, -math.inf).argmax(dim=1)
    return float((chosen == actions).float().mean())


def temperature_for(
    policy: PolicyNet, states: torch.Tensor, masks: torch.Tensor, confidence: float, *, chunk: int = 4096
) -> float:
    """The temperature ``T >= 1`` at which the mean over ``states`` of the greedy action's probability (the masked
    softmax of the logits / T) is ``confidence``; 1 when it is that or lower untempered, or there are no states.

    A supervised policy that matches its teacher 98 % of the time gives that action a probability near 1 (logits
    tens apart): sampled inferences then repeat the teacher, and the policy gradient of §4.3 through a saturated
    softmax is about 0 wherever the policy is sure. Dividing the logits flattens the softmax and keeps every
    argmax. The mean probability falls as T grows, so a bisection on log T finds it (to a relative 1e-4)."""
    if len(states) == 0:
        return 1.0
    with torch.no_grad():
        logits = torch.cat([policy(states[k : k + chunk]) for k in range(0, len(states), chunk)]).double()

    def confidence_at(temperature: float) -> float:
        probs = masked_log_softmax(logits / temperature, masks).exp()
        return float(probs.max(dim=1).values.mean())

    if confidence_at(1.0) <= confidence:
        return 1.0
    low, high = 0.0, 1.0  # log10 T, with confidence_at(10**low) > confidence
    while confidence_at(math.pow(10.0, high)) > confidence:
        if high >= 12:  # the mean never goes below 1 / (the actions allowed): as flat as the softmax gets
            return math.pow(10.0, high)
        low, high = high, high + 1.0
    while high - low > 4e-5:
        mid = (low + high) / 2
        low, high = (mid, high) if confidence_at(math.pow(10.0, mid)) > confidence else (low, mid)
    return math.pow(10.0, high)


def supervised(
    policy: PolicyNet,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    epochs: int,
    lr: float,
    batch: int,
    rng: np.random.Generator,
) -> list[float]:
    """§4.2: cross entropy of the masked softmax against the teacher's actions, Adam; the mean loss per epoch."""
    states, masks, actions = data
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    losses: list[float] = []
    count = len(actions)
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(count))
        total = 0.0
        for start in range(0, count, batch):
            idx = order[start : start + batch]
            logp = masked_log_softmax(policy(states[idx]), masks[idx])
            loss = torch.nn.functional.nll_loss(logp, actions[idx])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / max(count, 1))
    return losses


# -- online actor-critic (§4.3) ----------------------------------------------------------------------------------


class _Replay:
    """The latest ``capacity`` samples: state, mask, action, n-step discounted return, the state n slots later and
    the discount to apply to its value (0 at the episode's end)."""

    def __init__(self, spec: StateSpec, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._next = 0
        self.states = np.zeros((capacity, spec.state_size), dtype=np.float32)
        self.masks = np.zeros((capacity, spec.action_size), dtype=np.bool_)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.next_states = np.zeros((capacity, spec.state_size), dtype=np.float32)
        self.discounts = np.zeros(capacity, dtype=np.float32)
        self.gains = np.zeros((capacity, spec.action_size), dtype=np.float32)

    def push(
        self,
        steps: Sequence[Step],
        gains: FloatArray,
        reward: float,
        next_state: FloatArray | None,
        discount: float,
    ) -> None:
        for i, step in enumerate(steps):
            k = self._next
            self.gains[k] = gains[i]
            self.states[k] = step.state
            self.masks[k] = step.mask
            self.actions[k] = step.action
            self.rewards[k] = reward
            self.next_states[k] = 0.0 if next_state is None else next_state
            self.discounts[k] = 0.0 if next_state is None else discount
            self._next = (k + 1) % self.capacity
            self.size = min(self.size + 1, self.capacity)

    def sample(self, rng: np.random.Generator, batch: int) -> tuple[torch.Tensor, ...]:
        idx = rng.integers(0, self.size, size=min(batch, self.size))
        return (
            torch.from_numpy(self.states[idx]),
            torch.from_numpy(self.masks[idx]),
            torch.from_numpy(self.actions[idx]),
            torch.from_numpy(self.rewards[idx]),
            torch.from_numpy(self.next_states[idx]),
            torch.from_numpy(self.discounts[idx]),
            torch.from_numpy(self.gains[idx]),
        )


class _Explorer(SlotPolicy):
    """The policy while it trains: sampled inferences with job-aware exploration (§4.3), steps kept per slot."""

    name = "dl2-train"

    def __init__(self, spec: StateSpec, network: Network, rng: np.random.Generator, epsilon: float) -> None:
        self.spec = spec
        self.network = network
        self._choose = sampler(rng, epsilon)
        self.steps: tuple[Step, ...] = ()

    def allocate(self, inp: SlotInput) -> SlotDecision:
        decision, self.steps = infer(self.spec, inp, self.network, self._choose, explore=True)
        return decision


def immediate_gains(spec: StateSpec, inp: SlotInput, steps: Sequence[Step]) -> FloatArray:
    """Per inference of a slot, per action: the normalised epochs (Eq. 1's terms) the action would add to the
    slot's reward, from the type's speed model with the allocation so far (``(len(steps), 3J + 1)``; void and rows
    beyond the batch's jobs 0; the update weighs only the actions the mask allowed). A job's epochs in the slot
    are ``min(epochs left, speed(w, p) x slot)``, so the gains of a job's actions in the order taken sum to its
    Eq. 1 term of the slot (less the start and rescale overheads and the job's own speed factor, which no policy
    sees)."""
    out = np.zeros((len(steps), spec.action_size))
    alloc: dict[int, tuple[int, int]] = {}

    def term(job: SlotJob, w: int, p: int) -> float:
        if w == 0 or p == 0:
            return 0.0
        speed = inp.job_type(job).epochs_per_second(w, p)
        return min(job.epochs_left, speed * inp.slot_seconds) / job.epochs_total

    def row_gains(index: int) -> tuple[float, float, float]:
        job = inp.jobs[index]
        w, p = alloc.get(index, (0, 0))
        now = term(job, w, p)
        return (term(job, w + 1, p) - now, term(job, w, p + 1) - now, term(job, w + 1, p + 1) - now)

    start = -1
    table = np.zeros((spec.jobs, 3))
    for i, step in enumerate(steps):
        if step.start != start:
            start = step.start
            table[:] = 0.0
            for k in range(min(spec.jobs, len(inp.jobs) - start)):
                table[k] = row_gains(start + k)
        out[i, : 3 * spec.jobs] = table.reshape(-1)
        if step.action == spec.void:
            continue
        k, a = divmod(step.action, 3)
        kind = JOB_ACTIONS[a]
        w, p = alloc.get(start + k, (0, 0))
        alloc[start + k] = (w + (kind is not SlotAction.PS), p + (kind is not SlotAction.WORKER))
        table[k] = row_gains(start + k)
    return out


class _ActorCritic:
    def __init__(self, policy: PolicyNet, value: ValueNet, config: TrainConfig) -> None:
        self.policy, self.value, self.config = policy, value, config
        self.policy_opt = torch.optim.Adam(policy.parameters(), lr=config.rl_lr)
        self.value_opt = torch.optim.Adam(value.parameters(), lr=config.value_lr)

    def update(self, batch: tuple[torch.Tensor, ...], *, policy: bool = True) -> None:
        states, masks, actions, returns, next_states, discounts, gains = batch
        cfg = self.config
        with torch.no_grad():
            target = returns + discounts * self.value(next_states)
        values = self.value(states)
        value_loss = torch.nn.functional.mse_loss(values, target)
        self.value_opt.zero_grad()
        value_loss.backward()  # type: ignore[no-untyped-call]
        self.value_opt.step()
        if not policy:
            return

        advantage = (target - values).detach()
        if len(advantage) > 1:
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        logp = masked_log_softmax(self.policy(states), masks)
        if cfg.immediate > 0:
            with torch.no_grad():
                expected = (logp.exp() * gains.masked_fill(~masks, 0.0)).sum(dim=1)
                own = gains.gather(1, actions.unsqueeze(1)).squeeze(1) - expected
                if len(own) > 1:
                    own = own / (own.std() + 1e-8)
            advantage = advantage + cfg.immediate * own
        chosen = logp.gather(1, actions.unsqueeze(1)).squeeze(1)
        entropy = -(logp.exp() * logp.masked_fill(~masks, 0.0)).sum(dim=1)
        policy_loss = -(advantage * chosen).mean() - cfg.entropy * entropy.mean()
        self.policy_opt.zero_grad()
        policy_loss.backward()
        self.policy_opt.step()


class Online:
    """§4.3's online phase: episodes of the simulator, one actor-critic update after every slot."""

    def __init__(
        self,
        policy: PolicyNet,
        value: ValueNet,
        spec: StateSpec,
        config: TrainConfig,
        *,
        validate: Callable[[Network], float],
        rng: np.random.Generator,
    ) -> None:
        self.policy, self.spec, self.config = policy, spec, config
        self._learner = _ActorCritic(policy, value, config)
        self._replay = _Replay(spec, config.replay)
        self._explorer = _Explorer(spec, inference_network(policy), rng, config.epsilon)
        self._validate = validate
        self._rng = rng
        self.curve = [CurvePoint(0, 0, validate(self._explorer.network), math.nan)]
        self.best: tuple[float, dict[str, torch.Tensor]] = (self.curve[0].avg_jct, copy.deepcopy(policy.state_dict()))
        self.updates = 0
        self.episodes = 0
        self._reward = 0.0
        self._pending: list[tuple[tuple[Step, ...], FloatArray, float]] = []

    def episode(self, trace: Sequence[SlotTraceJob], bound: int) -> None:
        """One episode on ``trace``, cut after ``bound`` slots."""
        self.episodes += 1
        self._reward = 0.0
        self._pending = []
        simulator = SlotSimulator(dataclasses.replace(sim_config(self.config), max_slots=bound), trace)
        simulator.run(self._explorer, self._observe)
        self._flush(None)

    def _flush(self, next_state: FloatArray | None) -> None:
        """Samples into the replay buffer once their n-step return is known: the oldest pending slot when
        ``n_step`` slots followed it (``next_state``: the state that starts the slot after them), or every
        pending slot at the episode's end (``None``: terminal)."""
        gamma = self.config.gamma
        if next_state is not None:
            if len(self._pending) < self.config.n_step:
                return
            ret = sum(gamma**k * reward for k, (_, _, reward) in enumerate(self._pending))
            steps, gains, _ = self._pending.pop(0)
            self._replay.push(steps, gains, ret, next_state, gamma ** (len(self._pending) + 1))
            return
        while self._pending:
            ret = sum(gamma**k * reward for k, (_, _, reward) in enumerate(self._pending))
            steps, gains, _ = self._pending.pop(0)
            self._replay.push(steps, gains, ret, None, 0.0)

    def _observe(self, inp: SlotInput, decision: SlotDecision, outcome: SlotOutcome) -> None:
        self._flush(initial_state(self.spec, inp))
        steps = self._explorer.steps
        gains = (
            immediate_gains(self.spec, inp, steps)
            if self.config.immediate > 0
            else np.zeros((len(steps), self.spec.action_size))
        )
        self._pending.append((steps, gains, outcome.reward))
        self._reward += outcome.reward
        if self._replay.size == 0:
            return
        batch = self._replay.sample(self._rng, self.config.batch)
        self._learner.update(batch, policy=self.updates >= self.config.value_warmup)
        self.updates += 1
        self._explorer.network = inference_network(self.policy)
        if self.updates % self.config.eval_every == 0:
            jct = self._validate(self._explorer.network)
            self.curve.append(CurvePoint(self.updates, self.episodes, jct, self._reward))
            if jct < self.best[0]:
                self.best = (jct, copy.deepcopy(self.policy.state_dict()))


# -- the whole run -----------------------------------------------------------------------------------------------


def _traces(
    config: TrainConfig,
) -> tuple[list[tuple[SlotTraceJob, ...]], list[tuple[SlotTraceJob, ...]], list[tuple[SlotTraceJob, ...]]]:
    """The training, held-out and validation traces; the ``k``-th of each kind at ``load x load_fractions[k % n]``
    (one validation trace per fraction)."""
    fractions = config.load_fractions
    # three independent streams: the training traces do not change with the held-out count, and so on
    train_seeds, held_seeds, val_seeds = (
        [int(v) for v in child.generate_state(n, dtype=np.uint32)]
        for child, n in zip(
            np.random.SeedSequence(config.seed).spawn(3),
            (config.traces, config.held_out, len(fractions)),
            strict=True,
        )
    )

    def make(k: int, seed: int, jobs: int) -> tuple[SlotTraceJob, ...]:
        load = config.load * fractions[k % len(fractions)]
        return generate(seed, jobs=jobs, servers=config.cluster, load=load, types=config.types)

    train = [make(k, s, config.jobs) for k, s in enumerate(train_seeds)]
    held = [make(k, s, config.jobs) for k, s in enumerate(held_seeds)]
    return train, held, [make(k, s, config.validation_jobs) for k, s in enumerate(val_seeds)]


def _bound(teacher: SlotResult) -> int:
    """The slots a DL² run may take on a trace its teacher (DRF, or the bootstrap's) finished in
    ``teacher.makespan``."""
    return SLOT_BOUND_FACTOR * (math.ceil(teacher.makespan / SLOT_SECONDS) + 1)


@dataclass(frozen=True)
class Validation:
    """A run's validation traces (one per load fraction), each with the simulator configuration it runs with (cut
    after :data:`SLOT_BOUND_FACTOR` times DRF's slots), and DRF's average JCT over all their jobs (s)."""

    runs: tuple[tuple[tuple[SlotTraceJob, ...], SlotConfig], ...]
    drf_jct: float

    def jct(self, policy: SlotPolicy) -> float:
        """``policy``'s average JCT (s) over all the traces' jobs (:func:`score` on each)."""
        return _pooled([(SlotSimulator(sim, trace).run(policy), trace) for trace, sim in self.runs])

    def evaluate(self, network: Network, spec: StateSpec) -> float:
        """The greedy policy's average JCT (s) over all the traces' jobs."""
        return self.jct(Dl2Policy(network, spec))


def _pooled(results: Sequence[tuple[SlotResult, Sequence[SlotTraceJob]]]) -> float:
    """Average JCT (s) over the jobs of several runs, each scored by :func:`score`."""
    total = sum(score(result, trace, SLOT_SECONDS) * len(trace) for result, trace in results)
    return total / sum(len(trace) for _, trace in results)


def validation(config: TrainConfig) -> Validation:
    """The validation traces of a run (:class:`Validation`)."""
    sim = sim_config(config)
    drf = [(SlotSimulator(sim, trace).run(Drf()), trace) for trace in _traces(config)[2]]
    runs = tuple((trace, dataclasses.replace(sim, max_slots=_bound(result))) for result, trace in drf)
    return Validation(runs, _pooled(drf))


def base_spec(config: TrainConfig) -> StateSpec:
    """The state of a run before its training range is known: J, the simulator's job types and slot length."""
    return StateSpec(
        jobs=config.max_jobs,
        type_names=tuple(kind.name for kind in config.types),
        slot_seconds=SLOT_SECONDS,
        slots_scale=100.0,
        epochs_scale=1000.0,
        share_scale=0.01,
        tasks_scale=16.0,
    )


#: the share of a history's slots, the latest, whose samples are held out (the supervised match rate)
HELD_OUT_SHARE = 0.2


def history_samples(spec: StateSpec, slots: Sequence[TeacherSlot]) -> tuple[_Samples, _Samples]:
    """Training and held-out samples of Slurm's history (§4.2): the latest :data:`HELD_OUT_SHARE` of the slots
    (at least one when there are five or more) are held out; a slot with no samples adds nothing."""
    usable = sorted((slot for slot in slots if slot.steps is not None), key=lambda slot: slot.slot)
    cut = len(usable) - (max(1, int(len(usable) * HELD_OUT_SHARE)) if len(usable) >= 5 else 0)
    samples, held = _Samples(), _Samples()
    for k, slot in enumerate(usable):
        (samples if k < cut else held).observe(spec, slot.inp, slot.decision)
    return samples, held


def train(
    config: TrainConfig,
    progress: Callable[[str], None] | None = None,
    *,
    history: Sequence[TeacherSlot] | None = None,
    teacher: dict[str, object] | None = None,
) -> TrainResult:
    """Supervised bootstrap from the simulated ``config.bootstrap`` teacher, or from Slurm's ``history`` (its slots,
    :func:`history_samples`;
    ``teacher`` describes it for the model file), then online actor-critic (module docstring)."""
    say = progress or (lambda _: None)
    torch_seed, sample_seed, batch_seed = seeds(config.seed + 1_000_003, 3)
    train_traces, held_traces, _ = _traces(config)
    spec = base_spec(config)
    sim = sim_config(config)
    samples, held = _Samples(), _Samples()
    bounds = []
    teacher_policy = BOOTSTRAP_TEACHERS[config.bootstrap]()
    for trace in train_traces:
        result = _teacher_run(spec, sim, trace, samples, teacher_policy)
        bounds.append(_bound(result))
    if history is None:
        for trace in held_traces:
            _teacher_run(spec, sim, trace, held, teacher_policy)
    else:
        simulated = samples
        samples, held = history_samples(spec, history)
        if not samples.actions:
            raise ValueError(f"Slurm's history gave no training samples ({len(held.actions)} held out)")
        samples.max_slots_run = max(samples.max_slots_run, held.max_slots_run, simulated.max_slots_run)
        samples.max_epochs_left = max(samples.max_epochs_left, held.max_epochs_left, simulated.max_epochs_left)
        samples.max_tasks = max(samples.max_tasks, held.max_tasks, simulated.max_tasks)
    spec = dataclasses.replace(
        spec,
        max_slots_run=samples.max_slots_run,
        max_epochs_left=samples.max_epochs_left,
        max_tasks=samples.max_tasks,
    )
    checks = validation(config)
    say(f"supervised: {len(samples.actions)} samples, {samples.skipped} slots of more than {spec.jobs} jobs left out")

    with deterministic_torch(torch_seed):
        policy = PolicyNet(spec, config.shape)
        value = ValueNet(spec, config.shape)
        data = samples.tensors(spec)
        held_data = held.tensors(spec)
        losses = supervised(
            policy,
            data,
            epochs=config.supervised_epochs,
            lr=config.supervised_lr,
            batch=config.batch,
            rng=np.random.default_rng(batch_seed),
        )
        temperature = temperature_for(policy, data[0], data[1], config.online_confidence)
        report = SupervisedReport(
            samples=len(samples.actions),
            held_out_samples=len(held.actions),
            skipped_slots=samples.skipped + held.skipped,
            losses=tuple(losses),
            train_match=match_rate(policy, *data),
            held_out_match=match_rate(policy, *held_data),
            temperature=temperature,
        )
        policy.temper(temperature)
        say(
            f"supervised: match {report.train_match:.3f} on training, {report.held_out_match:.3f} held out; "
            f"logits / {temperature:.4g} for the online phase"
        )
        episodes = [
            (train_traces[k % len(train_traces)], bounds[k % len(train_traces)]) for k in range(config.rl_episodes)
        ]
        online = Online(
            policy,
            value,
            spec,
            config,
            validate=lambda network: checks.evaluate(network, spec),
            rng=np.random.default_rng(sample_seed),
        )
        for trace, bound in episodes:
            online.episode(trace, bound)
            last = online.curve[-1]
            say(f"episode {online.episodes}: {online.updates} updates, validation JCT {last.avg_jct:.0f} s")
        policy.load_state_dict(online.best[1])
    return TrainResult(policy, value, spec, config, report, tuple(online.curve), checks.drf_jct, teacher)


# -- the model file ----------------------------------------------------------------------------------------------


def save_model(path: Path, result: TrainResult) -> None:
    """Write a training run's model file (:mod:`hpc_elastic.dl2.model_file`): both networks, the spec, the
    configuration, the supervised report and the curve."""
    meta = {
        "supervised": dataclasses.asdict(result.supervised),
        "curve": [dataclasses.asdict(point) for point in result.curve],
        "drf_validation_jct": result.drf_validation_jct,
    }
    if result.teacher is not None:
        meta["teacher"] = result.teacher
    model_file.save(path, result.spec, result.config.to_dict(), meta, to_arrays(result.policy, result.value))


def load_networks(model: model_file.ModelFile) -> tuple[TrainConfig, PolicyNet, ValueNet]:
    """The training configuration and both networks of a loaded model file; ``ValueError`` when they do not fit."""
    try:
        config = TrainConfig.from_dict(model.config)
    except TypeError as exc:
        raise ValueError(f"model file: bad training configuration ({exc})") from None
    policy, value = PolicyNet(model.spec, config.shape), ValueNet(model.spec, config.shape)
    load_arrays(policy, "policy", model.arrays)
    load_arrays(value, "value", model.arrays)
    return config, policy, value
