"""What a PS-mode process uses, read by the process itself (so the same under ``srun`` on another node as here):
its CPU seconds so far, all threads together, and its peak resident memory. The job master collects them (workers
send theirs with each lease, parameter servers answer ``usage``); DLRover's Brain turns their rates into ``ŵ`` and
``ŝ`` (:mod:`hpc_elastic.ps.brain_agent`)."""

from __future__ import annotations

import resource
import time

#: ``ru_maxrss`` is in KiB on Linux
_KIB_PER_MIB = 1024


def own_usage() -> dict[str, float]:
    """``{"cpu_s": CPU seconds of this process, "rss_mb": its peak resident set in MiB}``."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"cpu_s": time.process_time(), "rss_mb": peak / _KIB_PER_MIB}
