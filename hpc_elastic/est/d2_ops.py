"""D2 operators: the layers real models use, with the same bits on every CPU and CUDA GPU (EasyScale §3.3).

Every operator is a ``torch.autograd.Function`` whose forward *and* backward are written with the primitives of
:mod:`hpc_elastic.est.d2_math` only (single-operation element-wise torch calls, data movement, the fixed-order
products of :func:`~hpc_elastic.est.d2_math.det_matmul_nt` and the fixed-tree reductions of
:func:`~hpc_elastic.est.d2_math.det_sum`).  Autograd's own backward of composed torch ops is never used: a
broadcast's backward sums with ``torch.sum`` and ``index_select``'s scatters with atomics on CUDA.

- Conv2d: an implicit GEMM, one product of the weight with the patches, a strided view of the padded channels-last
  image that the kernel reads in place (no gathered im2col matrix); backward: the weight gradient is a product
  with the patch columns (a view of the padded image), the input's gradient the transposed convolution (per phase
  of the stride, a product with the windows of the padded output gradient, also read in place, and the kernel
  offsets that reach the phase; no ``F.fold``, no scatter-add);
- BatchNorm1d/2d/3d (batch statistics by fixed trees, running statistics by torch's formula with the unbiased
  variance), LayerNorm;
- Embedding: forward gathers; backward sums every id's gradient rows by a segmented scan over the stably sorted
  ids, a tree fixed by the id's count, and gathers each row's sum (no scatter, no accumulation race, no host read
  in a graph capture: :func:`embedding_row_sums`);
- MaxPool2d (comparisons over the kernel offsets in a fixed order: ties go to the first offset by construction),
  AdaptiveAvgPool2d for output sizes that divide the input;
- Sigmoid, Tanh, SiLU, GELU (erf and tanh forms), Softmax, LogSoftmax and :func:`det_cross_entropy`.

The modules (``DetConv2d``...) subclass torch's and keep its parameters, buffers and state dict;
:func:`hpc_elastic.est.d2.to_d2` swaps them in by class.  Autograd itself still adds the gradients of a tensor
used twice (a residual block's input): two contributions, one correctly rounded, commutative addition.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpc_elastic.est.d2_math import (
    batch_norm_train,
    batch_norm_train_backward,
    bcast,
    c_kernels,
    channel_dims,
    det_bmm_nt,
    det_erfc,
    det_exp,
    det_log,
    det_matmul_nt,
    det_matmul_nt_groups,
    det_sigmoid,
    det_sqrt,
    det_sum,
    det_sum_dims,
    det_tanh,
    div_count,
    f32,
    reciprocal,
)
from hpc_elastic.est.gpu import capturing

Grads = tuple[torch.Tensor | None, ...]
Pair = tuple[int, int]


class Window(NamedTuple):
    """The sliding window of a convolution or a pooling."""

    kernel: Pair
    stride: Pair
    padding: Pair
    dilation: Pair

    def output(self, h: int, w: int) -> Pair:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self
        return (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1


INV_SQRT2 = f32(1.0 / math.sqrt(2.0))
INV_SQRT_2PI = f32(1.0 / math.sqrt(2.0 * math.pi))
GELU_C = f32(math.sqrt(2.0 / math.pi))
GELU_A = f32(0.044715)


def _pair(value: Any) -> Pair:
    if isinstance(value, int):
        return value, value
    a, b = value
    return int(a), int(b)


# ---------------------------------------------------------------------------------------------- linear, conv


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = det_matmul_nt(x2, weight)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.lead = lead
        return out if x.dim() == 2 else _fresh(out.reshape(*lead, weight.shape[0]))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        x2, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, weight.shape[0]).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = det_matmul_nt(g2, weight.t()).reshape(*ctx.lead, weight.shape[1])  # the transposes read in place
        if ctx.needs_input_grad[1]:
            gw = det_matmul_nt(g2.t(), x2.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            ones = torch.ones((1, g2.shape[0]), dtype=torch.float32, device=g2.device)
            gb = det_matmul_nt(ones, g2.t()).reshape(weight.shape[0])
        return gx, gw, gb


def _padded_nhwc(x: torch.Tensor, padding: Pair) -> torch.Tensor:
    """[N, C, H, W] -> zero-padded, contiguous [N, H + 2ph, W + 2pw, C] (channels last: a patch's channels are
    contiguous, so a patch row is read as runs of whole pixels)."""
    ph, pw = padding
    return _pad_image(x, (ph, ph, pw, pw), channels_last=True)


def _pad_image(x: torch.Tensor, pads: tuple[int, int, int, int], *, channels_last: bool) -> torch.Tensor:
    """[N, C, H, W] with +0.0 around, ``pads`` = (top, bottom, left, right): the contiguous [N, C, H', W'] tensor, or
    with ``channels_last`` the contiguous [N, H', W', C] one.  Only copies of bits: the same tensor by any route.
    The image is copied into the interior of an uninitialised tensor and only the border zeroed (``F.pad`` fills the
    whole tensor first; of a permuted image, followed by ``contiguous``, it copied twice).  On the CPU by the C
    kernel, on torch's threads: each row written once, and into channels last transposed in 8 x 8 blocks, where
    torch's copy of the permuted view moves one element at a time (5-8x slower on the first convolutions'
    [32, 16, 32, 32] images here)."""
    top, bottom, left, right = pads
    n, c, h, w = x.shape
    hp, wp = top + h + bottom, left + w + right
    out = x.new_empty((n, hp, wp, c) if channels_last else (n, c, hp, wp))
    ext = c_kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if ext is not None and out.numel():
        geometry = np.array([n, c, h, w, top, bottom, left, right], np.int64)
        xc = x.detach().contiguous()
        ext.pad_image(xc.numpy(), out.numpy(), geometry, channels_last, torch.get_num_threads())
        return out
    planes = out.permute(0, 3, 1, 2) if channels_last else out  # [N, C, H', W'] either way
    planes[:, :, top : top + h, left : left + w].copy_(x)
    planes[:, :, :top].zero_()
    planes[:, :, top + h :].zero_()
    planes[:, :, top : top + h, :left].zero_()
    planes[:, :, top : top + h, left + w :].zero_()
    return out


def _patches(xp: torch.Tensor, window: Window, out: Pair) -> torch.Tensor:
    """The [N, Ho, Wo, kh, kw, C] view of every window of a padded channels-last image (no copy)."""
    n, _, _, c = xp.shape
    s_n, s_h, s_w, _ = xp.stride()
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    size = (n, out[0], out[1], kh, kw, c)
    return xp.as_strided(size, (s_n, s_h * sh, s_w * sw, s_h * dh, s_w * dw, 1))


def _columns(x: torch.Tensor, window: Window, out: Pair) -> torch.Tensor:
    """The patches as columns, the [kh, kw, C, N, Ho, Wo] view (rows (i, j, c), columns (n, y, x)) of the
    zero-padded [N, C, H, W] image: a window row's values lie W apart there, so the product reads runs along x."""
    ph, pw = window.padding
    xq = _pad_image(x, (ph, ph, pw, pw), channels_last=False) if ph or pw else x.contiguous()
    n, c = x.shape[0], x.shape[1]
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    s_n, s_c, s_h, s_w = xq.stride()
    size = (kh, kw, c, n, out[0], out[1])
    return xq.as_strided(size, (s_h * dh, s_w * dw, s_c, s_n, s_h * sh, s_w * sw))


def _by_group(t: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    """The view of ``t`` with dimension ``dim`` cut into ``groups`` equal ranges, the group first: [G, ...,
    size / G, ...] (a convolution's channels or filters, group by group; no copy)."""
    return t.view(*t.shape[:dim], groups, t.shape[dim] // groups, *t.shape[dim + 1 :]).movedim(dim, 0)


#: planes smaller than this are written as an [O, N*Ho*Wo] matrix and copied (the product's panels end at planes)
MIN_PLANE = 16


def _planes_product(a: torch.Tensor, rows: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``det_matmul_nt_groups(a, rows, b_rows=3)``, group g's [C / G, N*H*W] product, as channels g C / G .. of the
    contiguous [N, C, H, W] tensor whose planes they hold: written in place (each group's output columns in segments
    of H*W, one plane each), or for small planes formed as a matrix and copied.  The same values either way."""
    n, c, h, w = shape
    if h * w < MIN_PLANE:
        return det_matmul_nt_groups(a, rows, b_rows=3).reshape(c, n, h, w).permute(1, 0, 2, 3).contiguous()
    out = a.new_empty((n, c, h, w))
    det_matmul_nt_groups(a, rows, b_rows=3, out=_by_group(out.view(n, c, h * w).permute(1, 0, 2), 0, a.shape[0]))
    return out


def _taps(phase: int, kernel: int, stride: int, padding: int, dilation: int) -> tuple[list[int], int, int]:
    """The kernel offsets that reach the input positions ``phase + stride * t`` (those with ``phase + padding -
    i * dilation`` a multiple of the stride), from the last to the first, and the output position each reaches from
    ``t = 0``, ``(phase + padding - i * dilation) / stride``: the first one's and the step between them (increasing)."""
    taps = [i for i in reversed(range(kernel)) if (phase + padding - i * dilation) % stride == 0]
    first = (phase + padding - taps[0] * dilation) // stride if taps else 0
    step = dilation * (taps[0] - taps[1]) // stride if len(taps) > 1 else 1
    return taps, first, step


class _Phase(NamedTuple):
    """The input positions ``(py + sh * t, px + sw * u)`` of one phase of a convolution's stride, t < th and u < tw,
    and the kernel offsets that reach them (from the last to the first) with the output position of the first and
    the step between them, per axis (:func:`_taps`)."""

    py: int
    px: int
    taps_i: list[int]
    first_i: int
    step_i: int
    taps_j: list[int]
    first_j: int
    step_j: int
    th: int
    tw: int


def _phases(window: Window, size: Pair, out: Pair) -> tuple[list[_Phase], tuple[int, int, int, int]]:
    """The phases any window reaches, and the (top, bottom, left, right) zero padding of the output gradient that
    every phase's windows read inside."""
    h, w = size
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = window
    phases = []
    for py in range(min(sh, h)):
        taps_i, first_i, step_i = _taps(py, kh, sh, ph, dh)
        for px in range(min(sw, w)):
            taps_j, first_j, step_j = _taps(px, kw, sw, pw, dw)
            if taps_i and taps_j:  # else no window reaches these positions: their gradient is 0
                th, tw = len(range(py, h, sh)), len(range(px, w, sw))
                phases.append(_Phase(py, px, taps_i, first_i, step_i, taps_j, first_j, step_j, th, tw))
    if not phases:
        return phases, (0, 0, 0, 0)
    top = max(max(0, -p.first_i) for p in phases)
    left = max(max(0, -p.first_j) for p in phases)
    bottom = max(max(0, p.th + p.first_i + p.step_i * (len(p.taps_i) - 1) - out[0]) for p in phases)
    right = max(max(0, p.tw + p.first_j + p.step_j * (len(p.taps_j) - 1) - out[1]) for p in phases)
    return phases, (top, bottom, left, right)


def _input_grad_buffer(grad_out: torch.Tensor, phases: list[_Phase], shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The input gradient's tensor: uninitialised where the phases cover every position, else zeros (a position no
    window reaches has gradient 0)."""
    covered = sum(p.th * p.tw for p in phases) == shape[2] * shape[3]
    return grad_out.new_empty(shape) if covered else grad_out.new_zeros(shape)


def _input_grad(grad_out: torch.Tensor, weight: torch.Tensor, window: Window, size: Pair, groups: int) -> torch.Tensor:
    """The gradient of a convolution's input [N, C, H, W]: the transposed convolution, one product per phase of the
    stride (input positions ``(py + sh * t, px + sw * u)``, stride 1: one phase).  A phase's product is, group by
    group, the weight of the kernel offsets that reach it, [C / G, (i, j, o)] (offsets from the last to the first;
    the group's filters o), against the windows of the zero-padded channels-last output gradient over those offsets
    and the group's channels (a view read in place): every input value one fixed-order dot product, no col2im and
    no product with the zeros a stride would put between the output gradient's values."""
    n, o, ho, wo = grad_out.shape
    c = weight.shape[1] * groups
    h, w = size
    sh, sw = window.stride
    phases, pads = _phases(window, size, (ho, wo))
    if not phases:
        return grad_out.new_zeros((n, c, h, w))
    # one zero-padded channels-last copy of the output gradient, padded for every phase's windows
    top, _, left, _ = pads
    gp = _pad_image(grad_out, pads, channels_last=True)
    s_n, s_h, s_w, _ = gp.stride()
    gx = _input_grad_buffer(grad_out, phases, (n, c, h, w))
    for py, px, taps_i, first_i, step_i, taps_j, first_j, step_j, th, tw in phases:
        window_view = gp.as_strided(
            (n, th, tw, len(taps_i), len(taps_j), o),
            (s_n, s_h, s_w, s_h * step_i, s_w * step_j, 1),
            (first_i + top) * s_h + (first_j + left) * s_w,
        )
        rows = _by_group(window_view, 5, groups)  # [G, n, th, tw, i, j, O / G]
        sub = (
            _by_group(weight, 0, groups)
            .index_select(3, torch.tensor(taps_i, device=weight.device))
            .index_select(4, torch.tensor(taps_j, device=weight.device))
            .permute(0, 2, 3, 4, 1)
            .reshape(groups, weight.shape[1], -1)
        )  # [G, C / G, (i, j, o)]
        # [C, N*th*tw]: the weight as the rows, so that a channel's values come out as whole planes (an FMA's
        # product commutes: each output sees the same operations as with the operands the other way round)
        if sh > 1 or sw > 1:
            phase = det_matmul_nt_groups(sub, rows, b_rows=3)
            gx[:, :, py::sh, px::sw] = phase.reshape(c, n, th, tw).permute(1, 0, 2, 3)
        else:
            gx = _planes_product(sub, rows, (n, c, h, w))
    return gx


def _depthwise_ext(x: torch.Tensor, weight: torch.Tensor, groups: int) -> Any:
    """The C extension when it runs this convolution as a depthwise one (a CPU float32 tensor, one channel and one
    filter per group), else None."""
    depthwise = groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1
    return c_kernels() if depthwise and x.device.type == "cpu" and x.dtype == torch.float32 else None


def _stencil(
    ext: Any, img: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, *, offsets: list[int], geometry: Any
) -> None:
    """``ext.stencil`` (kernels/detreduce.c) over the planes of ``img``, a contiguous padded [N, C, Hp, Wp] image:
    geometry ``(y0, x0, sy, sx, th, tw, out_at, out_st, out_su)`` (kernels/detreduce.c), ``out`` a contiguous
    [N, C, H, W] tensor, a plane apart per channel."""
    n, c, hp, wp = img.shape
    y0, x0, sy, sx, th, tw, out_at, out_st, out_su = geometry
    plane = out.shape[2] * out.shape[3]
    full = np.array([n * c, hp, wp, c, y0, x0, sy, sx, th, tw, out_at, plane, out_st, out_su], np.int64)
    flat = weights.detach().contiguous().numpy()
    ext.stencil(img.numpy(), flat, np.array(offsets, np.int64), out.numpy(), full, torch.get_num_threads())


def _kernel_offsets(window: Window, wp: int) -> list[int]:
    """The kernel offsets (i, j) in row-major order as distances in a padded plane of rows ``wp`` apart."""
    (kh, kw), _, _, (dh, dw) = window
    return [i * dh * wp + j * dw for i in range(kh) for j in range(kw)]


def _depthwise_forward(ext: Any, x: torch.Tensor, weight: torch.Tensor, window: Window) -> torch.Tensor:
    """A depthwise convolution's output [N, C, Ho, Wo] by the stencil kernel: each output the dot product over the
    kernel offsets (i, j) in row-major order of the channel's filter and its window of the zero-padded plane: the
    bits of the one-channel implicit GEMM (k = (i, j, c) with one c), with no patches and no per-output tree."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw), _ = window
    ho, wo = window.output(h, w)
    xp = _pad_image(x, (ph, ph, pw, pw), channels_last=False)
    out = x.new_empty((n, c, ho, wo))
    if out.numel():
        geometry = (0, 0, sh, sw, ho, wo, 0, wo, 1)
        _stencil(
            ext, xp, weight.reshape(c, kh * kw), out, offsets=_kernel_offsets(window, xp.shape[3]), geometry=geometry
        )
    return out


def _depthwise_input_grad(
    ext: Any, grad_out: torch.Tensor, weight: torch.Tensor, window: Window, size: Pair
) -> torch.Tensor:
    """:func:`_input_grad` of a depthwise convolution by the stencil kernel, phase by phase: each input value the dot
    product over the offsets that reach it (from the last to the first) of the channel's filter and the zero-padded
    plane of the output gradient, as the one-channel product has it (k = (i, j, o) with one o)."""
    n, c, ho, wo = grad_out.shape
    h, w = size
    sh, sw = window.stride
    kw = weight.shape[3]
    phases, pads = _phases(window, size, (ho, wo))
    gx = _input_grad_buffer(grad_out, phases, (n, c, h, w))
    if not phases or not gx.numel():
        return gx
    top, _, left, _ = pads
    gp = _pad_image(grad_out, pads, channels_last=False)
    wp = gp.shape[3]
    filters = weight.reshape(c, -1)
    for p in phases:
        taps = [i * kw + j for i in p.taps_i for j in p.taps_j]
        offsets = [a * p.step_i * wp + b * p.step_j for a in range(len(p.taps_i)) for b in range(len(p.taps_j))]
        geometry = (p.first_i + top, p.first_j + left, 1, 1, p.th, p.tw, p.py * w + p.px, sh * w, sw)
        _stencil(ext, gp, filters[:, taps], gx, offsets=offsets, geometry=geometry)
    return gx


def _depthwise_weight_grad(
    ext: Any, grad_out: torch.Tensor, x: torch.Tensor, window: Window, out: Pair
) -> torch.Tensor:
    """A depthwise convolution's weight gradient [C, kh * kw] by the stencil kernel: each value the dot product over
    the outputs (n, y, x) of the channel's output gradient and its window values at that kernel offset, lane t mod 8
    of output t, as the one-channel product of the gradient's plane and the patch columns has it."""
    n, c = x.shape[0], x.shape[1]
    (kh, kw), (sh, sw), (ph, pw), _ = window
    xp = _pad_image(x, (ph, ph, pw, pw), channels_last=False)
    hp, wp = xp.shape[2], xp.shape[3]
    offsets = np.array(_kernel_offsets(window, wp), np.int64)
    gw = x.new_empty((c, kh * kw))
    geometry = np.array([n, c, hp, wp, 0, 0, sh, sw, out[0], out[1]], np.int64)
    ext.stencil_weight_grad(
        xp.numpy(), grad_out.detach().numpy(), offsets, gw.numpy(), geometry, torch.get_num_threads()
    )
    return gw


class _Conv2dFn(torch.autograd.Function):
    """Implicit GEMM: the weight [O, kh*kw*C] against the patches [N*Ho*Wo, kh*kw*C], read in place from the padded
    channels-last image (a strided view, no gather); each output is one fixed-order dot product over (i, j, c).  The
    input's gradient is the transposed convolution (:func:`_input_grad`), formed the same way.  With G groups, group
    g's filters against the patches of its channels, each output the dot product over its group's (i, j, c): the
    groups' products are views of the same image and weight at offsets, run in one call
    (:func:`det_matmul_nt_groups`)."""

    @staticmethod
    def forward(  # noqa: PLR0917 - autograd's apply passes every input positionally
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        window: Window,
        groups: int,
    ) -> torch.Tensor:
        n, _, h, w = x.shape
        o = weight.shape[0]
        ho, wo = window.output(h, w)
        ext = _depthwise_ext(x, weight, groups)
        if ext is not None:
            out = _depthwise_forward(ext, x, weight, window)
        else:
            rows = _by_group(_patches(_padded_nhwc(x, window.padding), window, (ho, wo)), 5, groups)
            w_rows = weight.permute(0, 2, 3, 1).reshape(groups, o // groups, -1)
            # [O, N*Ho*Wo]: the weight as the rows, so that the output's planes come out whole (the FMA's product
            # commutes: each output sees the same operations as with the patches as the rows), written in place as
            # the planes of the NCHW output
            out = _planes_product(w_rows, rows, (n, o, ho, wo))
        if bias is not None:
            out = out + bias.reshape(1, o, 1, 1)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.window = window
        ctx.groups = groups
        return _fresh(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        x, weight = ctx.saved_tensors
        window, groups = ctx.window, ctx.groups
        n, _, h, w = x.shape
        o, c, kh, kw = weight.shape  # (c: a group's channels)
        ho, wo = grad_out.shape[2], grad_out.shape[3]
        gx = gw = gb = None
        ext = _depthwise_ext(x, weight, groups)
        if ctx.needs_input_grad[0]:
            if ext is not None:
                gx = _depthwise_input_grad(ext, grad_out.contiguous(), weight, window, (h, w))
            else:
                gx = _input_grad(grad_out, weight, window, (h, w), groups)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            cols_g = grad_out.permute(1, 0, 2, 3)  # [O, (n, y, x)]
            if ctx.needs_input_grad[1]:
                if ext is not None:
                    gw = _depthwise_weight_grad(ext, grad_out.contiguous(), x, window, (ho, wo)).reshape(weight.shape)
                else:
                    columns = _by_group(_columns(x, window, (ho, wo)), 2, groups)  # [G, (i, j, c), (n, y, x)]
                    gw = det_matmul_nt_groups(_by_group(cols_g, 0, groups), columns, b_rows=3)
                    gw = gw.reshape(o, kh, kw, c).permute(0, 3, 1, 2).contiguous()
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = det_sum(cols_g.reshape(o, n * ho * wo), 1)
        return gx, gw, gb, None, None


# ---------------------------------------------------------------------------------------------- normalisation


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """An output that is not a view (autograd forbids in-place changes of a custom Function's view outputs)."""
    return t if t._base is None else t.clone(memory_format=torch.contiguous_format)


class _BatchNormTrainFn(torch.autograd.Function):
    """Batch statistics; also returns the batch mean and the sum of squared deviations (for the running
    statistics)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        count = x.numel() // x.shape[1]
        if count < 2:
            raise ValueError(
                f"batch norm needs more than 1 value per channel when training, got input {tuple(x.shape)}"
            )
        y, xhat, mean, sq, invstd = batch_norm_train(x, weight, bias, eps)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(mean, sq)
        return y, mean, sq

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _gm: torch.Tensor | None, _gv: torch.Tensor | None) -> Grads:
        xhat, invstd, weight = ctx.saved_tensors
        gx, gw, gb = batch_norm_train_backward(grad_out, xhat, invstd, weight, ctx.needs_input_grad[0])
        return (
            gx,
            gw if weight is not None and ctx.needs_input_grad[1] else None,
            gb if ctx.has_bias and ctx.needs_input_grad[2] else None,
            None,
        )


class _BatchNormEvalFn(torch.autograd.Function):
    """Normalisation by the running statistics."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        stats: tuple[torch.Tensor, torch.Tensor, float],
    ) -> torch.Tensor:
        running_mean, running_var, eps = stats
        invstd = reciprocal(det_sqrt(running_var + f32(eps)))
        xhat = (x - bcast(running_mean, x)) * bcast(invstd, x)
        y = xhat
        if weight is not None:
            y = y * bcast(weight, x)
        if bias is not None:
            y = y + bcast(bias, x)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        xhat, invstd, weight = ctx.saved_tensors
        dims = channel_dims(xhat)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else weight * invstd
            gx = grad_out * bcast(scale, xhat)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = det_sum_dims(grad_out * xhat, dims)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = det_sum_dims(grad_out, dims)
        return gx, gw, gb, None


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, shape: tuple[int, float]
    ) -> torch.Tensor:
        dims, eps = shape
        inner = tuple(range(x.dim() - dims, x.dim()))
        size = math.prod(x.shape[x.dim() - dims :])
        mean = div_count(det_sum_dims(x, inner, keepdim=True), size)
        d = x - mean
        var = div_count(det_sum_dims(d * d, inner, keepdim=True), size)
        invstd = reciprocal(det_sqrt(var + f32(eps)))
        y = d * invstd
        xhat = y
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.has_bias = bias is not None
        ctx.dims = dims
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        xhat, invstd, weight = ctx.saved_tensors
        inner = tuple(range(xhat.dim() - ctx.dims, xhat.dim()))
        outer = tuple(range(xhat.dim() - ctx.dims))
        size = math.prod(xhat.shape[xhat.dim() - ctx.dims :])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gxhat = grad_out if weight is None else grad_out * weight
            mean_g = div_count(det_sum_dims(gxhat, inner, keepdim=True), size)
            mean_gx = div_count(det_sum_dims(gxhat * xhat, inner, keepdim=True), size)
            gx = gxhat - mean_g
            gx = gx - xhat * mean_gx
            gx = gx * invstd
        if weight is not None and ctx.needs_input_grad[1]:
            gw = det_sum_dims(grad_out * xhat, outer)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = det_sum_dims(grad_out, outer)
        return gx, gw, gb, None


# ---------------------------------------------------------------------------------------------- embedding, pooling


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        flat = ids.reshape(-1)
        ctx.save_for_backward(flat)
        ctx.rows = weight.shape[0]
        ctx.padding_idx = padding_idx
        return weight[ids]  # a gather into a new tensor

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        (flat,) = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if not flat.numel():
            return None, g.new_zeros((ctx.rows, g.shape[1])), None
        return None, embedding_row_sums(flat, g, ctx.rows, ctx.padding_idx), None


def embedding_row_sums(ids: torch.Tensor, g: torch.Tensor, rows: int, padding_idx: int | None) -> torch.Tensor:
    """The embedding's weight gradient: for every row, the sum of the [T, E] gradient ``g``'s rows at the positions
    where the [T] ``ids`` name it, by a fixed tree that depends only on how often the id occurs.

    The ids are sorted stably (an id's occurrences stay in input order, as one segment), then a segmented inclusive
    scan in the manner of Hillis and Steele runs in rounds of shift s = 1, 2, 4...: position p becomes
    ``v[p] + v[p - s]`` where ``p - s`` lies in p's segment (the previous round's values).  At a segment's last
    position this is the sum of the segment's L occurrences by a tree fixed by L (ranges aligned on the segment's
    end).  Each row gathers the value at its segment's last position (a binary search of the sorted ids: no
    scatter, so no race), the padding id's row and the rows of absent ids are +0.

    While a CUDA graph is captured the rounds run up to T, a count fixed by the shape, and nothing is read back to
    the host; otherwise they stop at the longest segment (one host read), as the later rounds add -0.0 everywhere."""
    total = ids.numel()
    order = torch.sort(ids, stable=True)
    sorted_ids = order.values
    # the gradient rows in sorted order, then a row of -0.0, the identity of IEEE addition (x + -0.0 == x for every
    # x, -0.0 included), which a position adds in a round where it has nothing to add, and a row of +0.0
    v = g.new_empty((total + 2, g.shape[1]))
    torch.index_select(g, 0, order.indices, out=v[:total])
    v[total].fill_(-0.0)
    v[total + 1].fill_(0.0)
    position = torch.arange(total, device=ids.device)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    first = torch.cummax(torch.where(starts, position, torch.zeros_like(position)), 0).values
    # rounds past the longest segment change nothing: outside a graph capture they stop there (one host read)
    rounds_to = total if capturing(ids) else int((position - first).max().item()) + 1
    shift = 1
    while shift < rounds_to:
        source = position[shift:] - shift
        addend = v.index_select(0, torch.where(source >= first[shift:], source, total))  # the previous round's
        v[shift:total] += addend
        shift *= 2
    # every row gathers its segment's last position, found by a binary search of the sorted ids (no scatter), or
    # the +0.0 row
    row = torch.arange(rows, device=ids.device, dtype=sorted_ids.dtype)
    last = torch.searchsorted(sorted_ids, row, right=True) - 1
    present = (last >= 0) & (sorted_ids.index_select(0, last.clamp(min=0)) == row)
    if padding_idx is not None:
        present = present & (row != padding_idx)
    return v.index_select(0, torch.where(present, last, total + 1))


def max_pool_torch(x: torch.Tensor, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """D2's maximum pool by its definition (the CUDA path, and the reference of the C kernel): the maximum of each
    window of the ``-inf``-padded [N, C, H, W] input by element-wise comparisons over the kernel offsets in row-major
    order; an offset replaces the best so far only when strictly greater (or NaN over a number), so ties go to the
    first offset by construction, on every device.  Returns the maximum and the selected offset (uint8)."""
    ph, pw = window.padding
    xp = F.pad(x, (pw, pw, ph, ph), value=float("-inf")).contiguous()
    best = idx = None
    for t, part in enumerate(_window_slices(xp, window, window.output(x.shape[2], x.shape[3]))):
        if best is None or idx is None:
            best, idx = part, torch.zeros(part.shape, dtype=torch.uint8, device=x.device)
            continue
        take = (part > best) | (torch.isnan(part) & ~torch.isnan(best))
        best = torch.where(take, part, best)
        idx = torch.where(take, torch.full_like(idx, t), idx)
    assert best is not None and idx is not None
    return _fresh(best), idx


def max_pool_backward_torch(grad_out: torch.Tensor, idx: torch.Tensor, h: int, w: int, window: Window) -> torch.Tensor:
    """The input gradient of :func:`max_pool_torch` by its definition: the padded gradient starts at +0 and each
    offset, in increasing order, adds the gradients its windows selected; the padding is dropped."""
    n, c, ho, wo = grad_out.shape
    ph, pw = window.padding
    gxp = grad_out.new_zeros((n, c, h + 2 * ph, w + 2 * pw))
    zeros = torch.zeros_like(grad_out)
    for t, target in enumerate(_window_slices(gxp, window, (ho, wo))):
        target.add_(torch.where(idx == t, grad_out, zeros))
    return gxp[:, :, ph : ph + h, pw : pw + w].contiguous()


def _pool_geometry(x_shape: torch.Size, window: Window) -> np.ndarray[Any, Any]:
    n, c, h, w = x_shape
    ho, wo = window.output(h, w)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = window
    return np.array([n * c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo], np.int64)


def _c_max_pool(x: torch.Tensor, window: Window) -> Any:
    """The C extension when it runs this max pool (a CPU tensor, at most 256 offsets), else None."""
    kh, kw = window.kernel
    if x.device.type != "cpu" or kh * kw > 256:
        return None
    return c_kernels()


def max_pool(x: torch.Tensor, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`max_pool_torch`; on the CPU by the C kernel in one pass (the same comparisons: the same bits)."""
    ext = _c_max_pool(x, window)
    if ext is None:
        return max_pool_torch(x, window)
    xc = x.detach().contiguous()
    ho, wo = window.output(xc.shape[2], xc.shape[3])
    out = xc.new_empty((xc.shape[0], xc.shape[1], ho, wo))
    idx = torch.empty(out.shape, dtype=torch.uint8)
    ext.max_pool_forward(xc.numpy(), out.numpy(), idx.numpy(), _pool_geometry(xc.shape, window))
    return out, idx


def max_pool_backward(grad_out: torch.Tensor, idx: torch.Tensor, h: int, w: int, window: Window) -> torch.Tensor:
    """:func:`max_pool_backward_torch`; on the CPU by the C kernel (the same additions in the same order)."""
    ext = _c_max_pool(grad_out, window)
    if ext is None:
        return max_pool_backward_torch(grad_out, idx, h, w, window)
    g = grad_out.detach().contiguous()
    n, c = g.shape[0], g.shape[1]
    gx = g.new_empty((n, c, h, w))
    ext.max_pool_backward(g.numpy(), idx.contiguous().numpy(), gx.numpy(), _pool_geometry(gx.shape, window))
    return gx


class _MaxPool2dFn(torch.autograd.Function):
    """:func:`max_pool` and its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, window: Window) -> torch.Tensor:
        out, idx = max_pool(x, window)
        ctx.save_for_backward(idx)
        ctx.geometry = (x.shape[2], x.shape[3], window)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        (idx,) = ctx.saved_tensors
        h, w, window = ctx.geometry
        return max_pool_backward(grad_out, idx, h, w, window), None


def _window_slices(xp: torch.Tensor, window: Window, out: Pair) -> list[torch.Tensor]:
    """For each kernel offset (i, j) in row-major order, the [N, C, Ho, Wo] view of a padded [N, C, Hp, Wp] image
    that the offset sees in every window."""
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    ho, wo = out
    return [
        xp[:, :, i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw]
        for i in range(kh)
        for j in range(kw)
    ]


class _AvgPoolDividingFn(torch.autograd.Function):
    """Average over non-overlapping (kh, kw) windows of an [N, C, H, W] input (H, W multiples of them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
        n, c, h, w = x.shape
        x6 = x.reshape(n, c, h // kh, kh, w // kw, kw)
        ctx.shape = x.shape
        ctx.window = (kh, kw)
        return _fresh(div_count(det_sum_dims(x6, (3, 5)), kh * kw))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        n, c, h, w = ctx.shape
        kh, kw = ctx.window
        g = div_count(grad_out, kh * kw).reshape(n, c, h // kh, 1, w // kw, 1)
        return g.expand(n, c, h // kh, kh, w // kw, kw).reshape(n, c, h, w), None, None


# ---------------------------------------------------------------------------------------------- activations


def sigmoid_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient through ``y = sigmoid(x)``: ``(grad y)(1 - y)``, one rounding per operation."""
    return (grad * y) * (1.0 - y)


def tanh_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient through ``y = tanh(x)``: ``grad (1 - y^2)``, one rounding per operation."""
    return grad * (1.0 - y * y)


class _SigmoidFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = det_sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        (y,) = ctx.saved_tensors
        return (sigmoid_backward(grad_out, y),)


class _TanhFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = det_tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        (y,) = ctx.saved_tensors
        return (tanh_backward(grad_out, y),)


class _SiLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        s = det_sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        x, s = ctx.saved_tensors
        d = x * (1.0 - s)
        d = (d + 1.0) * s  # silu' = s (1 + x (1 - s))
        return (grad_out * d,)


class _GeluErfFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        cdf = det_erfc(x * -INV_SQRT2) * 0.5  # Phi(x) = erfc(-x / sqrt 2) / 2, accurate in the left tail
        ctx.save_for_backward(x, cdf)
        return x * cdf

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        x, cdf = ctx.saved_tensors
        pdf = det_exp((x * x) * -0.5) * INV_SQRT_2PI
        return (grad_out * (cdf + x * pdf),)


class _GeluTanhFn(torch.autograd.Function):
    """x / 2 (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x2 = x * x
        inner = (x2 * GELU_A + 1.0) * x
        s = det_sigmoid(inner * (2.0 * GELU_C))
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        x, s = ctx.saved_tensors
        du = ((x * x) * (3.0 * GELU_A) + 1.0) * (2.0 * GELU_C)  # d(2u)/dx
        d = ((s * (1.0 - s)) * du) * x
        return (grad_out * (s + d),)


def _row_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The maximum along ``dim`` (exact), + 0.0: a maximum over both -0.0 and +0.0 may be either, depending on the
    order a device compares in, and adding +0.0 turns -0.0 into +0.0."""
    return x.amax(dim, keepdim=True) + 0.0


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        e = det_exp(x - _row_max(x, dim))
        y = torch.div(e, det_sum(e, dim, keepdim=True))
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        (y,) = ctx.saved_tensors
        dot = det_sum(grad_out * y, ctx.dim, keepdim=True)
        return (y * (grad_out - dot), None)


def _log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    shifted = x - _row_max(x, dim)
    return shifted - det_log(det_sum(det_exp(shifted), dim, keepdim=True))


class _LogSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        y = _log_softmax(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        (y,) = ctx.saved_tensors
        total = det_sum(grad_out, ctx.dim, keepdim=True)
        return (grad_out - det_exp(y) * total, None)


class _CrossEntropyFn(torch.autograd.Function):
    """Mean over the batch of -((1 - eps) log p[target] + eps mean_c log p[c])."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
        n, classes = logits.shape
        lsm = _log_softmax(logits, 1)
        picked = lsm.gather(1, target.reshape(n, 1))  # [N, 1]
        loss = -picked
        if smoothing:
            uniform = div_count(det_sum(lsm, 1, keepdim=True), classes)
            loss = loss * f32(1.0 - smoothing) - uniform * f32(smoothing)
        total = div_count(det_sum(loss, 0), n)  # [1]
        ctx.save_for_backward(lsm, target)
        ctx.smoothing = smoothing
        return total.reshape(())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        lsm, target = ctx.saved_tensors
        n, classes = lsm.shape
        onehot = torch.zeros_like(lsm).scatter_(1, target.reshape(n, 1), 1.0)  # a copy into distinct cells
        if ctx.smoothing:
            onehot = onehot * f32(1.0 - ctx.smoothing) + f32(ctx.smoothing / classes)
        scale = div_count(grad_out.reshape(1, 1), n)
        return ((det_exp(lsm) - onehot) * scale, None, None)


def det_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of [N, C] logits against class indices [N], mean over the batch (``F.cross_entropy`` with its
    defaults and optional label smoothing), the same bits on every device.  The targets' range is checked on the host,
    except while a CUDA graph is captured, where a read back is not allowed (a target out of range then trips the
    gather's device-side check, as it does with ``F.cross_entropy``)."""
    if logits.dim() != 2 or target.shape != (logits.shape[0],):
        raise ValueError(
            f"det_cross_entropy needs [N, C] logits and [N] targets, got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}"
        )
    if target.dtype != torch.int64:
        raise ValueError(f"det_cross_entropy needs int64 class indices, got {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if (
        target.numel()
        and not capturing(target)
        and (int(target.min().item()) < 0 or int(target.max().item()) >= logits.shape[1])
    ):
        raise ValueError(f"targets must be class indices in [0, {logits.shape[1]}) (ignore_index is not supported)")
    out: torch.Tensor = _CrossEntropyFn.apply(logits, target, float(label_smoothing))  # type: ignore[no-untyped-call]
    return out


# ---------------------------------------------------------------------------------------------- attention


class _BmmNtFn(torch.autograd.Function):
    """Batched ``a @ b.transpose(1, 2)`` by the fixed-order product, and its gradients by the same product."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return det_bmm_nt(a, b)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        a, b = ctx.saved_tensors
        g = grad_out.contiguous()
        ga = det_bmm_nt(g, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None  # g[i] @ b[i]
        gb = det_bmm_nt(g.transpose(1, 2), a.transpose(1, 2)) if ctx.needs_input_grad[1] else None  # g[i].T @ a[i]
        return ga, gb


def _float_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """An attention mask as values to add to the scores: a boolean mask's True (not allowed) is -inf."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise ValueError(f"attention masks must be bool or floating point, got {mask.dtype}")
    return mask.to(like.dtype)


def mha_unsupported(mha: nn.MultiheadAttention) -> str | None:
    """Why :class:`DetMultiheadAttention` cannot stand in for ``mha``, or None."""
    if mha.dropout:
        return f"dropout={mha.dropout} (CPU and CUDA generators draw different masks; 0 only)"
    if mha.bias_k is not None or mha.bias_v is not None:
        return "add_bias_kv"
    if mha.add_zero_attn:
        return "add_zero_attn"
    return None


class DetMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (no dropout, bias_kv or zero attention) by its definition ("Attention Is All You
    Need" §3.2.2): the projections and the two batched products by the fixed-order product, the scores scaled by
    ``1 / sqrt(head_dim)`` (one float32 multiplication of the queries, as torch scales them), masks added (a boolean
    mask's True is -inf), :class:`DetSoftmax`'s operation over the keys.  Each sample's outputs depend on that
    sample alone.  The same parameters and state dict as the stock module."""

    def forward(  # noqa: PLR0917 (torch's signature)
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _refuse(self, mha_unsupported(self))
        batched = query.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:  # [L, E]: a batch of one, in the module's layout
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        length, n, embed = query.shape  # sequence first from here
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        source = k.shape[0]

        def split(t: torch.Tensor, steps: int) -> torch.Tensor:  # [steps, N, E] -> [N * heads, steps, head_dim]
            return t.reshape(steps, n * heads, head_dim).transpose(0, 1).contiguous()

        q = split(q * f32(1.0 / math.sqrt(head_dim)), length)
        scores = _apply(_BmmNtFn, q, split(k, source))  # [N * heads, L, S]
        if attn_mask is None and is_causal:
            attn_mask = torch.ones((length, source), dtype=torch.bool, device=query.device).triu_(1)
        mask = _float_mask(attn_mask, scores)
        if mask is not None:
            if mask.dim() == 2:
                mask = mask.reshape(1, length, source)
            elif mask.shape != (n * heads, length, source):
                raise ValueError(
                    f"attn_mask must be [L, S] or [N * heads, L, S] = {[n * heads, length, source]}, "
                    f"got {list(mask.shape)}"
                )
            scores = scores + mask
        padding = _float_mask(key_padding_mask, scores)
        if padding is not None:
            if padding.shape != (n, source):
                raise ValueError(f"key_padding_mask must be [N, S] = {[n, source]}, got {list(padding.shape)}")
            scores = (scores.reshape(n, heads, length, source) + padding.reshape(n, 1, 1, source)).reshape(
                n * heads, length, source
            )
        weights = _apply(_SoftmaxFn, scores, -1)
        out = _apply(_BmmNtFn, weights, split(v, source).transpose(1, 2))  # [N * heads, L, head_dim]
        out = out.transpose(0, 1).reshape(length, n, embed)
        out = _apply(_LinearFn, out, self.out_proj.weight, self.out_proj.bias)
        if self.batch_first:
            out = out.transpose(0, 1)
        attention: torch.Tensor | None = None
        if need_weights:
            attention = weights.reshape(n, heads, length, source)
            if average_attn_weights:
                attention = div_count(det_sum(attention, 1), heads)
        if not batched:
            out = out.squeeze(batch_dim)
            attention = None if attention is None else attention.squeeze(0)
        return out, attention

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections of [L, N, E] sequences: one product for self-attention with packed weights (then
        split), else one per input with its slice of the packed weights or its own weight."""
        bias = self.in_proj_bias
        if self._qkv_same_embed_dim:
            if query is key and key is value:
                return _apply(_LinearFn, query, self.in_proj_weight, bias).chunk(3, dim=-1)  # type: ignore[return-value]
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None, None, None) if bias is None else bias.chunk(3)
        q, k, v = (_apply(_LinearFn, t, w, b) for t, w, b in zip((query, key, value), weights, biases, strict=True))
        return q, k, v


def _activation(fn: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The D2 form of a transformer layer's activation: ReLU (exact), GELU, or a module the scanner checks (a child
    of the layer); None for another function."""
    if fn is F.relu:
        return torch.relu
    if fn is F.gelu:
        return lambda x: _apply(_GeluErfFn, x)
    if isinstance(fn, nn.Module):
        return fn
    return None


def transformer_layer_unsupported(layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) -> str | None:
    if _activation(layer.activation) is None:
        return f"activation {getattr(layer.activation, '__name__', layer.activation)!r} (relu, gelu or a module)"
    return None


def _layer_activation(
    layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer,
) -> Callable[[torch.Tensor], torch.Tensor]:
    act = _activation(layer.activation)
    if act is None:
        raise ValueError(f"{type(layer).__name__} does not support {transformer_layer_unsupported(layer)}")
    return act


class _Masks(NamedTuple):
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    is_causal: bool


def _attention(
    mha: nn.Module, dropout: nn.Module, x: torch.Tensor, memory: torch.Tensor, masks: _Masks
) -> torch.Tensor:
    """A transformer layer's attention block: ``x`` attending to ``memory`` (``x`` itself for self-attention), no
    weights returned, then the block's dropout."""
    out = mha(
        x, memory, memory, attn_mask=masks.attn_mask, key_padding_mask=masks.key_padding_mask, need_weights=False,
        is_causal=masks.is_causal,
    )[0]  # fmt: skip
    dropped: torch.Tensor = dropout(out)
    return dropped


def _feed_forward(
    layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer,
    act: Callable[[torch.Tensor], torch.Tensor],
    dropout: nn.Module,
    x: torch.Tensor,
) -> torch.Tensor:
    out: torch.Tensor = dropout(layer.linear2(layer.dropout(act(layer.linear1(x)))))
    return out


class DetTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer``'s forward without its fused inference path (``norm_first`` or not): the
    children (attention, linears, norms, dropouts) are scanned and converted on their own; the layer adds residuals
    of equal shapes (exact) and applies ReLU or D2's GELU."""

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        act = _layer_activation(self)
        masks = _Masks(src_mask, src_key_padding_mask, is_causal)
        x = src
        if self.norm_first:
            h = self.norm1(x)
            x = x + _attention(self.self_attn, self.dropout1, h, h, masks)
            return x + _feed_forward(self, act, self.dropout2, self.norm2(x))
        x = self.norm1(x + _attention(self.self_attn, self.dropout1, x, x, masks))
        out: torch.Tensor = self.norm2(x + _feed_forward(self, act, self.dropout2, x))
        return out


class DetTransformerEncoder(nn.TransformerEncoder):
    """``nn.TransformerEncoder``'s forward without its nested-tensor and fused paths: the layers in turn, then the
    optional norm."""

    def forward(
        self,
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        out = src
        for layer in self.layers:
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
        if self.norm is not None:
            out = self.norm(out)
        return out


class DetTransformerDecoderLayer(nn.TransformerDecoderLayer):
    """``nn.TransformerDecoderLayer``'s forward (``norm_first`` or not) with ReLU or D2's GELU: self-attention,
    attention over the memory, feed-forward, each added as a residual of equal shape; the children are converted on
    their own."""

    def forward(  # noqa: PLR0917 (torch's signature)
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        tgt_key_padding_mask: torch.Tensor | None = None,
        memory_key_padding_mask: torch.Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> torch.Tensor:
        act = _layer_activation(self)
        own = _Masks(tgt_mask, tgt_key_padding_mask, tgt_is_causal)
        over_memory = _Masks(memory_mask, memory_key_padding_mask, memory_is_causal)
        x = tgt
        if self.norm_first:
            h = self.norm1(x)
            x = x + _attention(self.self_attn, self.dropout1, h, h, own)
            x = x + _attention(self.multihead_attn, self.dropout2, self.norm2(x), memory, over_memory)
            return x + _feed_forward(self, act, self.dropout3, self.norm3(x))
        x = self.norm1(x + _attention(self.self_attn, self.dropout1, x, x, own))
        x = self.norm2(x + _attention(self.multihead_attn, self.dropout2, x, memory, over_memory))
        out: torch.Tensor = self.norm3(x + _feed_forward(self, act, self.dropout3, x))
        return out


def rnn_unsupported(rnn: nn.RNNBase) -> str | None:
    """Why :class:`DetRNN`, :class:`DetLSTM` or :class:`DetGRU` cannot stand in for ``rnn``, or None."""
    if rnn.dropout:
        return f"dropout={rnn.dropout} (CPU and CUDA generators draw different masks; 0 only)"
    if getattr(rnn, "proj_size", 0):
        return f"proj_size={rnn.proj_size}"
    return None


class _DetRNNBase(nn.RNNBase):
    """The recurrences of torch's RNN (tanh or ReLU), LSTM and GRU, by their documented equations, one time step
    after the other: the input projections of all steps in one fixed-order product, each step's hidden projection
    in another (biases added inside them), the gates by D2's sigmoid and tanh, the rest element-wise with one
    rounding each, and a hand-written backward through time (:class:`_RecurrenceFn`).  Layers and directions as
    torch's (outputs of both directions concatenated); no dropout between layers, no projections, no packed
    sequences."""

    def forward(self, input: Any, hx: Any = None) -> tuple[torch.Tensor, Any]:
        _refuse(self, rnn_unsupported(self))
        if not isinstance(input, torch.Tensor):
            raise ValueError(f"{type(self).__name__} does not support packed sequences")
        lstm = self.mode == "LSTM"
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if self.batch_first and batched:
            x = x.transpose(0, 1)
        n = x.shape[1]
        directions = 2 if self.bidirectional else 1
        states = self.num_layers * directions
        zeros = x.new_zeros((states, n, self.hidden_size))
        h0, c0 = (hx if lstm else (hx, None)) if hx is not None else (zeros, zeros if lstm else None)
        if not batched and hx is not None:
            h0 = h0.unsqueeze(1)
            c0 = None if c0 is None else c0.unsqueeze(1)
        last_h, last_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                k = layer * directions + direction
                h = h0[k]
                c = None if c0 is None else c0[k]
                ys, h, c = self._run(x, h, c, layer, direction)
                outputs.append(ys)
                last_h.append(h)
                if c is not None:
                    last_c.append(c)
            x = outputs[0] if directions == 1 else torch.cat(outputs, dim=2)
        out = x.transpose(0, 1) if self.batch_first and batched else x
        h_n = torch.stack(last_h)
        c_n = torch.stack(last_c) if lstm else None
        if not batched:
            out = out.squeeze(1)
            h_n = h_n.squeeze(1)
            c_n = None if c_n is None else c_n.squeeze(1)
        return out, ((h_n, c_n) if lstm else h_n)

    def _run(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, layer: int, direction: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        w_ih, w_hh = getattr(self, "weight_ih" + suffix), getattr(self, "weight_hh" + suffix)
        b_ih = getattr(self, "bias_ih" + suffix) if self.bias else None
        b_hh = getattr(self, "bias_hh" + suffix) if self.bias else None
        projected = _apply(_LinearFn, x, w_ih, b_ih)  # [T, N, gates * H]: every step's input projection at once
        c_in = h.new_empty(0) if c is None else c
        args = (projected, h, c_in, w_hh, b_hh, self.mode, bool(direction))
        ys, h, c_out = _RecurrenceFn.apply(*args)  # type: ignore[no-untyped-call]
        return ys, h, (c_out if c is not None else None)


class _RecurrenceFn(torch.autograd.Function):
    """One layer and direction of :class:`_DetRNNBase`: the steps' recurrences forward, and a hand-written
    backward through time.  Forward, per step: the hidden projection ``h W_hh^T + b_hh`` (a fixed-order product),
    then the mode's gates, every element-wise operation one rounding:

    - LSTM: ``i, f, o = sigmoid`` of their gates (one D2 sigmoid over all four), ``g = tanh``, ``c = f c + i g``,
      ``h = o tanh(c)``;
    - GRU: ``r, z = sigmoid(gi + gh)`` (first two gates), ``n = tanh(gi_n + r gh_n)``, ``h = (1 - z) n + z h``;
    - RNN: ``h = tanh(gi + gh)`` or ``relu``.

    Backward, from the last step to the first: each step's gate gradients by the D2 activations' backward rules
    (:func:`sigmoid_backward`, :func:`tanh_backward`), the gradient to the previous hidden state by one product with
    ``W_hh`` per step (its data dependency).  ``W_hh``'s and ``b_hh``'s gradients are then one fixed-order product
    each over all steps and samples (rows in time order), instead of one product per step added up by autograd; the
    input projection's gradient is returned for all steps at once."""

    @staticmethod
    def forward(  # noqa: PLR0917 - Function.apply passes every input as an argument
        ctx: Any,
        projected: torch.Tensor,
        h: torch.Tensor,
        c: torch.Tensor,
        w_hh: torch.Tensor,
        b_hh: torch.Tensor | None,
        mode: str,
        reverse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        steps, width = projected.shape[0], h.shape[1]
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        ys = projected.new_empty((steps, h.shape[0], width))
        h_prev = projected.new_empty((steps, h.shape[0], width))
        per_step: list[tuple[torch.Tensor, ...]] = [()] * steps  # what the mode's backward needs, by step
        for t in order:
            h_prev[t] = h
            gh = det_matmul_nt(h, w_hh)
            if b_hh is not None:
                gh = gh + b_hh
            gi = projected[t]
            if mode == "LSTM":
                gates = gi + gh
                s = det_sigmoid(gates)
                i, f, _, o = s.chunk(4, dim=1)
                g = det_tanh(gates.chunk(4, dim=1)[2])
                c_before = c
                c = f * c + i * g
                tc = det_tanh(c)
                h = o * tc
                per_step[t] = (s, g, c_before, tc)
            elif mode == "GRU":
                r, z = det_sigmoid(gi[:, : 2 * width] + gh[:, : 2 * width]).chunk(2, dim=1)
                hn = gh[:, 2 * width :]
                n = det_tanh(gi[:, 2 * width :] + r * hn)
                h = (1.0 - z) * n + z * h
                per_step[t] = (r, z, n, hn)
            else:
                pre = gi + gh
                h = det_tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)
                per_step[t] = (h,)
            ys[t] = h
        saved = [torch.stack(parts) for parts in zip(*per_step, strict=True)]  # each part over the steps
        ctx.save_for_backward(h_prev, w_hh, *saved)
        ctx.mode, ctx.reverse, ctx.has_bias = mode, reverse, b_hh is not None
        c_out = c.clone()
        if mode != "LSTM":
            ctx.mark_non_differentiable(c_out)
        return ys, h.clone(), c_out

    @staticmethod
    def backward(ctx: Any, g_ys: torch.Tensor, g_h: torch.Tensor, g_c: torch.Tensor) -> Grads:
        h_prev, w_hh, *saved = ctx.saved_tensors
        mode = ctx.mode
        steps, batch, width = h_prev.shape
        backward_order = range(steps) if ctx.reverse else range(steps - 1, -1, -1)
        d_gh = h_prev.new_empty((steps, batch, w_hh.shape[0]))
        d_gi = d_gh if mode != "GRU" else h_prev.new_empty((steps, batch, w_hh.shape[0]))
        dh, dc = g_h, g_c
        for t in backward_order:
            dh = dh + g_ys[t]
            if mode == "LSTM":
                s, g, c_before, tc = (part[t] for part in saved)
                i, f, _, o = s.chunk(4, dim=1)
                dc = dc + tanh_backward(dh * o, tc)
                di, df, do = dc * g, dc * c_before, dh * tc
                dg = dc * i
                dc = dc * f
                d_gh[t] = torch.cat(
                    [sigmoid_backward(di, i), sigmoid_backward(df, f), tanh_backward(dg, g), sigmoid_backward(do, o)], 1
                )
            elif mode == "GRU":
                r, z, n, hn = (part[t] for part in saved)
                dn = tanh_backward(dh * (1.0 - z), n)
                dz = dh * h_prev[t] - dh * n
                dr = dn * hn
                d_rz = torch.cat([sigmoid_backward(dr, r), sigmoid_backward(dz, z)], 1)
                d_gh[t] = torch.cat([d_rz, dn * r], 1)
                d_gi[t] = torch.cat([d_rz, dn], 1)
                direct = dh * z
            else:
                (y,) = (part[t] for part in saved)
                d_gh[t] = tanh_backward(dh, y) if mode == "RNN_TANH" else torch.where(y > 0, dh, 0.0)
            dh = det_matmul_nt(d_gh[t], w_hh.t())
            if mode == "GRU":
                dh = dh + direct
        flat = d_gh.reshape(steps * batch, w_hh.shape[0])
        gw = det_matmul_nt(flat.t(), h_prev.reshape(steps * batch, width).t())
        gb = None
        if ctx.has_bias:
            ones = torch.ones((1, flat.shape[0]), dtype=torch.float32, device=flat.device)
            gb = det_matmul_nt(ones, flat.t()).reshape(-1)
        return d_gi, dh, (dc if mode == "LSTM" else None), gw, gb, None, None


class DetRNN(_DetRNNBase, nn.RNN):  # type: ignore[misc]  # one forward for the three, typed loosely
    pass


class DetLSTM(_DetRNNBase, nn.LSTM):  # type: ignore[misc]  # one forward for the three, typed loosely
    pass


class DetGRU(_DetRNNBase, nn.GRU):  # type: ignore[misc]  # one forward for the three, typed loosely
    pass


def dropout_unsupported(dropout: nn.Dropout) -> str | None:
    return None if dropout.p == 0 else f"p={dropout.p} (CPU and CUDA generators draw different masks; 0 only)"


class DetDropout(nn.Dropout):
    """``nn.Dropout`` with ``p = 0``: the identity, drawing nothing (a transformer layer built with ``dropout=0``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training:
            _refuse(self, dropout_unsupported(self))
        return input


# ---------------------------------------------------------------------------------------------- modules


def _apply(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    out: torch.Tensor = fn.apply(*args)  # type: ignore[no-untyped-call]
    return out


class DetLinear(nn.Linear):
    """``nn.Linear`` by the fixed-order kernels (same parameters, same state dict)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _apply(_LinearFn, input, self.weight, self.bias)


def conv2d_unsupported(conv: nn.Conv1d | nn.Conv2d) -> str | None:
    """Why :class:`DetConv2d` (or :class:`DetConv1d`, the same convolution) cannot stand in for ``conv``, or None."""
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros')"
    if isinstance(conv.padding, str) and conv.padding != "valid":
        return f"padding={conv.padding!r} (numbers or 'valid' only)"
    return None


def _refuse(module: nn.Module, reason: str | None) -> None:
    """``ValueError`` naming what of ``module``'s settings its D2 operator does not support (``reason``), if any."""
    if reason is not None:
        raise ValueError(f"{type(module).__name__} does not support {reason}")


def _as_batch(input: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` of an (N, C, H, W) batch; a (C, H, W) input goes through as a batch of one."""
    return fn(input) if input.dim() == 4 else fn(input.unsqueeze(0)).squeeze(0)


class DetConv2d(nn.Conv2d):
    """``nn.Conv2d`` (zero padding, any groups: depthwise too) as an implicit GEMM: a fixed-order product over
    patches read in place, one per group, all groups in one call."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _refuse(self, conv2d_unsupported(self))
        padding = (0, 0) if isinstance(self.padding, str) else _pair(self.padding)
        window = Window(_pair(self.kernel_size), _pair(self.stride), padding, _pair(self.dilation))
        return _as_batch(input, lambda x: _apply(_Conv2dFn, x, self.weight, self.bias, window, self.groups))


class DetConv1d(nn.Conv1d):
    """``nn.Conv1d`` (zero padding, any groups) as :class:`DetConv2d`'s convolution of a height-1 image: the weight
    [O, C, k] viewed as [O, C, 1, k], the input [N, C, L] as [N, C, 1, L] (views: the same parameters)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _refuse(self, conv2d_unsupported(self))
        padding = 0 if isinstance(self.padding, str) else int(self.padding[0])
        window = Window(
            (1, int(self.kernel_size[0])), (1, int(self.stride[0])), (0, padding), (1, int(self.dilation[0]))
        )
        batched = input.dim() == 3
        x = (input if batched else input.unsqueeze(0)).unsqueeze(2)
        out = _apply(_Conv2dFn, x, self.weight.unsqueeze(2), self.bias, window, self.groups).squeeze(2)
        return out if batched else out.squeeze(0)


class _DetBatchNorm(nn.modules.batchnorm._BatchNorm):
    """torch's ``_BatchNorm.forward`` with the deterministic normalisation (and running statistics updated with
    single operations: ``(1 - momentum) * running + momentum * batch``, the unbiased variance for ``running_var``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)  # type: ignore[no-untyped-call]
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        x = input
        if not use_batch:
            assert self.running_mean is not None and self.running_var is not None
            stats = (self.running_mean, self.running_var, self.eps)
            return _apply(_BatchNormEvalFn, x, self.weight, self.bias, stats)
        y, mean, sq = _BatchNormTrainFn.apply(x, self.weight, self.bias, self.eps)  # type: ignore[no-untyped-call]
        if self.training and self.running_mean is not None and self.running_var is not None:
            count = x.numel() // x.shape[1]
            with torch.no_grad():
                keep = f32(1.0 - factor)
                take = f32(factor)
                self.running_mean.copy_(self.running_mean * keep + mean * take)
                self.running_var.copy_(self.running_var * keep + div_count(sq, count - 1) * take)
        out: torch.Tensor = y
        return out


class DetBatchNorm1d(_DetBatchNorm, nn.BatchNorm1d):
    pass


class DetBatchNorm2d(_DetBatchNorm, nn.BatchNorm2d):
    pass


class DetBatchNorm3d(_DetBatchNorm, nn.BatchNorm3d):
    pass


class DetLayerNorm(nn.LayerNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dims = len(self.normalized_shape)
        if tuple(input.shape[input.dim() - dims :]) != tuple(self.normalized_shape):
            raise ValueError(f"LayerNorm over {tuple(self.normalized_shape)} got input {tuple(input.shape)}")
        return _apply(_LayerNormFn, input, self.weight, self.bias, (dims, self.eps))


class _ChannelAffineFn(torch.autograd.Function):
    """``y = x * weight + bias`` per channel (dimension 1) of [N, C, ...], its parameters' gradients by fixed-tree
    sums over the other dimensions (a broadcast's gradient in autograd would be torch's own sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        y = x
        if weight is not None:
            y = y * bcast(weight, x)
        if bias is not None:
            y = y + bcast(bias, x)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y if y is not x else y.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Grads:
        x, weight = ctx.saved_tensors
        dims = channel_dims(x)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = grad_out if weight is None else grad_out * bcast(weight, x)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = det_sum_dims(grad_out * x, dims)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = det_sum_dims(grad_out, dims)
        return gx, gw, gb


class DetGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm``: each (sample, group) normalised over its channels and positions by :class:`DetLayerNorm`'s
    operation (fixed-tree mean and variance, one rounding per step), then the per-channel affine."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        n, c = input.shape[0], input.shape[1]
        if c != self.num_channels:
            raise ValueError(f"GroupNorm over {self.num_channels} channels got input {tuple(input.shape)}")
        grouped = input.reshape(n, self.num_groups, -1)
        xhat = _apply(_LayerNormFn, grouped, None, None, (1, self.eps)).reshape(input.shape)
        if not self.affine:
            return xhat
        return _apply(_ChannelAffineFn, xhat, self.weight, self.bias)


def embedding_unsupported(emb: nn.Embedding) -> str | None:
    if emb.max_norm is not None:
        return "max_norm (renormalises the weight in place)"
    if emb.scale_grad_by_freq:
        return "scale_grad_by_freq"
    if emb.sparse:
        return "sparse gradients"
    return None


class DetEmbedding(nn.Embedding):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _refuse(self, embedding_unsupported(self))
        return _apply(_EmbeddingFn, input, self.weight, self.padding_idx)


def maxpool2d_unsupported(pool: nn.MaxPool2d) -> str | None:
    if pool.ceil_mode:
        return "ceil_mode"
    if pool.return_indices:
        return "return_indices"
    return None


class DetMaxPool2d(nn.MaxPool2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _refuse(self, maxpool2d_unsupported(self))
        kernel = _pair(self.kernel_size)
        stride = kernel if self.stride is None else _pair(self.stride)
        window = Window(kernel, stride, _pair(self.padding), _pair(self.dilation))
        return _as_batch(input, lambda x: _apply(_MaxPool2dFn, x, window))


class DetAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """Output sizes that divide the input's (then the windows do not overlap); other sizes raise ``ValueError``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _as_batch(input, self._pool)

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[2], x.shape[3]
        size = self.output_size if isinstance(self.output_size, tuple) else (self.output_size, self.output_size)
        oh = h if size[0] is None else int(size[0])
        ow = w if size[1] is None else int(size[1])
        if oh < 1 or ow < 1 or h % oh or w % ow:
            raise ValueError(f"DetAdaptiveAvgPool2d needs output sizes that divide the input's: {(oh, ow)} of {(h, w)}")
        return _apply(_AvgPoolDividingFn, x, h // oh, w // ow)


class DetSigmoid(nn.Sigmoid):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _apply(_SigmoidFn, input)


class DetTanh(nn.Tanh):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _apply(_TanhFn, input)


class DetSiLU(nn.SiLU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _apply(_SiLUFn, input)


class DetGELU(nn.GELU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _apply(_GeluTanhFn if self.approximate == "tanh" else _GeluErfFn, input)


def softmax_unsupported(module: nn.Softmax | nn.LogSoftmax) -> str | None:
    return "dim=None (implicit dimension)" if module.dim is None else None


class DetSoftmax(nn.Softmax):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            raise ValueError("DetSoftmax needs an explicit dim")
        return _apply(_SoftmaxFn, input, self.dim)


class DetLogSoftmax(nn.LogSoftmax):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            raise ValueError("DetLogSoftmax needs an explicit dim")
        return _apply(_LogSoftmaxFn, input, self.dim)
