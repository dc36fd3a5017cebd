"""Types of the C extension built from ``kernels/dl2.c``."""

import numpy as np
import numpy.typing as npt

def forward(
    dims: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32],
    jobs: int,
    columns: int,
    state: npt.NDArray[np.float32],
    logits: npt.NDArray[np.float32],
) -> None: ...
def decide(
    dims: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32],
    jobs: int,
    columns: int,
    base: int,
    share_scale: float,
    tasks_scale: float,
    total_gpus: int,
    total_cpus: int,
    rows: npt.NDArray[np.float64],
    job_fields: npt.NDArray[np.int64],
    type_demands: npt.NDArray[np.int64],
    server_gpus: npt.NDArray[np.int64],
    server_cpus: npt.NDArray[np.int64],
    out: npt.NDArray[np.int64],
) -> int: ...
