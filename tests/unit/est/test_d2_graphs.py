"""D2 steps in CUDA graphs: the operators' device path reads nothing back to the host (checked on the CPU with the
C kernels off, the operations the GPU runs), and on a GPU a step replayed from a graph gives the eager step's bits
(skipped without CUDA)."""

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
from hpc_elastic.est.d2 import to_d2
from hpc_elastic.est.d2_ops import det_cross_entropy
from hpc_elastic.est.gpu import capture_step

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

#: operations that read a device value back to the host (a synchronisation, refused while a graph is captured)
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
              "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.is_nonzero", "aten.equal"}  # fmt: skip


class Dispatched(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten operations dispatched, and the host reads among them (an index by a boolean mask is one: its
    result's size depends on the values)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: collections.Counter[str] = collections.Counter()
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        self.ops[name] += 1
        masked = name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        if name in HOST_READS or masked:
            self.host_reads.append(name)
        return func(*args, **(kwargs or {}))


def d2_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = det_cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


@pytest.mark.parametrize("factory", [models.resnet_like, models.vgg_like], ids=["resnet_like", "vgg_like"])
def test_the_device_path_of_a_d2_step_reads_nothing_back(
    factory: Callable[[], models.ModelBundle], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operations a D2 forward, loss and backward run on a GPU (the CPU's C kernels off, so batch norm and max
    pool take their torch definitions, as on CUDA), with a capture under way: no host read among them."""
    monkeypatch.setattr(d2_math, "c_kernels", lambda: None)
    monkeypatch.setattr(d2_ops, "c_kernels", lambda: None)
    monkeypatch.setattr(d2_ops, "capturing", lambda t: True)
    torch.manual_seed(0)
    model, sample = factory()[:2]
    to_d2(model)
    x, y = sample(4)
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    with Dispatched() as seen:
        d2_step(model, x, y)
    assert seen.host_reads == []
    # the step did run the torch definitions (batch norm's fixed trees, the max pool's comparisons)
    assert seen.ops["aten.add"] > 50


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


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


@needs_cuda
@pytest.mark.parametrize("factory", [models.resnet_like, models.vgg_like], ids=["resnet_like", "vgg_like"])
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
