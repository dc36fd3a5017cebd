"""Bitwise tests of the C kernels (kernels/detreduce.c) against the NumPy reference (hpc_elastic.est.detsum)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hpc_elastic.est import detsum as d
from hpc_elastic.est.gpu import cuda_extension
from hpc_elastic.est.kernels import tensor_kernels

C = d.CKernels(d.c_extension())  # no skip: CI builds the extension with the package
REF = d.ReferenceKernels()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint64)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def any_f32(finite: bool) -> st.SearchStrategy[float]:
    return st.floats(width=32, allow_nan=not finite, allow_infinity=not finite)


@st.composite
def contributions(draw: st.DrawFn, finite: bool = True) -> tuple[list[np.ndarray], int]:
    n_est = draw(st.integers(1, 8))
    size = draw(st.integers(1, 200))
    chunk = draw(st.sampled_from([1, 3, 16, 64]))
    elems = any_f32(finite)
    xs = [draw(hnp.arrays(np.float32, size, elements=elems)) for _ in range(n_est)]
    return xs, chunk


def run_incremental(
    kern: d.Kernels, xs: list[np.ndarray], groups: list[list[int]], chunk: int, divisor: float, *, fold: bool = False
) -> np.ndarray:
    """Deposit each group's ESTs in the given order, combine per group, sum the groups, finalize.  ``fold``: the
    runtime's way, the last EST of each group is not deposited but folded in after the MAX of the top bins."""
    n_est = len(xs)
    width = d.bin_width(n_est)
    n = xs[0].size
    nch = d.num_chunks(n, chunk)
    accs = []
    for group in groups:
        hi = np.full(n, 99, np.int64)  # whatever the buffers held before: the first deposit or fold overwrites it
        lo = np.full(n, -99, np.int64)
        tops = np.zeros(nch, np.uint8)
        deposited = group[:-1] if fold else group
        for j, v in enumerate(deposited):
            g = xs[v].copy()
            kern.deposit(g, hi, lo, tops, chunk=chunk, width=width, first=j == 0, clear=True)
            assert not np.any(g), "clear=True must zero the gradient"
        last = xs[group[-1]].copy()
        mine = np.zeros(nch, np.uint8)
        kern.tops(last, mine, chunk=chunk, width=width)
        if deposited:
            mine = np.maximum(mine, tops)
        accs.append((hi, lo, tops, last, mine, bool(deposited)))
    gtops = np.maximum.reduce([a[4] if fold else a[2] for a in accs])
    total = np.zeros(n, np.int64)
    for hi, lo, tops, last, _, have_bins in reversed(accs):  # any order: integer sums
        if fold:
            kept = last.copy()
            kern.fold(last, hi, lo, tops, gtops, chunk=chunk, width=width, have_bins=have_bins)
            assert same(last, kept), "fold must leave the gradient as it is"
        else:
            kern.combine(hi, lo, tops, gtops, chunk=chunk, width=width)
        total += hi
    out = np.empty(n, np.float32)
    kern.finalize(total, gtops, out, chunk=chunk, width=width, divisor=divisor)
    return out


@st.composite
def grouping(draw: st.DrawFn, n_est: int) -> list[list[int]]:
    order = draw(st.permutations(list(range(n_est))))
    m = draw(st.integers(1, n_est))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, n_est - 1)), min_size=m - 1, max_size=m - 1, unique=True)))
    cuts = [c for c in cuts if 0 < c < n_est]
    bounds = [0, *cuts, n_est]
    return [list(order[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), case=contributions(finite=False))
def test_any_grouping_and_order_gives_the_definition(data: st.DataObject, case: tuple[list[np.ndarray], int]) -> None:
    xs, chunk = case
    groups = data.draw(grouping(len(xs)))
    divisor = float(data.draw(st.sampled_from([1, len(xs)])))
    expected = d.reference_allreduce(xs, len(xs), chunk, divisor)
    for kern in (C, REF):
        assert same(run_incremental(kern, xs, groups, chunk, divisor), expected)
        assert same(run_incremental(kern, xs, groups, chunk, divisor, fold=True), expected)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), case=contributions(finite=False))
def test_c_ops_equal_numpy_twin_step_by_step(data: st.DataObject, case: tuple[list[np.ndarray], int]) -> None:
    xs, chunk = case
    width = d.bin_width(len(xs))
    n = xs[0].size
    nch = d.num_chunks(n, chunk)
    state: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {
        k: (np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(nch, np.uint8)) for k in ("c", "r")
    }
    for j, x in enumerate(xs):
        clear = data.draw(st.booleans())
        gc, gr = x.copy(), x.copy()
        C.deposit(gc, *state["c"], chunk=chunk, width=width, first=j == 0, clear=clear)
        REF.deposit(gr, *state["r"], chunk=chunk, width=width, first=j == 0, clear=clear)
        for a, b in zip(state["c"], state["r"], strict=True):
            assert np.array_equal(a, b)
        assert same(gc, gr)
    gtops = np.maximum(state["c"][2], data.draw(hnp.arrays(np.uint8, nch, elements=st.sampled_from([0, 1, 5, 255]))))
    for k, kern in (("c", C), ("r", REF)):
        kern.combine(state[k][0], state[k][1], state[k][2], gtops, chunk=chunk, width=width)
    assert np.array_equal(state["c"][0], state["r"][0])
    # tops and fold of one more gradient on the same bins: the C loops equal the twin
    x = data.draw(hnp.arrays(np.float32, n, elements=any_f32(finite=False)))
    t_c, t_r = np.zeros(nch, np.uint8), np.zeros(nch, np.uint8)
    C.tops(x, t_c, chunk=chunk, width=width)
    REF.tops(x, t_r, chunk=chunk, width=width)
    assert np.array_equal(t_c, t_r)
    g2 = np.maximum(np.maximum(t_c, state["c"][2]), gtops)
    folded = []
    for k, kern in (("c", C), ("r", REF)):
        hi, lo = state[k][0].copy(), state[k][1].copy()
        kern.fold(x, hi, lo, state[k][2], g2, chunk=chunk, width=width, have_bins=True)
        folded.append(hi)
    assert np.array_equal(folded[0], folded[1])
    outs = []
    for k, kern in (("c", C), ("r", REF)):
        out = np.empty(n, np.float32)
        kern.finalize(state[k][0], gtops, out, chunk=chunk, width=width, divisor=3.0)
        outs.append(out)
    assert same(outs[0], outs[1])


def test_placements_of_four_ests_over_one_two_four_processes_agree() -> None:
    rng = np.random.default_rng(7)
    n = 10_000
    xs = [(rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32) for _ in range(4)]
    results = []
    for groups in ([[0, 1, 2, 3]], [[3, 2, 1, 0]], [[0, 1], [2, 3]], [[0, 3], [2, 1]], [[0], [1], [2], [3]]):
        results.append(run_incremental(C, xs, groups, 64, 4.0))
        results.append(run_incremental(C, xs, groups, 64, 4.0, fold=True))
    assert all(same(results[0], r) for r in results[1:])
    # while a plain fp32 sum does depend on the order (the reason this exists)
    fwd = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    bwd = ((xs[3] + xs[2]) + xs[1]) + xs[0]
    assert not same(fwd, bwd)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_error_is_bounded_by_the_window(data: st.DataObject) -> None:
    n_est = data.draw(st.integers(1, 16))
    chunk = data.draw(st.sampled_from([4, 64]))
    size = data.draw(st.integers(1, 300))
    elems = st.floats(min_value=-1e6, max_value=1e6, width=32)
    xs = [data.draw(hnp.arrays(np.float32, size, elements=elems)) for _ in range(n_est)]
    out = d.reference_allreduce(xs, n_est, chunk, 1.0)
    assert same(out, run_incremental(C, xs, [list(range(n_est))], chunk, 1.0))
    exact = np.sum(np.stack([x.astype(np.float64) for x in xs]), axis=0)
    width = d.bin_width(n_est)
    pad = d.num_chunks(size, chunk) * chunk - size
    chunk_max = np.repeat(np.pad(np.max(np.abs(np.stack(xs)), axis=0), (0, pad)).reshape(-1, chunk).max(axis=1), chunk)[
        :size
    ].astype(np.float64)
    bound = n_est * chunk_max * 2.0 ** (1 - width) + np.spacing(np.abs(out)).astype(np.float64)
    assert np.all(np.abs(out.astype(np.float64) - exact) <= bound)


def test_zeros_and_non_finite_chunks() -> None:
    x = np.zeros(130, np.float32)
    y = np.ones(130, np.float32)
    y[70] = np.inf
    out = d.reference_allreduce([x, y], 2, 64, 1.0)
    assert same(out, run_incremental(C, [x, y], [[1], [0]], 64, 1.0))
    assert np.all(out[:64] == 1.0) and np.all(out[128:] == 1.0)
    assert np.all(np.isnan(out[64:128]))
    zero = d.reference_allreduce([x, -x], 2, 64, 2.0)
    assert np.all(zero == 0.0) and not np.any(np.signbit(zero))


def test_bin_width_never_overflows_int64() -> None:
    for n in [*range(1, 65), 100, 1000, 4096, d.MAX_ESTS]:
        w = d.bin_width(n)
        assert 24 <= w <= 31
        assert n * 2 ** (2 * w + 1) <= 2**63
    for bad in (0, -1, d.MAX_ESTS + 1, True, 2.0):
        with pytest.raises(ValueError, match="num_ests"):
            d.bin_width(bad)  # type: ignore[arg-type]


def test_kernels_reject_bad_buffers() -> None:
    m = d.c_extension()
    g = np.zeros(10, np.float32)
    hi = np.zeros(10, np.int64)
    lo = np.zeros(10, np.int64)
    tops = np.zeros(1, np.uint8)
    with pytest.raises(ValueError, match="grad must hold float32"):
        m.deposit(np.zeros(10), hi, lo, tops, 64, 30, True, False)
    with pytest.raises(ValueError, match="size mismatch"):
        m.deposit(g, hi[:5], lo, tops, 64, 30, True, False)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        m.deposit(g, hi, lo, tops, 0, 30, True, False)
    with pytest.raises(ValueError, match="width must be in"):
        m.deposit(g, hi, lo, tops, 64, 40, True, False)
    with pytest.raises(ValueError, match="C-contiguous"):
        m.deposit(np.zeros(20, np.float32)[::2], hi, lo, tops, 64, 30, True, False)
    with pytest.raises(ValueError, match="not a MAX"):
        m.combine(hi, lo, np.full(1, 3, np.uint8), np.full(1, 2, np.uint8), 64, 30)
    with pytest.raises(ValueError, match="divisor must be a positive finite number, got 0"):
        m.finalize(hi, tops, g, 64, 30, 0.0)
    with pytest.raises(ValueError, match="size mismatch"):
        m.matmul_nt(np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32), np.zeros((2, 2), np.float32), 2, 2, 3)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_matmul_nt_matches_reference_bitwise(data: st.DataObject) -> None:
    m = data.draw(st.integers(0, 5))
    n = data.draw(st.integers(0, 5))
    k = data.draw(st.integers(0, 40))
    elems = st.floats(min_value=-1e3, max_value=1e3, width=32)
    a = data.draw(hnp.arrays(np.float32, (m, k), elements=elems))
    b = data.draw(hnp.arrays(np.float32, (n, k), elements=elems))
    out = np.empty((m, n), np.float32)
    C.matmul_nt(a, b, out)
    ref = d.ref_matmul_nt(a, b)
    assert same(out, ref)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64).T, rtol=1e-4, atol=1e-2)


def test_cpu_kernels_prefers_the_extension() -> None:
    assert d.cpu_kernels().name == "c"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU kernels untested here")


@requires_cuda
def test_cuda_kernels_equal_cpu_kernels_bitwise() -> None:  # pragma: no cover - needs a GPU
    k = tensor_kernels(torch.device("cuda"))
    rng = np.random.default_rng(3)
    xs = [(rng.standard_normal(5000) * np.exp2(rng.integers(-40, 40, 5000))).astype(np.float32) for _ in range(3)]
    chunk, width = 64, d.bin_width(3)
    nch = d.num_chunks(5000, chunk)
    hi = torch.zeros(5000, dtype=torch.int64, device="cuda")
    lo = torch.zeros_like(hi)
    tops = torch.zeros(nch, dtype=torch.uint8, device="cuda")
    for j, x in enumerate(xs):
        k.deposit(torch.from_numpy(x).cuda(), hi, lo, tops, chunk=chunk, width=width, first=j == 0, clear=True)
    k.combine(hi, lo, tops, tops.clone(), chunk=chunk, width=width)
    out = torch.empty(5000, dtype=torch.float32, device="cuda")
    k.finalize(hi, tops, out, chunk=chunk, width=width, divisor=3.0)
    assert same(out.cpu().numpy(), d.reference_allreduce(xs, 3, chunk, 3.0))
    # the runtime's way: two deposits, the last gradient folded in
    for j, x in enumerate(xs[:2]):
        k.deposit(torch.from_numpy(x).cuda(), hi, lo, tops, chunk=chunk, width=width, first=j == 0, clear=True)
    last = torch.from_numpy(xs[2]).cuda()
    gtops = torch.zeros_like(tops)
    k.tops(last, gtops, chunk=chunk, width=width)
    assert np.array_equal(gtops.cpu().numpy(), d.ref_tops(xs[2], chunk, width))
    torch.maximum(gtops, tops, out=gtops)
    k.fold(last, hi, lo, tops, gtops, chunk=chunk, width=width, have_bins=True)
    k.finalize(hi, gtops, out, chunk=chunk, width=width, divisor=3.0)
    assert same(out.cpu().numpy(), d.reference_allreduce(xs, 3, chunk, 3.0))
    a = rng.standard_normal((7, 37)).astype(np.float32)
    b = rng.standard_normal((5, 37)).astype(np.float32)
    got = cuda_extension().matmul_nt(torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()).cpu().numpy()
    assert same(got, d.ref_matmul_nt(a, b))


@requires_cuda
@pytest.mark.parametrize(
    ("m", "n", "k"),
    # one output; tiles' edges in rows and columns (32) with k tails (k mod 8); k over several shared-memory tiles
    [(1, 1, 1), (1, 1, 0), (33, 17, 9), (31, 65, 40), (70, 45, 100), (5, 300, 1030), (64, 64, 64)],
)
@pytest.mark.parametrize("kernel", ["tiled", "lanes", "auto"])
def test_cuda_product_is_the_fixed_order_reference_at_tile_edges(
    m: int, n: int, k: int, kernel: str
) -> None:  # pragma: no cover
    rng = np.random.default_rng(m * 1000 + n + k)
    a = (rng.standard_normal((m, k)) * 10.0 ** rng.integers(-3, 4, (m, k))).astype(np.float32)
    b = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-3, 4, (n, k))).astype(np.float32)
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    assert same(cuda_extension().matmul_nt(ta, tb, kernel=kernel).cpu().numpy(), d.ref_matmul_nt(a, b))


@requires_cuda
def test_cuda_product_keeps_lanes_of_negative_zero_through_the_padding() -> None:  # pragma: no cover
    """Every product underflows to -0.  From k = 8 on every lane holds -0 and the output is -0: padding past k
    with +0 * +0 would turn the lanes that read padding into +0.  Below 8 the lanes no k reaches stay +0."""
    for k, kernel in itertools.product((5, 13, 40), ("tiled", "lanes")):
        a = np.full((3, k), 1e-30, np.float32)
        b = np.full((35, k), -1e-30, np.float32)
        ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
        got = cuda_extension().matmul_nt(ta, tb, kernel=kernel).cpu().numpy()
        assert same(got, d.ref_matmul_nt(a, b))
        assert not got.any() and bool(np.all(np.signbit(got))) is (k >= 8)
    with pytest.raises(RuntimeError, match="kernel must be auto, tiled or lanes, got fast"):
        cuda_extension().matmul_nt(ta, tb, kernel="fast")


@requires_cuda
@pytest.mark.parametrize(("batch", "m", "n", "k"), [(1, 33, 17, 9), (7, 31, 65, 40), (128, 32, 32, 32), (3, 1, 5, 0)])
@pytest.mark.parametrize("kernel", ["tiled", "lanes", "auto"])
def test_cuda_batched_product_is_each_entrys_reference(
    batch: int, m: int, n: int, k: int, kernel: str
) -> None:  # pragma: no cover
    """One launch for all entries (the grid's third or second dimension): entry i is the reference product of
    entry i's operands alone."""
    rng = np.random.default_rng(batch * 100 + m + n + k)
    a = (rng.standard_normal((batch, m, k)) * 10.0 ** rng.integers(-3, 4, (batch, m, k))).astype(np.float32)
    b = (rng.standard_normal((batch, n, k)) * 10.0 ** rng.integers(-3, 4, (batch, n, k))).astype(np.float32)
    got = cuda_extension().bmm_nt(torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda(), kernel=kernel).cpu().numpy()
    assert got.shape == (batch, m, n)
    for i in range(batch):
        assert same(got[i], d.ref_matmul_nt(a[i], b[i]))


def one_est_each(kern: d.Kernels, xs: list[np.ndarray], chunk: int, divisor: float) -> tuple[np.ndarray, np.ndarray]:
    """The one-EST-per-process path at an owner: all contributions as the rows of one buffer (in the given order),
    their exact sum with the top bins found over them, finalize.  Returns (result, top bins)."""
    width = d.bin_width(len(xs))
    n = xs[0].size
    acc = np.full(n, 12345, np.int64)  # owner_sum must overwrite whatever is there
    tops = np.full(d.num_chunks(n, chunk), 7, np.uint8)
    kern.owner_sum(np.stack(xs), acc, tops, chunk=chunk, width=width)
    out = np.empty(n, np.float32)
    kern.finalize(acc, tops, out, chunk=chunk, width=width, divisor=divisor)
    return out, tops


@settings(max_examples=80, deadline=None)
@given(data=st.data(), case=contributions(finite=False))
def test_one_est_per_process_path_gives_the_definition(data: st.DataObject, case: tuple[list[np.ndarray], int]) -> None:
    xs, chunk = case
    order = data.draw(st.permutations(range(len(xs))))
    want = d.reference_allreduce(xs, len(xs), chunk, float(len(xs)))
    width = d.bin_width(len(xs))
    want_tops = np.maximum.reduce([d.ref_tops(x, chunk, width) for x in xs])
    for kern in (C, REF):
        got, tops = one_est_each(kern, [xs[i] for i in order], chunk, float(len(xs)))
        assert same(got, want)
        assert np.array_equal(tops, want_tops)  # the MAX over the contributions, found where they are added


def test_fold_rejects_a_window_below_the_process_and_mismatched_sizes() -> None:
    x = np.array([1.0, -3.5, 2.0**20], np.float32)
    hi, lo = np.zeros(3, np.int64), np.zeros(3, np.int64)
    width = d.bin_width(2)
    mine = d.ref_tops(x, 4, width)
    for kern in (C, REF):
        with pytest.raises(ValueError, match="MAX"):  # the global window must hold this process's largest value
            kern.fold(x, hi, lo, mine, mine - 1, chunk=4, width=width, have_bins=False)
        with pytest.raises(ValueError, match="MAX"):  # and its bins' top
            kern.fold(x, hi, lo, mine + 1, mine, chunk=4, width=width, have_bins=True)
    with pytest.raises(ValueError, match="size mismatch"):
        C.fold(x, hi[:2], lo, mine, mine, chunk=4, width=width, have_bins=False)
    with pytest.raises(ValueError, match="size mismatch"):
        C.tops(x, np.zeros(2, np.uint8), chunk=4, width=width)


def test_owner_sum_rejects_mismatched_sizes() -> None:
    acc = np.zeros(10, np.int64)
    for kern in (C, REF):
        with pytest.raises(ValueError, match="size mismatch"):  # rows must be acc's length
            kern.owner_sum(np.zeros(15, np.float32), acc, np.zeros(1, np.uint8), chunk=64, width=30)
        with pytest.raises(ValueError, match="size mismatch"):  # one top bin per chunk
            kern.owner_sum(np.zeros(20, np.float32), acc, np.zeros(2, np.uint8), chunk=64, width=30)


def _round_to_f32(x: Fraction) -> np.float32:
    """The float32 nearest to the exact ``x`` (ties to even), found among the neighbours of a near guess."""
    guess = np.float32(float(x))
    cands = [guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))]
    finite = [c for c in cands if np.isfinite(c)]
    best = min(abs(Fraction(float(c)) - x) for c in finite)
    ties = [c for c in finite if abs(Fraction(float(c)) - x) == best]
    return min(ties, key=lambda c: int(np.array(c, np.float32).view(np.int32)) & 1)


def test_fma32_is_the_correctly_rounded_fused_multiply_add() -> None:
    """The NumPy emulation of float32 fma against exact rational arithmetic: random operands over a wide range,
    products cancelled by the addend, addends just below half an ulp of the product, underflowing products."""
    rng = np.random.default_rng(11)
    n = 3000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 60, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 60, n))).astype(np.float32)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-150, 100, n))).astype(np.float32)
    c[:500] = -(a[:500] * b[:500])  # cancellation: the result is the product's rounding error
    c[500:1000] = (a[500:1000] * b[500:1000]) * np.float32(2.0**-25)  # near the halfway points
    a[1000:1100], b[1000:1100], c[1000:1100] = np.float32(1e-30), np.float32(-1e-20), np.float32(0.0)  # -> -0.0
    got = d.fma32(a, b, c)
    want = np.array(
        [
            _round_to_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(a, b, c, strict=True)
        ],
        np.float32,
    )
    want[1000:1100] = np.float32(-0.0)  # an exact nonzero result keeps its sign when it rounds to zero
    assert same(got, want)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(7, 9, 27), (3, 4, 16), (6, 131, 45), (5, 6, 1030), (4, 3, 2048), (1, 1, 513)],
)
def test_matmul_nt_blocks_chunks_and_tails_match_reference_bitwise(m: int, n: int, k: int) -> None:
    """Full and edge blocks of outputs, a panel edge (n > 128), one chunk of k with an 8-lane tail, several chunks;
    operands whose products underflow (lanes that hold -0.0) and overflow-free wide exponents."""
    rng = np.random.default_rng(m * 1000 + n + k)
    a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-75, 40, (m, k)))).astype(np.float32)
    b = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-75, 40, (n, k)))).astype(np.float32)
    b[:, ::3] = -np.abs(b[:, ::3])
    out = np.empty((m, n), np.float32)
    C.matmul_nt(a, b, out)
    assert same(out, d.ref_matmul_nt(a, b))


def _geometry(offset: int, rows: list[tuple[int, int]], cols: list[tuple[int, int]]) -> np.ndarray:
    sizes = [s for s, _ in rows + cols]
    strides = [t for _, t in rows + cols]
    return np.array([offset, len(rows), len(cols), *sizes, *strides], np.int64)


@pytest.mark.parametrize(
    ("a_rows", "a_cols", "b_rows", "b_cols", "span"),
    [
        # patch rows of a padded channels-last image [2, 7, 6, 5] (3x3 windows, stride 2, dilation 1)
        ([(2, 210), (3, 60), (2, 10)], [(3, 30), (3, 5), (5, 1)], [(4, 45)], [(45, 1)], (0, 12)),
        # the same against strided weight rows; only rows [5, 11) of a
        ([(2, 210), (3, 60), (2, 10)], [(3, 30), (3, 5), (5, 1)], [(6, 1)], [(45, 6)], (5, 11)),
        # patch columns of a padded [3, 4, 9, 9] image (k = 3 * 7 * 7 = 147, runs along x), both operands views
        ([(5, 1)], [(3, 5), (49, 15)], [(2, 9), (2, 1), (4, 81)], [(3, 324), (7, 9), (7, 1)], (0, 5)),
        # k = 1200 > one chunk, with x strided by 2 (no contiguous run), and a panel edge (n = 70 > 64)
        ([(3, 1)], [(1200, 3)], [(70, 2)], [(2, 1800), (600, 3)], (0, 3)),
        # a dense operand given as a view with an offset, k = 520: one chunk and an 8-lane tail
        ([(50, 520)], [(520, 1)], [(7, 3)], [(4, 1), (130, 21)], (1, 50)),
        # both operands transposed matrices (a linear layer's backward), packed in 8 x 8 blocks: row counts (50: a
        # tile of 48 and 2 more; 57) and k = 700 (a chunk of 512, then 188: 23 blocks of 8 and 4) not multiples of 8
        ([(50, 1)], [(700, 50)], [(57, 1)], [(700, 57)], (0, 50)),
        ([(50, 1)], [(700, 50)], [(57, 1)], [(700, 57)], (3, 46)),
        # a packed whole once per chunk (more than one panel of b: n = 70 > 64), two chunks (k = 520)
        ([(50, 1)], [(520, 50)], [(70, 1)], [(520, 70)], (0, 50)),
        ([(50, 1)], [(520, 50)], [(70, 1)], [(520, 70)], (7, 30)),
        # operands whose columns are runs of a multiple of 8 values, which the AVX-512 path reads in place: patch
        # rows of a padded channels-last [2, 10, 9, 8] image (3x3, runs of kw * C = 24; 112 rows: two panels)
        # against dense weights, either way round, rows from an offset
        ([(5, 72)], [(72, 1)], [(2, 720), (8, 72), (7, 8)], [(3, 72), (24, 1)], (0, 5)),
        ([(2, 720), (8, 72), (7, 8)], [(3, 72), (24, 1)], [(5, 72)], [(72, 1)], (9, 103)),
        # a weight gradient: an output gradient's planes [10, (3, 16, 16)] against patch columns of a padded
        # [3, 2, 18, 18] image (runs of 16 along x), k = 768: two chunks with the lanes' state between them
        ([(10, 256)], [(3, 2560), (256, 1)], [(3, 18), (3, 1), (2, 324)], [(3, 648), (16, 18), (16, 1)], (0, 10)),
        ([(10, 256)], [(3, 2560), (256, 1)], [(3, 18), (3, 1), (2, 324)], [(3, 648), (16, 18), (16, 1)], (3, 8)),
    ],
)
def test_matmul_nt_view_reads_strided_operands_like_their_copies(
    a_rows: list[tuple[int, int]],
    a_cols: list[tuple[int, int]],
    b_rows: list[tuple[int, int]],
    b_cols: list[tuple[int, int]],
    span: tuple[int, int],
) -> None:
    """Operands read in place (packed tile by tile, chunk by chunk, a whole, lanes' state kept between chunks) give
    the bits of the product of their gathered copies, the reference's and the dense kernel's, on every path the CPU
    runs."""
    ext = d.c_extension()
    rng = np.random.default_rng(len(a_cols) * 100 + span[1])
    data_a = (rng.standard_normal(40_000) * np.exp2(rng.integers(-60, 30, 40_000))).astype(np.float32)
    data_b = rng.standard_normal(40_000).astype(np.float32)
    data_b[::7] = np.float32(-0.0)
    ga, gb = _geometry(3, a_rows, a_cols), _geometry(11, b_rows, b_cols)
    a, b = d.view_matrix(data_a, ga), d.view_matrix(data_b, gb)
    r0, r1 = span
    ref = d.ref_matmul_nt(a[r0:r1], b)
    try:
        for path in ext._matmul_paths():
            ext._matmul_path(path)
            out = np.full((r1 - r0, b.shape[0]), np.nan, np.float32)
            C.matmul_nt_view(data_a, ga, data_b, gb, out, rows=span)
            dense = np.empty((a.shape[0], b.shape[0]), np.float32)
            C.matmul_nt(a, b, dense)
            assert same(out, ref), path
            assert same(out, dense[r0:r1]), path
    finally:
        ext._matmul_path("auto")


@pytest.mark.parametrize(
    ("m", "n", "k", "seg", "span"),
    [
        (16, 4 * 100, 144, 100, (0, 16)),  # planes of 100: panels end at each plane (60 + 40 columns)
        (9, 3 * 64, 40, 64, (2, 9)),  # a panel of 60 and one of 4 per plane, rows from an offset
        (5, 6 * 7, 600, 7, (0, 5)),  # planes narrower than a block, two chunks of k
        (3, 2 * 8, 0, 8, (0, 3)),  # k = 0: zeros
    ],
)
def test_matmul_nt_view_writes_outputs_in_planes(m: int, n: int, k: int, seg: int, span: tuple[int, int]) -> None:
    """With an out geometry, output (i, j) goes to ``offset + i * ldo + (j // seg) * seg_stride + j % seg`` (a
    convolution's NCHW planes from its [O, N*Ho*Wo] product): the reference's bits there on every path, and the
    buffer's other elements untouched."""
    ext = d.c_extension()
    rng = np.random.default_rng(m * 1000 + n + k)
    a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-40, 30, (m, k)))).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    ga, gb = _geometry(0, [(m, k)], [(k, 1)]), _geometry(0, [(n, k)], [(k, 1)])
    planes = n // seg
    ldo, seg_stride, offset = seg, m * seg + 3, 5  # [planes, m, seg] with a gap after each plane
    r0, r1 = span
    ref = d.ref_matmul_nt(a[r0:r1], b).reshape(r1 - r0, planes, seg) if k else np.zeros((r1 - r0, planes, seg))
    try:
        for path in ext._matmul_paths():
            ext._matmul_path(path)
            flat = np.full(offset + planes * seg_stride + 2, np.nan, np.float32)
            og = np.array([offset, ldo, seg, seg_stride], np.int64)
            C.matmul_nt_view(a.reshape(-1), ga, b.reshape(-1), gb, flat, rows=span, out_geometry=og)
            target = np.lib.stride_tricks.as_strided(
                flat[offset + r0 * ldo :], shape=(r1 - r0, planes, seg), strides=(4 * ldo, 4 * seg_stride, 4)
            )
            assert same(target.copy(), ref.astype(np.float32)), path
            assert np.count_nonzero(~np.isnan(flat)) == (r1 - r0) * n, path
    finally:
        ext._matmul_path("auto")
    # the NumPy reference behind the same interface (used where the extension is not built) writes the same places
    flat_ref = np.full_like(flat, np.nan)
    d.ReferenceKernels().matmul_nt_view(a.reshape(-1), ga, b.reshape(-1), gb, flat_ref, rows=span, out_geometry=og)
    assert same(flat_ref, flat)
    with pytest.raises(ValueError, match="out_geometry"):
        short = flat[: offset + planes * seg_stride - 4]  # one element short of the last plane's last row
        C.matmul_nt_view(a.reshape(-1), ga, b.reshape(-1), gb, short, rows=(0, m), out_geometry=og)


def test_matmul_nt_view_refuses_views_outside_the_buffer_and_mismatched_sizes() -> None:
    m = d.c_extension()
    data = np.zeros(100, np.float32)
    out = np.zeros((2, 2), np.float32)
    inside = _geometry(0, [(2, 10)], [(10, 1)])
    with pytest.raises(ValueError, match="reaches element 100"):
        m.matmul_nt_view(data, _geometry(1, [(2, 90)], [(10, 1)]), data, inside, out, 0, 2)
    with pytest.raises(ValueError, match="size mismatch"):
        m.matmul_nt_view(data, inside, data, _geometry(0, [(2, 9)], [(9, 1)]), out, 0, 2)
    with pytest.raises(ValueError, match="bad geometry"):
        m.matmul_nt_view(data, np.array([0, 1, 1, 2], np.int64), data, inside, out, 0, 2)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def test_the_product_runs_the_widest_path_the_cpu_has_and_refuses_others() -> None:
    """The paths listed are those the CPU runs (AVX-512 where it has avx512f, AVX2 where it has avx2 and fma, fmaf
    lane by lane everywhere), ``auto`` picks the widest, and a name the CPU does not run is refused."""
    m = d.c_extension()
    flags = _cpu_flags()
    paths = m._matmul_paths()
    if flags:  # an x86-64 Linux machine
        want = ["scalar"]
        if {"avx2", "fma"} <= flags:
            want.insert(0, "avx2")
            if "avx512f" in flags:
                want.insert(0, "avx512")
        assert list(paths) == want
    assert paths[-1] == "scalar"
    try:
        assert m._matmul_path("auto") == paths[0]
        assert m._matmul_path() == paths[0]
        for p in paths:
            assert m._matmul_path(p) == p
        with pytest.raises(ValueError, match="'sse'"):
            m._matmul_path("sse")
    finally:
        m._matmul_path("auto")


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (8, 6, 8),  # one AVX-512 block, one step
        (16, 60, 144),  # whole blocks, one AVX-512 panel
        (17, 61, 27),  # a row and a column past the blocks, a 3-value k tail
        (9, 7, 519),  # one chunk and a 7-value tail, one row and one column past a block
        (7, 125, 1030),  # partial rows; panels of 60 and 64 with edges; three chunks, the last of 6
        (23, 13, 1),  # k = 1: the tail step only
        (1, 1, 513),  # one output, a chunk and one more k
        (5, 66, 1100),  # five rows, a panel edge, a tail of 76 after two chunks
    ],
)
def test_every_matmul_path_the_cpu_runs_gives_the_reference_bits(m: int, n: int, k: int) -> None:
    """Each build of the product's step (AVX-512: two outputs' lanes per vector in 8 x 6 blocks; AVX2: 3 x 4
    blocks; fmaf lane by lane), forced in turn, gives the NumPy emulation's bits on shapes at the blocks', panels'
    and chunks' edges, with products that underflow (outputs whose lanes all hold -0.0) and wide exponents."""
    ext = d.c_extension()
    rng = np.random.default_rng(m * 10_000 + n * 10 + k)
    a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-75, 40, (m, k)))).astype(np.float32)
    b = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-75, 40, (n, k)))).astype(np.float32)
    b[:, ::3] = -np.abs(b[:, ::3])
    a[:, ::5] = np.float32(-0.0)
    # outputs in the first and last rows and columns (both halves of an AVX-512 vector) whose every product
    # underflows to -0: every lane holds -0, and so does the sum, which a padded tail step must keep
    a[[0, -1]] = np.float32(2.0**-80)
    b[[0, -1]] = np.float32(-(2.0**-80))
    ref = d.ref_matmul_nt(a, b)
    if k >= 8:  # every lane has a product (a lane that has none holds +0)
        assert np.signbit(ref[-1, -1]) and ref[-1, -1] == 0
    try:
        for path in ext._matmul_paths():
            ext._matmul_path(path)
            out = np.full((m, n), np.nan, np.float32)
            C.matmul_nt(a, b, out)
            assert same(out, ref), path
    finally:
        ext._matmul_path("auto")


def _parts_of(
    ga: np.ndarray, gb: np.ndarray, cuts: list[tuple[int, int]], by: str, m: int, n: int, inner: int
) -> np.ndarray:
    """Parts cutting a plain [m, n] product into ranges of a's rows or of b's first row dimension (``inner``
    columns each; an empty range keeps a segment of ``inner``)."""
    if by == "rows":
        return np.array([(ga[0], gb[0], gb[3], lo, hi, 0, n, n, 0) for lo, hi in cuts], np.int64)
    stride = gb[3 + int(gb[1]) + int(gb[2])]  # b's first row dimension's stride
    return np.array(
        [(ga[0], gb[0] + lo * stride, hi - lo, 0, m, lo * inner, n, max(hi - lo, 1) * inner, 0) for lo, hi in cuts],
        np.int64,
    )


@pytest.mark.parametrize("by", ["rows", "columns"])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_matmul_nt_parts_gives_the_bits_of_one_product_whatever_the_parts_and_threads(by: str, threads: int) -> None:
    """Parts cut along a's rows or b's first row dimension (a convolution's patch rows read in place: [2, 5, 6]
    rows of a padded channels-last image), on 1 to 8 OpenMP threads, on every path the CPU runs: the bits of the
    product in one part, and of the NumPy reference behind the same interface."""
    ext = d.c_extension()
    rng = np.random.default_rng(threads)
    data_a = (rng.standard_normal(20_000) * np.exp2(rng.integers(-40, 30, 20_000))).astype(np.float32)
    data_b = rng.standard_normal(40_000).astype(np.float32)
    data_b[::5] = np.float32(-0.0)
    ga = _geometry(7, [(13, 600)], [(600, 1)])  # 13 rows, k = 600: two chunks of k
    gb = _geometry(2, [(2, 12_000), (5, 1_000), (6, 100)], [(3, 200), (2, 100), (100, 1)])
    m, n, inner = 13, 60, 30
    whole = np.full((m, n), np.nan, np.float32)
    C.matmul_nt_view(data_a, ga, data_b, gb, whole, rows=(0, m))
    assert same(whole, d.ref_matmul_nt(d.view_matrix(data_a, ga), d.view_matrix(data_b, gb)))
    cuts = {"rows": [(0, 1), (1, 6), (6, 6), (6, 13)], "columns": [(0, 1), (1, 1), (1, 2)]}[by]
    parts = _parts_of(ga, gb, cuts, by, m, n, inner)
    try:
        for path in ext._matmul_paths():
            ext._matmul_path(path)
            out = np.full(m * n, np.nan, np.float32)
            C.matmul_nt_parts(data_a, ga, data_b, gb, out, parts=parts, threads=threads)
            assert same(out.reshape(m, n), whole), path
    finally:
        ext._matmul_path("auto")
    ref = np.full(m * n, np.nan, np.float32)
    d.ReferenceKernels().matmul_nt_parts(data_a, ga, data_b, gb, ref, parts=parts, threads=threads)
    assert same(ref.reshape(m, n), whole)


def test_matmul_nt_parts_refuses_bad_parts_before_any_product() -> None:
    """A part outside the output, rows past a's, a ragged parts array or no thread: ValueError, nothing written."""
    ext = d.c_extension()
    data = np.ones(100, np.float32)
    g = _geometry(0, [(4, 10)], [(10, 1)])
    good = (0, 0, 4, 0, 4, 0, 4, 4, 0)
    for parts, threads, match in (
        ([good, (0, 0, 4, 0, 4, 1, 4, 4, 0)], 2, "inside out"),  # the second part's last output is element 16
        ([(0, 0, 4, 0, 5, 0, 4, 4, 0)], 1, "rows"),
        ([good[:8]], 1, "parts"),
        ([good], 0, "threads"),
        ([(0, 0, 4, 0, 4, 0, 4, 3, 0)], 1, "multiple of seg"),
    ):
        out = np.full(16, np.nan, np.float32)
        with pytest.raises(ValueError, match=match):
            ext.matmul_nt_parts(data, g, data, g, out, np.array(parts, np.int64), threads)
        assert np.isnan(out).all()


def test_matmul_nt_view_of_no_rows_writes_nothing_on_every_path() -> None:
    """An empty row range (r0 == r1) of an operand read in place returns at once on every path (it used to reach
    the blocked loops without its row table and crash the process)."""
    ext = d.c_extension()
    rng = np.random.default_rng(1)
    data_a = rng.standard_normal(20_000).astype(np.float32)
    data_b = rng.standard_normal(40_000).astype(np.float32)
    ga = _geometry(7, [(13, 600)], [(600, 1)])
    gb = _geometry(2, [(2, 12_000), (5, 1_000), (6, 100)], [(3, 200), (2, 100), (100, 1)])
    try:
        for path in ext._matmul_paths():
            ext._matmul_path(path)
            out = np.zeros((0, 60), np.float32)
            C.matmul_nt_view(data_a, ga, data_b, gb, out, rows=(6, 6))
            flat = np.full(10, np.nan, np.float32)
            C.matmul_nt_view(data_a, ga, data_b, gb, flat, rows=(6, 6), out_geometry=np.array([0, 60, 60, 0]))
            assert np.isnan(flat).all(), path
    finally:
        ext._matmul_path("auto")
