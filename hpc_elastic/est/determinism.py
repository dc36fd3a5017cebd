"""The process-wide D0 settings every level includes (EasyScale §3.3): deterministic algorithms, a fixed intra-op
thread count, identical seeds."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from hpc_elastic.est.levels import CUBLAS_WORKSPACE, DeterminismLevel


def apply_determinism(level: DeterminismLevel, intra_op_threads: int = 1) -> None:
    """Process-wide D0 settings (every level includes D0).

    The intra-op thread count is fixed too: CPU reductions split their work by thread, so the same count
    must be used by every process of every configuration.
    """
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
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
