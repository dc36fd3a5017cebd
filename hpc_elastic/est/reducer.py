"""Gradient buckets and the deterministic allreduce of the N EST gradients (EasyScale §3.3, D1).

Per process: one flat fp32 gradient buffer that the parameters' ``.grad`` are views of (buckets packed by
parameter index, :func:`hpc_elastic.est.plan.plan_buckets`), and for D1/D2 two int64 bins per element.
After each EST's backward, :meth:`GradientReducer.deposit` hands its gradient over; it stays in the buffer until
the next EST switches in (:meth:`GradientReducer.switch_in` adds it to the bins and clears the buffer: the whole
cost of a context switch besides RNG/buffer swaps) or until :meth:`GradientReducer.reduce`, which takes the last
EST's gradient straight into the combined integers (``fold``: one pass, where a deposit and a combine would write
and re-read both bins), runs one byte-per-chunk ``MAX`` allreduce and an exact int64 ``SUM``, and writes the mean
gradient back.
Over gloo on CPU tensors the int64 ``SUM`` is a ring reduce-scatter over chunk-aligned ranges, each process
converts only its own range to fp32, and an fp32 ring allgather returns the rest (12 bytes per element on the
wire instead of 16); over MPI each range's int64 go to its owner, which adds them, converts, and sends the fp32
back (the same volume); elsewhere (Horovod, NCCL) it is one int64 allreduce. All give the same bits: the
integer sum is exact and the conversion is elementwise.
With at most one EST per process (as many devices as ESTs) over gloo or MPI, nothing is binned: each process
sends its raw fp32 gradient of every other range to the range's owner, which finds the chunks' top bins over the N
copies, forms and adds the N integers exactly and sends its range back (8 bytes per element on the wire, like an
fp32 ring allreduce; no MAX allreduce); the integers, hence the bits, are the same.
D0 keeps PyTorch's usual fp32 accumulation and an fp32 ``SUM``: reproducible only for a fixed M.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence

import torch

from hpc_elastic.est.comm import Communicator, ReduceOp
from hpc_elastic.est.detsum import bin_width, num_chunks
from hpc_elastic.est.kernels import TensorKernels, tensor_kernels
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.est.plan import BucketLayout

#: the one-EST path cuts each (range, bucket) part into this many pieces, so that adding and converting one piece
#: overlaps the transfer of the next.  On the 2-core dev machine (64 MB over 4 gloo ranks, bench/allreduce.py) 1, 4
#: and 8 pieces measured alike (0.85-0.90x of gloo's SUM): there the sum is a few ms against ~100 ms on the wire;
#: the overlap pays where the wire is fast next to the sum
OWNER_PIECES = 4
OWNER_MIN_PIECE = 1 << 16


def piece_cuts(bounds: Sequence[int], bucket_starts: Sequence[int], total: int, chunk: int) -> list[int]:
    """Where the one-EST path cuts its ranges into pieces: at every range bound and bucket start, and each
    (range, bucket) part into up to OWNER_PIECES pieces of whole chunks of their bucket, OWNER_MIN_PIECE elements at
    least.  A piece lies in one bucket, so the kernels take all its rows in one call.  ``bounds`` must be chunk
    starts of their buckets (or ``total``), as :meth:`GradientReducer._range_bounds` makes them."""
    edges = sorted({*bounds, *bucket_starts, total})
    cuts = set(edges)
    for a, b in itertools.pairwise(edges):
        count = max(1, min(OWNER_PIECES, (b - a) // OWNER_MIN_PIECE))
        start = bucket_starts[bisect.bisect_right(bucket_starts, a) - 1]
        for k in range(1, count):  # rounded down to a chunk start of the piece's bucket
            x = a + (b - a) * k // count
            cuts.add(start + (x - start) // chunk * chunk)
    return sorted(cuts)


class GradientReducer:
    """Owns the gradient buffers of one process and reduces them over ``comm``."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: BucketLayout,
        *,
        num_ests: int,
        comm: Communicator,
        level: DeterminismLevel,
        kernels: TensorKernels | None = None,
        max_local_ests: int | None = None,
    ) -> None:
        """``max_local_ests``: the most ESTs any process of the group hosts (the same on every process, from the
        placement); 1 lets D1/D2 on CPU over gloo or MPI take the one-EST-per-process path (see :meth:`reduce`)."""
        if max_local_ests is not None and (isinstance(max_local_ests, bool) or max_local_ests < 0):
            raise ValueError(f"max_local_ests must be a non-negative integer, got {max_local_ests!r}")
        if not params:
            raise ValueError("the model has no trainable parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must live on one device, got {sorted(map(str, devices))}")
        dtypes = {p.dtype for p in params}
        if dtypes != {torch.float32}:
            raise ValueError(
                f"deterministic reduction supports float32 parameters only, got {sorted(map(str, dtypes))}"
            )
        sizes = [p.numel() for p in params]
        planned = [s.numel for b in layout.buckets for s in b.slots]
        if planned != sizes:
            raise ValueError(
                "the bucket layout does not match the model's parameters (different sizes or order): layout "
                f"{planned[:8]}{'...' if len(planned) > 8 else ''}, model {sizes[:8]}{'...' if len(sizes) > 8 else ''}"
            )
        self.params = list(params)
        self.layout = layout
        self.num_ests = num_ests
        self.width = bin_width(num_ests)
        self.comm = comm
        self.level = level
        self.device = next(iter(devices))
        total = sum(b.numel for b in layout.buckets)
        self._bucket_start: list[int] = []
        self._chunk_start: list[int] = []
        start = cstart = 0
        for b in layout.buckets:
            self._bucket_start.append(start)
            self._chunk_start.append(cstart)
            start += b.numel
            cstart += num_chunks(b.numel, layout.chunk)
        self.flat_grad = torch.zeros(total, dtype=torch.float32, device=self.device)
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for bi, b in enumerate(layout.buckets):
            for s in b.slots:
                off = self._bucket_start[bi] + s.offset
                self._views[s.index] = self.flat_grad[off : off + s.numel].view_as(self.params[s.index])
        self.exact = level.exact_allreduce
        self._deposits = 0  # ESTs whose gradient this step is in the bins (binned) or in the buffer
        self._pending = False  # an EST's gradient waits in the buffer, not yet in the bins (binned path)
        exchanges = self.exact and comm.size > 1 and self.device.type == "cpu"  # over ranges of CPU tensors
        #: one EST per process at most, and an all-to-all to the range owners: raw fp32 on the wire, no bins
        self.one_est_each = (
            exchanges and max_local_ests is not None and max_local_ests <= 1 and comm.owner_exchange is not None
        )
        #: several ESTs on some process and no ring (MPI): the binned int64 go to the range owners the same way (after
        #: the MAX).  Over gloo the ring stays: both measured alike there (0.46-0.49x vs 0.39-0.50x of gloo's SUM,
        #: bench/allreduce.py); over MPI the owners took 139 ms against 211-236 ms for the int64 Allreduce
        self._binned_at_owners = (
            exchanges and not self.one_est_each and comm.owner_exchange is not None and comm.scatter_gather is None
        )
        self._bounds: list[int] | None = None
        inbox = 0
        if self.one_est_each or self._binned_at_owners or (exchanges and comm.scatter_gather is not None):
            self._bounds = self._range_bounds(comm.size)
            width = self._bounds[comm.rank + 1] - self._bounds[comm.rank]
            inbox = comm.size * width
            if self.one_est_each or self._binned_at_owners:  # the owner's buffers, kept across steps
                self._acc = torch.zeros(width, dtype=torch.int64)
                self._cuts = piece_cuts(self._bounds, self._bucket_start, total, layout.chunk)
        if self.one_est_each:
            self._inbox = torch.zeros(inbox, dtype=torch.float32)
        if self.exact:
            self.kernels = kernels if kernels is not None else tensor_kernels(self.device)
            bins = 0 if self.one_est_each else total  # the one-EST path keeps the gradient itself until reduce
            self.hi = torch.zeros(bins, dtype=torch.int64, device=self.device)
            # the lo bins are spent once combined: the binned owners' inbox uses them (M times a range may pass
            # the total by a few chunks)
            lo = max(bins, inbox) if self._binned_at_owners else bins
            self.lo = torch.zeros(lo, dtype=torch.int64, device=self.device)
            self.local_tops = torch.zeros(cstart, dtype=torch.uint8, device=self.device)
            self.global_tops = torch.zeros(cstart, dtype=torch.uint8, device=self.device)
        self.attach_grads()

    def _range_bounds(self, size: int) -> list[int]:
        """Element offsets splitting the buffer into ``size`` ranges of whole chunks (as even as chunks allow):
        a range boundary is the start of a chunk of its bucket, so each process can convert its range alone."""
        chunk = self.layout.chunk
        starts: list[int] = []  # element offset of every chunk, over all buckets
        for bi, b in enumerate(self.layout.buckets):
            s = self._bucket_start[bi]
            starts.extend(range(s, s + b.numel, chunk))
        total = self.flat_grad.numel()
        bounds = []
        for r in range(size + 1):
            c = (len(starts) * r) // size
            bounds.append(starts[c] if c < len(starts) else total)
        return bounds

    def attach_grads(self) -> None:
        """Make every ``param.grad`` a view of the flat buffer again (``zero_grad(set_to_none=True)`` or user
        code may have replaced it)."""
        for p, v in zip(self.params, self._views, strict=True):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v

    def _segments(self) -> list[tuple[slice, slice]]:
        out = []
        for bi, b in enumerate(self.layout.buckets):
            s = self._bucket_start[bi]
            c = self._chunk_start[bi]
            out.append((slice(s, s + b.numel), slice(c, c + num_chunks(b.numel, self.layout.chunk))))
        return out

    def switch_in(self) -> None:
        """Before an EST's forward and backward: the buffer must start empty, so the gradient the previous EST left
        there goes into the bins now; then every ``param.grad`` is a view of the buffer again."""
        if self._pending:
            self._deposit_buffer()
        self.attach_grads()

    def deposit(self) -> None:
        """Take the current EST's gradient (after its backward).  It stays in the buffer: the one-EST path sends it
        as it is, the binned path adds it to the bins at the next :meth:`switch_in` or folds it in at
        :meth:`reduce`; D0 lets the next EST's gradient accumulate on it."""
        self.attach_grads()
        if self._pending:
            raise RuntimeError("an EST's gradient was handed over twice without switch_in() in between")
        if self.one_est_each and self._deposits:
            raise RuntimeError("a second EST on this process, but the reducer was planned for one per process")
        self._pending = self.exact and not self.one_est_each
        if not self._pending:
            self._deposits += 1

    def _deposit_buffer(self) -> None:
        """Add the waiting gradient to the bins and clear the buffer."""
        first = self._deposits == 0
        for el, ch in self._segments():
            self.kernels.deposit(
                self.flat_grad[el],
                self.hi[el],
                self.lo[el],
                self.local_tops[ch],
                chunk=self.layout.chunk,
                width=self.width,
                first=first,
                clear=True,
            )
        self._deposits += 1
        self._pending = False

    def reduce(self) -> None:
        """Allreduce over all processes; leaves the mean of the N EST gradients in ``param.grad``."""
        if not self.exact:
            self.comm.allreduce_(self.flat_grad, ReduceOp.SUM)
            self.flat_grad.div_(float(self.num_ests))
            self._deposits = 0
            return
        if self.one_est_each:
            self._reduce_one_est_each()
            self._deposits = 0
            return
        self._combine()
        if self._binned_at_owners:
            self._sum_at_owners()
        elif self._bounds is None:
            self.comm.allreduce_(self.hi, ReduceOp.SUM)
            self._finalize(0, self.flat_grad.numel(), self.hi)
        else:
            exchange = self.comm.scatter_gather
            if exchange is None:
                raise RuntimeError("the communicator lost its reduce-scatter")
            rank = self.comm.rank
            exchange.sum_scatter(self.hi, self._bounds)
            self._finalize(self._bounds[rank], self._bounds[rank + 1], self.hi)
            exchange.gather(self.flat_grad, self._bounds)
        self._deposits = 0

    def _combine(self) -> None:
        """Agree on the chunks' global top bins (``MAX``) and leave this process's sum on that window in ``hi``,
        one int64 per element: the bins combined, plus the waiting gradient folded in."""
        chunk, width = self.layout.chunk, self.width
        if not self._pending:
            if self._deposits == 0:  # no EST here: contribute nothing
                self.hi.zero_()
                self.lo.zero_()
                self.local_tops.zero_()
            self.global_tops.copy_(self.local_tops)
            self.comm.allreduce_(self.global_tops, ReduceOp.MAX)
            for el, ch in self._segments():
                self.kernels.combine(
                    self.hi[el], self.lo[el], self.local_tops[ch], self.global_tops[ch], chunk=chunk, width=width
                )
            return
        have_bins = self._deposits > 0
        for el, ch in self._segments():
            self.kernels.tops(self.flat_grad[el], self.global_tops[ch], chunk=chunk, width=width)
        if have_bins:
            torch.maximum(self.global_tops, self.local_tops, out=self.global_tops)
        self.comm.allreduce_(self.global_tops, ReduceOp.MAX)
        for el, ch in self._segments():
            self.kernels.fold(
                self.flat_grad[el],
                self.hi[el],
                self.lo[el],
                self.local_tops[ch],
                self.global_tops[ch],
                chunk=chunk,
                width=width,
                have_bins=have_bins,
            )
        self._pending = False  # the buffer is overwritten with the mean below

    def _reduce_one_est_each(self) -> None:
        """D1 with at most one EST per process (EasyScale's usual case: as many devices as ESTs).

        The same integers as the binned path, formed elsewhere: each process sends its raw fp32 gradient of every
        other range to that range's owner; the owner, holding all N contributions of its range, finds each chunk's
        top bin over them (no MAX allreduce), adds ``trunc(x * 2^-L)`` of the N contributions exactly (int64),
        converts its range to fp32 and sends it back to every process.  ``V = sum_i trunc(x_i * 2^-L)`` on the
        window of the top bin over all N is the definition (:func:`hpc_elastic.est.detsum.reference_allreduce`), so
        the bits equal those of any other placement.
        On the wire: 4 + 4 bytes per element (the fp32 ring allreduce's volume) instead of 8 + 4; no bins, no
        deposit pass at the context switch.

        Pipelined by pieces: the owner adds and converts a piece as soon as its copies are in, and sends it back
        while the next pieces are still coming in."""
        if self._deposits == 0:  # no EST here: contribute nothing
            self.flat_grad.zero_()
        chunk = self.layout.chunk

        def add(rows: torch.Tensor, a: int, acc: torch.Tensor) -> None:  # a piece lies in one bucket: one call
            bi = bisect.bisect_right(self._bucket_start, a) - 1
            c = self._chunk_start[bi] + (a - self._bucket_start[bi]) // chunk  # the piece's first chunk
            tops = self.global_tops[c : c + num_chunks(acc.numel(), chunk)]
            self.kernels.owner_sum(rows, acc, tops, chunk=chunk, width=self.width)

        self._at_owners(self.flat_grad, self._inbox, add)

    def _sum_at_owners(self) -> None:
        """The binned path's exact SUM over the owner exchange: each process's combined int64 of every range to the
        range's owner (into the spent lo bins), which adds the M rows, converts, and sends its fp32 back, piece by
        piece.  Integer sums are exact, so this gives the ring's and the allreduce's bits."""
        inbox = self.lo[: self.comm.size * self._acc.numel()]

        def add(rows: torch.Tensor, a: int, acc: torch.Tensor) -> None:
            torch.sum(rows, dim=0, out=acc)

        self._at_owners(self.hi, inbox, add)

    def _at_owners(
        self, tensor: torch.Tensor, inbox: torch.Tensor, add: Callable[[torch.Tensor, int, torch.Tensor], None]
    ) -> None:
        """One owner round of ``tensor`` (copies into ``inbox``, results into the gradient buffer): for each piece
        ``[a, b)`` of this process's range, ``add(rows, a, acc)`` leaves the exact integer sums of its M copies in
        ``acc`` (a view of the owner's int64 buffer), then the piece is converted and sent back to every process."""
        bounds, start = self._bounds, self.comm.owner_exchange
        if bounds is None or start is None:
            raise RuntimeError("the communicator lost its owner exchange")
        lo = bounds[self.comm.rank]
        rnd = start(tensor, bounds, self._cuts, inbox, self.flat_grad)
        for i, (a, b) in enumerate(rnd.pieces):
            add(rnd.arrived(i), a, self._acc[a - lo : b - lo])
            self._finalize(a, b, self._acc, lo)
            rnd.publish(i)
        rnd.finish()

    def _pieces_of(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``[lo, hi)`` (both at chunk starts of their buckets, or the end) cut at bucket boundaries: element range
        and index of its first chunk, for each piece."""
        chunk = self.layout.chunk
        out = []
        for el, ch in self._segments():
            a, b = max(lo, el.start), min(hi, el.stop)
            if a < b:
                out.append((a, b, ch.start + (a - el.start) // chunk))
        return out

    def _finalize(self, lo: int, hi: int, sums: torch.Tensor, base: int = 0) -> None:
        """fp32 mean gradient of the elements ``[lo, hi)`` (both at chunk starts of their buckets, or the end)
        from the reduced integers of element ``i`` in ``sums[i - base]``."""
        chunk = self.layout.chunk
        for a, b, first in self._pieces_of(lo, hi):
            self.kernels.finalize(
                sums[a - base : b - base],
                self.global_tops[first : first + num_chunks(b - a, chunk)],
                self.flat_grad[a:b],
                chunk=chunk,
                width=self.width,
                divisor=float(self.num_ests),
            )

    def zero(self) -> None:
        self.flat_grad.zero_()
        self._deposits = 0
        self._pending = False
