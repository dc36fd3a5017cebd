"""The measuring half of the profiler: torch, timers, psutil and pynvml (all imported lazily).

:func:`run_profile` loads a MODEL (see :mod:`hpc_elastic.models` for the protocol), reads its tensor sizes
(skew, Tiresias §3.3), searches the memory limit x^o (LB-BSP §3.3.1(4)), times one training step at each
batch size to get Γ(x) and throughput C (LB-BSP §3.1), fits Γ (:mod:`hpc_elastic.profile.curve`) and
returns a validated :class:`~hpc_elastic.profile.schema.Profile`.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import gc
import importlib
import importlib.util
import math
import multiprocessing
import os
import platform
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from hpc_elastic import __version__
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.profile.curve import fit_gamma, summarize_repeats
from hpc_elastic.profile.memory import find_memory_limit, format_size
from hpc_elastic.profile.options import DeviceSpec, auto_batch_sizes, parse_model_spec
from hpc_elastic.profile.schema import (
    NAME_PATTERN,
    CurvePoint,
    DeviceInfo,
    DeviceKind,
    GammaFitInfo,
    Measurement,
    MemoryLimitInfo,
    MemoryMethod,
    MemoryProbe,
    ModelInfo,
    Profile,
    ShardSkew,
    StepClock,
    TensorInfo,
    slugify,
)
from hpc_elastic.profile.skew import DEFAULT_SHARD_COUNTS, largest_tensor_share, shard_skews

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZER = "sgd(lr=0.001, momentum=0.9)"
DEFAULT_CPU_CAP_FRACTION = 0.5  # of the host memory available when profiling starts
SAMPLE_INTERVAL_S = 0.002
MEMORY_RESOLUTION = 1 / 32  # bisection stops within ~3 %: the peak RSS of one step varies by a few % run to run

Progress = Callable[[str, int, int | None], None]
"""``progress(description, completed, total)``; total None while unknown (memory search)."""


class ProfileRunError(HpcElasticError):
    """The model cannot be loaded or profiled as asked."""


@dataclass(frozen=True)
class ProfileRequest:
    """Everything ``hpc-elastic profile run`` was asked to do."""

    model_spec: str
    device: DeviceSpec = field(default_factory=lambda: DeviceSpec(DeviceKind.CPU))
    batch_sizes: tuple[int, ...] | None = None  # None: powers of two up to min(x^o, max_batch)
    iters: int = 3
    warmup: int = 2
    repeats: int = 5
    max_batch: int = 1024
    memory_cap_bytes: int | None = None  # None: half the available host memory (CPU), all of it (GPU)
    measure_memory: bool = True
    shard_counts: tuple[int, ...] = DEFAULT_SHARD_COUNTS
    name: str | None = None
    device_type: str | None = None
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None: torch's default (one per core)
    clock: StepClock = StepClock.WALL

    def __post_init__(self) -> None:
        for label, value, low in (
            ("iters", self.iters, 1),
            ("warmup", self.warmup, 0),
            ("repeats", self.repeats, 1),
            ("max_batch", self.max_batch, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes < 1:
            raise ValueError(f"memory cap must be positive, got {self.memory_cap_bytes!r}")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"batch sizes must be positive integers, got {self.batch_sizes!r}")
        if self.name is not None and not re.match(NAME_PATTERN, self.name):
            raise ValueError(f"a profile name takes letters, digits, _ . + - and one @, got {self.name!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if self.clock is StepClock.PROCESS and self.device.kind is DeviceKind.CUDA:
            raise ValueError("--clock process times CPU work; a CUDA profile needs the wall clock")
        if not self.shard_counts or min(self.shard_counts) < 1:
            raise ValueError(f"shard counts must be positive integers, got {self.shard_counts!r}")


@dataclass
class LoadedModel:
    """A MODEL after calling its factory."""

    spec: str
    name: str
    module: nn.Module
    sample_batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Any] | None


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise ProfileRunError("profiling needs torch: pip install 'hpc-elastic[torch]'") from None


def _import_script(path_text: str, spec: str) -> Any:
    """Import a training script from its file as ``_hpc_elastic_script_<stem>`` (not ``__main__``).

    Its directory goes first on ``sys.path``, as when Python runs the script, so sibling modules import.
    """
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ProfileRunError(f"MODEL {spec!r}: no script file {path}")
    name = "_hpc_elastic_script_" + re.sub(r"\W", "_", path.stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ProfileRunError(f"MODEL {spec!r}: cannot import {path} as Python")
    module = importlib.util.module_from_spec(module_spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:  # the script is user code (SystemExit included): report it in one line
        del sys.modules[name]
        raise ProfileRunError(
            f"cannot import script {path_text!r} of MODEL {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    return module


def load_model(spec: str) -> LoadedModel:
    """Import MODEL (``package.module:factory`` or ``train.py[:factory]``), call the factory and check what
    it returns (the MODEL protocol of :mod:`hpc_elastic.models`)."""
    parsed = parse_model_spec(spec)
    factory_name = parsed.factory
    torch = _torch()
    if parsed.script is not None:
        module = _import_script(parsed.script, spec)
        module_path = parsed.script
    else:
        module_path = cast("str", parsed.module)
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:  # ImportError, or whatever the module raises while it is imported
            raise ProfileRunError(
                f"cannot import module {module_path!r} of MODEL {spec!r}: {type(exc).__name__}: {exc}"
            ) from None
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        raise ProfileRunError(f"module {module_path!r} has no callable {factory_name!r} (MODEL {spec!r})")
    try:
        bundle = factory()
    except Exception as exc:  # the factory is user code: report it in one line
        raise ProfileRunError(f"MODEL {spec!r}: calling {factory_name}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(bundle, tuple) or len(bundle) not in (2, 3):
        raise ProfileRunError(
            f"MODEL {spec!r} must return (module, sample_batch) or (module, sample_batch, loss_fn), "
            f"got {type(bundle).__name__}"
        )
    net, sample_batch = bundle[0], bundle[1]
    loss_fn = bundle[2] if len(bundle) == 3 else None
    if not isinstance(net, torch.nn.Module):
        raise ProfileRunError(f"MODEL {spec!r} returned {type(net).__name__} where a torch.nn.Module belongs")
    if not callable(sample_batch) or (loss_fn is not None and not callable(loss_fn)):
        raise ProfileRunError(f"MODEL {spec!r}: sample_batch and loss_fn must be callables")
    return LoadedModel(spec, parsed.name, net, sample_batch, loss_fn)


def tensor_infos(module: nn.Module) -> list[TensorInfo]:
    """Trainable parameter tensors in model order: what a parameter server holds and exchanges."""
    return [
        TensorInfo(name=name, shape=list(param.shape), bytes=param.numel() * param.element_size())
        for name, param in module.named_parameters()
        if param.requires_grad
    ]


def model_info(spec: str, name: str, module: nn.Module, shard_counts: Sequence[int]) -> ModelInfo:
    """Tensor sizes and skew (Tiresias §3.3) of ``module``."""
    tensors = tensor_infos(module)
    if not tensors:
        raise ProfileRunError(f"MODEL {spec!r} has no trainable parameters")
    sizes = [tensor.bytes for tensor in tensors]
    skews = shard_skews(sizes, shard_counts)
    return ModelInfo(
        spec=spec,
        name=name,
        num_parameters=sum(math.prod(tensor.shape) for tensor in tensors),
        parameter_bytes=sum(sizes),
        tensors=tensors,
        largest_tensor_share=largest_tensor_share(sizes),
        shard_skew=[ShardSkew(shards=k, skew=v) for k, v in skews.items()],
    )


# --- memory meters ---------------------------------------------------------------------------------------


class PeakMeter(Protocol):
    """Peak memory of the code run between :meth:`start` and :meth:`stop`."""

    method: MemoryMethod

    def start(self) -> None: ...

    def stop(self) -> int: ...


def _psutil() -> Any:
    try:
        return importlib.import_module("psutil")
    except ImportError:
        raise ProfileRunError("measuring memory on CPU needs psutil: pip install psutil") from None


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so an earlier larger batch does not inflate RSS."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim(0)


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _kernel_hwm() -> int | None:
    with contextlib.suppress(OSError):
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    return None


class RssPeakMeter:
    """Peak RSS of this process (psutil), exact on Linux through the kernel's resettable VmHWM.

    On Linux, writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark VmHWM to the current RSS,
    so VmHWM after the step is its exact peak. Elsewhere a thread samples ``psutil`` RSS every 2 ms.
    """

    method = MemoryMethod.RSS

    def __init__(self) -> None:
        self._process = _psutil().Process()
        self._kernel = False
        try:
            _CLEAR_REFS.write_text("5")
            self._kernel = _kernel_hwm() is not None
        except OSError:
            self._kernel = False
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self._peak = max(self._peak, self._rss())

    def start(self) -> None:
        gc.collect()
        _malloc_trim()
        self._peak = self._rss()
        if self._kernel:
            _CLEAR_REFS.write_text("5")
        else:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        peak = max(self._peak, self._rss())
        if self._kernel:
            peak = max(peak, _kernel_hwm() or 0)
        return peak


class CudaPeakMeter:
    """Peak memory reserved by torch's CUDA caching allocator on one device."""

    method = MemoryMethod.CUDA_PEAK

    def __init__(self, device: torch.device) -> None:
        self._torch = _torch()
        self._device = device

    def start(self) -> None:
        gc.collect()
        self._torch.cuda.synchronize(self._device)
        self._torch.cuda.empty_cache()
        self._torch.cuda.reset_peak_memory_stats(self._device)

    def stop(self) -> int:
        self._torch.cuda.synchronize(self._device)
        return int(self._torch.cuda.max_memory_reserved(self._device))


# --- the training step ---------------------------------------------------------------------------------


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, tuple | list):
        return tuple(_move(item, device) for item in value)
    return value.to(device)


class StepRunner:
    """One training step of a MODEL on a device: forward, loss, backward, optimizer step (LB-BSP §3.1)."""

    def __init__(self, loaded: LoadedModel, device: torch.device, seed: int) -> None:
        self._torch = _torch()
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


def _is_oom(exc: BaseException, torch: Any) -> bool:
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


StepPeak = Callable[[int], int | None]
"""Peak memory in bytes of one training step at a batch size, or None when it ran out of memory."""


def in_process_step_peak(runner: StepRunner, meter: PeakMeter) -> StepPeak:
    """Peak of one step measured in this process: right for CUDA, whose peak statistics reset exactly."""
    torch = _torch()

    def peak_of(batch_size: int) -> int | None:
        runner.restore()
        meter.start()
        try:
            inputs, targets = runner.batch(batch_size)
            runner.step(inputs, targets)
            runner.sync()
            del inputs, targets
        except Exception as exc:
            if not _is_oom(exc, torch):
                raise
            meter.stop()
            runner.restore()
            gc.collect()
            if runner.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        return meter.stop()

    return peak_of


def _child_step_peak(spec: str, seed: int, batch_size: int, threads: int | None = None) -> int | None:
    """Run in a fresh process: peak RSS of one CPU step at ``batch_size`` after a first step at batch 1."""
    torch = _torch()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    runner = StepRunner(load_model(spec), torch.device("cpu"), seed)
    runner.step(*runner.batch(1))
    meter = RssPeakMeter()
    meter.start()
    try:
        runner.step(*runner.batch(batch_size))
    except Exception as exc:
        if _is_oom(exc, torch):
            return None
        raise
    return meter.stop()


def _child_entry(connection: Any, spec: str, seed: int, batch_size: int, threads: int | None) -> None:
    try:
        connection.send(("ok", _child_step_peak(spec, seed, batch_size, threads)))
    except BaseException as exc:  # report everything to the parent, in one line
        connection.send(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
    finally:
        connection.close()


class ChildProcessStepPeak:
    """Peak RSS of one CPU step, each probe in a fresh process.

    In one long-lived process the C allocator keeps memory freed by an earlier, larger batch, so the RSS of a
    later probe depends on the probes before it. A fresh process per probe (forked from a server that has
    already imported torch, so a probe costs the step and torch's first-operation set-up, not an import)
    measures each batch size from the same baseline. A probe killed by SIGKILL (the kernel's OOM killer, or
    a Slurm memory cgroup) counts as not fitting. As with any multiprocessing code, a script that calls this
    must guard its main module with ``if __name__ == "__main__":``.
    """

    def __init__(self, spec: str, seed: int, threads: int | None = None) -> None:
        methods = multiprocessing.get_all_start_methods()
        self._context: Any = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            parsed = parse_model_spec(spec)
            # torch.optim imports torch._dynamo on first use (over a second): preload it once in the server.
            # A script is imported by file in each probe (it is no importable module name).
            preload = ["torch", "torch._dynamo", __name__]
            self._context.set_forkserver_preload(preload if parsed.module is None else [*preload, parsed.module])
        self._spec = spec
        self._seed = seed
        self._threads = threads

    def __call__(self, batch_size: int) -> int | None:
        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_child_entry, args=(sender, self._spec, self._seed, batch_size, self._threads), daemon=True
        )
        process.start()
        sender.close()
        try:
            result = receiver.recv()
        except EOFError:
            result = None
        finally:
            process.join()
            receiver.close()
        if result is None:
            if process.exitcode == -signal.SIGKILL:
                return None
            raise ProfileRunError(f"memory probe at batch {batch_size} died with exit code {process.exitcode}")
        kind, value = result
        if kind != "ok":
            raise ProfileRunError(f"memory probe at batch {batch_size} failed: {value}")
        return None if value is None else int(value)


def fits_under(step_peak: StepPeak, cap_bytes: int, peaks: dict[int, int | None]) -> Callable[[int], bool]:
    """The "does batch x fit" predicate for :func:`find_memory_limit`: no OOM and peak <= ``cap_bytes``."""

    def fits(batch_size: int) -> bool:
        peak = step_peak(batch_size)
        peaks[batch_size] = peak
        return peak is not None and peak <= cap_bytes

    return fits


# --- device identity -------------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return " ".join(line.split(":", 1)[1].split())
    return platform.processor() or platform.machine() or "unknown cpu"


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_identity(torch: Any, index: int) -> tuple[str | None, int | None, str | None]:
    """(name, total memory, driver version) from pynvml, or Nones when pynvml is missing or fails."""
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return None, None, None
    try:
        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            name = pynvml.nvmlDeviceGetName(handle)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            driver = pynvml.nvmlSystemGetDriverVersion()
            return _text(name), memory, _text(driver)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml is optional: any NVML failure falls back to torch's view
        return None, None, None


def identify_device(device: DeviceSpec, device_type: str | None) -> DeviceInfo:
    """CPU model and cores, or GPU name and memory (pynvml when installed, else torch)."""
    torch = _torch()
    cpu = _cpu_model()
    common: dict[str, Any] = {
        "cpu_model": cpu,
        "cpu_count": _cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node() or "unknown",
        "torch_version": str(torch.__version__),
    }
    if device.kind is DeviceKind.CPU:
        memory = int(_psutil().virtual_memory().total)
        return DeviceInfo(
            kind=DeviceKind.CPU,
            type=slugify(device_type) if device_type else slugify(f"cpu {cpu}"),
            name=cpu,
            memory_bytes=memory,
            **common,
        )
    index = device.index or 0
    properties = torch.cuda.get_device_properties(index)
    name, memory_total, driver = _nvml_identity(torch, index)
    gpu_name = name or str(properties.name)
    return DeviceInfo(
        kind=DeviceKind.CUDA,
        type=slugify(device_type) if device_type else slugify(gpu_name),
        name=gpu_name,
        index=index,
        memory_bytes=memory_total or int(properties.total_memory),
        cuda_version=torch.version.cuda,
        driver_version=driver,
        **common,
    )


# --- the whole run ---------------------------------------------------------------------------------------


def _resolve_device(request: ProfileRequest) -> torch.device:
    lib = _torch()
    if request.device.kind is DeviceKind.CUDA:
        if not lib.cuda.is_available():
            raise ProfileRunError(f"device {request.device.torch_name} asked for, but torch sees no CUDA device")
        if (request.device.index or 0) >= lib.cuda.device_count():
            raise ProfileRunError(
                f"device {request.device.torch_name} asked for, but torch sees {lib.cuda.device_count()} GPU(s)"
            )
    return cast("torch.device", lib.device(request.device.torch_name))


def _load_average() -> float | None:
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0]
    return None


def _default_cap(device_info: DeviceInfo) -> int:
    if device_info.kind is DeviceKind.CPU:
        return int(_psutil().virtual_memory().available * DEFAULT_CPU_CAP_FRACTION)
    if device_info.memory_bytes is None:
        raise ProfileRunError("cannot tell the GPU's memory size; give --memory-cap")
    return device_info.memory_bytes


def run_profile(request: ProfileRequest, progress: Progress | None = None) -> Profile:
    """Measure a profile as ``request`` says (see the module docstring)."""
    report: Progress = progress or (lambda description, done, total: None)
    began = time.perf_counter()
    load_start = _load_average()
    torch = _torch()
    if request.threads is not None:
        # On a shared host, fewer threads than cores avoids OpenMP barriers waiting on descheduled threads.
        torch.set_num_threads(request.threads)
    device = _resolve_device(request)
    torch.manual_seed(request.seed)
    loaded = load_model(request.model_spec)
    info = model_info(request.model_spec, loaded.name, loaded.module, request.shard_counts)
    device_info = identify_device(request.device, request.device_type)
    meter: PeakMeter = CudaPeakMeter(device) if device.type == "cuda" else RssPeakMeter()
    runner = StepRunner(loaded, device, request.seed)
    runner.step(*runner.batch(1))  # creates the momentum buffers, so every probe sees the same state
    runner.sync()
    runner.snapshot()

    memory_limit: MemoryLimitInfo | None = None
    limit_batch = request.max_batch
    if request.measure_memory:
        cap = request.memory_cap_bytes or _default_cap(device_info)
        if device_info.kind is DeviceKind.CPU and device_info.memory_bytes and cap > device_info.memory_bytes:
            raise ValueError(
                f"memory cap {format_size(cap)} is above this host's memory {format_size(device_info.memory_bytes)}"
            )
        peaks: dict[int, int | None] = {}
        step_peak: StepPeak
        if device.type == "cuda":
            step_peak = in_process_step_peak(runner, meter)
        else:
            step_peak = ChildProcessStepPeak(request.model_spec, request.seed, request.threads)
        fits = fits_under(step_peak, cap, peaks)
        probes_done = 0

        def counted(batch_size: int) -> bool:
            nonlocal probes_done
            report(f"memory limit: batch {batch_size}", probes_done, None)
            fitted = fits(batch_size)
            probes_done += 1
            return fitted

        search = find_memory_limit(counted, max_batch=request.max_batch, resolution=MEMORY_RESOLUTION)
        memory_limit = MemoryLimitInfo(
            batch_size=search.limit,
            capped=search.capped,
            max_batch=search.max_batch,
            first_failing_batch=search.first_failing,
            cap_bytes=cap,
            method=meter.method,
            probes=[MemoryProbe(batch_size=b, fits=f, peak_bytes=peaks.get(b)) for b, f in search.probes],
        )
        if search.limit is None:
            raise ProfileRunError(
                f"MODEL {request.model_spec!r}: not even batch 1 fits under the memory cap {format_size(cap)}"
            )
        limit_batch = search.limit

    sizes = request.batch_sizes if request.batch_sizes is not None else auto_batch_sizes(limit_batch)
    sizes = tuple(size for size in sizes if size <= limit_batch) if request.measure_memory else sizes
    if not sizes:
        raise ProfileRunError(
            f"every batch size asked for is above the memory limit x^o = {limit_batch}; ask for smaller ones"
        )
    points = measure_curve(
        runner,
        sorted(sizes),
        warmup=request.warmup,
        iters=request.iters,
        repeats=request.repeats,
        meter=meter,
        progress=report,
        clock=request.clock,
    )

    gamma: GammaFitInfo | None = None
    if len(points) >= 2:
        fit = fit_gamma([(point.batch_size, point.step_time_s) for point in points])
        gamma = GammaFitInfo(
            launch_overhead_s=fit.launch_overhead_s,
            flat_time_s=fit.flat_time_s,
            per_sample_s=fit.per_sample_s,
            saturation_batch=fit.saturation_batch,
            rms_relative_error=fit.rms_relative_error,
        )
    name = request.name or f"{info.name}@{device_info.type}"
    return Profile(
        schema_version=1,
        name=name,
        model=info,
        device=device_info,
        measurement=Measurement(
            created_at=datetime.now(UTC),
            hpc_elastic_version=__version__,
            warmup=request.warmup,
            iters=request.iters,
            repeats=request.repeats,
            optimizer=OPTIMIZER,
            seed=request.seed,
            clock=request.clock,
            duration_s=time.perf_counter() - began,
            load_average_start=load_start,
            load_average_end=_load_average(),
        ),
        points=points,
        gamma=gamma,
        memory_limit=memory_limit,
    )
