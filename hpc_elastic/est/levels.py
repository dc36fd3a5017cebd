"""Determinism levels D0/D1/D2 (EasyScale §3.3, "Solutions for different levels of determinism"), without torch:
the job environment and the submit side read them; the settings themselves are :mod:`hpc_elastic.est.determinism`."""

from __future__ import annotations

from enum import StrEnum

from hpc_elastic.choices import parse_choice

CUBLAS_WORKSPACE = ":4096:8"


class DeterminismLevel(StrEnum):
    """How far a job's results are independent of the resources it runs on.

    - ``D0`` static determinism: fixed seeds, deterministic algorithms, no autotuning; identical results
      for repeated runs on the *same* number of processes (gradients summed in fp32 by the backend).
    - ``D1`` elastic determinism: D0 + constant virtual ranks for the ESTs + gradient buckets fixed by
      parameter index + the exact deterministic allreduce: identical bits for *any* number of processes.
    - ``D2`` heterogeneous determinism: D1 + hardware-agnostic operators for the layers a model uses
      (Linear, Conv2d, BatchNorm, LayerNorm, Embedding, pooling, the common activations, softmax and
      cross-entropy: :mod:`hpc_elastic.est.d2_ops`; :func:`hpc_elastic.est.d2.scan_model` says whether they
      cover a model; the optimizer's update: :mod:`hpc_elastic.est.d2_optim`): identical bits on CPU and on any
      GPU model where every operator is covered.
    """

    D0 = "d0"
    D1 = "d1"
    D2 = "d2"

    @classmethod
    def parse(cls, value: str | DeterminismLevel) -> DeterminismLevel:
        return parse_choice(cls, value, "determinism level")

    @property
    def exact_allreduce(self) -> bool:
        return self is not DeterminismLevel.D0


def child_environment() -> dict[str, str]:
    """Variables a launcher sets for the processes it starts: cuBLAS reads its workspace setting at handle
    creation, TorchInductor its determinism switch when its config is first imported."""
    return {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE, "TORCHINDUCTOR_DETERMINISTIC": "1"}
