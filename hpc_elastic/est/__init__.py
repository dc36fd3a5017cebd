"""EasyScale threads (ESTs) and the deterministic allreduce: the pieces of the one training runtime
(:class:`hpc_elastic.state.State`, built by :func:`hpc_elastic.init`; EasyScale, SC'23, §3.2-3.3).

- :mod:`~hpc_elastic.est.plan`: EST-to-process placement and gradient buckets (pure);
- :mod:`~hpc_elastic.est.context`: what an EST owns and a context switch saves and restores;
- :mod:`~hpc_elastic.est.data`: each EST's mini-batches, one shared loader per process;
- :mod:`~hpc_elastic.est.detsum`, :mod:`~hpc_elastic.est.reducer`: the exact sum of the N gradients (D1);
- :mod:`~hpc_elastic.est.comm`, :mod:`~hpc_elastic.est.exchange`: the process group and its range exchanges;
- :mod:`~hpc_elastic.est.levels`, :mod:`~hpc_elastic.est.d2`: determinism levels D0/D1/D2 and the model scanner;
- :mod:`~hpc_elastic.est.d2_math`, :mod:`~hpc_elastic.est.d2_ops`: D2's device-independent arithmetic and operators;
- :mod:`~hpc_elastic.est.checkpoint`: the checkpoint format and its fingerprint;
- :mod:`~hpc_elastic.est.example`: the bundled training script.

Importing this package loads nothing heavy; each module imports torch or the C extension itself.
"""
