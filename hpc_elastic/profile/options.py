"""Parsing of ``hpc-elastic profile run`` arguments (pure; no torch)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

from hpc_elastic.profile.schema import DeviceKind

_MODEL_SPEC_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)$")
_SCRIPT_SPEC_RE = re.compile(r"^(.+\.py)(?::([A-Za-z_][A-Za-z0-9_]*))?$")
_NAME_CHARS_RE = re.compile(r"[^A-Za-z0-9_.+-]+")
DEFAULT_SCRIPT_FACTORY = "profile_model"
"""The factory ``hpc-elastic profile run train.py`` calls when the script is given without ``:factory``."""
_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
AUTO = "auto"


@dataclass(frozen=True)
class DeviceSpec:
    """A device as given on the command line: ``cpu``, ``cuda`` or ``cuda:i``."""

    kind: DeviceKind
    index: int | None = None

    @property
    def torch_name(self) -> str:
        """Name for ``torch.device``."""
        if self.kind is DeviceKind.CUDA:
            return f"cuda:{self.index or 0}"
        return "cpu"


@dataclass(frozen=True)
class ModelSpec:
    """A parsed MODEL: ``package.module:factory``, or a training script ``path/to/train.py[:factory]``.

    A script is imported from its file under a private module name (never as ``__main__``), so the training
    that a script using the hpc_elastic session API runs under ``if __name__ == "__main__":`` does not start;
    the profiler only calls its factory (``profile_model`` unless named).
    """

    text: str
    factory: str
    module: str | None = None  # dotted module path (package.module:factory)
    script: str | None = None  # path of a .py file (train.py[:factory])

    @property
    def name(self) -> str:
        """Model name: the factory's name, or the script's file name when its default factory is used."""
        if self.script is not None and self.factory == DEFAULT_SCRIPT_FACTORY:
            stem = _NAME_CHARS_RE.sub("-", PurePath(self.script).stem).strip("-._+")
            return stem or self.factory
        return self.factory


def parse_model_spec(spec: str) -> ModelSpec:
    """``package.module:factory`` or ``path/to/train.py[:factory]`` → :class:`ModelSpec`."""
    text = spec.strip() if isinstance(spec, str) else spec
    if isinstance(text, str):
        match = _MODEL_SPEC_RE.match(text)
        if match is not None:
            return ModelSpec(text=text, factory=match.group(2), module=match.group(1))
        script = _SCRIPT_SPEC_RE.match(text)
        if script is not None:
            return ModelSpec(text=text, factory=script.group(2) or DEFAULT_SCRIPT_FACTORY, script=script.group(1))
    raise ValueError(
        "MODEL must be package.module:factory (for example hpc_elastic.models:mlp) or a training script "
        f"path/to/train.py[:factory], got {spec!r}"
    )


def parse_device(text: str) -> DeviceSpec:
    """``cpu``, ``cuda`` or ``cuda:i``."""
    match = _DEVICE_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"device must be cpu, cuda or cuda:INDEX, got {text!r}")
    kind = DeviceKind(match.group(1))
    if kind is DeviceKind.CPU and match.group(2) is not None:
        raise ValueError(f"the cpu device takes no index, got {text!r}")
    return DeviceSpec(kind, int(match.group(2)) if match.group(2) is not None else None)


def parse_positive_ints(text: str, what: str) -> tuple[int, ...]:
    """Comma-separated positive integers, returned sorted and without duplicates."""
    values: set[int] = set()
    for part in text.split(","):
        item = part.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"{what} must be comma-separated positive integers, got {text!r} (bad item {item!r})")
        values.add(int(item))
    return tuple(sorted(values))


def parse_batch_sizes(text: str) -> tuple[int, ...] | None:
    """``auto`` (None: powers of two up to the memory limit) or a list such as ``8,16,32``."""
    if text.strip().lower() == AUTO:
        return None
    return parse_positive_ints(text, "batch sizes")


def auto_batch_sizes(limit: int) -> tuple[int, ...]:
    """Powers of two from 1 up to ``limit``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"the largest batch size must be a positive integer, got {limit!r}")
    return tuple(1 << power for power in range(limit.bit_length()))
