"""Device-independent arithmetic for D2 (EasyScale §3.3): the building blocks of :mod:`hpc_elastic.est.d2_ops`.

Why these give the same bits on every CPU and CUDA GPU
=======================================================
Between two IEEE-754 machines the results of a float32 program differ only through (1) the order of a
reduction, (2) contraction of a multiply and an add into one FMA, (3) transcendental functions (libm and CUDA's
math library round differently), (4) tie-breaking and (5) atomics.  A *single* IEEE operation (``+ - * /``,
``sqrt``, comparisons, min/max, copies, gathers without accumulation, exact integer work on the bits) is correctly
rounded everywhere, and torch's eager element-wise kernels run one such operation per element and per call,
with one exception found on this project's CPU: torch's float32 ``sqrt`` there is not correctly rounded, so the
square root is taken in float64 and rounded (:func:`det_sqrt`).  So everything here is built from

- such single-operation torch calls (never ``alpha=``, ``addcmul``, ``lerp``, ``rsqrt``, ``torch.exp`` and its
  relatives, nor a division by a Python number, which CUDA turns into a multiplication by the reciprocal);
  constants are float32 numbers, so multiplying by one is one rounding on every device;
- :func:`det_matmul_nt`, the fixed-order 8-lane dot products of ``kernels/detreduce.c`` and its CUDA twin
  ``kernels/detreduce_cuda.cu`` (each lane step one fused multiply-add, written out: a single correctly rounded
  operation like the others, never the compiler's contraction);
- :func:`det_sum`, a reduction whose tree is fixed by the length alone: the dimension is padded with +0.0 to a
  power of two and halved by element-wise additions (log2(n) kernels, the same tree on any device and with any
  number of threads).

The transcendental functions are evaluated by fixed formulas from those operations: :func:`det_exp` and
:func:`det_expm1` (Cody-Waite reduction with a 15-bit ``ln2_hi`` so that ``k * ln2_hi`` is exact, a degree-8
polynomial in Horner form, ``2^k`` built from integer bits in two exact factors), :func:`det_log` (exponent and
mantissa from the bits, ``log1p`` of the mantissa by the ``atanh`` series), :func:`det_erfc`/:func:`det_erf`
(Maclaurin series below 0.5, the Numerical Recipes Chebyshev fit of ``erfc`` above, fractional error 1.2e-7) and,
from them, :func:`det_sigmoid` and :func:`det_tanh`.  Measured against float64 over a dense sweep
(``tests/unit/est/test_d2_ops.py`` asserts the bounds): exp, expm1, log, sigmoid and tanh within 2 ulps, erfc
within 4 and erf within 2.  Results out of the normal float32 range are clamped by selection: ``det_exp`` of
``x < -87.34`` is 0 and of ``x > 88.72`` is inf; NaN stays NaN.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.detsum import PART_VALUES, c_extension, cpu_kernels
from hpc_elastic.est.gpu import cuda_extension


def f32(value: float) -> float:
    """``value`` rounded to float32 (a Python float): multiplying a float32 tensor by it is one rounding anywhere."""
    return float(np.float32(value))


LOG2E = f32(1.4426950408889634)
LN2_HI = f32(0.693145751953125)  # 0x3f317200: 15 significant bits, so k * LN2_HI is exact for |k| <= 256
LN2_LO = f32(0.6931471805599453 - 0.693145751953125)
#: float32 bounds of exp's normal results: exp(EXP_LO) is the smallest normal, exp(EXP_HI) the largest finite
EXP_LO = f32(-87.33654475)
EXP_HI = f32(88.72283905)
SQRT2 = f32(1.4142135623730951)
TINY = f32(2.0**-126)
#: Taylor coefficients 1/2!, 1/3!, ... 1/8! of expm1(r) = r + r^2 * P(r) on |r| <= ln2 / 2
_EXPM1_P = tuple(f32(1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64)))) for n in range(2, 9))
#: atanh(s) = s * (1 + s^2 / 3 + s^4 / 5 + ...), |s| <= 0.172 (log1p of the mantissa, up to s^12)
_ATANH_P = tuple(f32(1.0 / n) for n in (3, 5, 7, 9, 11, 13))
TWO_OVER_SQRT_PI = f32(1.1283791670955126)
#: erf(z) = 2/sqrt(pi) * z * (1 - z^2/3 + z^4/10 - ...), |z| < 0.5 (up to z^15)
_ERF_P = tuple(
    f32((-1.0) ** n / (float(np.prod(np.arange(1, n + 1, dtype=np.float64))) * (2 * n + 1))) for n in range(1, 8)
)
#: Numerical Recipes' erfcc: erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2), z >= 0, fractional error < 1.2e-7
_ERFC_P = tuple(
    f32(c)
    for c in (
        -1.26551223,
        1.00002368,
        0.37409196,
        0.09678418,
        -0.18628806,
        0.27886807,
        -1.13520398,
        1.48851587,
        -0.82215223,
        0.17087277,
    )
)
ERF_SMALL = f32(0.5)
#: the constants of exp's C kernel, in its order (kernels/detreduce.c)
_EXP_CONSTANTS = np.array([LOG2E, LN2_HI, LN2_LO, EXP_LO, EXP_HI, *_EXPM1_P], dtype=np.float32)


#: below this many multiply-adds a product runs on the calling thread
PARALLEL_MIN_WORK = 1 << 20


def _threads(count: int, work: int) -> int:
    """The threads a product of ``work`` multiply-adds cut into ``count`` whole items runs on: torch's, at most one
    per item, or one below :data:`PARALLEL_MIN_WORK`."""
    return 1 if work < PARALLEL_MIN_WORK else max(1, min(torch.get_num_threads(), count))


def _cuts(count: int, threads: int) -> list[tuple[int, int]]:
    """[0, count) in ``threads`` ranges of whole items."""
    return list(itertools.pairwise(count * t // threads for t in range(threads + 1)))


def _geometry(t: torch.Tensor, row_dims: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``t``'s storage as a flat float32 array and the geometry that names ``t`` in it as a matrix (its first
    ``row_dims`` dimensions the rows), for ``matmul_nt_view``: the kernel reads the view in place."""
    flat = t.as_strided((t.untyped_storage().nbytes() // 4,), (1,), 0)
    sizes, strides = list(t.shape), list(t.stride())
    geometry = np.array([t.storage_offset(), row_dims, t.dim() - row_dims, *sizes, *strides], dtype=np.int64)
    return flat.numpy(), geometry


def det_matmul_nt(
    a: torch.Tensor, b: torch.Tensor, *, a_rows: int = 1, b_rows: int = 1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b.T`` with the fixed summation order of ``kernels/`` (float32), where ``a`` is ``[*rows, *k]`` with
    its first ``a_rows`` dimensions the rows (row-major), and ``b`` likewise: a 2-D matrix by default, or any view
    (a convolution's patches as a strided view of its padded image), which the CPU kernel reads in place, chunk by
    chunk, instead of gathering it first (the same operations per output: only where the operands are read from
    changes).

    On the CPU the product is cut into one part per ``torch.get_num_threads()`` thread, along b's first dimension
    or a's rows, and the parts run in one C call on the OpenMP runtime's threads (torch's team: kernels/README.md,
    "Threads"); every output is formed whole by one part, so the bits do not depend on the cut.

    ``out``: where to write, an [m, S, seg] float32 view whose last dimension is contiguous (S * seg = n, output
    (i, j) at ``out[i, j // seg, j % seg]``), returned: a convolution's [O, N, Ho * Wo] product written as whole
    planes of its NCHW output (on the CPU in place, without the [m, n] matrix and its copy)."""
    _check_operands(a, b, a_rows, b_rows, grouped=False)
    m, n, k = a.shape[:a_rows].numel(), b.shape[:b_rows].numel(), a.shape[a_rows:].numel()
    if out is not None:
        _check_out(out, (), m, n, a.device)
    a, b = a.detach(), b.detach()
    if a.device.type == "cuda":
        out_gpu: torch.Tensor = cuda_extension().matmul_nt(a.reshape(m, k).contiguous(), b.reshape(n, k).contiguous())
        return out_gpu if out is None else out.copy_(out_gpu.reshape(out.shape))
    _check_cpu(a)
    result = torch.empty((m, n), dtype=torch.float32) if out is None else out
    if m and n:
        _run_groups(a, b, a_rows, b_rows, result, planes=out is not None, groups=1, steps=(0, 0, 0))
    return result


def det_matmul_nt_groups(
    a: torch.Tensor, b: torch.Tensor, *, a_rows: int = 1, b_rows: int = 1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a[g] @ b[g].T`` for every group g of ``a`` [G, *rows, *k] and ``b`` [G, *rows, *k] (the first dimension the
    group, any strides; a group's rows and k as in :func:`det_matmul_nt`): each group's product is one
    :func:`det_matmul_nt` product, so its bits depend on its operands alone.  A grouped convolution's groups are
    views of one padded image and one weight that differ by an offset, so all groups run in one C call (no copy per
    group, no call per group); a batched product (:func:`det_bmm_nt`) is the case of one row dimension.

    Returns [G, m, n], or writes ``out``, a [G, m, S, seg] view whose last dimension is contiguous (group g's output
    (i, j) at ``out[g, i, j // seg, j % seg]``), and returns it.  On a GPU: one launch of the batched CUDA product
    on contiguous copies (the same bits per output)."""
    if a.dim() < 1 or b.dim() < 1 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"det_matmul_nt_groups needs operands with the same groups, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    _check_operands(a, b, a_rows, b_rows, grouped=True)
    groups = a.shape[0]
    m, n, k = a.shape[1 : a_rows + 1].numel(), b.shape[1 : b_rows + 1].numel(), a.shape[a_rows + 1 :].numel()
    if out is not None:
        _check_out(out, (groups,), m, n, a.device)
    a, b = a.detach(), b.detach()
    if a.device.type == "cuda":
        product: torch.Tensor = cuda_extension().bmm_nt(
            a.reshape(groups, m, k).contiguous(), b.reshape(groups, n, k).contiguous()
        )
        return product if out is None else out.copy_(product.reshape(out.shape))
    _check_cpu(a)
    result = torch.empty((groups, m, n), dtype=torch.float32) if out is None else out
    if groups and m and n:
        steps = (a.stride(0), b.stride(0), result.stride(0))
        _run_groups(a[0], b[0], a_rows, b_rows, result[0], planes=out is not None, groups=groups, steps=steps)
    return result


def _check_operands(a: torch.Tensor, b: torch.Tensor, a_rows: int, b_rows: int, *, grouped: bool) -> None:
    """ValueError unless ``a`` and ``b`` are ``[*rows, *k]`` float32 operands with the same k (``grouped``: behind
    their first dimension, the group), on one device."""
    a_shape, b_shape = (a.shape[1:], b.shape[1:]) if grouped else (a.shape, b.shape)
    if not (0 < a_rows < len(a_shape) and 0 < b_rows < len(b_shape)) or (
        a_shape[a_rows:].numel() != b_shape[b_rows:].numel()
    ):
        raise ValueError(
            f"det_matmul_nt needs [*rows, *k] operands with the same k, got {tuple(a_shape)} (rows: {a_rows} dims) "
            f"and {tuple(b_shape)} (rows: {b_rows} dims)"
        )
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"det_matmul_nt supports float32 only, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"operands on different devices: {a.device} and {b.device}")


def _check_out(out: torch.Tensor, lead: tuple[int, ...], m: int, n: int, device: torch.device) -> None:
    """ValueError unless ``out`` is a ``[*lead, m, S, seg]`` float32 view on ``device`` with S * seg = n and a
    contiguous last dimension."""
    d = len(lead)
    if (
        out.dim() != d + 3
        or tuple(out.shape[:d]) != lead
        or out.shape[d] != m
        or out.shape[d + 1] * out.shape[d + 2] != n
        or out.stride(d + 2) != 1
        or out.dtype != torch.float32
        or out.device != device
    ):
        want = "[G, m, S, seg]" if lead else "[m, S, seg]"
        raise ValueError(
            f"det_matmul_nt's out must be a {want} float32 view with S * seg = n and a contiguous last dimension on "
            f"{device}, for {'G = ' + str(lead[0]) + ', ' if lead else ''}m = {m}, n = {n}: got {tuple(out.shape)}, "
            f"strides {out.stride()}"
        )


def _check_cpu(a: torch.Tensor) -> None:
    if a.device.type != "cpu":
        raise ValueError(f"no D2 kernel for device {a.device}")


def _run_groups(
    a: torch.Tensor,
    b: torch.Tensor,
    a_rows: int,
    b_rows: int,
    out: torch.Tensor,
    *,
    planes: bool,
    groups: int,
    steps: tuple[int, int, int],
) -> None:
    """The CPU product of ``a`` and ``b`` (group 0's views, non-empty) into ``out`` (group 0's: a plain [m, n]
    result, or with ``planes`` an [m, S, seg] view), and of every further group at its ``steps`` (the offsets in
    elements from one group's a, b and out to the next's): group 0's parts, then the same parts of each group,
    in one C call on the OpenMP runtime's threads.  With fewer groups than threads, each group's product is cut
    into parts for the threads; else each group is one part."""
    m, n, k = a.shape[:a_rows].numel(), b.shape[:b_rows].numel(), a.shape[a_rows:].numel()
    an, ag = _geometry(a, a_rows)
    bn, bg = _geometry(b, b_rows)
    on = out.as_strided((out.untyped_storage().nbytes() // 4,), (1,), 0).numpy()
    if planes:
        where = (int(out.storage_offset()), out.stride(0), out.shape[2], out.stride(1))
    else:
        where = (int(out.storage_offset()), n, n, 0)  # rows n apart, one segment of n
    per_group = -(-torch.get_num_threads() // groups)
    parts = _parts(
        int(ag[0]), int(bg[0]), b_step=b.stride(0), items=b.shape[0], m=m, n=n, k=k, where=where, plain=not planes,
        cuts=per_group,
    )  # fmt: skip
    table = np.array(parts, dtype=np.int64)
    if groups > 1:
        shift = np.zeros(PART_VALUES, dtype=np.int64)
        shift[[0, 1, 5]] = steps
        table = (table[None, :, :] + np.arange(groups, dtype=np.int64)[:, None, None] * shift).reshape(-1, PART_VALUES)
    threads = _threads(len(table), groups * m * n * k)
    cpu_kernels().matmul_nt_parts(an, ag, bn, bg, on, parts=table, threads=threads)


def _parts(
    a_at: int,
    b_at: int,
    *,
    b_step: int,
    items: int,
    m: int,
    n: int,
    k: int,
    where: tuple[int, int, int, int],
    plain: bool,
    cuts: int,
) -> list[tuple[int, ...]]:
    """``matmul_nt_parts``' parts of one product (a at ``a_at``, b at ``b_at``, b's first dimension ``items`` of
    ``b_step`` elements; the output where ``where`` = [offset, row stride, seg, seg stride] says): at most ``cuts``
    parts, along the operand read less often: b's first dimension (whole output columns) when it is the larger and
    has enough items for the cuts (or as many as a has rows), so that each part reads a part of b and all of a; else
    a's rows. An output is formed whole by one part either way (the same operations), so the bits do not depend on
    the cut."""
    inner = n // items if items else 0
    enough = items >= 2 and items >= min(cuts, m)
    if n > m and enough and (plain or inner % where[2] == 0):

        def columns(lo: int, hi: int) -> tuple[int, int, int, int]:
            """Where b's items [lo, hi) write: in a plain [m, n] result, rows of their width n apart; in out's
            planes, their whole segments."""
            if plain:
                return lo * inner, n, (hi - lo) * inner, 0
            return where[0] + lo * inner // where[2] * where[3], where[1], where[2], where[3]

        count = min(cuts, _threads(items, m * n * k))
        return [(a_at, b_at + lo * b_step, hi - lo, 0, m, *columns(lo, hi)) for lo, hi in _cuts(items, count)]
    count = min(cuts, _threads(m, m * n * k))
    return [(a_at, b_at, items, lo, hi, *where) for lo, hi in _cuts(m, count)]


def det_bmm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[i] @ b[i].T`` for every i of [B, m, k] and [B, n, k] float32 operands (any strides): each entry is one
    :func:`det_matmul_nt` product, so an entry's result depends on its operands alone (:func:`det_matmul_nt_groups`
    with one row dimension: on the CPU one geometry whose offset moves, the parts on the OpenMP runtime's threads;
    on a GPU all entries in one launch of the CUDA twin)."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(
            f"det_bmm_nt needs [B, m, k] and [B, n, k] operands, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return det_matmul_nt_groups(a, b)


def det_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` by a fixed pairwise tree: pad with +0.0 to a power of two, then halve with element-wise
    additions (element i of the first half plus element i of the second).  The tree depends on the length only."""
    dim = dim % x.dim() if x.dim() else 0
    n = x.shape[dim]
    if n == 0:
        shape = list(x.shape)
        shape[dim] = 1
        out = x.new_zeros(shape)
        return out if keepdim else out.squeeze(dim)
    width = 1 << (n - 1).bit_length()
    if width != n:
        shape = list(x.shape)
        shape[dim] = width - n
        x = torch.cat([x, x.new_zeros(shape)], dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x if keepdim else x.squeeze(dim)


def det_sum_dims(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool = False) -> torch.Tensor:
    """:func:`det_sum` over several dimensions, the last one first (a fixed order of fixed trees)."""
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = det_sum(x, d, keepdim=keepdim)
    return x


def bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel [C] vector shaped [1, C, 1, ...] against an [N, C, ...] input."""
    return v.reshape(1, -1, *([1] * (like.dim() - 2)))


def channel_dims(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions a batch norm reduces: all but the channels (1)."""
    return (0, *range(2, x.dim()))


@lru_cache(maxsize=1)
def c_kernels() -> Any:
    """The C extension, whose batch norm and max pool kernels run the operations of their torch definitions in fewer
    passes; None if not built."""
    try:
        return c_extension()
    except HpcElasticError:
        return None


def _empty_if_none(v: torch.Tensor | None) -> np.ndarray[Any, Any]:
    return np.empty(0, np.float32) if v is None else v.detach().contiguous().numpy()


class BatchNormForward(NamedTuple):
    y: torch.Tensor
    xhat: torch.Tensor
    mean: torch.Tensor
    sq: torch.Tensor
    invstd: torch.Tensor


def batch_norm_train_torch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> BatchNormForward:
    """Batch norm's training forward over [N, C, ...] by its definition: ``mean = det_sum_dims(x) / count``,
    ``sq = det_sum_dims((x - mean)^2)``, ``invstd = 1 / sqrt(sq / count + eps)``, ``xhat = (x - mean) * invstd``,
    ``y = xhat * weight + bias``, every operation one rounding (the CUDA path, and the reference of the C kernel)."""
    dims = channel_dims(x)
    count = x.numel() // x.shape[1]
    mean = div_count(det_sum_dims(x, dims), count)
    d = x - bcast(mean, x)
    sq = det_sum_dims(d * d, dims)
    invstd = reciprocal(det_sqrt(div_count(sq, count) + f32(eps)))
    xhat = d * bcast(invstd, x)
    y = xhat
    if weight is not None:
        y = y * bcast(weight, x)
    if bias is not None:
        y = y + bcast(bias, x)
    return BatchNormForward(y, xhat, mean, sq, invstd)


def batch_norm_train(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> BatchNormForward:
    """:func:`batch_norm_train_torch`'s operations; on the CPU by the C kernel in three passes per channel (the same
    trees, the same operations per element: the same bits), the channels shared out between torch's threads."""
    ext = c_kernels()
    if x.device.type != "cpu" or ext is None:
        return batch_norm_train_torch(x, weight, bias, eps)
    xc = x.detach().contiguous()
    n, c = xc.shape[0], xc.shape[1]
    y, xhat = torch.empty_like(xc), torch.empty_like(xc)
    mean, sq, invstd = (torch.empty(c, dtype=torch.float32) for _ in range(3))
    sizes = np.array(xc.shape[2:], np.int64)
    ext.batch_norm_forward(
        xc.numpy(), y.numpy(), xhat.numpy(), mean.numpy(), sq.numpy(), invstd.numpy(),
        _empty_if_none(weight), _empty_if_none(bias), n, c, sizes, f32(eps), torch.get_num_threads(),
    )  # fmt: skip
    return BatchNormForward(y, xhat, mean, sq, invstd)


def batch_norm_train_backward_torch(
    g: torch.Tensor, xhat: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None, want_gx: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(gx, gw, gb) of :func:`batch_norm_train_torch` by its definition: ``gb = det_sum_dims(g)``,
    ``gw = det_sum_dims(g * xhat)``, ``gx = ((g w - gb w / count) - xhat (gw w / count)) invstd``."""
    dims = channel_dims(xhat)
    count = xhat.numel() // xhat.shape[1]
    gb = det_sum_dims(g, dims)
    gw = det_sum_dims(g * xhat, dims)
    if not want_gx:
        return None, gw, gb
    gxhat, sum_g, sum_gx = g, gb, gw
    if weight is not None:
        gxhat = g * bcast(weight, xhat)
        sum_g = gb * weight
        sum_gx = gw * weight
    gx = gxhat - bcast(div_count(sum_g, count), xhat)
    gx = gx - xhat * bcast(div_count(sum_gx, count), xhat)
    return gx * bcast(invstd, xhat), gw, gb


def batch_norm_train_backward(
    g: torch.Tensor, xhat: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None, want_gx: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`batch_norm_train_backward_torch`'s operations; on the CPU by the C kernel in two passes per
    channel, the channels shared out between torch's threads."""
    ext = c_kernels()
    if g.device.type != "cpu" or ext is None:
        return batch_norm_train_backward_torch(g, xhat, invstd, weight, want_gx)
    gc = g.detach().contiguous()
    n, c = gc.shape[0], gc.shape[1]
    gx = torch.empty_like(gc) if want_gx else torch.empty(0)
    gw, gb = torch.empty(c, dtype=torch.float32), torch.empty(c, dtype=torch.float32)
    sizes = np.array(gc.shape[2:], np.int64)
    ext.batch_norm_backward(
        gc.numpy(), xhat.detach().contiguous().numpy(), invstd.detach().contiguous().numpy(),
        _empty_if_none(weight), gx.numpy(), gw.numpy(), gb.numpy(), n, c, sizes, torch.get_num_threads(),
    )  # fmt: skip
    return (gx if want_gx else None), gw, gb


def div_count(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x / n`` as a correctly rounded tensor-by-tensor division (a division by a Python number may become a
    multiplication by its reciprocal on CUDA)."""
    return torch.div(x, torch.full_like(x, float(n)))


def det_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root: taken in float64 (correctly rounded on every device) and rounded
    to float32, which is the correctly rounded float32 result (53 >= 2 * 24 + 2 bits: the double rounding is
    innocuous).  torch's float32 ``sqrt`` on the CPU is not: it is 1 ulp off for some inputs (for 1.041376 it gives
    1.0204782, the correctly rounded root is 1.0204784), where CUDA's and C's ``sqrtf`` are exact."""
    return torch.sqrt(x.double()).float()


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x``, one correctly rounded division per element."""
    return torch.div(torch.ones_like(x), x)


def _horner(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """c0 + x * (c1 + x * (c2 + ...)), one rounded multiply and one rounded add per step."""
    acc = torch.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * x
        acc = acc + c
    return acc


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k for integer k in [-126, 127] from the float32 bits."""
    return torch.bitwise_left_shift(k + 127, 23).view(torch.float32)


def _exp_reduce(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = k ln2 + r with |r| <= ~ln2/2: (r, expm1(r), k) for x clamped to [EXP_LO, EXP_HI]."""
    xc = torch.clamp(x, EXP_LO, EXP_HI)
    kf = torch.round(xc * LOG2E)
    r = xc - kf * LN2_HI  # k * LN2_HI is exact and close to xc: the subtraction is exact
    r = r - kf * LN2_LO
    q = (r * r) * _horner(r, _EXPM1_P)
    q = r + q
    return r, q, kf.to(torch.int32)


def _scale_pow2(y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """y * 2^k as two exact power-of-two products (2^k alone overflows for k = 128)."""
    half = torch.div(k, 2, rounding_mode="floor")
    return (y * _pow2(half)) * _pow2(k - half)


def _special(x: torch.Tensor, value: torch.Tensor, low: float, high: float) -> torch.Tensor:
    value = torch.where(x < EXP_LO, torch.full_like(x, low), value)
    value = torch.where(x > EXP_HI, torch.full_like(x, high), value)
    return torch.where(torch.isnan(x), x, value)


#: the functions of the C kernel ``exp``
_EXP, _EXPM1, _SIGMOID, _TANH = 0, 1, 2, 3


def _c_exp(x: torch.Tensor, fn: int) -> torch.Tensor | None:
    """:func:`det_exp`, :func:`det_expm1`, :func:`det_sigmoid` or :func:`det_tanh` (``fn``) of a float32 CPU tensor
    by the C kernel (``exp`` in ``kernels/detreduce.c``: the torch definitions' operations element by element, the
    same bits, one pass instead of some 25-30 small torch calls); None where the torch definition runs (another
    device or dtype, no extension, or a tensor autograd would have to follow)."""
    ext = c_kernels()
    if ext is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return None
    xc = x.detach().contiguous()
    out = torch.empty_like(xc)
    ext.exp(xc.numpy(), out.numpy(), _EXP_CONSTANTS, fn)
    return out


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) within 2 ulps of the exact value, the same bits on every device (float32)."""
    fast = _c_exp(x, _EXP)
    if fast is not None:
        return fast
    _, q, k = _exp_reduce(x)
    return _special(x, _scale_pow2(q + 1.0, k), 0.0, float("inf"))


def det_expm1(x: torch.Tensor) -> torch.Tensor:
    """exp(x) - 1 without cancellation near 0: 2^k * expm1(r) + (2^k - 1)."""
    fast = _c_exp(x, _EXPM1)
    if fast is not None:
        return fast
    _, q, k = _exp_reduce(x)
    p = _scale_pow2(torch.ones_like(x), k)
    value = _scale_pow2(q, k) + (p - 1.0)
    return _special(x, value, -1.0, float("inf"))


def det_log(x: torch.Tensor) -> torch.Tensor:
    """Natural logarithm: x = 2^e * m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh((m - 1) / (m + 1))."""
    sub = x < TINY
    xs = torch.where(sub, x * f32(2.0**23), x)  # subnormals scaled exactly into the normal range
    bits = xs.view(torch.int32)
    e = torch.bitwise_right_shift(bits, 23) - 127
    e = torch.where(sub, e - 23, e)
    m = torch.bitwise_or(torch.bitwise_and(bits, 0x7FFFFF), 0x3F800000).view(torch.float32)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1, e)
    f = m - 1.0  # exact
    s = torch.div(f, f + 2.0)
    s2 = s * s
    poly = (s2 * _horner(s2, _ATANH_P)) * s
    poly = poly + poly  # exact doubling: 2 atanh(s) = 2s + 2 s^3 / 3 + ...
    two_s = s + s
    ef = e.to(torch.float32)
    low = ef * LN2_LO
    low = low + poly
    low = low + two_s
    value = ef * LN2_HI  # exact
    value = value + low
    value = torch.where(x == 0.0, torch.full_like(x, float("-inf")), value)
    value = torch.where(x < 0.0, torch.full_like(x, float("nan")), value)
    value = torch.where(torch.isinf(x) & (x > 0), x, value)
    return torch.where(torch.isnan(x), x, value)


def _erfc_pos(z: torch.Tensor) -> torch.Tensor:
    """erfc(z) for z >= 0 (Numerical Recipes' erfcc).  exp(-z^2) is taken as exp(-zh^2) * exp(-zl * (z + zh)) with
    zh = z cut to 12 significant bits (so zh^2 is exact) and zl = z - zh, as fdlibm does: a rounded z^2 would cost
    up to 64 ulps near z = 9."""
    t = reciprocal(z * 0.5 + 1.0)
    zh = torch.bitwise_and(z.view(torch.int32), -4096).view(torch.float32)
    zl = z - zh  # exact
    exponent = _horner(t, _ERFC_P) - zl * (z + zh)
    return (t * det_exp(-(zh * zh))) * det_exp(exponent)


def _erf_small(z: torch.Tensor) -> torch.Tensor:
    w = z * z
    series = (w * _horner(w, _ERF_P)) * z
    series = series + z
    return series * TWO_OVER_SQRT_PI


def det_erfc(x: torch.Tensor) -> torch.Tensor:
    """Complementary error function, relative accuracy kept in the tails (erfc(-z) = 2 - erfc(z))."""
    a = torch.abs(x)
    tail = _erfc_pos(a)
    value = torch.where(x < 0, 2.0 - tail, tail)
    small = 1.0 - _erf_small(x)
    value = torch.where(a < ERF_SMALL, small, value)
    return torch.where(torch.isnan(x), x, value)


def det_erf(x: torch.Tensor) -> torch.Tensor:
    """Error function: the Maclaurin series for |x| < 0.5, 1 - erfc(|x|) (with the sign of x) above."""
    a = torch.abs(x)
    big = 1.0 - _erfc_pos(a)
    big = torch.where(x < 0, -big, big)
    value = torch.where(a < ERF_SMALL, _erf_small(x), big)
    return torch.where(torch.isnan(x), x, value)


def det_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) below, with e = exp(-|x|) (no overflow, no cancellation)."""
    fast = _c_exp(x, _SIGMOID)
    if fast is not None:
        return fast
    e = det_exp(-torch.abs(x))
    d = e + 1.0
    return torch.where(x >= 0, reciprocal(d), torch.div(e, d))


def det_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(|x|) = -t / (2 + t) with t = expm1(-2|x|), then the sign of x (relative accuracy near 0 too)."""
    fast = _c_exp(x, _TANH)
    if fast is not None:
        return fast
    t = det_expm1(torch.abs(x) * -2.0)
    y = torch.div(-t, t + 2.0)
    return torch.copysign(y, x)
