"""PS mode: asynchronous parameter-server training of recommendation models on CPU partitions (DLRover's Elastic
Trainer). The job master's Data Shard Manager and per-sample ledger (:mod:`~hpc_elastic.ps.shards`), the gRPC
transport and its messages (:mod:`~hpc_elastic.ps.rpc`, :mod:`~hpc_elastic.ps.wire`), the synthetic Criteo-like data
(:mod:`~hpc_elastic.ps.data`), Wide & Deep's parameters (:mod:`~hpc_elastic.ps.model`), the processes
(:mod:`~hpc_elastic.ps.server`, :mod:`~hpc_elastic.ps.master`, :mod:`~hpc_elastic.ps.worker`), the job's checkpoint
(:mod:`~hpc_elastic.ps.checkpoint`) and the launcher (:mod:`~hpc_elastic.ps.job`, ``python -m hpc_elastic.ps``)."""
