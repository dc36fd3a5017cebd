"""Exact, order-independent summation of the N EST gradients (the heart of determinism level D1).

Why this method
===============
EasyScale (SC'23, §3.3, "communication mechanism") traces elastic non-determinism in data-parallel
training to the gradient allreduce: the order in which floating-point gradients are added depends on the
number of processes, on the bucket mapping and on the collective algorithm, and fp32 addition is not
associative.  Of the cures (a fixed reduction order, wider accumulators, exact sums) we use **exact fixed-point
accumulation on absolutely aligned bins** (a ReproBLAS-flavoured binned sum carried in int64):

* **Exact, hence order-free.**  Every gradient value is mapped to an integer on a window shared by a
  chunk of ``chunk`` consecutive elements, and integer addition is associative.  The reduced gradient
  depends only on the multiset of the N EST contributions: not on M, on the EST-to-process placement,
  on the backend, on its algorithm (ring, tree, halving-doubling) nor on message order.
* **The backend's own collective does the work.**  After a small ``MAX`` allreduce of one byte per chunk
  (the global top bin), the data travels through a plain integer ``SUM`` allreduce.  Every backend has
  that (gloo, NCCL, MPI, Horovod), so no custom collective is needed; a fixed reduction tree over EST ids
  would need point-to-point messages that Horovod does not offer and, when a process's ESTs are not an
  aligned subtree, would send every EST's gradient separately.
* **Memory flat in N.**  Each process keeps two int64 bins per gradient element whatever the number of
  its ESTs: an EST's gradient is deposited into the bins at its context switch (paper §3.2: "only the
  gradients need to be handled"), so no per-EST gradient copy is kept.
* **Same bits on CPU and GPU** (D2): the kernels use only integer arithmetic, exact scalings by powers
  of two and single correctly rounded conversions.

Cost: the SUM moves int64, twice the bytes of fp32 (``bench/allreduce.py`` measures the consequence).  Where each
process hosts one EST, the integers are formed at the owner of each range from raw fp32 (:func:`ref_owner_sum`),
so only fp32 travels (``hpc_elastic/est/reducer.py``).
Precision: within a chunk, the window keeps between W and 2W bits below the top of the chunk's largest
magnitude (W = ``bin_width(N)``, 29-31 bits for N <= 16); smaller bits are truncated toward zero, an
absolute error below 2^-W of the chunk's largest value per contribution, far under fp32's own rounding of
the sum.  A chunk holding a NaN or an infinity in any EST yields NaN for the whole chunk on every process.

Definition (what every implementation must reproduce bit for bit)
=================================================================
For fp32 ``x`` let ``u(x) = biased_exponent(x) + 1`` (so ``|x| < 2^(u-127)``) and ``bin(x) = u // W``;
``bin = 255`` marks a non-finite value.  For one chunk and all N contributions ``x_1..x_N``:

1. ``t = max_i max_chunk bin(x_i)`` (the global top bin), ``L = (t - 1) * W - 127``;
2. ``V = sum_i trunc(x_i * 2^-L)``: exact int64 (``|V| < N * 2^(2W+1) <= 2^63``);
3. ``out = RN_f32(RN_f32(V) * 2^L) / divisor`` (the scaling is applied as exact power-of-two multiplies).

The incremental form used by the runtime splits every ``T = trunc(x * 2^-L)`` into a high and a low bin
(``hi = trunc(T / 2^W)``, ``lo = T - hi * 2^W``).  Truncation toward zero nests
(``trunc(trunc(a) / 2^W) == trunc(a / 2^W)``), so when a process's top bin rises, promoting ``hi`` to the
low bin and dropping the old ``lo`` leaves exactly the deposits the final window would have made; this is
why deposits can happen EST by EST before the global top bin is known.  A process's last EST need not be
deposited at all: once the global top bins are agreed on (their MAX taken over the bins' and that gradient's,
:func:`ref_tops`), :func:`ref_fold` adds ``trunc(x * 2^-L)`` of it straight to the combined bins, the same
integers in one pass.  :func:`reference_allreduce` is the direct definition, :func:`ref_deposit`/
:func:`ref_combine`/:func:`ref_fold`/:func:`ref_finalize` the NumPy twin of the C loops in ``kernels/detreduce.c``;
the unit tests check all three agree bit for bit.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Sequence
from functools import lru_cache
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from hpc_elastic.errors import HpcElasticError

NONFINITE_TOP = 255
EXP_BIAS = 127
DOT_LANES = 8
#: the values of one part of ``matmul_nt_parts`` (kernels/detreduce.c PART_VALUES)
PART_VALUES = 9
DEFAULT_CHUNK = 64
MAX_ESTS = 1 << 14  # keeps the bin width >= 24 bits, so the largest value of a chunk is always exact

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def bin_width(num_ests: int) -> int:
    """Width W in bits of one bin for a sum of ``num_ests`` contributions (largest W with no overflow)."""
    if isinstance(num_ests, bool) or not isinstance(num_ests, int) or not 1 <= num_ests <= MAX_ESTS:
        raise ValueError(f"num_ests must be an integer in [1, {MAX_ESTS}], got {num_ests!r}")
    return min(31, (62 - math.ceil(math.log2(num_ests))) // 2)


def num_chunks(n: int, chunk: int) -> int:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    return (n + chunk - 1) // chunk


# --------------------------------------------------------------------------- NumPy reference


def _per_element(values: npt.NDArray[Any], n: int, chunk: int) -> npt.NDArray[Any]:
    return np.repeat(values, chunk)[:n]


def ref_tops(x: F32, chunk: int, width: int) -> U8:
    """Top bin of every chunk of ``x`` (``NONFINITE_TOP`` when a chunk holds a NaN or an infinity)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    e = ((x.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int64)
    b = (e + 1) // width
    b[e == 0xFF] = NONFINITE_TOP
    nch = num_chunks(x.size, chunk)
    padded = np.zeros(nch * chunk, dtype=np.int64)
    padded[: x.size] = b
    tops: U8 = padded.reshape(nch, chunk).max(axis=1, initial=0).astype(np.uint8)
    return tops


def _trunc_scaled(x: F32, low: npt.NDArray[np.int64]) -> I64:
    # x * 2^-L is exact in float64 (24 significant bits, no overflow/underflow for these L)
    scaled = x.astype(np.float64) * np.ldexp(np.ones(low.shape, dtype=np.float64), -low)
    out: I64 = scaled.astype(np.int64)  # C cast semantics: truncation toward zero
    return out


def _trunc_shift(v: I64, width: int) -> I64:
    out: I64 = np.sign(v) * (np.abs(v) >> np.int64(width))
    return out


def ref_deposit(grad: F32, hi: I64, lo: I64, tops: U8, *, chunk: int, width: int, first: bool, clear: bool) -> None:
    """NumPy twin of ``_detreduce.deposit`` (updates ``hi``, ``lo``, ``tops`` and maybe ``grad`` in place)."""
    n = grad.size
    tn = ref_tops(grad, chunk, width).astype(np.int64)
    if first:
        ta = tn.copy()
        hi[:] = 0
        lo[:] = 0
    else:
        ta = tops.astype(np.int64)
        poisoned = (ta != NONFINITE_TOP) & (tn == NONFINITE_TOP)
        rising = (ta != NONFINITE_TOP) & (tn != NONFINITE_TOP) & (tn > ta)
        shift1 = _per_element(rising & (tn - ta == 1), n, chunk)
        shift2 = _per_element(rising & (tn - ta >= 2), n, chunk)
        lo[shift1] = hi[shift1]
        hi[shift1] = 0
        hi[shift2] = 0
        lo[shift2] = 0
        ta = np.where(poisoned, NONFINITE_TOP, np.where(rising, tn, ta))
    tops[:] = ta.astype(np.uint8)
    finite = _per_element(ta != NONFINITE_TOP, n, chunk)
    low = _per_element((ta - 1) * width - EXP_BIAS, n, chunk)
    t_val = np.where(finite, _trunc_scaled(np.where(finite, grad, 0).astype(np.float32), low), 0)
    q = _trunc_shift(t_val, width)
    r = t_val - q * np.int64(1 << width)
    hi += np.where(finite, q, 0)
    lo += np.where(finite, r, 0)
    if clear:
        grad[:] = 0


def ref_combine(hi: I64, lo: I64, local_tops: U8, global_tops: U8, *, chunk: int, width: int) -> None:
    """NumPy twin of ``_detreduce.combine``: writes one int64 per element on the global window into ``hi``."""
    n = hi.size
    g = global_tops.astype(np.int64)
    lt = local_tops.astype(np.int64)
    if np.any((g != NONFINITE_TOP) & (lt > g)):
        raise ValueError("global top bins must be the MAX of the local ones")
    zero = _per_element((g == NONFINITE_TOP) | (g - lt >= 2), n, chunk)
    same = _per_element((g != NONFINITE_TOP) & (g == lt), n, chunk)
    hi[same] = hi[same] * np.int64(1 << width) + lo[same]
    hi[zero] = 0


def ref_fold(
    grad: F32, hi: I64, lo: I64, bin_tops: U8, global_tops: U8, *, chunk: int, width: int, have_bins: bool
) -> None:
    """NumPy twin of ``_detreduce.fold``: ``hi`` = :func:`ref_combine` of the bins (when ``have_bins``; their top
    bins in ``bin_tops``) after a deposit of ``grad``, i.e. the bins' sum on the global window plus
    ``trunc(grad * 2^-L)``.  ``grad`` is left as it is."""
    n = grad.size
    g = global_tops.astype(np.int64)
    mine = ref_tops(grad, chunk, width).astype(np.int64)
    if have_bins:
        mine = np.maximum(mine, bin_tops.astype(np.int64))
    if np.any((g != NONFINITE_TOP) & (mine > g)):
        raise ValueError("global top bins must be the MAX of this process's")
    if have_bins:
        ref_combine(hi, lo, bin_tops, global_tops, chunk=chunk, width=width)
    else:
        hi[:] = 0
    finite = _per_element(g != NONFINITE_TOP, n, chunk)
    low = _per_element((g - 1) * width - EXP_BIAS, n, chunk)
    hi += np.where(finite, _trunc_scaled(np.where(finite, grad, 0).astype(np.float32), low), 0)


def ref_finalize(v: I64, global_tops: U8, out: F32, *, chunk: int, width: int, divisor: float) -> None:
    """NumPy twin of ``_detreduce.finalize``."""
    n = v.size
    g = _per_element(global_tops.astype(np.int64), n, chunk)
    low = (np.where(g == NONFINITE_TOP, 1, g) - 1) * width - EXP_BIAS
    s1 = np.where(low >= -126, np.ldexp(np.float32(1.0), np.maximum(low, -126)), np.float32(2.0**-64))
    s2 = np.where(low >= -126, np.float32(1.0), np.ldexp(np.float32(1.0), np.minimum(low + 64, 127)))
    f = v.astype(np.float32)
    f = f * s1.astype(np.float32)
    f = f * s2.astype(np.float32)
    if divisor != 1.0:
        f = f / np.float32(divisor)
    f[g == NONFINITE_TOP] = np.nan
    out[:] = f


def ref_owner_sum(rows: F32, acc: I64, tops: U8, *, chunk: int, width: int) -> None:
    """NumPy twin of ``_detreduce.owner_sum`` (the one-EST-per-process path of the reducer): ``rows`` holds all N
    contributions of a range, as rows of ``acc``'s length; ``tops`` gets each chunk's top bin over every row and
    ``acc`` the sum over the rows of ``trunc(x * 2^-L)`` on that window (the same integers as the deposits make),
    0 in non-finite chunks."""
    n = acc.size
    if (rows.size % n if n else rows.size) != 0 or (n and rows.size == 0):
        raise ValueError(f"size mismatch: rows has {rows.size} elements, not rows of acc's {n}")
    if tops.size != num_chunks(n, chunk):
        raise ValueError(f"size mismatch: tops has {tops.size} entries, expected {num_chunks(n, chunk)}")
    if n == 0:
        return
    rs = rows.reshape(-1, n)
    g = np.maximum.reduce([ref_tops(r, chunk, width).astype(np.int64) for r in rs])
    finite = _per_element(g != NONFINITE_TOP, n, chunk)
    low = _per_element((g - 1) * width - EXP_BIAS, n, chunk)
    total = np.zeros(n, dtype=np.int64)
    for row in rs:
        total += np.where(finite, _trunc_scaled(np.where(finite, row, 0).astype(np.float32), low), 0)
    tops[:] = g.astype(np.uint8)
    acc[:] = total


def reference_allreduce(
    contributions: Sequence[F32], num_ests: int, chunk: int = DEFAULT_CHUNK, divisor: float = 1.0
) -> F32:
    """Direct definition of the deterministic sum of ``contributions`` (one fp32 array per EST)."""
    if len(contributions) != num_ests:
        raise ValueError(f"expected {num_ests} contributions, got {len(contributions)}")
    width = bin_width(num_ests)
    n = contributions[0].size
    g = np.zeros(num_chunks(n, chunk), dtype=np.int64)
    for x in contributions:
        if x.size != n:
            raise ValueError(f"contributions differ in size: {x.size} != {n}")
        g = np.maximum(g, ref_tops(x, chunk, width).astype(np.int64))
    finite = _per_element(g != NONFINITE_TOP, n, chunk)
    low = _per_element((g - 1) * width - EXP_BIAS, n, chunk)
    total = np.zeros(n, dtype=np.int64)
    for x in contributions:
        xs = np.where(finite, np.asarray(x, dtype=np.float32), 0).astype(np.float32)
        total += np.where(finite, _trunc_scaled(xs, low), 0)
    out = np.empty(n, dtype=np.float32)
    ref_finalize(total, g.astype(np.uint8), out, chunk=chunk, width=width, divisor=divisor)
    return out


def fma32(a: F32, b: F32, c: F32) -> F32:
    """float32 fused multiply-add, element-wise: ``a * b + c`` computed exactly and rounded once to the nearest
    float32 (C's ``fmaf``, CUDA's ``__fmaf_rn``).

    NumPy has no fma, so it is emulated exactly: the product of two float32 is exact in float64 (48 significant
    bits), the float64 sum ``s = p + c`` is made *round to odd* (TwoSum gives the exact error; an inexact ``s`` with
    an even last bit moves one ulp toward the exact sum), and a value rounded to odd with at least two more bits than
    the target rounds to nearest as the exact value would (Boldo and Melquiond, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd", IEEE TC 2008): 53 >= 24 + 2, and float64's exponent range
    holds every such sum exactly up to its 53rd bit.  NaN and infinities pass through as float64 arithmetic gives
    them."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c64 = np.asarray(c, np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c = s + err exactly (s finite)
    with np.errstate(invalid="ignore"):
        fix = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    with np.errstate(over="ignore"):
        out: F32 = s.astype(np.float32)
    return out


def ref_matmul_nt(a: F32, b: F32) -> F32:
    """NumPy twin of ``_detreduce.matmul_nt``: ``a @ b.T`` with the fixed 8-lane order, lane ``l = k mod 8``
    accumulating ``fma(a[i, k], b[j, k], acc)`` in increasing ``k`` from +0, then
    ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))``."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    m, k = a.shape
    n, k2 = b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: {k} != {k2}")
    acc = np.zeros((DOT_LANES, m, n), dtype=np.float32)
    for kk in range(k):
        lane = kk % DOT_LANES
        acc[lane] = fma32(a[:, kk][:, None], b[:, kk][None, :], acc[lane])
    s01, s23 = acc[0] + acc[1], acc[2] + acc[3]
    s45, s67 = acc[4] + acc[5], acc[6] + acc[7]
    out: F32 = ((s01 + s23) + (s45 + s67)).astype(np.float32)
    return out


def view_matrix(data: F32, geometry: I64) -> F32:
    """The [rows, cols] matrix that a geometry ``[offset, row dims, column dims, sizes..., strides...]`` (in
    elements; row dimensions first, each group row-major) names in the flat float32 array ``data``, as a copy: the
    operand ``matmul_nt_view`` reads in place."""
    offset, nr, nc = (int(v) for v in geometry[:3])
    nd = nr + nc
    sizes = [int(v) for v in geometry[3 : 3 + nd]]
    strides = [int(v) * data.itemsize for v in geometry[3 + nd : 3 + 2 * nd]]
    view = np.lib.stride_tricks.as_strided(data[offset:], shape=sizes, strides=strides, writeable=False)
    rows, cols = int(np.prod(sizes[:nr], dtype=np.int64)), int(np.prod(sizes[nr:], dtype=np.int64))
    out: F32 = np.ascontiguousarray(view).reshape(rows, cols)
    return out


# --------------------------------------------------------------------------- kernel dispatch


class Kernels(Protocol):
    """The hot loops, on NumPy arrays (CPU).  The CUDA extension takes the same argument names."""

    name: str

    def deposit(
        self, grad: F32, hi: I64, lo: I64, tops: U8, *, chunk: int, width: int, first: bool, clear: bool
    ) -> None: ...

    def combine(self, hi: I64, lo: I64, local_tops: U8, global_tops: U8, *, chunk: int, width: int) -> None: ...

    def tops(self, grad: F32, tops: U8, *, chunk: int, width: int) -> None: ...

    def fold(
        self, grad: F32, hi: I64, lo: I64, bin_tops: U8, global_tops: U8, *, chunk: int, width: int, have_bins: bool
    ) -> None: ...

    def finalize(self, v: I64, global_tops: U8, out: F32, *, chunk: int, width: int, divisor: float) -> None: ...

    def owner_sum(self, rows: F32, acc: I64, tops: U8, *, chunk: int, width: int) -> None: ...

    def matmul_nt(self, a: F32, b: F32, out: F32) -> None: ...

    def matmul_nt_view(
        self,
        a: F32,
        a_geometry: I64,
        b: F32,
        b_geometry: I64,
        out: F32,
        *,
        rows: tuple[int, int],
        out_geometry: I64 | None = None,
    ) -> None: ...

    def matmul_nt_parts(
        self, a: F32, a_geometry: I64, b: F32, b_geometry: I64, out: F32, *, parts: I64, threads: int
    ) -> None: ...


def part_geometries(a_geometry: I64, b_geometry: I64, part: I64) -> tuple[I64, I64, tuple[int, int], I64]:
    """One row of ``matmul_nt_parts``' parts as ``matmul_nt_view``'s arguments: a's geometry at the part's offset,
    b's at its offset with the part's size of its first row dimension, the rows, and the out geometry."""
    ga, gb = a_geometry.copy(), b_geometry.copy()
    ga[0], gb[0], gb[3] = part[0], part[1], part[2]
    return ga, gb, (int(part[3]), int(part[4])), part[5:9].copy()


class ReferenceKernels:
    """The NumPy reference behind the :class:`Kernels` interface (slow; same bits)."""

    name = "numpy-reference"

    def deposit(
        self, grad: F32, hi: I64, lo: I64, tops: U8, *, chunk: int, width: int, first: bool, clear: bool
    ) -> None:
        ref_deposit(grad, hi, lo, tops, chunk=chunk, width=width, first=first, clear=clear)

    def combine(self, hi: I64, lo: I64, local_tops: U8, global_tops: U8, *, chunk: int, width: int) -> None:
        ref_combine(hi, lo, local_tops, global_tops, chunk=chunk, width=width)

    def tops(self, grad: F32, tops: U8, *, chunk: int, width: int) -> None:
        tops[:] = ref_tops(grad, chunk, width)

    def fold(
        self, grad: F32, hi: I64, lo: I64, bin_tops: U8, global_tops: U8, *, chunk: int, width: int, have_bins: bool
    ) -> None:
        ref_fold(grad, hi, lo, bin_tops, global_tops, chunk=chunk, width=width, have_bins=have_bins)

    def finalize(self, v: I64, global_tops: U8, out: F32, *, chunk: int, width: int, divisor: float) -> None:
        ref_finalize(v, global_tops, out, chunk=chunk, width=width, divisor=divisor)

    def owner_sum(self, rows: F32, acc: I64, tops: U8, *, chunk: int, width: int) -> None:
        ref_owner_sum(rows, acc, tops, chunk=chunk, width=width)

    def matmul_nt(self, a: F32, b: F32, out: F32) -> None:
        out[...] = ref_matmul_nt(a, b)

    def matmul_nt_view(
        self,
        a: F32,
        a_geometry: I64,
        b: F32,
        b_geometry: I64,
        out: F32,
        *,
        rows: tuple[int, int],
        out_geometry: I64 | None = None,
    ) -> None:
        product = ref_matmul_nt(view_matrix(a, a_geometry)[rows[0] : rows[1]], view_matrix(b, b_geometry))
        if out_geometry is None:
            out[...] = product
            return
        offset, ldo, seg, seg_stride = (int(v) for v in out_geometry)
        m, n = product.shape
        strides = tuple(v * out.itemsize for v in (ldo, seg_stride, 1))
        start = offset + rows[0] * ldo
        target = np.lib.stride_tricks.as_strided(out[start:], shape=(m, n // seg, seg), strides=strides)
        target[...] = product.reshape(m, n // seg, seg)

    def matmul_nt_parts(
        self, a: F32, a_geometry: I64, b: F32, b_geometry: I64, out: F32, *, parts: I64, threads: int
    ) -> None:
        for part in parts.reshape(-1, PART_VALUES):
            ga, gb, rows, og = part_geometries(a_geometry, b_geometry, part)
            self.matmul_nt_view(a, ga, b, gb, out, rows=rows, out_geometry=og)


class CKernels:
    """The C extension ``hpc_elastic._detreduce`` (built from ``kernels/detreduce.c``)."""

    name = "c"

    def __init__(self, module: ModuleType) -> None:
        self._m = module

    def deposit(
        self, grad: F32, hi: I64, lo: I64, tops: U8, *, chunk: int, width: int, first: bool, clear: bool
    ) -> None:
        self._m.deposit(grad, hi, lo, tops, chunk, width, first, clear)

    def combine(self, hi: I64, lo: I64, local_tops: U8, global_tops: U8, *, chunk: int, width: int) -> None:
        self._m.combine(hi, lo, local_tops, global_tops, chunk, width)

    def tops(self, grad: F32, tops: U8, *, chunk: int, width: int) -> None:
        self._m.tops(grad, tops, chunk, width)

    def fold(
        self, grad: F32, hi: I64, lo: I64, bin_tops: U8, global_tops: U8, *, chunk: int, width: int, have_bins: bool
    ) -> None:
        self._m.fold(grad, hi, lo, bin_tops, global_tops, chunk, width, have_bins)

    def finalize(self, v: I64, global_tops: U8, out: F32, *, chunk: int, width: int, divisor: float) -> None:
        self._m.finalize(v, global_tops, out, chunk, width, float(divisor))

    def owner_sum(self, rows: F32, acc: I64, tops: U8, *, chunk: int, width: int) -> None:
        self._m.owner_sum(rows, acc, tops, chunk, width)

    def matmul_nt(self, a: F32, b: F32, out: F32) -> None:
        m, k = a.shape
        n = b.shape[0]
        if b.shape[1] != k or out.shape != (m, n):
            raise ValueError(f"shapes do not fit a @ b.T: a {a.shape}, b {b.shape}, out {out.shape}")
        self._m.matmul_nt(a, b, out, m, n, k)

    def matmul_nt_view(
        self,
        a: F32,
        a_geometry: I64,
        b: F32,
        b_geometry: I64,
        out: F32,
        *,
        rows: tuple[int, int],
        out_geometry: I64 | None = None,
    ) -> None:
        """Rows ``rows[0]`` to ``rows[1]`` of the product of two strided views into ``out`` (see
        :func:`view_matrix` for the geometry): a [rows, n] matrix, or with ``out_geometry`` ``[offset, ldo, seg,
        seg_stride]`` a flat buffer where output (i, j) goes to ``offset + i * ldo + (j // seg) * seg_stride + j %
        seg`` (whole NCHW planes of a convolution)."""
        self._m.matmul_nt_view(a, a_geometry, b, b_geometry, out, rows[0], rows[1], out_geometry)

    def matmul_nt_parts(
        self, a: F32, a_geometry: I64, b: F32, b_geometry: I64, out: F32, *, parts: I64, threads: int
    ) -> None:
        """Several :meth:`matmul_nt_view` products in one call, on up to ``threads`` threads of the OpenMP runtime
        (torch's team once torch is loaded): ``parts`` is int64 ``[P, 9]``, a row per product: a's offset, b's
        offset, the size of b's first row dimension, the rows r0 and r1, and the out geometry (``out`` flat).
        Each output is formed whole by one part, so the bits do not depend on the parts or the threads."""
        self._m.matmul_nt_parts(a, a_geometry, b, b_geometry, out, parts, threads)


def c_extension() -> ModuleType:
    """Import the C extension, or raise :class:`HpcElasticError` saying how to build it."""
    try:
        return importlib.import_module("hpc_elastic._detreduce")
    except ImportError as exc:
        raise HpcElasticError(
            "the C extension hpc_elastic._detreduce is not built; reinstall the package "
            f"(pip install -e .) with a C compiler available ({exc})"
        ) from exc


@lru_cache(maxsize=2)
def cpu_kernels(allow_reference: bool = True) -> Kernels:
    """The CPU kernels: the C extension, else (with a warning) the NumPy reference, which gives the same bits."""
    try:
        return CKernels(c_extension())
    except HpcElasticError:
        if not allow_reference:
            raise
        warnings.warn(
            "hpc_elastic._detreduce is not built: using the NumPy reference (same bits, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return ReferenceKernels()
