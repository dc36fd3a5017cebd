"""DL²'s model file: the networks' weights, the :class:`StateSpec`, the training configuration and curve, in one
file written atomically and checked on load.

Layout (little endian)::

    MAGIC (16 bytes) | header length (8 bytes) | header (UTF-8 JSON) | tensors (raw float32) | sha256 (32 bytes)

The header holds the format version, the spec, the training configuration, the supervised report, the curve, and
for every tensor its name, shape and byte offset in the tensor section. The final sha256 covers everything before
it. Nothing is unpickled: a file is JSON and raw numbers, so a corrupt or foreign file can only be refused
(``ValueError`` saying why), never run. Reading needs no torch: a daemon gets the policy network from
:meth:`ModelFile.network` (numpy and the package's C extension).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hpc_elastic.files import atomic_write_bytes, loads_json, read_input
from hpc_elastic.policy.dl2 import Dl2Policy, Layers, Network, StateSpec
from hpc_elastic.policy.slot_registry import SlotPolicyFactory

MAGIC = b"HPC-ELASTIC-DL2\n"
VERSION = 1
#: a model file larger than this is refused before it is read
MAX_BYTES = 1 << 30
_DIGEST = 32
_LENGTH = struct.Struct("<Q")

Arrays = Mapping[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class ModelFile:
    """A loaded model: its spec, training metadata and weights (numpy, by the torch parameter names)."""

    spec: StateSpec
    config: dict[str, Any]
    meta: dict[str, Any]
    arrays: dict[str, npt.NDArray[np.float32]]

    def layers(self, prefix: str) -> Layers:
        """The (weight, bias) pairs of the linear layers under ``prefix`` (e.g. ``policy.layers``), in order."""
        pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.weight$")
        indexes = sorted(int(m.group(1)) for name in self.arrays if (m := pattern.match(name)))
        out: Layers = []
        for k in indexes:
            weight, bias = self.arrays[f"{prefix}.{k}.weight"], self.arrays.get(f"{prefix}.{k}.bias")
            if bias is None:
                raise ValueError(f"model file: {prefix}.{k} has a weight and no bias")
            if weight.ndim != 2 or bias.shape != weight.shape[:1]:
                raise ValueError(
                    f"model file: {prefix}.{k} is not a linear layer (weight {weight.shape}, bias {bias.shape})"
                )
            out.append((weight, bias))
        return out

    def network(self) -> Network:
        """The policy network for inference (checked against the spec's sizes)."""
        layers = self.layers("policy.layers")
        if not layers:
            raise ValueError("model file: no policy network")
        if layers[0][0].shape[1] != self.spec.state_size or layers[-1][0].shape[0] != self.spec.action_size:
            raise ValueError(
                f"model file: policy network {layers[0][0].shape[1]} -> {layers[-1][0].shape[0]} does not fit the "
                f"spec's {self.spec.state_size} -> {self.spec.action_size}"
            )
        rows = self.layers("policy.rows")
        if rows and (rows[0][0].shape[1] != self.spec.columns + 1 or rows[-1][0].shape[0] != 3):
            raise ValueError(
                f"model file: the per-job head ({rows[0][0].shape[1]} inputs, {rows[-1][0].shape[0]} outputs) does not"
                f" fit the spec ({self.spec.columns + 1} inputs, 3 outputs)"
            )
        try:
            return Network(layers, rows, self.spec.columns)
        except ValueError as exc:
            raise ValueError(f"model file: {exc}") from None


def _clean(value: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def encode(spec: StateSpec, config: Mapping[str, Any], meta: Mapping[str, Any], arrays: Arrays) -> bytes:
    """The file's bytes (deterministic: the same inputs give the same bytes)."""
    tensors = []
    chunks = []
    offset = 0
    for name in sorted(arrays):
        data = np.ascontiguousarray(arrays[name], dtype="<f4")
        raw = data.tobytes()
        tensors.append({"name": name, "shape": list(data.shape), "offset": offset, "nbytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    header = {
        "format": "hpc-elastic-dl2",
        "version": VERSION,
        "spec": spec.to_dict(),
        "config": _clean(dict(config)),
        "meta": _clean(dict(meta)),
        "tensors": tensors,
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    body = MAGIC + _LENGTH.pack(len(head)) + head + b"".join(chunks)
    return body + hashlib.sha256(body).digest()


def save(path: Path, spec: StateSpec, config: Mapping[str, Any], meta: Mapping[str, Any], arrays: Arrays) -> None:
    """Write the model to ``path`` atomically (temporary file, fsync, rename)."""
    atomic_write_bytes(path, encode(spec, config, meta, arrays))


def decode(data: bytes, where: str = "model file") -> ModelFile:
    """Parse and check a model file's bytes; ``ValueError`` naming what is wrong."""
    if not data.startswith(MAGIC):
        raise ValueError(f"{where}: not a DL² model file (no {MAGIC[:-1].decode()} header)")
    if len(data) < len(MAGIC) + _LENGTH.size + _DIGEST:
        raise ValueError(f"{where}: truncated")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError(f"{where}: checksum mismatch (corrupt or truncated)")
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if start + length > len(body):
        raise ValueError(f"{where}: header length {length} beyond the file")
    header = loads_json(body[start : start + length], f"{where}: the header")
    if not isinstance(header, dict) or header.get("format") != "hpc-elastic-dl2":
        raise ValueError(f"{where}: not a DL² model file")
    if header.get("version") != VERSION:
        raise ValueError(f"{where}: format version {header.get('version')!r}, this reads version {VERSION}")
    spec_raw, config, meta, tensors = (header.get(k) for k in ("spec", "config", "meta", "tensors"))
    if not isinstance(spec_raw, dict) or not isinstance(config, dict) or not isinstance(meta, dict):
        raise ValueError(f"{where}: header lacks its spec, config or meta")
    if not isinstance(tensors, list):
        raise ValueError(f"{where}: header lacks its tensor table")
    spec = StateSpec.from_dict(spec_raw)
    payload = memoryview(body)[start + length :]
    arrays: dict[str, npt.NDArray[np.float32]] = {}
    for entry in tensors:
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: malformed tensor entry {entry!r}")
        name, shape, offset, nbytes = (entry.get(k) for k in ("name", "shape", "offset", "nbytes"))
        if (
            not isinstance(name, str)
            or not isinstance(shape, list)
            or not all(isinstance(n, int) and n >= 0 for n in shape)
            or not isinstance(offset, int)
            or not isinstance(nbytes, int)
        ):
            raise ValueError(f"{where}: malformed tensor entry {entry!r}")
        if nbytes != 4 * math.prod(shape) or offset < 0 or offset + nbytes > len(payload):
            raise ValueError(f"{where}: tensor {name!r} does not fit the file")
        flat = np.frombuffer(payload[offset : offset + nbytes], dtype="<f4")
        if not np.isfinite(flat).all():  # a network with NaN or infinite weights decides nothing sound
            raise ValueError(f"{where}: tensor {name!r} holds NaN or infinite values")
        arrays[name] = flat.reshape(shape).astype(np.float32)
    return ModelFile(spec, config, meta, arrays)


def load(path: Path) -> ModelFile:
    """Read and check ``path``; ``ValueError`` for a missing, oversized, corrupt or foreign file."""
    try:
        data = read_input(path, limit=MAX_BYTES)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the model file ({exc.strerror or exc})") from None
    return decode(data, str(path))


def slot_policies(path: Path) -> dict[str, SlotPolicyFactory]:
    """``{"dl2": factory}`` for :func:`~hpc_elastic.policy.slot_registry.make_slot_policy`'s ``extra``, from the
    model file at ``path`` (read and checked now: ``ValueError`` when it cannot be used)."""
    loaded = load(path)
    network = loaded.network()
    return {Dl2Policy.name: lambda: Dl2Policy(network, loaded.spec)}
