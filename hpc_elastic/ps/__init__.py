"""PS mode: asynchronous parameter-server training of recommendation models on CPU partitions (DLRover's Elastic
Trainer): the job master's Data Shard Manager (:mod:`hpc_elastic.ps.shards`), the transport, parameter servers and
workers as processes."""
