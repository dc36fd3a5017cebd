"""Trace-driven simulation of a GPU cluster under the policies of :mod:`hpc_elastic.policy`.

- :mod:`hpc_elastic.sim.trace`: loaders for Tiresias, Pollux, Alibaba openb and Philly-style traces;
- :mod:`hpc_elastic.sim.cluster`: ``NxG`` clusters and node files;
- :mod:`hpc_elastic.sim.engine`: the discrete-event simulator;
- :mod:`hpc_elastic.sim.metrics`: JCT / queueing / makespan / preemption / utilisation summary;
- :mod:`hpc_elastic.sim.bounds`: lower bounds on a trace's average JCT that no policy goes below;
- :mod:`hpc_elastic.sim.synth`: synthetic traces resampled from the shared ones (scale tests).
- :mod:`hpc_elastic.sim.ps_jobs` and :mod:`hpc_elastic.sim.slots`: parameter-server jobs in time slots (DL²'s
  model): the job catalogue, synthetic workloads and the slotted simulator.
"""

from hpc_elastic.sim.cluster import NodeSpec, load_cluster_file, parse_cluster_spec
from hpc_elastic.sim.engine import EventKind, SimConfig, SimEvent, SimResult, Simulator
from hpc_elastic.sim.metrics import METRIC_KEYS, summarize
from hpc_elastic.sim.trace import LoadedTrace, TraceFormat, TraceFormatError, TraceJob, load_trace

__all__ = [
    "METRIC_KEYS",
    "EventKind",
    "LoadedTrace",
    "NodeSpec",
    "SimConfig",
    "SimEvent",
    "SimResult",
    "Simulator",
    "TraceFormat",
    "TraceFormatError",
    "TraceJob",
    "load_cluster_file",
    "load_trace",
    "parse_cluster_spec",
    "summarize",
]
