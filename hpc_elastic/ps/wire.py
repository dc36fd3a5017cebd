"""The bytes of one PS-mode message: a JSON header and named numpy arrays, no pickle (a peer can only make the
receiver allocate arrays of the listed dtypes, never run code).

Layout: ``b"HPS1"``, the header's length (4 bytes, little endian), the header as UTF-8 JSON
``{"h": <header>, "a": [[name, dtype, shape], ...]}``, then the arrays' raw bytes (C order) one after the other.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from hpc_elastic.files import loads_json

MAGIC = b"HPS1"
#: the dtypes a message may carry (in this machine's byte order)
DTYPES = frozenset({"float32", "float64", "int64", "int32", "uint8"})
#: each one's name by its dtype, and its size: looked up, not recomputed, for every array of every message
_NAMES = {np.dtype(name): name for name in DTYPES}
_ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}

Arrays = dict[str, npt.NDArray[Any]]


def encode(header: Mapping[str, Any], arrays: Mapping[str, npt.NDArray[Any]] | None = None) -> bytes:
    arrays = arrays or {}
    meta = []
    for name, arr in arrays.items():
        dtype = _NAMES.get(arr.dtype)
        if dtype is None:
            raise ValueError(f"array {name!r} has dtype {arr.dtype.str} ({arr.dtype}), not one of {sorted(DTYPES)}")
        meta.append([name, dtype, list(arr.shape)])
    head = json.dumps({"h": dict(header), "a": meta}, separators=(",", ":")).encode()
    parts = [MAGIC, struct.pack("<I", len(head)), head]
    parts.extend(np.ascontiguousarray(arr).tobytes() for arr in arrays.values())
    return b"".join(parts)


def decode(data: bytes) -> tuple[dict[str, Any], Arrays]:
    """The header and the arrays (read-only views into ``data``) of a message; ValueError if it is not one."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise ValueError(f"not a PS message (bad magic {bytes(data[:4])!r})")
    (n,) = struct.unpack_from("<I", data, 4)
    try:
        doc = loads_json(data[8 : 8 + n], "a PS message header")
        header, meta = doc["h"], doc["a"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a PS message header: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(meta, list):
        raise ValueError("not a PS message header")
    arrays: Arrays = {}
    offset = 8 + n
    for name, dtype, shape in meta:
        if dtype not in DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad array {name!r}: {dtype} {shape}")
        count = math.prod(shape)
        size = count * _ITEMSIZE[dtype]
        if offset + size > len(data):
            raise ValueError(f"array {name!r} runs past the end of the message")
        arrays[str(name)] = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset += size
    if offset != len(data):
        raise ValueError("trailing bytes after the last array")
    return header, arrays
