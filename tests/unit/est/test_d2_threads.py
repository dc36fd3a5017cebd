"""D2's CPU kernels give the same bits on any number of threads: the products cut along a's rows, along b's first
dimension (whole output columns or whole planes of a convolution's output), or by entries of a batched product;
batch norm's channels shared out between threads; the zero-padded images the convolutions read (rows shared out)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpc_elastic.est import d2_ops
from hpc_elastic.est.d2_math import (
    PARALLEL_MIN_WORK,
    batch_norm_train,
    batch_norm_train_backward,
    batch_norm_train_torch,
    c_kernels,
    det_bmm_nt,
    det_matmul_nt,
    det_matmul_nt_groups,
)


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def bits_on_threads(fn: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """fn's result, as int32 bits, on 1, 2, 3 and 5 torch threads."""
    out = []
    for threads in (1, 2, 3, 5):
        torch.set_num_threads(threads)
        out.append(fn().clone().view(torch.int32))
    return out


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (16, 3001, 333),  # n > m: cut by columns
        (300, 40, 9000),  # m > n: cut by rows
        (5, 100_003, 13),  # a few rows, many columns
        (3, 2, 200_000),  # fewer items than threads
    ],
)
def test_det_matmul_nt_bits_do_not_depend_on_the_threads(m: int, n: int, k: int) -> None:
    assert m * n * k >= PARALLEL_MIN_WORK  # (the products are cut)
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen)
    b_strided = torch.randn(k, n, generator=gen).t()  # b read in place through its strides
    for fn in (lambda: det_matmul_nt(a, b), lambda: det_matmul_nt(a, b_strided)):
        first, *others = bits_on_threads(fn)
        assert all(torch.equal(first, o) for o in others)
    assert torch.allclose(det_matmul_nt(a, b), a @ b.T, rtol=1e-4, atol=1e-3)


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("offset", [0, 2])
def test_det_matmul_nt_planes_of_a_convolution_on_any_threads(offset: int) -> None:
    """b a channels-last image's rows [N, H, W] (each thread a range of its N), out whole NCHW planes of a larger
    buffer: the same bits on every thread count, nothing written outside the planes."""
    n_img, h, w, c, o = 9, 17, 19, 40, 12
    gen = torch.Generator().manual_seed(offset)
    image = torch.randn(n_img, c, h, w, generator=gen).permute(0, 2, 3, 1)
    weight = torch.randn(o, c, generator=gen)
    big = torch.full((o, n_img + 3, h * w), float("nan"))

    def conv() -> torch.Tensor:
        det_matmul_nt(weight, image, a_rows=1, b_rows=3, out=big[:, offset : offset + n_img])
        return big

    first, *others = bits_on_threads(conv)
    assert all(torch.equal(first, other) for other in others)
    inside = big[:, offset : offset + n_img]
    assert not inside.isnan().any()
    assert big.isnan().sum() == o * 3 * h * w
    ref = (weight @ image.reshape(-1, c).T).reshape(o, n_img, h * w)
    assert torch.allclose(inside, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("torch_threads")
def test_det_bmm_nt_bits_do_not_depend_on_the_threads() -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(7, 33, 300, generator=gen)
    b = torch.randn(300, 7, 41, generator=gen).permute(1, 2, 0)  # strided entries
    first, *others = bits_on_threads(lambda: det_bmm_nt(a, b))
    assert all(torch.equal(first, o) for o in others)
    assert torch.allclose(det_bmm_nt(a, b), a @ b.transpose(1, 2), rtol=1e-4, atol=1e-3)


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("shape", [(6, 7, 33, 29), (5, 3, 4100), (70_000, 2)])
def test_batch_norm_bits_do_not_depend_on_the_threads(shape: tuple[int, ...]) -> None:
    """Forward and backward (with and without weight), channels fewer and more than threads, each above the size
    that wakes the threads: the same bits on every thread count, and the bits of the definition's torch ops."""
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen) * 3 + 1
    g = torch.randn(*shape, generator=gen)
    weight = torch.randn(shape[1], generator=gen)
    bias = torch.randn(shape[1], generator=gen)
    assert x.numel() >= 1 << 15

    def step(w: torch.Tensor | None) -> torch.Tensor:
        fwd = batch_norm_train(x, w, bias if w is not None else None, 1e-5)
        gx, gw, gb = batch_norm_train_backward(g, fwd.xhat, fwd.invstd, w, True)
        assert gx is not None
        return torch.cat([t.reshape(-1) for t in (*fwd, gx, gw, gb)])

    for w in (weight, None):
        first, *others = bits_on_threads(functools.partial(step, w))
        assert all(torch.equal(first, o) for o in others)
        ref = batch_norm_train_torch(x, w, bias if w is not None else None, 1e-5)
        got = batch_norm_train(x, w, bias if w is not None else None, 1e-5)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, ref, strict=True))


@pytest.mark.parametrize(("m", "n", "k"), [(3, 0, 5), (0, 4, 5), (0, 0, 0), (3, 4, 0), (1, 2, 0)])
def test_empty_products(m: int, n: int, k: int) -> None:
    """No rows, no columns or no terms: the shape of ``a @ b.T``, zeros where there are outputs (empty sums)."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    got = det_matmul_nt(a, b)
    assert got.shape == (m, n)
    assert torch.equal(got, torch.zeros(m, n))
    batched = det_bmm_nt(a.expand(2, m, k), b.expand(2, n, k))
    assert batched.shape == (2, m, n)
    assert torch.equal(batched, torch.zeros(2, m, n))


@pytest.mark.usefixtures("torch_threads")
def test_few_column_items_cut_by_rows_give_the_same_bits() -> None:
    """b's first dimension has 2 items for 5 threads and a has 15 rows: the cut goes along a's rows. The bits are
    those of one thread, as on every other cut."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(15, 320, generator=gen)
    b = torch.randn(2, 700, 320, generator=gen)  # n = 1,400 rows of b in 2 items
    first, *others = bits_on_threads(lambda: det_matmul_nt(a, b, b_rows=2))
    assert all(torch.equal(first, o) for o in others)
    assert torch.allclose(det_matmul_nt(a, b, b_rows=2), a @ b.reshape(-1, 320).T, rtol=1e-4, atol=1e-3)


def padded_by_definition(x: torch.Tensor, pads: tuple[int, int, int, int], channels_last: bool) -> torch.Tensor:
    top, bottom, left, right = pads
    out = F.pad(x, (left, right, top, bottom))
    return out.permute(0, 2, 3, 1).contiguous() if channels_last else out


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize(
    ("shape", "pads"),
    [
        ((32, 16, 32, 32), (1, 1, 1, 1)),  # the first convolutions' images: 8 x 8 blocks only, rows threaded
        ((3, 13, 11, 19), (2, 0, 1, 3)),  # channels and width not multiples of 8, pads uneven
        ((2, 7, 5, 6), (0, 0, 0, 0)),  # no pad, below the size that wakes the threads: one thread
        ((4, 64, 1, 9), (3, 2, 0, 4)),  # one row
    ],
)
def test_padded_images_are_the_images_bits(
    shape: tuple[int, int, int, int],
    pads: tuple[int, int, int, int],
    channels_last: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The C kernel's padded image, planes or channels last, is bit for bit ``F.pad`` of the image (permuted): a
    NaN's payload, infinities and -0.0 moved as they are, +0.0 around, on 1, 2, 3 and 5 threads; from a
    non-contiguous image too. The torch route (a CUDA tensor's) gives the same bits."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen)
    flat = x.view(-1)
    flat[::7] = -0.0
    flat[1::11] = float("inf")
    flat[2::13] = -float("inf")
    flat.view(torch.int32)[3::17] = 0x7FC0_1234  # a NaN with a payload
    want = padded_by_definition(x, pads, channels_last).view(torch.int32)
    for got in bits_on_threads(lambda: d2_ops._pad_image(x, pads, channels_last=channels_last)):
        assert torch.equal(got, want)
    strided = torch.empty(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2).copy_(x)
    assert not strided.is_contiguous()
    got = d2_ops._pad_image(strided, pads, channels_last=channels_last)
    assert torch.equal(got.view(torch.int32), want)
    monkeypatch.setattr(d2_ops, "c_kernels", lambda: None)
    got = d2_ops._pad_image(x, pads, channels_last=channels_last)
    assert torch.equal(got.view(torch.int32), want)


def test_pad_image_refuses_bad_geometry() -> None:
    ext = c_kernels()
    x, out = np.zeros((2, 3, 4, 5), np.float32), np.zeros((2, 6, 7, 3), np.float32)
    ext.pad_image(x, out, np.array([2, 3, 4, 5, 1, 1, 1, 1], np.int64), True, 2)  # fits
    with pytest.raises(ValueError, match="size mismatch"):
        ext.pad_image(x, out, np.array([2, 3, 4, 5, 1, 1, 1, 2], np.int64), True, 2)
    with pytest.raises(ValueError, match="geometry: 8 int64 values >= 0"):
        ext.pad_image(x, out, np.array([2, 3, 4, 5, -1, 3, 1, 1], np.int64), True, 2)
    with pytest.raises(ValueError, match="threads >= 1"):
        ext.pad_image(x, out, np.array([2, 3, 4, 5, 1, 1, 1, 1], np.int64), True, 0)


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize(("groups", "m", "n", "k"), [(1, 8, 6000, 200), (2, 4, 5000, 300), (64, 1, 4096, 9)])
def test_grouped_products_are_each_groups_product(groups: int, m: int, n: int, k: int) -> None:
    """Each group's result, on 1, 2, 3 and 5 threads (fewer groups than threads: each group cut; more: one part per
    group), is bit for bit the one product of that group's operands, read in place from views of one tensor at
    offsets, as a plain result and written as the planes of an NCHW output."""
    gen = torch.Generator().manual_seed(groups * m)
    a = torch.randn(m, groups, k, generator=gen).transpose(0, 1)  # [G, m, k]: a group at an offset, rows strided
    b = torch.randn(n, groups * k, generator=gen).view(n, groups, k).transpose(0, 1)  # [G, n, k]
    planes = 8  # n = planes * (n / planes): each row of a group's output as 8 planes of an NCHW tensor
    seg = n // planes

    def plain() -> torch.Tensor:
        return det_matmul_nt_groups(a, b)

    def as_planes() -> torch.Tensor:
        out = torch.empty(planes, groups * m, seg)  # [N, C, H*W] with C = groups * m
        det_matmul_nt_groups(a, b, out=out.permute(1, 0, 2).view(groups, m, planes, seg))
        return out.permute(1, 0, 2).reshape(groups, m, n)

    for fn in (plain, as_planes):
        first, *others = bits_on_threads(fn)
        assert all(torch.equal(first, o) for o in others)
        for g in range(groups):
            want = det_matmul_nt(a[g], b[g]).view(torch.int32)
            assert torch.equal(first[g], want)


def test_grouped_products_refuse_what_they_cannot_form() -> None:
    a, b = torch.randn(3, 4, 5), torch.randn(3, 6, 5)
    assert det_matmul_nt_groups(torch.empty(0, 4, 5), torch.empty(0, 6, 5)).shape == (0, 4, 6)
    with pytest.raises(ValueError, match="the same groups"):
        det_matmul_nt_groups(a, torch.randn(2, 6, 5))
    with pytest.raises(ValueError, match="the same k"):
        det_matmul_nt_groups(a, torch.randn(3, 6, 4))
    with pytest.raises(ValueError, match=r"out must be a \[G, m, S, seg\]"):
        det_matmul_nt_groups(a, b, out=torch.empty(3, 4, 6))
