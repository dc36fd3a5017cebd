"""Loading a MODEL for the profiler (the protocol of :mod:`hpc_elastic.models`) and reading its tensor sizes and
skew (Tiresias §3.3).  torch is imported on first use (:func:`torch_module`)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.files import read_input
from hpc_elastic.profile.options import parse_model_spec
from hpc_elastic.profile.schema import ModelInfo, ShardSkew, TensorInfo
from hpc_elastic.profile.skew import largest_tensor_share, shard_skews

if TYPE_CHECKING:
    from torch import nn


class ProfileRunError(HpcElasticError):
    """The model cannot be loaded or profiled as asked."""


@dataclass
class LoadedModel:
    """A MODEL after calling its factory."""

    spec: str
    name: str
    module: nn.Module
    sample_batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Any] | None


def torch_module() -> Any:
    """``torch``, imported on first use; a clear error when it is not installed."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise ProfileRunError("profiling needs torch: pip install 'hpc-elastic[torch]'") from None


def _import_script(path_text: str, spec: str) -> Any:
    """Import a training script from its file as ``_hpc_elastic_script_<stem>`` (not ``__main__``).

    Its directory goes first on ``sys.path``, as when Python runs the script, so sibling modules import.
    """
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ProfileRunError(f"MODEL {spec!r}: no script file {path}")
    name = "_hpc_elastic_script_" + re.sub(r"\W", "_", path.stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ProfileRunError(f"MODEL {spec!r}: cannot import {path} as Python")
    module = importlib.util.module_from_spec(module_spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        # compiled here, as Python runs a script: no bytecode cache left beside it (the loader's would write one)
        exec(compile(read_input(path), str(path), "exec"), module.__dict__)  # noqa: S102 - the user's own script
    except BaseException as exc:  # the script is user code (SystemExit included): report it in one line
        del sys.modules[name]
        raise ProfileRunError(
            f"cannot import script {path_text!r} of MODEL {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    return module


def load_model(spec: str) -> LoadedModel:
    """Import MODEL (``package.module:factory`` or ``train.py[:factory]``), call the factory and check what
    it returns (the MODEL protocol of :mod:`hpc_elastic.models`)."""
    parsed = parse_model_spec(spec)
    factory_name = parsed.factory
    torch = torch_module()
    if parsed.script is not None:
        module = _import_script(parsed.script, spec)
        module_path = parsed.script
    else:
        module_path = cast("str", parsed.module)
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:  # ImportError, or whatever the module raises while it is imported
            raise ProfileRunError(
                f"cannot import module {module_path!r} of MODEL {spec!r}: {type(exc).__name__}: {exc}"
            ) from None
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        raise ProfileRunError(f"module {module_path!r} has no callable {factory_name!r} (MODEL {spec!r})")
    try:
        bundle = factory()
    except Exception as exc:  # the factory is user code: report it in one line
        raise ProfileRunError(f"MODEL {spec!r}: calling {factory_name}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(bundle, tuple) or len(bundle) not in (2, 3):
        raise ProfileRunError(
            f"MODEL {spec!r} must return (module, sample_batch) or (module, sample_batch, loss_fn), "
            f"got {type(bundle).__name__}"
        )
    net, sample_batch = bundle[0], bundle[1]
    loss_fn = bundle[2] if len(bundle) == 3 else None
    if not isinstance(net, torch.nn.Module):
        raise ProfileRunError(f"MODEL {spec!r} returned {type(net).__name__} where a torch.nn.Module belongs")
    if not callable(sample_batch) or (loss_fn is not None and not callable(loss_fn)):
        raise ProfileRunError(f"MODEL {spec!r}: sample_batch and loss_fn must be callables")
    return LoadedModel(spec, parsed.name, net, sample_batch, loss_fn)


def tensor_infos(module: nn.Module) -> list[TensorInfo]:
    """Trainable parameter tensors in model order: what a parameter server holds and exchanges."""
    return [
        TensorInfo(name=name, shape=list(param.shape), bytes=param.numel() * param.element_size())
        for name, param in module.named_parameters()
        if param.requires_grad
    ]


def model_info(spec: str, name: str, module: nn.Module, shard_counts: Sequence[int]) -> ModelInfo:
    """Tensor sizes and skew (Tiresias §3.3) of ``module``."""
    tensors = tensor_infos(module)
    if not tensors:
        raise ProfileRunError(f"MODEL {spec!r} has no trainable parameters")
    sizes = [tensor.bytes for tensor in tensors]
    skews = shard_skews(sizes, shard_counts)
    return ModelInfo(
        spec=spec,
        name=name,
        num_parameters=sum(math.prod(tensor.shape) for tensor in tensors),
        parameter_bytes=sum(sizes),
        tensors=tensors,
        largest_tensor_share=largest_tensor_share(sizes),
        shard_skew=[ShardSkew(shards=k, skew=v) for k, v in skews.items()],
    )
