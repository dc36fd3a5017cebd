"""One training step of a MODEL (forward, loss, backward, optimizer step: LB-BSP §3.1) and the step-time curve
Γ(x) measured with it."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hpc_elastic.profile.curve import summarize_repeats
from hpc_elastic.profile.model import LoadedModel, ProfileRunError, torch_module
from hpc_elastic.profile.schema import CurvePoint, MemoryMethod, StepClock

if TYPE_CHECKING:
    import torch

Progress = Callable[[str, int, int | None], None]
"""``progress(description, completed, total)``; total None while unknown (memory search)."""


class PeakMeter(Protocol):
    """Peak memory of the code run between :meth:`start` and :meth:`stop`."""

    method: MemoryMethod

    def start(self) -> None: ...

    def stop(self) -> int: ...


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, tuple | list):
        return tuple(_move(item, device) for item in value)
    return value.to(device)


class StepRunner:
    """One training step of a MODEL on a device: forward, loss, backward, optimizer step (LB-BSP §3.1)."""

    def __init__(self, loaded: LoadedModel, device: torch.device, seed: int) -> None:
        self._torch = torch_module()
        self.loaded = loaded
        self.device = device
        self.seed = seed
        self.module = loaded.module.to(device)
        self.module.train()
        self.optimizer = self._torch.optim.SGD(self.module.parameters(), lr=0.001, momentum=0.9)
        functional = self._torch.nn.functional
        self._default_loss: Callable[[Any, Any], Any] = lambda out, target: (
            functional.cross_entropy(out, target)
            if not (target.is_floating_point() or target.is_complex())
            else functional.mse_loss(out, target)
        )
        self._initial: tuple[dict[str, Any], dict[str, Any]] | None = None

    def batch(self, batch_size: int) -> tuple[Any, Any]:
        """One sample batch of ``batch_size``, seeded, on the device."""
        self._torch.manual_seed(self.seed)
        pair = self.loaded.sample_batch(batch_size)
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ProfileRunError(f"MODEL {self.loaded.spec!r}: sample_batch must return (inputs, targets)")
        return _move(pair[0], self.device), _move(pair[1], self.device)

    def step(self, inputs: Any, targets: Any) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self.module(*inputs) if isinstance(inputs, tuple) else self.module(inputs)
        loss_fn = self.loaded.loss_fn or self._default_loss
        loss = loss_fn(outputs, targets)
        loss.backward()
        self.optimizer.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)

    def snapshot(self) -> None:
        """Remember the weights and optimizer state (after a first step has created the momentum buffers)."""
        self._initial = (copy.deepcopy(self.module.state_dict()), copy.deepcopy(self.optimizer.state_dict()))

    def restore(self) -> None:
        """Go back to the remembered state, so every batch size starts from the same weights."""
        if self._initial is not None:
            self.module.load_state_dict(self._initial[0])
            self.optimizer.load_state_dict(self._initial[1])
        self.optimizer.zero_grad(set_to_none=True)


def is_oom(exc: BaseException, torch: Any) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and (
        "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower()
    )


def measure_curve(
    runner: StepRunner,
    sizes: Sequence[int],
    *,
    warmup: int,
    iters: int,
    repeats: int,
    meter: PeakMeter | None,
    progress: Progress | None = None,
    clock: StepClock = StepClock.WALL,
) -> list[CurvePoint]:
    """Γ(x) and throughput C at each batch size (LB-BSP §3.1): ``repeats`` timings of ``iters`` steps each.

    The repeats are interleaved: round r times every batch size once, so a burst of load from other processes
    on a shared host lands on several batch sizes' r-th repeat instead of on all repeats of one batch size,
    and the median over rounds discards it. Each batch size gets ``warmup`` untimed steps before its first
    timed repeat and one untimed step before each later one (switching batch size re-primes allocator and
    kernel caches); warm-up steps are never timed. Every repeat starts from the same weights and optimizer
    state. ``peak_memory_bytes`` is the meter's peak over the first round (warm-up and timed steps).
    ``clock`` WALL times with ``time.perf_counter``; PROCESS with ``time.process_time``, the CPU time of all
    threads of this process, which on a shared host excludes the time other processes held the cores (with
    one torch thread it is the step time on a dedicated core; meaningless for CUDA, which runs off the CPU).
    """
    if not sizes:
        raise ValueError("at least one batch size is needed, got none")
    report: Progress = progress or (lambda description, done, total: None)
    timer = time.perf_counter if clock is StepClock.WALL else time.process_time
    batches = {size: runner.batch(size) for size in sizes}
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    peaks: dict[int, int | None] = dict.fromkeys(sizes)
    total = repeats * len(sizes)
    for round_index in range(repeats):
        for position, size in enumerate(sizes):
            done = round_index * len(sizes) + position
            report(f"Γ(x): batch {size}, repeat {round_index + 1}/{repeats}", done, total)
            inputs, targets = batches[size]
            runner.restore()
            first = round_index == 0
            if first and meter is not None:
                meter.start()
            for _ in range(warmup if first else min(warmup, 1)):
                runner.step(inputs, targets)
            runner.sync()
            began = timer()
            for _ in range(iters):
                runner.step(inputs, targets)
            runner.sync()
            timings[size].append((timer() - began) / iters)
            if first and meter is not None:
                peaks[size] = meter.stop()
    report("Γ(x): done", total, total)
    points: list[CurvePoint] = []
    for size in sizes:
        summary = summarize_repeats(timings[size])
        points.append(
            CurvePoint(
                batch_size=size,
                step_time_s=summary.median_s,
                step_time_min_s=summary.min_s,
                step_time_max_s=summary.max_s,
                batches_per_s=1.0 / summary.median_s,
                samples_per_s=size / summary.median_s,
                peak_memory_bytes=peaks[size],
            )
        )
    return points


def measure_point(
    runner: StepRunner, batch_size: int, *, warmup: int, iters: int, repeats: int, meter: PeakMeter | None
) -> CurvePoint:
    """Γ(x) at one batch size (:func:`measure_curve` with a single size)."""
    return measure_curve(runner, [batch_size], warmup=warmup, iters=iters, repeats=repeats, meter=meter)[0]
