"""The runtime side of EST-mode balancing (``--balance est``): LB-BSP's Alg. 2 with whole ESTs as the step.

The :class:`~hpc_elastic.state.State` times the ESTs of this process at every global step (the time inside its
ESTs: data, forward, backward and the hand-over to the reducer, not the wait in the allreduce: LB-BSP §4's batch
processing time).  Every ``every`` steps :meth:`ESTBalancer.observe` all-gathers each process's mean time per step
and its free device memory, and every process runs the same pure Alg. 2 step
(:func:`hpc_elastic.balance.gpu.alg2_step`, Δ = 1 EST, the predictive guard on) on the same readings, so all reach
the same EST counts without a leader process.  New counts become the nearest placement
(:meth:`hpc_elastic.est.plan.Placement.with_counts`), which the State applies at once, at the step boundary
(:meth:`~hpc_elastic.state.State.rebalance`).  Every process keeps at least one EST: Alg. 2 moves nothing off a
straggler with Δ or fewer.  The decisions are pure; this module only holds the clocks' readings and the exchange.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hpc_elastic.balance.gpu import Alg2Config, Alg2Decision, Alg2State, Outcome, WorkerReading, alg2_step
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
