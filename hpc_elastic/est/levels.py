"""Determinism levels D0/D1/D2 (EasyScale §3.3, "Solutions for different levels of determinism")."""

from __future__ import annotations

import os
import random
import sys
from enum import StrEnum

import numpy as np

from hpc_elastic.est.choices import parse_choice

CUBLAS_WORKSPACE = ":4096:8"


class DeterminismLevel(StrEnum):
    """How far a job's results are independent of the resources it runs on.

    - ``D0`` static determinism: fixed seeds, deterministic algorithms, no autotuning; identical results
      for repeated runs on the *same* number of processes (gradients summed in fp32 by the backend).
    - ``D1`` elastic determinism: D0 + constant virtual ranks for the ESTs + gradient buckets fixed by
      parameter index + the exact deterministic allreduce: identical bits for *any* number of processes.
    - ``D2`` heterogeneous determinism: D1 + the hardware-agnostic kernels of ``kernels/`` for the
      operators a model uses (Linear today; see :func:`hpc_elastic.est.d2.scan_model`): identical bits on
      CPU and on any GPU model where every operator is covered.
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


def apply_determinism(level: DeterminismLevel, intra_op_threads: int = 1) -> None:
    """Process-wide D0 settings (every level includes D0).

    The intra-op thread count is fixed too: CPU reductions split their work by thread, so the same count
    must be used by every process of every configuration.
    """
    import torch

    DeterminismLevel.parse(level)
    if isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int) or intra_op_threads < 1:
        raise ValueError(f"intra_op_threads must be a positive integer, got {intra_op_threads!r}")
    # torch.use_deterministic_algorithms() also imports TorchInductor's config (1.5 s per process here) to
    # set its ``deterministic`` flag: set it only if something imported it already; launchers pass
    # TORCHINDUCTOR_DETERMINISTIC=1 (see child_environment) for scripts that compile later.
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True  # type: ignore[attr-defined]
    torch._C._set_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if torch.get_num_threads() != intra_op_threads:
        torch.set_num_threads(intra_op_threads)
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # cuBLAS reads it when its first handle is created; launchers also pass it to child processes.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) identically in every process (D0)."""
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
