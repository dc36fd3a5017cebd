"""The runtime side of LB-BSP's balancing: EST mode (``--balance est``, :class:`ESTBalancer`) and paper mode
(``--balance lbbsp``, :class:`PaperBalancer`).  The decisions are the pure modules' of :mod:`hpc_elastic.balance`;
this module holds the clocks' readings, the host and device usage and the exchange of the readings.

EST mode: LB-BSP's Alg. 2 with whole ESTs as the step.

The :class:`~hpc_elastic.state.State` times the ESTs of this process at every global step (the time inside its
ESTs: data, forward, backward and the hand-over to the reducer, not the wait in the allreduce: LB-BSP §4's batch
processing time).  Every ``every`` steps :meth:`ESTBalancer.observe` all-gathers each process's mean time per step
and its free device memory, and every process runs the same pure Alg. 2 step
(:func:`hpc_elastic.balance.gpu.alg2_step`, Δ = 1 EST, the predictive guard on) on the same readings, so all reach
the same EST counts without a leader process.  New counts become the nearest placement
(:meth:`hpc_elastic.est.plan.Placement.with_counts`), which the State applies at once, at the step boundary
(:meth:`~hpc_elastic.state.State.rebalance`).  Every process keeps at least one EST: Alg. 2 moves nothing off a
straggler with Δ or fewer.

Paper mode: one worker per process with x_i samples per iteration, Σ x_i = X (the job's N ESTs times the batch of
one), from the exact-once :class:`~hpc_elastic.balance.sampler.BalancedSampler`; the State scales the process's
gradient by n·x_i/X (Eq. 7) before the mean allreduce.  After every iteration the processes all-gather their batch
processing times and usage, and all run the same pure step: Alg. 2 when every process trains on a GPU (free memory
from ``cudaMemGetInfo``), Alg. 1 otherwise (host CPU and memory usage from psutil).  Which samples a worker gets
depends on the measured speeds, so the trained bits do too: bitwise identity is not promised in this mode.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hpc_elastic.balance.apportion import apportion
from hpc_elastic.balance.cpu import Alg1Config, Alg1State, CpuReading, alg1_step
from hpc_elastic.balance.gpu import Alg2Config, Alg2Decision, Alg2State, Outcome, WorkerReading, alg2_step
from hpc_elastic.balance.sampler import BalancedSampler, SamplerState
from hpc_elastic.est.comm import Communicator
from hpc_elastic.est.plan import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ESTBalanceConfig:
    """``every``: global steps per reading (one Alg. 2 iteration); ``fast_window`` / ``fine_window``: Alg. 2's D
    before and after an oscillation, in readings (Δ is one EST in both phases)."""

    every: int = 5
    fast_window: int = 2
    fine_window: int = 5

    def __post_init__(self) -> None:
        for name in ("every", "fast_window", "fine_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def alg2(self) -> Alg2Config:
        return Alg2Config(
            fast_step=1,
            fast_window=self.fast_window,
            fine_step=1,
            fine_window=self.fine_window,
            predictive=True,
        )


def free_memory_fraction(device: torch.device) -> float:
    """The free fraction of ``device``'s memory (Alg. 2 line 5); 1.0 off CUDA."""
    if device.type != "cuda":
        return 1.0
    free, total = torch.cuda.mem_get_info(device)
    return free / total if total else 1.0


class ESTBalancer:
    """Alg. 2 over the processes of ``comm`` for ``placement``'s EST counts (see the module docstring)."""

    def __init__(self, comm: Communicator, placement: Placement, config: ESTBalanceConfig | None = None) -> None:
        self.comm = comm
        self.config = config if config is not None else ESTBalanceConfig()
        self._alg2 = self.config.alg2()
        self.state = Alg2State(sizes=placement.counts(), caps=(None,) * placement.num_procs)
        self._busy = 0.0
        self._steps = 0
        #: every decision taken, in order (the step it was taken at, and the decision)
        self.decisions: list[tuple[int, Alg2Decision]] = []

    def observe(self, step: int, busy_s: float, placement: Placement, device: torch.device) -> Placement | None:
        """After global step ``step``, whose ESTs took ``busy_s`` seconds here: the placement to switch to now, or
        None.  Collective every ``every`` steps (every process calls it at every step)."""
        if placement.counts() != self.state.sizes:
            raise RuntimeError(f"the balancer has EST counts {self.state.sizes}, the placement {placement.counts()}")
        self._busy += busy_s
        self._steps += 1
        if self._steps < self.config.every:
            return None
        mine = (self._busy / self._steps, free_memory_fraction(device))
        self._busy, self._steps = 0.0, 0
        readings = [WorkerReading(seconds, free) for seconds, free in self.comm.allgather_object(mine)]
        self.state, decision = alg2_step(self.state, readings, self._alg2)
        self.decisions.append((step, decision))
        if decision.outcome is not Outcome.MOVED:
            return None
        moved = placement.with_counts(decision.sizes)
        if self.comm.rank == 0:
            gone = [v for v in range(placement.num_ests) if moved.owner[v] != placement.owner[v]]
            times = ", ".join(f"{r.seconds * 1e3:.1f}" for r in readings)
            log.info(
                "balance est: step %d: EST %s from process %d to %d; ESTs per process %s (ms per step: %s)",
                step,
                ",".join(map(str, gone)),
                decision.straggler,
                decision.leader,
                list(decision.sizes),
                times,
            )
        return moved


# ---------------------------------------------------------------------------------------------------- paper mode


@dataclass(frozen=True)
class PaperConfig:
    """Alg. 2's parameters for GPU workers, Alg. 1's for CPU workers."""

    gpu: Alg2Config = field(default_factory=Alg2Config)
    cpu: Alg1Config = field(default_factory=Alg1Config)


def host_usage() -> tuple[float, float]:
    """The host's CPU and memory usage as fractions (Alg. 1's c_i and m_i), through psutil."""
    try:
        psutil = importlib.import_module("psutil")
    except ImportError:
        raise RuntimeError("--balance lbbsp on CPU workers needs psutil (pip install 'hpc-elastic[balance]')") from None
    cpu = min(max(float(psutil.cpu_percent(interval=None)) / 100.0, 0.0), 1.0)
    mem = min(max(float(psutil.virtual_memory().percent) / 100.0, 0.0), 1.0)
    return cpu, mem


class PaperBalancer:
    """The batch sizes x_i of the processes of ``comm`` and the sample stream they draw from (see the module
    docstring).  Built collectively (the processes agree on GPU or CPU workers)."""

    def __init__(
        self,
        comm: Communicator,
        sampler: BalancedSampler,
        total: int,
        device: torch.device,
        config: PaperConfig | None = None,
    ) -> None:
        if total > sampler.dataset_len:
            raise ValueError(f"a global batch of {total} is larger than the dataset ({sampler.dataset_len} samples)")
        self.comm = comm
        self.sampler = sampler
        self.config = config if config is not None else PaperConfig()
        self.device = device
        self.gpu = all(t == "cuda" for t in comm.allgather_object(device.type))
        self.position = SamplerState()
        self._start(apportion([1.0] * comm.size, total))
        self._taken: tuple[tuple[int, ...], ...] | None = None
        #: the sizes of every iteration so far in this process's life (rank order)
        self.history: list[tuple[int, ...]] = []

    def _start(self, sizes: Sequence[int]) -> None:
        if min(sizes) < 1:
            raise ValueError(f"a global batch of {sum(sizes)} leaves one of {len(sizes)} workers without samples")
        self.sizes = tuple(sizes)
        caps: tuple[int | None, ...] = (None,) * len(sizes)
        self._alg2 = Alg2State(sizes=self.sizes, caps=caps)
        self._alg1 = Alg1State(self.sizes, caps, Alg1State.initial(sum(sizes), caps).predictors)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def indices(self) -> tuple[int, ...]:
        """This process's x_i dataset indices of the current iteration."""
        if self._taken is None:
            self._taken = self.sampler.take(self.position, self.sizes).indices
        return self._taken[self.comm.rank]

    def factor(self) -> float:
        """n·x_i/X of this process (Eq. 7)."""
        return len(self.sizes) * self.sizes[self.comm.rank] / self.total

    def finish(self, busy_s: float) -> tuple[int, ...]:
        """After an iteration whose batch took ``busy_s`` seconds here: move the stream on, agree on the readings
        and return the sizes of the next iteration (collective)."""
        self.position = self.sampler.take(self.position, self.sizes).state
        self._taken = None
        self.history.append(self.sizes)
        if self.gpu:
            mine: tuple[float, ...] = (busy_s, free_memory_fraction(self.device))
        else:
            mine = (max(busy_s, 1e-9), *host_usage())
        readings = self.comm.allgather_object(mine)
        if self.gpu:
            self._alg2, decision = alg2_step(self._alg2, [WorkerReading(t, f) for t, f in readings], self.config.gpu)
            if decision.warning is not None and self.comm.rank == 0:
                log.warning("balance lbbsp: %s (the runtime keeps every process: sizes unchanged)", decision.warning)
            self.sizes = decision.sizes
        else:
            cpu_readings = [CpuReading(x, t, c, m) for x, (t, c, m) in zip(self.sizes, readings, strict=True)]
            self._alg1, cpu_decision = alg1_step(self._alg1, cpu_readings, self.config.cpu)
            sizes = cpu_decision.sizes
            if min(sizes) < 1:  # a process cannot train on no sample: one each, the rest by the predicted speeds
                n = len(sizes)
                sizes = tuple(1 + x for x in apportion(cpu_decision.speeds, self.total - n))
                self._alg1 = replace(self._alg1, sizes=sizes)
                if self.comm.rank == 0:
                    log.warning(
                        "balance lbbsp: a worker's predicted share of the batch is below one sample (LB-BSP would "
                        "remove it); every process keeps one"
                    )
            self.sizes = sizes
        return self.sizes

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint keeps: the stream's position and the sizes (the speed histories start again)."""
        return {"sampler": self.position.to_json(), "sizes": list(self.sizes)}

    def load(self, data: Mapping[str, Any]) -> None:
        """Continue from :meth:`to_json`'s form: the same stream position; the same sizes when the process count
        and X are those of the checkpoint, else X split evenly again."""
        self.position = SamplerState.from_json(data["sampler"])
        self._taken = None
        sizes = [int(x) for x in data.get("sizes", [])]
        if len(sizes) != self.comm.size or sum(sizes) != self.total or min(sizes, default=0) < 1:
            sizes = list(apportion([1.0] * self.comm.size, self.total))
        self._start(sizes)
