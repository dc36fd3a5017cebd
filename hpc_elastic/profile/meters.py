"""Peak memory of a training step (LB-BSP §3.3.1(4): the memory limit x^o): the process's RSS on CPUs (exact on
Linux through the kernel's resettable high-water mark, each probe in a fresh process), torch's CUDA peak on GPUs."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import multiprocessing
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_elastic.profile.model import ProfileRunError, load_model, torch_module
from hpc_elastic.profile.options import parse_model_spec
from hpc_elastic.profile.schema import MemoryMethod
from hpc_elastic.profile.step import PeakMeter, StepRunner, is_oom

if TYPE_CHECKING:
    import torch

SAMPLE_INTERVAL_S = 0.002


def psutil_module() -> Any:
    """``psutil``, imported on first use; a clear error when it is not installed."""
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
        self._process = psutil_module().Process()
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
        self._torch = torch_module()
        self._device = device

    def start(self) -> None:
        gc.collect()
        self._torch.cuda.synchronize(self._device)
        self._torch.cuda.empty_cache()
        self._torch.cuda.reset_peak_memory_stats(self._device)

    def stop(self) -> int:
        self._torch.cuda.synchronize(self._device)
        return int(self._torch.cuda.max_memory_reserved(self._device))


StepPeak = Callable[[int], int | None]
"""Peak memory in bytes of one training step at a batch size, or None when it ran out of memory."""


def in_process_step_peak(runner: StepRunner, meter: PeakMeter) -> StepPeak:
    """Peak of one step measured in this process: right for CUDA, whose peak statistics reset exactly."""
    torch = torch_module()

    def peak_of(batch_size: int) -> int | None:
        runner.restore()
        meter.start()
        try:
            inputs, targets = runner.batch(batch_size)
            runner.step(inputs, targets)
            runner.sync()
            del inputs, targets
        except Exception as exc:
            if not is_oom(exc, torch):
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
    torch = torch_module()
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
        if is_oom(exc, torch):
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
            preload = ["torch", "torch._dynamo", __name__]  # this module: the probes run _child_entry
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
