"""D2 operators: accuracy against float64, bitwise invariance to the thread count and to batch neighbours, the
scanner on the reference CNNs, a D2 training with the runtime, and CPU == CUDA bit for bit (skipped without CUDA)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpc_elastic import models
from hpc_elastic.est import d2_math, d2_ops
from hpc_elastic.est.d2 import D2Status, register_d2_module, scan_model, to_d2
from hpc_elastic.est.d2_ops import DetEmbedding, det_cross_entropy, embedding_row_sums
from hpc_elastic.est.detsum import ref_matmul_nt
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.session import Session

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


# ---------------------------------------------------------------------------------------------- the math


def max_ulps(y: torch.Tensor, ref: np.ndarray) -> float:
    """Largest error of float32 ``y`` against the float64 ``ref``, in units of the last place of ``ref`` in float32,
    over the normal float32 range."""
    ref32 = ref.astype(np.float32)
    ok = np.isfinite(ref32) & (np.abs(ref32) >= 2.0**-126)
    spacing = np.spacing(np.abs(ref32[ok])).astype(np.float64)
    return float(np.max(np.abs(y.numpy().astype(np.float64)[ok] - ref[ok]) / spacing))


def sweep(low: float, high: float, n: int = 400_001) -> torch.Tensor:
    return torch.linspace(low, high, n, dtype=torch.float32)


def _ref_erf(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(v) for v in x.tolist()])


def _ref_erfc(x: np.ndarray) -> np.ndarray:
    return np.array([math.erfc(v) for v in x.tolist()])


MATH_CASES: list[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[np.ndarray], np.ndarray], torch.Tensor, float]]
MATH_CASES = [
    (d2_math.det_exp, np.exp, sweep(-87.3, 88.7), 1.0),
    (d2_math.det_expm1, np.expm1, sweep(-20.0, 20.0), 2.0),
    (
        d2_math.det_log,
        np.log,
        torch.cat([sweep(1e-30, 1e-3), sweep(1e-3, 10.0), sweep(10.0, 1e30), torch.tensor([1e-40, 3e-45])]),
        2.0,
    ),
    (d2_math.det_sigmoid, lambda v: 1.0 / (1.0 + np.exp(-v)), sweep(-20.0, 20.0), 3.0),
    (d2_math.det_tanh, np.tanh, sweep(-12.0, 12.0), 3.0),
    (d2_math.det_erf, _ref_erf, sweep(-6.0, 6.0, 100_001), 4.0),
    (d2_math.det_erfc, _ref_erfc, sweep(-6.0, 9.0, 100_001), 8.0),
]


@pytest.mark.parametrize(("fn", "ref", "x", "bound"), MATH_CASES, ids=[c[0].__name__ for c in MATH_CASES])
def test_transcendentals_are_within_a_few_ulps_of_float64(
    fn: Callable[[torch.Tensor], torch.Tensor], ref: Callable[[np.ndarray], np.ndarray], x: torch.Tensor, bound: float
) -> None:
    with np.errstate(over="ignore"):
        assert max_ulps(fn(x), ref(x.numpy().astype(np.float64))) <= bound


def exp_kernel_inputs(seed: int, size: int) -> np.ndarray[Any, Any]:
    """Inputs for the exp kernel against its definitions: a dense sweep of ``size + 1`` points across the clamps,
    inputs whose x * log2(e) is a tie, the clamps and their neighbours, and ``size`` random bit patterns
    (subnormals, infinities, NaNs of any payload)."""
    rng = np.random.default_rng(seed)
    ties = (np.arange(-250, 250, dtype=np.float32) + np.float32(0.5)) / np.float32(d2_math.LOG2E)
    edges = [d2_math.EXP_LO, d2_math.EXP_HI, 0.0, -0.0, 1e-45, -1e-45, float("inf"), float("-inf"), float("nan")]
    edges += [float(np.nextafter(np.float32(e), np.float32(d))) for e in edges[:2] for d in (-200.0, 200.0)]
    patterns = rng.integers(-(2**31), 2**31 - 1, size, dtype=np.int64).astype(np.int32).view(np.float32)
    sweep_ = np.linspace(-110, 100, size + 1, dtype=np.float32)
    return np.concatenate([sweep_, ties, np.array(edges, dtype=np.float32), patterns])


@pytest.mark.parametrize(
    "fn",
    [d2_math.det_exp, d2_math.det_expm1, d2_math.det_sigmoid, d2_math.det_tanh],
    ids=["exp", "expm1", "sigmoid", "tanh"],
)
def test_exp_kernel_gives_the_torch_definitions_bits(
    fn: Callable[[torch.Tensor], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C kernel (the CPU's path) against the torch definition (the GPU's), on :func:`exp_kernel_inputs`."""
    assert d2_math.c_kernels() is not None
    x = torch.from_numpy(exp_kernel_inputs(11, 1_000_000))
    kernel = fn(x)
    monkeypatch.setattr(d2_math, "c_kernels", lambda: None)
    definition = fn(x)
    assert bits(kernel) == bits(definition)
    # a tensor autograd follows takes the torch definition (the kernel is outside the graph)
    monkeypatch.undo()
    y = torch.tensor([0.5, -1.0], requires_grad=True)
    assert fn(y).grad_fn is not None


def test_exp_kernel_refuses_bad_arguments() -> None:
    ext, x = d2_math.c_kernels(), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="fn: 0 \\(exp\\), 1 \\(expm1\\), 2 \\(sigmoid\\) or 3 \\(tanh\\), got 7"):
        ext.exp(x, x.copy(), d2_math._EXP_CONSTANTS, 7)
    with pytest.raises(ValueError, match="constants: 12 float32 values, got 3"):
        ext.exp(x, x.copy(), d2_math._EXP_CONSTANTS[:3], 0)
    with pytest.raises(ValueError, match="out has 3 elements, x 4"):
        ext.exp(x, x[:3].copy(), d2_math._EXP_CONSTANTS, 0)


def test_special_values() -> None:
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 100.0, -100.0])
    assert d2_math.det_exp(x)[:4].tolist() == [1.0, 1.0, math.inf, 0.0]
    assert d2_math.det_exp(x)[5:].tolist() == [math.inf, 0.0]
    assert d2_math.det_log(x)[:4].tolist()[:3] == [-math.inf, -math.inf, math.inf]
    assert torch.isnan(d2_math.det_log(torch.tensor([-1.0, -math.inf, math.nan]))).all()
    assert d2_math.det_tanh(x)[[0, 2, 3]].tolist() == [0.0, 1.0, -1.0]
    assert d2_math.det_sigmoid(x)[[0, 2, 3, 5, 6]].tolist() == [0.5, 1.0, 0.0, 1.0, 0.0]
    for fn in (d2_math.det_exp, d2_math.det_log, d2_math.det_tanh, d2_math.det_erf, d2_math.det_erfc):
        assert torch.isnan(fn(x[4:5])).all()


def test_det_sum_follows_the_fixed_pairwise_tree() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 13, 5) * torch.logspace(-3, 3, 5)
    got = d2_math.det_sum(x, 1)
    ref = x.permute(0, 2, 1).numpy().copy()
    ref = np.concatenate([ref, np.zeros((3, 5, 3), np.float32)], axis=2)  # padded to 16 with +0.0
    while ref.shape[2] > 1:
        half = ref.shape[2] // 2
        ref = ref[:, :, :half] + ref[:, :, half:]
    assert got.numpy().tobytes() == ref[:, :, 0].tobytes()
    assert d2_math.det_sum(x, -1, keepdim=True).shape == (3, 13, 1)
    assert d2_math.det_sum(torch.zeros(2, 0), 1).tolist() == [0.0, 0.0]
    torch.testing.assert_close(d2_math.det_sum_dims(x, (0, 2)), x.double().sum((0, 2)).float())


# ---------------------------------------------------------------------------------------------- the operators


def _conv() -> nn.Module:
    return nn.Conv2d(3, 5, 3, stride=2, padding=1, dilation=1)


def _conv_dilated() -> nn.Module:
    return nn.Conv2d(3, 4, (3, 2), stride=(1, 2), padding=(2, 1), dilation=2, bias=False)


def _conv_wide_padding() -> nn.Module:
    """Padding beyond the kernel's reach (the transposed convolution crops) and input rows no window reaches."""
    return nn.Conv2d(3, 4, (3, 1), stride=(2, 3), padding=(3, 2))


def _conv_channels() -> nn.Module:
    """Whole 8-lane steps in both products (kh * kw * C and kh * kw * O multiples of 8)."""
    return nn.Conv2d(8, 16, 3, padding=1)


def _conv_groups() -> nn.Module:
    """Two groups of 3 input channels and 2 filters each (ResNeXt-style), strided."""
    return nn.Conv2d(6, 4, 3, stride=2, padding=1, groups=2)


def _conv_depthwise() -> nn.Module:
    """Depthwise (MobileNet-style): one filter per channel, a multiplier of 2, without bias."""
    return nn.Conv2d(4, 8, 3, padding=1, groups=4, bias=False)


def _conv1d_depthwise() -> nn.Module:
    return nn.Conv1d(3, 3, 5, padding=2, groups=3)


def _bn2d() -> nn.Module:
    return nn.BatchNorm2d(3)


def _bn1d() -> nn.Module:
    return nn.BatchNorm1d(3, momentum=None)


def _layernorm() -> nn.Module:
    return nn.LayerNorm((6, 7))


def _maxpool() -> nn.Module:
    return nn.MaxPool2d(3, stride=2, padding=1)


def _avgpool() -> nn.Module:
    return nn.AdaptiveAvgPool2d((3, 7))


def _softmax() -> nn.Module:
    return nn.Softmax(dim=1)


def _logsoftmax() -> nn.Module:
    return nn.LogSoftmax(dim=-1)


def _encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)


def _encoder_layer_norm_first_gelu() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(8, 4, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), enable_nested_tensor=False)


@register_d2_module
class _MaskedSelfAttention(nn.Module):
    """Causal self-attention with the keys whose first feature exceeds 1 padded out (never the first key, so that
    no query sees only masked keys); [N, L, E] in and out."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = x[..., 0] > 1.0
        padded[:, 0] = False
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        out: torch.Tensor = self.attention(x, x, x, key_padding_mask=padded, attn_mask=causal, need_weights=False)[0]
        return out


def _conv1d() -> nn.Module:
    return nn.Conv1d(3, 5, 3, stride=2, padding=2, dilation=2)


def _groupnorm() -> nn.Module:
    return nn.GroupNorm(3, 6)


@register_d2_module
class _TinyTransformer(nn.Module):
    """``nn.Transformer`` (one encoder and one decoder layer) on [N, L, 8]: the sequence reversed as the source, its
    first 4 positions as the target, with a causal target mask."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        with warnings.catch_warnings():  # torch's note that norm_first turns its nested-tensor path off
            warnings.simplefilter("ignore", UserWarning)
            self.model = nn.Transformer(8, 2, 1, 1, 12, dropout=0.0, batch_first=True, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(4)
        out: torch.Tensor = self.model(x.flip(1), x[:, :4], tgt_mask=mask, tgt_is_causal=True)
        return out


@register_d2_module
class _Recurrent(nn.Module):
    """A batch-first recurrent layer whose output, final hidden states (and cell states) are returned as one
    [N, T + states, features] tensor, so that every gradient path is tested."""

    def __init__(self, kind: Callable[..., nn.RNNBase], **options: Any) -> None:
        super().__init__()
        self.rnn = kind(5, 4, batch_first=True, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        parts = [out]
        for s in state if isinstance(state, tuple) else (state,):
            parts.append(s.transpose(0, 1).reshape(x.shape[0], -1, out.shape[2]))
        return torch.cat(parts, dim=1)


#: (factory, input shape, relative bound of forward and gradients against float64, atol)
OPS: list[tuple[Callable[[], nn.Module], tuple[int, ...]]] = [
    (_conv, (4, 3, 9, 8)),
    (_conv_dilated, (2, 3, 10, 9)),
    (_conv_wide_padding, (2, 3, 8, 10)),
    (_conv_channels, (2, 8, 6, 5)),
    (_bn2d, (4, 3, 6, 7)),
    (_bn1d, (5, 3, 4)),
    (_layernorm, (3, 2, 6, 7)),
    (_maxpool, (2, 3, 9, 8)),
    (_avgpool, (2, 3, 6, 7)),
    (nn.Sigmoid, (4, 3, 6, 7)),
    (nn.Tanh, (4, 3, 6, 7)),
    (nn.SiLU, (4, 3, 6, 7)),
    (nn.GELU, (4, 3, 6, 7)),
    (lambda: nn.GELU(approximate="tanh"), (4, 3, 6, 7)),
    (_softmax, (4, 5, 7)),
    (_logsoftmax, (4, 5, 7)),
    (lambda: nn.Linear(7, 4), (3, 2, 7)),
    (_encoder_layer, (3, 5, 8)),
    (_encoder_layer_norm_first_gelu, (3, 6, 8)),
    (_encoder, (2, 7, 8)),
    (_MaskedSelfAttention, (3, 6, 8)),
    (_conv1d, (4, 3, 11)),
    (_conv_groups, (3, 6, 7, 6)),
    (_conv_depthwise, (2, 4, 6, 5)),
    (_conv1d_depthwise, (3, 3, 10)),
    (_groupnorm, (3, 6, 5, 4)),
    (_TinyTransformer, (3, 6, 8)),
    (lambda: _TinyTransformer(activation="gelu", norm_first=True), (2, 5, 8)),
    (lambda: _Recurrent(nn.LSTM, num_layers=2), (3, 6, 5)),
    (lambda: _Recurrent(nn.GRU, bidirectional=True), (3, 6, 5)),
    (lambda: _Recurrent(nn.RNN, nonlinearity="relu", bias=False), (3, 6, 5)),
    (lambda: _Recurrent(nn.RNN, num_layers=2, bidirectional=True), (2, 4, 5)),
]
OP_IDS = [
    "conv",
    "conv-dilated",
    "conv-wide-padding",
    "conv-channels",
    "bn2d",
    "bn1d-cumulative",
    "layernorm",
    "maxpool",
    "avgpool",
    "sigmoid",
    "tanh",
    "silu",
    "gelu",
    "gelu-tanh",
    "softmax",
    "logsoftmax",
    "linear",
    "encoder-layer",
    "encoder-layer-norm-first-gelu",
    "encoder",
    "masked-attention",
    "conv1d",
    "conv-groups",
    "conv-depthwise",
    "conv1d-depthwise",
    "groupnorm",
    "transformer",
    "transformer-norm-first-gelu",
    "lstm-2-layers",
    "gru-bidirectional",
    "rnn-relu-no-bias",
    "rnn-tanh-2-layers-bidirectional",
]


def run_op(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """Forward output, input gradient and parameter gradients (and buffers, for batch norm)."""
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(g.to(y.dtype))
    assert x.grad is not None
    grads = [p.grad for p in module.parameters()]
    assert all(gp is not None for gp in grads)
    return [y.detach(), x.grad, *[gp for gp in grads if gp is not None], *[b.clone() for b in module.buffers()]]


def make_pair(factory: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    stock = factory()
    for p in stock.parameters():  # non-trivial affine parameters
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.3)
    det = factory()
    det.load_state_dict(stock.state_dict())
    to_d2(det)
    assert scan_model(det).holds, scan_model(det).first_problem()
    return stock, det


def inputs(shape: tuple[int, ...], module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(shape) * 2.0
    with torch.no_grad():
        y = copy.deepcopy(module)(x)  # a copy: the module's running statistics must not move
    return x, torch.randn(y.shape)


@pytest.mark.parametrize(("factory", "shape"), OPS, ids=OP_IDS)
def test_operator_and_gradients_match_float64(factory: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    stock, det = make_pair(factory)
    x, g = inputs(shape, stock)
    got = run_op(det, x, g)
    ref = run_op(stock.double(), x.double(), g.double())
    assert state_dict_keys(det) == state_dict_keys(stock)
    for a, b in zip(got, ref, strict=True):
        scale = max(float(b.abs().max()), 1e-6) if b.dtype.is_floating_point else 1.0
        # float32 rounding of sums over at most a few hundred terms: well within 1e-5 of the largest value
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5 * scale)


def state_dict_keys(module: nn.Module) -> list[str]:
    return list(module.state_dict())


@pytest.mark.parametrize(("factory", "shape"), OPS, ids=OP_IDS)
def test_operator_bits_do_not_depend_on_the_thread_count(
    factory: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    results = []
    for threads in (1, 4):
        torch.set_num_threads(threads)
        _, det = make_pair(factory)
        x, g = inputs(shape, det)
        results.append([bits(t) for t in run_op(det, x, g)])
    assert results[0] == results[1]


PER_SAMPLE = [(f, shape) for (f, shape), name in zip(OPS, OP_IDS, strict=True) if not name.startswith("bn")]


@pytest.mark.parametrize(("factory", "shape"), PER_SAMPLE, ids=[n for n in OP_IDS if not n.startswith("bn")])
def test_a_samples_output_does_not_depend_on_its_batch_neighbours(
    factory: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    _, det = make_pair(factory)
    torch.manual_seed(2)
    x = torch.randn(6, *shape[1:])
    with torch.no_grad():
        whole = det(x)
        for i in range(6):
            assert bits(det(x[i : i + 1])) == bits(whole[i : i + 1])


def test_batch_norm_running_statistics_follow_torch() -> None:
    stock, det = make_pair(_bn2d)
    x, _ = inputs((6, 3, 5, 5), stock)
    for _ in range(3):
        stock(x)
        det(x)
    for a, b in zip(det.buffers(), stock.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    stock.eval()
    det.eval()
    torch.testing.assert_close(det(x), stock(x), rtol=1e-5, atol=1e-5)
    assert det.state_dict().keys() == stock.state_dict().keys()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        to_d2(nn.BatchNorm1d(3))(torch.randn(1, 3))


def test_max_pool_ties_go_to_the_first_offset() -> None:
    pool = to_d2(nn.MaxPool2d(2))
    x = torch.tensor([[[[-0.0, 0.0, 1.0, 1.0], [0.0, -0.0, 1.0, 1.0]]]], requires_grad=True)
    out = pool(x)
    assert bits(out) == bits(torch.tensor([[[[-0.0, 1.0]]]]))
    out.backward(torch.tensor([[[[2.0, 3.0]]]]))
    assert x.grad is not None
    assert x.grad.tolist() == [[[[2.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]]


def segment_scan_sum(occurrences: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """The sum of one id's gradient rows (in input order) by D2's definition, written per segment: an inclusive scan
    whose round of shift s adds the value s places back, until s reaches the count; the last position's value."""
    v = list(occurrences)
    shift = 1
    while shift < len(v):
        v = [v[j] if j < shift else (v[j - shift] + v[j]).astype(np.float32) for j in range(len(v))]
        shift *= 2
    return v[-1]


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "capturing"])
def test_embedding_gradient_sums_each_ids_rows_by_a_tree_fixed_by_its_count(
    capture: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a capture the scan stops at the longest segment, during one it runs rounds up to T: the same bits."""
    monkeypatch.setattr(d2_ops, "capturing", lambda t: capture)
    torch.manual_seed(3)
    emb = nn.Embedding(7, 5, padding_idx=2)
    det = to_d2(nn.Embedding(7, 5, padding_idx=2))
    det.load_state_dict(emb.state_dict())
    assert isinstance(det, DetEmbedding)
    # id 3 occurs 13 times (a tree of 4 rounds), 1 twice, 0 once, the padding id 2 three times, 4-6 never
    ids = torch.tensor([[3, 1, 3, 2, 3, 3, 0, 3, 2], [3, 1, 3, 3, 2, 3, 3, 3, 3]])
    g = torch.randn(2, 9, 5) * torch.logspace(-4, 4, 5)
    g[0, 6] = -0.0  # a lone -0 occurrence keeps its sign
    out = det(ids)
    assert bits(out) == bits(emb(ids))
    out.backward(g)
    flat, gn = ids.reshape(-1).tolist(), g.reshape(-1, 5).numpy()
    expected = np.zeros((7, 5), np.float32)
    sequential = np.zeros((7, 5), np.float32)
    for row in set(flat) - {2}:
        occurrences = [vec for r, vec in zip(flat, gn, strict=True) if r == row]
        expected[row] = segment_scan_sum(occurrences)
        for vec in occurrences:
            sequential[row] = sequential[row] + vec
    assert det.weight.grad is not None
    assert bits(det.weight.grad) == expected.tobytes()
    assert expected.tobytes() != sequential.tobytes()  # the tree is not the left-to-right sum
    assert bits(det.weight.grad[0]) == bits(g[0, 6])
    emb(ids).backward(g)
    assert emb.weight.grad is not None
    torch.testing.assert_close(det.weight.grad, emb.weight.grad)


def test_embedding_gradient_of_an_id_does_not_depend_on_the_other_ids() -> None:
    """More occurrences of id 0, which sorts first, move every other id's segment in the sorted ids: their rows keep
    their bits (a segment's tree is aligned on its end, whatever its offset).  Unused rows and the padding row stay
    zero."""
    torch.manual_seed(4)
    ids = torch.randint(1, 6, (40,))
    g = torch.randn(40, 3) * torch.logspace(-3, 3, 3)
    base = embedding_row_sums(ids, g, 9, None)
    for extra in (1, 3, 6, 13):
        more_ids = torch.cat([torch.zeros(extra, dtype=ids.dtype), ids])
        more_g = torch.cat([torch.randn(extra, 3), g])
        assert bits(embedding_row_sums(more_ids, more_g, 9, None)[1:]) == bits(base[1:])
    assert bits(base[6:]) == bits(torch.zeros(3, 3))
    assert bits(embedding_row_sums(ids, g, 9, 4)[4]) == bits(torch.zeros(3))


ATTENTION_CASES = [
    # (module options, shapes of query, key, value (sequence first unless batch_first), self-attention)
    ({}, ((5, 3, 8), (5, 3, 8), (5, 3, 8)), True),
    ({}, ((5, 3, 8), (7, 3, 8), (7, 3, 8)), False),
    ({"kdim": 6, "vdim": 10, "batch_first": True}, ((3, 5, 8), (3, 7, 6), (3, 7, 10)), False),
    ({"bias": False, "batch_first": True}, ((2, 4, 8), (2, 4, 8), (2, 4, 8)), True),
    ({}, ((5, 8), (6, 8), (6, 8)), False),  # unbatched
    ({"batch_first": True}, ((5, 8), (6, 8), (6, 8)), False),  # unbatched: [L, E] whatever the layout
]


@pytest.mark.parametrize(("options", "shapes", "self_attention"), ATTENTION_CASES)
@pytest.mark.parametrize("per_head", [False, True])
def test_attention_matches_float64_with_masks_and_weights(
    options: dict[str, Any], shapes: tuple[tuple[int, ...], ...], self_attention: bool, per_head: bool
) -> None:
    """Outputs, attention weights (averaged over the heads or per head) and every gradient against torch's module in
    float64, with float masks (``_MaskedSelfAttention`` above has boolean ones)."""
    torch.manual_seed(4)
    stock = nn.MultiheadAttention(8, 2, **options)
    det = to_d2(copy.deepcopy(stock))
    assert isinstance(det, d2_ops.DetMultiheadAttention)
    tensors = [torch.randn(shape) for shape in shapes]
    if self_attention:
        tensors = [tensors[0]] * 3
    batched = len(shapes[0]) == 3
    first = options.get("batch_first", False)
    length = shapes[0][1 if first else 0] if batched else shapes[0][0]
    source = shapes[1][1 if first else 0] if batched else shapes[1][0]
    n = shapes[0][0 if first else 1] if batched else 1
    attn_mask = torch.randn(length, source)
    padding = torch.zeros((n, source) if batched else (source,))
    padding[..., -1] = float("-inf")  # a float mask, as the float attention mask (torch warns when they differ)
    results = []
    for module, dtype in ((det, torch.float32), (stock.double(), torch.float64)):
        inputs_ = [t.detach().to(dtype).clone().requires_grad_(True) for t in tensors[:1]]
        if self_attention:
            q = k = v = inputs_[0]
        else:
            inputs_ = [t.detach().to(dtype).clone().requires_grad_(True) for t in tensors]
            q, k, v = inputs_
        masks = {"key_padding_mask": padding.to(dtype), "attn_mask": attn_mask.to(dtype)}
        out, weights = module(q, k, v, **masks, average_attn_weights=not per_head)
        assert weights is not None
        (out.sum() + (weights * torch.arange(weights.numel()).reshape(weights.shape).to(dtype)).sum()).backward()
        grads = [t.grad for t in inputs_] + [p.grad for p in module.parameters()]
        assert all(g is not None for g in grads)
        results.append([out.detach(), weights.detach(), *[g for g in grads if g is not None]])
    for a, b in zip(*results, strict=True):
        scale = max(float(b.abs().max()), 1e-6)
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batched", [True, False])
def test_recurrent_layers_match_float64_sequence_first_with_initial_states(
    kind: Callable[..., nn.RNNBase], batched: bool
) -> None:
    torch.manual_seed(6)
    stock = kind(3, 4, num_layers=2, bidirectional=True)
    det = to_d2(copy.deepcopy(stock))
    assert type(det).__name__ == f"Det{type(stock).__name__}"
    x = torch.randn((7, 2, 3) if batched else (7, 3))
    states = torch.randn((4, 2, 4) if batched else (4, 4))
    results = []
    for module, dtype in ((det, torch.float32), (stock.double(), torch.float64)):
        xi, hi, ci = (t.detach().to(dtype).clone().requires_grad_(True) for t in (x, states, states * 0.5))
        out, state = module(xi, (hi, ci) if kind is nn.LSTM else hi)
        finals = state if isinstance(state, tuple) else (state,)
        total = out.sum() + sum(((f * f).sum() for f in finals), torch.zeros((), dtype=dtype))
        total.backward()
        inputs_ = [xi, hi] + ([ci] if kind is nn.LSTM else [])
        grads = [t.grad for t in inputs_] + [p.grad for p in module.parameters()]
        assert all(g is not None for g in grads)
        results.append([out.detach(), *[f.detach() for f in finals], *[g for g in grads if g is not None]])
    assert results[0][0].shape == results[1][0].shape
    for a, b in zip(*results, strict=True):
        scale = max(float(b.abs().max()), 1e-6)
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * scale)


def test_recurrent_layers_refuse_packed_sequences() -> None:
    lstm = to_d2(nn.LSTM(3, 4))
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    with pytest.raises(ValueError, match="DetLSTM does not support packed sequences"):
        lstm(packed)


def test_attention_refuses_dropout_set_after_conversion() -> None:
    det = to_d2(nn.MultiheadAttention(4, 2))
    assert isinstance(det, d2_ops.DetMultiheadAttention)
    det.dropout = 0.1
    x = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="DetMultiheadAttention does not support dropout=0.1"):
        det(x, x, x)
    dropout = to_d2(nn.Dropout(0.0))
    assert isinstance(dropout, d2_ops.DetDropout) and dropout(x) is x
    dropout.p = 0.5
    with pytest.raises(ValueError, match="p=0.5"):
        dropout(x)


def test_cross_entropy_matches_torch_with_and_without_label_smoothing() -> None:
    torch.manual_seed(4)
    logits = torch.randn(9, 6) * 3.0
    target = torch.randint(0, 6, (9,))
    for smoothing in (0.0, 0.1):
        a = logits.clone().requires_grad_(True)
        b = logits.double().requires_grad_(True)
        loss = det_cross_entropy(a, target, label_smoothing=smoothing)
        ref = F.cross_entropy(b, target, label_smoothing=smoothing)
        loss.backward()  # type: ignore[no-untyped-call]
        ref.backward()  # type: ignore[no-untyped-call]
        assert loss.shape == ()
        torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="class indices in"):
        det_cross_entropy(logits, torch.full((9,), -100))
    with pytest.raises(ValueError, match=r"needs \[N, C\] logits"):
        det_cross_entropy(logits, target[:3])


# ---------------------------------------------------------------------------------------------- the scanner


def test_scanner_covers_the_reference_cnns_after_conversion() -> None:
    for factory in (models.vgg_like, models.resnet_like):
        model = factory()[0]
        before = dict(model.state_dict())
        assert scan_model(model).holds_after_conversion and not scan_model(model).holds
        report = scan_model(to_d2(model))
        assert report.holds, report.first_problem()
        after = model.state_dict()
        assert before.keys() == after.keys()
        assert all(before[k].data_ptr() == after[k].data_ptr() for k in before)


def test_scanner_covers_the_reference_lstm_after_conversion() -> None:
    lstm = models.lstm_small()[0]
    assert scan_model(lstm).holds_after_conversion and not scan_model(lstm).holds
    assert scan_model(to_d2(lstm)).holds, scan_model(lstm).first_problem()
    assert isinstance(lstm.lstm, d2_ops.DetLSTM)


def test_scanner_covers_the_reference_transformer_after_conversion() -> None:
    transformer = models.transformer_small()[0]
    before = scan_model(transformer)
    assert before.holds_after_conversion and not before.holds
    kinds = {f.kind for f in scan_model(to_d2(transformer)).findings}
    assert {"DetMultiheadAttention", "DetTransformerEncoderLayer", "DetDropout", "DetEmbedding"} <= kinds
    assert scan_model(transformer).holds, scan_model(transformer).first_problem()


def test_unsupported_configurations_stay_not_covered() -> None:
    cases = [
        (nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
        (nn.Embedding(5, 3, max_norm=1.0), "max_norm"),
        (nn.MaxPool2d(2, ceil_mode=True), "ceil_mode"),
        (nn.Softmax(), "dim=None"),
        (nn.InstanceNorm2d(4), "no D2 operator"),
        (nn.Conv3d(2, 2, 3), "Conv1d and Conv2d are covered"),
        (nn.Dropout(0.1), "p=0.1"),
        (nn.MultiheadAttention(4, 2, dropout=0.1), "dropout=0.1"),
        (nn.MultiheadAttention(4, 2, add_bias_kv=True), "add_bias_kv"),
        (nn.MultiheadAttention(4, 2, add_zero_attn=True), "add_zero_attn"),
        (nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, activation=torch.tanh), "activation 'tanh'"),
        (nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, activation=torch.tanh), "activation 'tanh'"),
        (nn.LSTM(4, 4, num_layers=2, dropout=0.5), "dropout=0.5"),
        (nn.LSTM(4, 4, proj_size=2), "proj_size=2"),
        (nn.LSTMCell(4, 4), "their cells are not"),
    ]
    for module, reason in cases:
        to_d2(module)
        finding = scan_model(module).findings[0]  # the module itself (then its children)
        assert finding.status is D2Status.NOT_COVERED and reason in finding.note, finding
    with pytest.raises(ValueError, match="output sizes that divide"):
        to_d2(nn.AdaptiveAvgPool2d(3))(torch.randn(1, 2, 7, 7))


# ---------------------------------------------------------------------------------------------- with the runtime


def train_d2(
    threads: int, steps: int = 2, device: str = "cpu", factory: Callable[[], models.ModelBundle] = models.resnet_like
) -> str:
    torch.set_num_threads(threads)
    torch.manual_seed(5)
    model, batch = factory()[:2]
    data = torch.utils.data.TensorDataset(*batch(16))  # type: ignore[arg-type]
    session = Session.local(None, num_workers=2, seed=5, level=DeterminismLevel.D2, device=device)
    model.to(session.device)
    assert not scan_model(model).holds
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = session.state(model, opt, data=data, batch_size=2)
    assert scan_model(model).holds  # the runtime converted it
    while state.step < steps:
        for x, y in state.batches():
            det_cross_entropy(model(x.to(session.device)), y.to(session.device)).backward()  # type: ignore[no-untyped-call]
        state.finish_step()
    return state.params_sha256()


@pytest.mark.parametrize(
    "factory", [models.resnet_like, models.transformer_small, models.lstm_small], ids=["resnet", "transformer", "lstm"]
)
def test_d2_training_gives_the_same_bits_at_1_and_4_threads(factory: Callable[[], models.ModelBundle]) -> None:
    assert train_d2(1, factory=factory) == train_d2(4, factory=factory)


# ---------------------------------------------------------------------------------------------- CPU == CUDA


@needs_cuda
@pytest.mark.parametrize(("fn", "ref", "x", "bound"), MATH_CASES, ids=[c[0].__name__ for c in MATH_CASES])
def test_cuda_math_gives_the_cpu_bits(
    fn: Callable[[torch.Tensor], torch.Tensor], ref: Callable[[np.ndarray], np.ndarray], x: torch.Tensor, bound: float
) -> None:
    assert bits(fn(x.cuda())) == bits(fn(x))


@needs_cuda
@pytest.mark.parametrize(("factory", "shape"), OPS, ids=OP_IDS)
def test_cuda_operator_gives_the_cpu_bits(factory: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    _, det = make_pair(factory)
    x, g = inputs(shape, det)
    _, det_gpu = make_pair(factory)
    cpu = run_op(det, x, g)
    gpu = run_op(det_gpu.cuda(), x.cuda(), g.cuda())
    assert [bits(t) for t in gpu] == [bits(t) for t in cpu]


@needs_cuda
def test_cuda_resnet_step_gives_the_cpu_bits() -> None:
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(6)
        model, batch = models.resnet_like()[:2]
        to_d2(model)
        x, y = batch(4)
        assert isinstance(x, torch.Tensor)
        model.to(device)
        loss = det_cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()  # type: ignore[no-untyped-call]
        results.append([bits(loss)] + [bits(p.grad) for p in model.parameters() if p.grad is not None])
    assert results[0] == results[1]


@needs_cuda
@pytest.mark.parametrize(
    "factory", [models.resnet_like, models.transformer_small, models.lstm_small], ids=["resnet", "transformer", "lstm"]
)
def test_cuda_d2_training_with_the_runtime_gives_the_cpu_bits(factory: Callable[[], models.ModelBundle]) -> None:
    """Two ESTs, the deterministic allreduce's CUDA kernels, the D2 operators and the optimizer on the GPU: the
    parameters after each number of steps are the CPU run's bits."""
    for steps in (1, 3):
        assert train_d2(1, steps, device="cuda", factory=factory) == train_d2(1, steps, factory=factory)


@pytest.mark.parametrize(("m", "n", "k"), [(7, 13, 45), (130, 11, 1100)])
def test_product_is_the_fixed_order_reference_for_blocks_chunks_and_threads(m: int, n: int, k: int) -> None:
    """Panels of 8 outputs with a partial one, k chunked (1100 > 512) with a tail, rows split over threads."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((m, k)) * 10.0 ** rng.integers(-3, 4, (m, k))).astype(np.float32)
    b = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-3, 4, (n, k))).astype(np.float32)
    ref = ref_matmul_nt(a, b).tobytes()
    for threads in (1, 4):
        torch.set_num_threads(threads)
        assert d2_math.det_matmul_nt(torch.from_numpy(a), torch.from_numpy(b)).numpy().tobytes() == ref


@pytest.mark.parametrize("threads", [1, 4])
def test_batched_product_gives_each_entrys_product_bits(threads: int) -> None:
    """Strided operands (a transposed view, a slice of a larger tensor), enough work to split over threads, and an
    empty batch: every entry is det_matmul_nt's bits for that entry alone."""
    torch.set_num_threads(threads)
    torch.manual_seed(9)
    a = torch.randn(12, 40, 70)[:, 3:33, 5:69]  # [12, 30, 64], strided
    b = torch.randn(12, 64, 50).transpose(1, 2)  # [12, 50, 64], k strided
    out = d2_math.det_bmm_nt(a, b)
    assert out.shape == (12, 30, 50)
    for i in range(12):
        assert bits(out[i]) == bits(d2_math.det_matmul_nt(a[i].contiguous(), b[i].contiguous()))
    assert d2_math.det_bmm_nt(torch.empty(0, 3, 4), torch.empty(0, 5, 4)).shape == (0, 3, 5)
    with pytest.raises(ValueError, match=r"needs \[B, m, k\] and \[B, n, k\]"):
        d2_math.det_bmm_nt(torch.randn(2, 3, 4), torch.randn(3, 3, 4))


@pytest.mark.parametrize("seed", range(8))
def test_convolution_products_read_in_place_give_the_gathered_products_bits(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every product of a convolution's forward and backward (patch rows, the transposed convolution's windows per
    phase, patch columns) reads its operands in place from the padded images, all groups at once: each group's
    product gives the bits of gathering that group's operands into matrices first and multiplying them, on random
    shapes, groups, strides, paddings and dilations, at 1 and 3 threads."""
    checked: list[tuple[int, int]] = []
    in_place = d2_math.det_matmul_nt_groups

    def both(
        a: torch.Tensor, b: torch.Tensor, *, a_rows: int = 1, b_rows: int = 1, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        result = in_place(a, b, a_rows=a_rows, b_rows=b_rows, out=out)  # with out: written as NCHW planes
        k = a.shape[a_rows + 1 :].numel()
        for g in range(a.shape[0]):
            gathered = d2_math.det_matmul_nt(a[g].reshape(-1, k).contiguous(), b[g].reshape(-1, k).contiguous())
            assert bits(result[g].reshape(gathered.shape)) == bits(gathered)
        checked.append((a_rows, b_rows))
        return result

    monkeypatch.setattr(d2_ops, "det_matmul_nt_groups", both)
    rng = np.random.default_rng(seed)
    groups = (1, 2, 3, 1, 2, 3, 5, 7)[seed]
    per_group = 1 if seed >= 6 else int(rng.integers(1, 8))  # the last two depthwise (one channel per group)
    n, c, o = int(rng.integers(1, 4)), groups * per_group, groups * int(rng.integers(1, 24))
    kernel = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    conv = nn.Conv2d(
        c,
        o,
        kernel,
        stride=(int(rng.integers(1, 3)), int(rng.integers(1, 3))),
        padding=(int(rng.integers(0, 3)), int(rng.integers(0, 3))),
        dilation=(int(rng.integers(1, 3)), int(rng.integers(1, 3))),
        groups=groups,
    )
    det = to_d2(copy.deepcopy(conv))
    x = torch.randn(n, c, int(rng.integers(6, 14)), int(rng.integers(6, 14)), requires_grad=True)
    for threads in (1, 3):
        torch.set_num_threads(threads)
        det(x).square().sum().backward()
    # the forward's, the input gradient's and the weight gradient's products, each with its view as the second operand
    assert len(checked) >= 6 and set(checked) == {(1, 3)}


@pytest.mark.parametrize(
    ("shape", "affine"),
    [
        ((6, 3), True),
        ((5, 4, 7), False),
        ((3, 5, 6, 7), True),
        ((4, 3, 8, 8), True),
        ((2, 3, 3, 5, 4), False),
        # rows in groups of 16 across samples (a last partial group), rows halved in place before the group's tails
        ((3, 2, 20, 33), True),
        ((2, 3, 9, 64), False),
        ((5, 2, 32, 32), True),
        ((3, 2, 17, 1), True),
        ((2, 2, 5, 3, 24), True),
        ((3, 2, 40), False),
    ],
)
def test_batch_norm_kernel_gives_the_definitions_bits(shape: tuple[int, ...], affine: bool) -> None:
    """The C batch norm (three passes forward, two backward) against its definition in torch operations (the CUDA
    path): the same bits for every output, trees padded to a power of two over every dimension, signed zeros and
    values spread over many binades included, with and without weight and bias."""
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())
    x.view(-1)[::5] = -0.0
    g = torch.randn(shape, generator=gen)
    g.view(-1)[::3] = -0.0
    c = shape[1]
    weight = torch.randn(c, generator=gen) if affine else None
    bias = torch.randn(c, generator=gen) if affine else None
    got = d2_math.batch_norm_train(x, weight, bias, 1e-5)
    want = d2_math.batch_norm_train_torch(x, weight, bias, 1e-5)
    for name, a, b in zip(got._fields, got, want, strict=True):
        assert bits(a) == bits(b), name
    for want_gx in (True, False):
        got_b = d2_math.batch_norm_train_backward(g, want.xhat, want.invstd, weight, want_gx)
        want_b = d2_math.batch_norm_train_backward_torch(g, want.xhat, want.invstd, weight, want_gx)
        assert (got_b[0] is None) == (not want_gx)
        assert [None if t is None else bits(t) for t in got_b] == [None if t is None else bits(t) for t in want_b]


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "padding", "dilation"),
    [
        ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1)),
        ((2, 3, 9, 7), (3, 3), (2, 2), (1, 1), (1, 1)),
        ((1, 2, 10, 11), (3, 2), (1, 2), (1, 1), (2, 1)),
        ((3, 1, 5, 6), (2, 3), (1, 1), (1, 0), (1, 2)),
        ((2, 2, 7, 7), (3, 3), (1, 1), (1, 1), (1, 1)),
    ],
)
def test_max_pool_kernel_gives_the_definitions_bits(
    shape: tuple[int, int, int, int],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> None:
    """The C max pool against its definition in torch operations (the CUDA path): the same output bits and offsets,
    and the same input gradient bits, with ties (values drawn from a few), signed zeros, NaNs, infinities,
    overlapping windows (a position then adds up to 9 gradients, in the offsets' order: another order rounds
    differently) and padding."""
    gen = torch.Generator().manual_seed(shape[2] * 10 + kernel[0])
    x = torch.randint(-3, 4, shape, generator=gen).float()
    x.view(-1)[::7] = -0.0
    x.view(-1)[::11] = float("nan")
    x.view(-1)[::13] = float("-inf")
    window = d2_ops.Window(kernel, stride, padding, dilation)
    got, got_idx = d2_ops.max_pool(x, window)
    want, want_idx = d2_ops.max_pool_torch(x, window)
    assert bits(got) == bits(want)
    assert bits(got_idx) == bits(want_idx)
    g = torch.randn(want.shape, generator=gen) * torch.exp2(torch.randint(-30, 30, want.shape, generator=gen).float())
    g.view(-1)[::3] = -0.0
    g.view(-1)[::17] = float("inf")
    h, w = shape[2], shape[3]
    got_g = d2_ops.max_pool_backward(g, want_idx, h, w, window)
    want_g = d2_ops.max_pool_backward_torch(g, want_idx, h, w, window)
    assert bits(got_g) == bits(want_g)


def test_det_sqrt_is_correctly_rounded() -> None:
    """Against NumPy's float32 square root (IEEE's correctly rounded one) over a sweep of binades, the input where
    torch's float32 sqrt on this project's CPU is 1 ulp off, zeros, infinity and a negative number."""
    special = np.array([1.041375994682312, 0.0, -0.0, np.inf, -1.0, 2.0**-149, 3.4e38], np.float32)
    x = np.concatenate([special, (np.random.default_rng(2).random(200_000) * np.exp2(np.arange(200_000) % 80 - 40))])
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        want = np.sqrt(x)
    got = d2_math.det_sqrt(torch.from_numpy(x)).numpy()
    assert np.isnan(got[4]) and np.isnan(want[4])  # a NaN (its sign bit is not defined the same way everywhere)
    assert np.delete(got, 4).tobytes() == np.delete(want, 4).tobytes()


def test_a_grouped_convolution_is_its_groups_convolutions_side_by_side() -> None:
    """D2's definition of a grouped convolution: group g's output channels are, bit for bit, the one-group D2
    convolution of its input channels by its filters (and so are the gradients of its input and parameters)."""
    torch.manual_seed(4)
    grouped = nn.Conv2d(6, 9, 3, padding=1, groups=3)
    to_d2(grouped)  # (in place: the class swapped)
    x = torch.randn(2, 6, 5, 5, requires_grad=True)
    g = torch.randn(2, 9, 5, 5)
    y = grouped(x)
    y.backward(g)
    assert x.grad is not None and grouped.weight.grad is not None and grouped.bias is not None
    assert grouped.bias.grad is not None
    for k in range(3):
        one = nn.Conv2d(2, 3, 3, padding=1)
        to_d2(one)
        assert one.bias is not None
        with torch.no_grad():
            one.weight.copy_(grouped.weight[3 * k : 3 * k + 3])
            one.bias.copy_(grouped.bias[3 * k : 3 * k + 3])
        xk = x.detach()[:, 2 * k : 2 * k + 2].clone().requires_grad_(True)
        yk = one(xk)
        yk.backward(g[:, 3 * k : 3 * k + 3])
        assert bits(yk.detach()) == bits(y.detach()[:, 3 * k : 3 * k + 3])
        assert xk.grad is not None and one.weight.grad is not None and one.bias.grad is not None
        assert bits(xk.grad) == bits(x.grad[:, 2 * k : 2 * k + 2])
        assert bits(one.weight.grad) == bits(grouped.weight.grad[3 * k : 3 * k + 3])
        assert bits(one.bias.grad) == bits(grouped.bias.grad[3 * k : 3 * k + 3])


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "dilation"),
    [
        ((16, 16), (3, 3), (1, 1), (1, 1), (1, 1)),  # MobileNet's 3 x 3: one run of 16 outputs per row
        ((23, 37), (3, 3), (2, 2), (1, 1), (1, 1)),  # strided: four phases in the input's gradient; a ragged run
        ((9, 40), (5, 3), (1, 3), (2, 0), (2, 1)),  # uneven kernel, stride and dilation, no padding across
        ((1, 50), (1, 9), (1, 1), (0, 4), (1, 1)),  # Conv1d's shape: 9 taps, the ninth in lane 0 again
        ((7, 7), (7, 7), (1, 1), (3, 3), (1, 1)),  # 49 taps: lanes reached six or seven times
        ((5, 6), (2, 2), (3, 3), (0, 0), (1, 1)),  # stride beyond the kernel: positions no window reaches
    ],
)
def test_depthwise_convolutions_give_the_grouped_products_bits(
    size: tuple[int, int],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A depthwise convolution on the CPU runs its output and its input's gradient by the stencil kernel: every value
    bit for bit the one-channel products of the grouped convolution (its definition), on 1 and 3 threads, with
    signed zeros and values of very different magnitudes in the image, the filters and the output's gradient."""
    gen = torch.Generator().manual_seed(sum(size) + sum(kernel))
    channels = 5

    def values(*shape: int) -> torch.Tensor:
        v = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape, generator=gen).float())
        v.view(-1)[::11] = -0.0
        return v

    conv = nn.Conv2d(channels, channels, kernel, stride, padding, dilation, groups=channels)
    with torch.no_grad():
        conv.weight.copy_(values(*conv.weight.shape))
    to_d2(conv)  # (in place: the class swapped)
    det = conv
    x = values(3, channels, *size)
    assert d2_ops._depthwise_ext(x, det.weight, channels) is not None  # (the stencil route runs)
    out_shape = det(x).shape
    g = values(*out_shape)

    def step() -> list[torch.Tensor]:
        xr = x.clone().requires_grad_(True)
        det.zero_grad()
        y = det(xr)
        y.backward(g)
        assert xr.grad is not None and det.weight.grad is not None and det.bias is not None
        assert det.bias.grad is not None
        return [t.detach().clone() for t in (y, xr.grad, det.weight.grad, det.bias.grad)]

    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(step())
        with monkeypatch.context() as m:
            m.setattr(d2_ops, "_depthwise_ext", lambda *_: None)  # the grouped products, one channel per group
            definition = step()
    finally:
        torch.set_num_threads(before)
    for got in results:
        for a, b in zip(got, definition, strict=True):
            assert bits(a) == bits(b)


def test_stencil_kernels_refuse_windows_outside_the_plane() -> None:
    """The kernel checks that every window lies inside its plane and every output inside out (it runs as the
    caller's process: a read past the buffer would be a crash, not an exception)."""
    ext = d2_math.c_kernels()
    img, weights = np.zeros((2, 4, 5), np.float32), np.ones((1, 2), np.float32)
    out = np.zeros((2, 3, 4), np.float32)
    offsets = np.array([0, 6], np.int64)
    ext.stencil(img, weights, offsets, out, np.array([2, 4, 5, 1, 0, 0, 1, 1, 3, 4, 0, 12, 4, 1], np.int64), 1)
    with pytest.raises(ValueError, match="a window outside its plane"):
        ext.stencil(img, weights, offsets, out, np.array([2, 4, 5, 1, 1, 0, 1, 1, 3, 4, 0, 12, 4, 1], np.int64), 1)
    with pytest.raises(ValueError, match="an output outside out"):
        ext.stencil(img, weights, offsets, out, np.array([2, 4, 5, 1, 0, 0, 1, 1, 3, 4, 1, 12, 4, 1], np.int64), 1)
    with pytest.raises(ValueError, match="size mismatch"):
        ext.stencil(img, np.ones((1, 3), np.float32), offsets, out,
                    np.array([2, 4, 5, 1, 0, 0, 1, 1, 3, 4, 0, 12, 4, 1], np.int64), 1)  # fmt: skip
    with pytest.raises(ValueError, match="geometry of 14 int64 values"):
        ext.stencil(img, weights, offsets, out, np.array([2, 4, 5, 1, 0, 0, 0, 1, 3, 4, 0, 12, 4, 1], np.int64), 1)
    grads = np.zeros((1, 2), np.float32)
    g = np.zeros((2, 1, 3, 4), np.float32)
    ext.stencil_weight_grad(img, g, offsets, grads, np.array([2, 1, 4, 5, 0, 0, 1, 1, 3, 4], np.int64), 1)
    with pytest.raises(ValueError, match="a window outside its plane"):
        ext.stencil_weight_grad(img, g, offsets, grads, np.array([2, 1, 4, 5, 1, 0, 1, 1, 3, 4], np.int64), 1)
    with pytest.raises(ValueError, match="size mismatch"):
        ext.stencil_weight_grad(img, g, offsets, grads, np.array([2, 1, 4, 5, 0, 0, 1, 1, 3, 3], np.int64), 1)
