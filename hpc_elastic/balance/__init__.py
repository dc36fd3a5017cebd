"""LB-BSP's load balancing: per-worker batch sizes x_i with Σ x_i = X (Chen et al., "Semi-dynamic load balancing").

- :mod:`~hpc_elastic.balance.gpu`: Alg. 2, leader/straggler steps for GPU workers (pure);
- :mod:`~hpc_elastic.balance.cpu`: Alg. 1, batch sizes from predicted speeds for CPU workers (pure, numpy), with
  the NARX model of :mod:`~hpc_elastic.balance.narx`;
- :mod:`~hpc_elastic.balance.apportion`: integer batch sizes summing to X under memory caps (pure);
- :mod:`~hpc_elastic.balance.speeds`: the observed capability C_i per device type from the processes' EST timings,
  the job's telemetry (pure);
- :mod:`~hpc_elastic.balance.aggregate`: the weighted gradient aggregation factor n·x_i/X of Eq. 7 (pure);
- :mod:`~hpc_elastic.balance.sampler`: the x_i samples of each worker, every sample once per epoch (imports torch
  through the data plan's permutation).

Importing this package loads nothing heavy.
"""
