"""Walking the state a shard holds: checking it loads with ``torch.load(weights_only=True)`` and copying it to host
memory for an asynchronous save.  No I/O.

torch is imported on first use (:func:`torch_module`): the checkpoint package is also imported by processes that
never load a shard (the wrapper, for its atomic writes), and they need not pay for torch."""

from __future__ import annotations

import collections
import importlib
from typing import Any

_SCALARS: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes)


def torch_module() -> Any:
    """``torch``, imported on first use."""
    return importlib.import_module("torch")


def _torch_leaves() -> tuple[type, ...]:
    torch = torch_module()
    return (torch.Tensor, torch.Size, torch.dtype, torch.device)


def check_loadable(obj: Any, path: str = "state") -> None:
    """Raise ``ValueError`` naming the first value of ``obj`` that ``torch.load(weights_only=True)`` would refuse.

    Accepted: tensors, ``None``/bool/int/float/complex/str/bytes, ``torch.Size``/``dtype``/``device``, and
    dicts (``OrderedDict`` too), lists, tuples and sets of those.
    """
    if isinstance(obj, _SCALARS + _torch_leaves()):
        return
    if isinstance(obj, dict):
        if type(obj) not in (dict, collections.OrderedDict):
            raise ValueError(f"{path} is a {type(obj).__qualname__}: use a plain dict for weights_only loading")
        for key, value in obj.items():
            if not isinstance(key, (*_SCALARS, tuple)):
                raise ValueError(f"{path} has a key of type {type(key).__qualname__}: {key!r}")
            check_loadable(value, f"{path}[{key!r}]")
        return
    if type(obj) in (list, tuple, set):
        for i, value in enumerate(obj):
            check_loadable(value, f"{path}[{i}]")
        return
    raise ValueError(f"{path} is a {type(obj).__qualname__}, which torch.load(weights_only=True) refuses")


def to_host(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live in host memory and share nothing with the originals, so training can
    change the originals while the copy is written.  Containers are rebuilt, other leaves are immutable."""
    torch = torch_module()
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone()
        return t.to("cpu", copy=True)
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for key, value in obj.items():
            out[key] = to_host(value)
        return out
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_host(v) for v in obj)
    if isinstance(obj, set):
        return set(obj)
    return obj
