"""Per-EST context: what an EST owns and what a context switch saves and restores (EasyScale §3.2).

Shared by all ESTs of a process (not in the context): parameters, optimizer state, CUDA context and the
data-loader workers.  Owned by one EST: the RNG states (Python ``random``, NumPy's global generator,
torch CPU and CUDA generators), the data-sampler cursor, the module buffers (BatchNorm running
statistics and any other registered buffer; §3.3 "implicit framework state") and its gradient
contribution, which the runtime deposits into the exact accumulator at the switch.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (splitmix64 chain): the same on every machine and version."""
    state = 0x9E3779B97F4A7C15
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"seed parts must be integers, got {p!r}")
        state = (state + (p & MASK64) + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        state = z ^ (z >> 31)
    return state >> 1


@dataclass
class RNGState:
    """The RNG states one EST owns, in a form ``torch.load(weights_only=True)`` accepts.

    CUDA generators are captured once CUDA is initialised.  Before that, ``cuda_seed`` stands for the
    EST's CUDA stream: :meth:`restore` seeds every CUDA generator with it (lazily, as ``torch.manual_seed``
    does), so an EST that first touches the GPU starts from its own seed, not from the previous EST's.
    """

    python: tuple[Any, ...]
    numpy: dict[str, Any]
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] = field(default_factory=list)
    cuda_seed: int | None = None

    @classmethod
    def capture(cls, previous: RNGState | None = None) -> RNGState:
        """The process's generators now; ``previous`` (the EST's state at switch-in) supplies the CUDA seed
        while CUDA is not initialised."""
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
        return cls(
            python=random.getstate(),
            numpy={
                "name": str(name),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
            torch_cpu=torch.get_rng_state(),
            torch_cuda=list(cuda),
            cuda_seed=None if cuda or previous is None else previous.cuda_seed,
        )

    def restore(self) -> None:
        random.setstate(self.python)
        n = self.numpy
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
        torch.set_rng_state(self.torch_cpu)
        if not torch.cuda.is_available():
            return
        if self.torch_cuda:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        elif self.cuda_seed is not None:
            torch.cuda.manual_seed_all(self.cuda_seed)

    @classmethod
    def seeded(cls, seed: int) -> RNGState:
        """The state every generator has right after being seeded with ``seed`` (without touching the
        process's current generators)."""
        saved = cls.capture()
        try:
            random.seed(seed)
            np.random.seed(seed % (1 << 32))
            torch.default_generator.manual_seed(seed)  # CPU only: CUDA is seeded through cuda_seed
            state = cls.capture()
            if torch.cuda.is_available() and state.torch_cuda:
                torch.cuda.manual_seed_all(seed)
                state = cls.capture()
            state.cuda_seed = seed
            return state
        finally:
            saved.restore()

    def to_state(self) -> dict[str, Any]:
        version, internal, gauss = self.python
        return {
            "python": [int(version), [int(v) for v in internal], gauss],
            "numpy": dict(self.numpy),
            "torch_cpu": self.torch_cpu,
            "torch_cuda": list(self.torch_cuda),
            "cuda_seed": self.cuda_seed,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RNGState:
        version, internal, gauss = state["python"]
        seed = state.get("cuda_seed")
        return cls(
            python=(int(version), tuple(int(v) for v in internal), gauss),
            numpy=dict(state["numpy"]),
            torch_cpu=state["torch_cpu"],
            torch_cuda=list(state["torch_cuda"]),
            cuda_seed=None if seed is None else int(seed),
        )


def est_seed(seed: int, vrank: int) -> int:
    """Seed of EST ``vrank``'s generators; a plain DDP rank ``vrank`` seeded the same way matches it."""
    return mix_seed(seed, 0x45535400, vrank)


@dataclass
class ESTContext:
    """Everything one EST owns; what a checkpoint stores per EST."""

    vrank: int
    rng: RNGState
    cursor: int = 0  # mini-batches this EST has consumed since the start of training
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def initial(cls, vrank: int, seed: int, buffers: Mapping[str, torch.Tensor]) -> ESTContext:
        return cls(
            vrank=vrank,
            rng=RNGState.seeded(est_seed(seed, vrank)),
            buffers={k: v.detach().clone() for k, v in buffers.items()},
        )

    def to_state(self) -> dict[str, Any]:
        return {
            "vrank": self.vrank,
            "rng": self.rng.to_state(),
            "cursor": self.cursor,
            "buffers": dict(self.buffers),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ESTContext:
        try:
            return cls(
                vrank=int(state["vrank"]),
                rng=RNGState.from_state(state["rng"]),
                cursor=int(state["cursor"]),
                buffers=dict(state["buffers"]),
                extra=dict(state.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed EST context: {exc!r}") from None
