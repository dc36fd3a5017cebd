"""Pure scheduling policies (Tiresias, NSDI'19, and baselines): typed data in, decisions out.

Nothing in this package runs a command, reads a clock, an environment variable or a file.

Typical use (a daemon or the simulator)::

    from hpc_elastic.policy import ClusterState, JobTable, PassInput, make_policy

    policy = make_policy("tiresias-las")
    cluster = ClusterState.from_nodes(nodes)            # NodeView per node
    decision = policy.schedule(PassInput(now, JobTable.from_views(jobs, cluster), cluster))
    decision.starts, decision.preemptions, decision.queue_changes, decision.next_wakeup
"""

from hpc_elastic.policy.gittins import GittinsTable, ServiceDistribution, gittins_index, gittins_index_sup
from hpc_elastic.policy.mlfq import DEFAULT_THRESHOLDS, MlfqConfig, mlfq_update
from hpc_elastic.policy.placement import (
    DEFAULT_PACK_LIMIT,
    FreeIndex,
    PlacementSample,
    fit_pack_limit,
)
from hpc_elastic.policy.policies import (
    DEFAULT_MAX_AGE,
    DEFAULT_MIN_HISTORY,
    DEFAULT_TIME_SLICE,
    DeltaMode,
    Fifo,
    FifoSkip,
    Gandiva,
    Policy,
    PolicyOptions,
    QueueOrder,
    SlurmBackfill,
    Srsf,
    Srtf,
    TiresiasGittins,
    TiresiasLas,
    TiresiasLasElastic,
)
from hpc_elastic.policy.registry import POLICY_NAMES, PolicyFactory, make_policy, policy_names
from hpc_elastic.policy.types import (
    ClusterState,
    Decision,
    JobStatus,
    JobTable,
    JobView,
    NodeView,
    PassInput,
    PlacementMode,
    Preemption,
    QueueChange,
    QueueChangeKind,
    ScalingCurve,
    SizeChange,
    Start,
)

__all__ = [
    "DEFAULT_MAX_AGE",
    "DEFAULT_MIN_HISTORY",
    "DEFAULT_PACK_LIMIT",
    "DEFAULT_THRESHOLDS",
    "DEFAULT_TIME_SLICE",
    "POLICY_NAMES",
    "ClusterState",
    "Decision",
    "DeltaMode",
    "Fifo",
    "FifoSkip",
    "FreeIndex",
    "Gandiva",
    "GittinsTable",
    "JobStatus",
    "JobTable",
    "JobView",
    "MlfqConfig",
    "NodeView",
    "PassInput",
    "PlacementMode",
    "PlacementSample",
    "Policy",
    "PolicyFactory",
    "PolicyOptions",
    "Preemption",
    "QueueChange",
    "QueueChangeKind",
    "QueueOrder",
    "ScalingCurve",
    "ServiceDistribution",
    "SizeChange",
    "SlurmBackfill",
    "Srsf",
    "Srtf",
    "Start",
    "TiresiasGittins",
    "TiresiasLas",
    "TiresiasLasElastic",
    "fit_pack_limit",
    "gittins_index",
    "gittins_index_sup",
    "make_policy",
    "mlfq_update",
    "policy_names",
]
