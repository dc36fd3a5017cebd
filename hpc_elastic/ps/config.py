"""The configuration of one PS-mode job: sizes of the data, the model, the shards and the processes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from hpc_elastic.files import loads_json
from hpc_elastic.policy.brain import DEFAULT_HOT_THRESHOLD
from hpc_elastic.ps.data import CriteoSpec
from hpc_elastic.ps.model import ModelSpec
from hpc_elastic.ps.shards import ShardConfig

#: memory of a PS job's process per CPU it holds, in MB: each job step asks for this much, the batch job as much
STEP_MEM_MB_PER_CPU = 1024


def settings_object(text: str, what: str) -> dict[str, Any]:
    """``text`` as a JSON object (a PS job's settings); ``ValueError`` naming ``what`` otherwise."""
    data = loads_json(text, what)
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, not {text!r}")
    return data


#: the most parameter servers, or workers, one PS-mode job runs
MAX_PROCESSES = 4096
#: the largest value of an integer setting (numpy's int64 holds it)
MAX_SETTING = 1 << 62


@dataclass(frozen=True)
class PsJobConfig:
    num_ps: int = 2
    num_workers: int = 3
    num_samples: int = 4096
    shard_size: int = 128
    batch_size: int = 64
    epochs: int = 1
    seed: int = 0
    vocab: int = 1000
    dim: int = 8
    lr: float = 0.05
    max_retries: int = 3
    # shards a worker holds at most (leased, not reported done): its cap starts at start_hold and follows it up to
    # max_hold (hpc_elastic.ps.shards)
    max_hold: int = 256
    start_hold: int = 16
    hold_seconds: float = 0.25  # seconds of work at its speed a worker holds at most (and reports after)
    # MiB a worker adds to its resident set once it finished its first shard (a worker whose embedding cache grows
    # as it trains): the knob that makes a worker outgrow its step's memory, to exercise the out-of-memory path
    worker_ballast_mb: int = 0
    # the share of its cores a PS uses at which Brain's adjust calls it hot and replaces it by a larger one
    # (DLRover's ``optimizer.ps.cpu.hot-threshold``)
    hot_threshold: float = DEFAULT_HOT_THRESHOLD

    def __post_init__(self) -> None:
        minimum = {"num_ps": 1, "num_workers": 0, "seed": 0, "max_retries": 0, "worker_ballast_mb": 0}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "hot_threshold":
                if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                    raise ValueError(f"hot_threshold must be a number in (0, 1], not {value!r}")
                continue
            if f.name == "hold_seconds":
                continue  # the Shard Manager's configuration checks it
            if f.name == "lr":
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise ValueError(f"lr must be a positive number, not {value!r}")
                if value <= 0:
                    raise ValueError(f"lr must be a positive number, not {value!r}")
                continue
            low = minimum.get(f.name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{f.name} must be an integer >= {low}, not {value!r}")
            high = MAX_PROCESSES if f.name in {"num_ps", "num_workers"} else MAX_SETTING
            if value > high:
                raise ValueError(f"{f.name} must be at most {high:,}, not {value!r}")
        self.shards()  # its own checks

    def shards(self) -> ShardConfig:
        return ShardConfig(
            num_samples=self.num_samples,
            shard_size=self.shard_size,
            epochs=self.epochs,
            seed=self.seed,
            max_retries=self.max_retries,
            max_hold=self.max_hold,
            start_hold=self.start_hold,
            hold_seconds=self.hold_seconds,
        )

    def criteo(self) -> CriteoSpec:
        return CriteoSpec(num_samples=self.num_samples, vocab=self.vocab, seed=self.seed)

    def model(self) -> ModelSpec:
        return ModelSpec(dim=self.dim, seed=self.seed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PsJobConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown PS job settings: {sorted(unknown)}")
        return cls(**data)
