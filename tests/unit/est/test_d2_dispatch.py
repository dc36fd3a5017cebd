"""What a D2 step dispatches, recorded on the CPU with the C kernels off (so batch norm and max pool take their torch
definitions: the operations a GPU runs):

- only operations that are exact or one IEEE rounding per element (no torch reduction, product, fused or
  transcendental kernel, whose results differ between devices): the reference models' steps and the D2
  optimizers' updates stay within them;
- nothing that reads a device value back to the host while a CUDA graph is captured, so a step can be replayed
  from one; on a GPU a replay gives the eager step's bits (skipped without CUDA)."""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpc_elastic import models
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est import d2_math, d2_ops
from hpc_elastic.est.d2 import optimizer_to_d2, to_d2
from hpc_elastic.est.d2_ops import det_cross_entropy
from hpc_elastic.est.gpu import capture_step
from tests.unit.est.test_d2_ops import OP_IDS, OPS, bits, inputs, make_pair, run_op

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
REFERENCE_MODELS = [models.resnet_like, models.vgg_like, models.resnet18, models.transformer_small, models.lstm_small]
REFERENCE_IDS = ["resnet_like", "vgg_like", "resnet18", "transformer_small", "lstm_small"]

#: operations that read a device value back to the host (a synchronisation, refused while a graph is captured)
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
              "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.is_nonzero", "aten.equal"}  # fmt: skip

#: what a D2 step may dispatch: views and copies, allocation and fills, comparisons and selections, integer and bit
#: work, max/min (exact), a stable sort, and element-wise + - * / and sqrt (one IEEE rounding each: the square root
#: in float64, see ``d2_math.det_sqrt``); the products are the fixed-order kernels (not dispatched), the reductions
#: fixed trees of additions
_ALLOWED = """
    _to_copy _unsafe_view alias as_strided clone contiguous copy_ detach expand lift_fresh permute reshape select
    select_backward slice slice_backward split squeeze t transpose unsqueeze view cat constant_pad_nd flip stack
    arange empty empty_like full full_like new_empty new_empty_strided new_zeros ones ones_like scalar_tensor zero_
    zeros zeros_like fill_ masked_fill_
    eq ne gt lt ge le isinf isnan where gather scatter_ index index_put_ index_select relu relu_ threshold_backward
    amax max min cummax sort searchsorted clamp round neg abs copysign bitwise_and bitwise_or bitwise_not
    bitwise_left_shift bitwise_right_shift maximum add add_ sub sub_ rsub mul mul_ div div_ sqrt _local_scalar_dense
    triu triu_
"""
EXACT_OR_ONE_ROUNDING = {f"aten.{name}" for name in _ALLOWED.split()}


class Dispatched(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten operations dispatched, and the host reads among them (an index by a boolean mask is one: its
    result's size depends on the values).  Three forms the D2 rules forbid get names of their own: a float32
    square root (not correctly rounded on this CPU), a float division by a Python number (CUDA multiplies by its
    reciprocal) and an addition or subtraction with ``alpha`` (a multiply-add)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: collections.Counter[str] = collections.Counter()
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        kwargs = kwargs or {}
        if name == "aten.sqrt" and args[0].dtype != torch.float64:
            name = f"aten.sqrt({args[0].dtype})"
        elif (
            name in ("aten.div", "aten.div_") and args[0].is_floating_point() and not isinstance(args[1], torch.Tensor)
        ):
            name = f"{name}(by a number)"
        elif name in ("aten.add", "aten.add_", "aten.sub", "aten.sub_", "aten.rsub") and kwargs.get("alpha", 1) != 1:
            name = f"{name}(alpha)"
        self.ops[name] += 1
        masked = name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        if name in HOST_READS or masked:
            self.host_reads.append(name)
        return func(*args, **kwargs)


def d2_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = det_cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def gpu_operator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(d2_math, "c_kernels", lambda: None)
    monkeypatch.setattr(d2_ops, "c_kernels", lambda: None)


def record_step(factory: Callable[[], models.ModelBundle], convert: bool = True) -> Dispatched:
    torch.manual_seed(0)
    model, sample = factory()[:2]
    if convert:
        to_d2(model)
    x, y = sample(4)
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    seen = Dispatched()
    with seen:
        d2_step(model, x, y)
    return seen


@pytest.mark.parametrize("factory", REFERENCE_MODELS, ids=REFERENCE_IDS)
def test_a_d2_step_dispatches_only_exact_or_once_rounded_operations(
    factory: Callable[[], models.ModelBundle], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_operator_path(monkeypatch)
    seen = record_step(factory)
    assert set(seen.ops) - EXACT_OR_ONE_ROUNDING == set()
    assert seen.ops["aten.add"] > 50  # the fixed trees ran


@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}),
        (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-4}),
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}),
    ],
    ids=["sgd", "adam", "adamw-amsgrad"],
)
def test_a_d2_optimizer_step_dispatches_only_exact_or_once_rounded_operations(
    cls: type[torch.optim.Optimizer], options: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    optimizer = optimizer_to_d2(cls([p], **options))
    optimizer.step()  # the state exists from here
    seen = Dispatched()
    with seen:
        optimizer.step()
    assert set(seen.ops) - EXACT_OR_ONE_ROUNDING == set()
    assert seen.ops["aten.mul_"] + seen.ops["aten.mul"] > 0


def test_the_audit_names_the_forbidden_forms() -> None:
    x = torch.rand(5) + 1.0
    seen = Dispatched()
    with seen:
        torch.sqrt(x)
        torch.sqrt(x.double())
        _ = x / 3.0
        torch.div(x, torch.full_like(x, 3.0))
        torch.add(x, x, alpha=2.0)
        torch.div(torch.arange(6), 2, rounding_mode="floor")  # integer work: exact
    assert set(seen.ops) - EXACT_OR_ONE_ROUNDING == {
        "aten.sqrt(torch.float32)",
        "aten.div(by a number)",
        "aten.add(alpha)",
    }


@pytest.mark.parametrize(("factory", "shape"), OPS, ids=OP_IDS)
def test_each_d2_operator_dispatches_only_exact_or_once_rounded_operations(
    factory: Callable[[], torch.nn.Module], shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every operator case of ``test_d2_ops`` (those the reference models do not use too: the other activations, the
    softmax modules, GELU's two forms, the average pool, the masked attention), forward and backward."""
    gpu_operator_path(monkeypatch)
    _, det = make_pair(factory)
    x, g = inputs(shape, det)
    seen = Dispatched()
    with seen:
        run_op(det, x, g)
    assert set(seen.ops) - EXACT_OR_ONE_ROUNDING == set()


def test_the_loss_with_label_smoothing_dispatches_only_exact_or_once_rounded_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_operator_path(monkeypatch)
    logits = torch.randn(6, 5, requires_grad=True)
    seen = Dispatched()
    with seen:
        det_cross_entropy(logits, torch.tensor([0, 4, 1, 2, 3, 0]), label_smoothing=0.1).backward()  # type: ignore[no-untyped-call]
    assert set(seen.ops) - EXACT_OR_ONE_ROUNDING == set()


def test_the_audit_sees_stock_kernels() -> None:
    """The same step without the conversion runs torch's products, reductions and fused kernels."""
    outside = set(record_step(models.transformer_small, convert=False).ops) - EXACT_OR_ONE_ROUNDING
    assert {"aten.mm", "aten.addmm", "aten.sum", "aten.native_layer_norm", "aten.embedding_dense_backward"} <= outside
    outside = set(record_step(models.resnet_like, convert=False).ops) - EXACT_OR_ONE_ROUNDING
    assert {"aten.convolution", "aten.native_batch_norm", "aten.mean"} <= outside


@pytest.mark.parametrize("factory", REFERENCE_MODELS, ids=REFERENCE_IDS)
def test_the_device_path_of_a_d2_step_reads_nothing_back(
    factory: Callable[[], models.ModelBundle], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operations a D2 forward, loss and backward run on a GPU, with a capture under way: no host read among
    them."""
    gpu_operator_path(monkeypatch)
    monkeypatch.setattr(d2_ops, "capturing", lambda t: True)
    assert record_step(factory).host_reads == []


def test_the_audit_sees_a_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails when a host read is there: outside a capture, the loss checks its targets on the host."""
    monkeypatch.setattr(d2_ops, "capturing", lambda t: False)
    logits, target = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])
    with Dispatched() as seen:
        det_cross_entropy(logits, target)
    assert "aten._local_scalar_dense" in seen.host_reads
    with Dispatched() as seen:
        logits[target > 0]
    assert seen.host_reads == ["aten.index"]


def test_targets_are_checked_outside_a_capture() -> None:
    with pytest.raises(ValueError, match="class indices in"):
        det_cross_entropy(torch.randn(2, 3), torch.tensor([0, 3]))


def test_capture_step_refuses_no_warmup_and_a_machine_without_cuda() -> None:
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        capture_step(lambda: None, warmup=0)
    if not CUDA:
        with pytest.raises(HpcElasticError, match="needs a CUDA device"):
            capture_step(lambda: None)


@needs_cuda
@pytest.mark.parametrize("factory", REFERENCE_MODELS, ids=REFERENCE_IDS)
def test_cuda_d2_step_replayed_from_a_graph_gives_the_eager_bits(factory: Callable[[], models.ModelBundle]) -> None:
    """One model captured, a twin run eagerly: for three batches copied into the captured step's inputs, the loss and
    every gradient of a replay are the eager step's bits (and so the CPU's, which the eager CUDA step gives)."""
    torch.manual_seed(3)
    model, sample = factory()[:2]
    to_d2(model)
    model.cuda()
    twin = copy.deepcopy(model)
    x, y = sample(4)
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    static_x, static_y = x.cuda(), y.cuda()
    captured = capture_step(lambda: d2_step(model, static_x, static_y))
    for seed in range(3):
        torch.manual_seed(100 + seed)
        bx, by = sample(4)
        assert isinstance(bx, torch.Tensor) and isinstance(by, torch.Tensor)
        static_x.copy_(bx)
        static_y.copy_(by)
        loss = captured.replay()
        graph = [bits(loss)] + [bits(p.grad) for p in model.parameters() if p.grad is not None]
        eager_loss = d2_step(twin, bx.cuda(), by.cuda())
        eager = [bits(eager_loss)] + [bits(p.grad) for p in twin.parameters() if p.grad is not None]
        assert len(graph) == len(eager) > 1
        assert graph == eager
