"""Point-to-point exchange patterns over ranges of a flat CPU tensor: the range owners' all-to-all
(:class:`OwnerRound`) and a ring reduce-scatter / allgather (:class:`ScatterGather`), on torch.distributed (gloo)
or MPI (mpi4py) messages.  The deterministic allreduce (:mod:`hpc_elastic.est.reducer`) builds on them; the
process group itself is :class:`hpc_elastic.est.comm.Communicator`'s."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpc_elastic.errors import HpcElasticError

#: ``(tensor, bounds)``: ``bounds`` are M + 1 increasing offsets; rank r owns ``tensor[bounds[r]:bounds[r + 1]]``.
RangeExchange = Callable[[torch.Tensor, Sequence[int]], None]


class OwnerRound(Protocol):
    """One round of the range owners' all-to-all, in flight: every process's copy of each range of ``tensor`` goes to
    the range's owner, piece by piece, and each owner's result (its range of ``result``) comes back to every process's
    ``result``, piece by piece.

    A range is cut into the pieces given by ``cuts``; the owner waits for one piece (:meth:`arrived`), works on it and
    sends its result out (:meth:`publish`) while the next pieces are still on the wire.  Piece ``i`` of the owner's
    range, ``pieces[i] = (a, b)`` with offset ``o = a - bounds[rank]``, arrives in ``inbox[M * o : M * (o + b - a)]``:
    M contiguous rows of ``b - a``, row ``k`` the copy of rank ``rank - k`` (row 0 the caller's own).
    """

    @property
    def pieces(self) -> Sequence[tuple[int, int]]:
        """The pieces ``(a, b)`` of the caller's own range, in order."""
        ...

    def arrived(self, piece: int) -> torch.Tensor:
        """Wait until every copy of piece ``piece`` is in; return them as an (M, b - a) view of ``inbox``."""
        ...

    def publish(self, piece: int) -> None:
        """Start sending ``result[a:b]`` of own piece ``piece`` (the owner's result) to every other process."""
        ...

    def finish(self) -> None:
        """Wait until every owner's published pieces are in ``result`` and every message of the round has left."""
        ...


#: ``(tensor, bounds, cuts, inbox, result)``: start an :class:`OwnerRound`; ``cuts`` are increasing offsets from 0 to
#: ``len(tensor)`` holding every bound, ``inbox`` a flat tensor of ``tensor``'s dtype and M times the caller's range
#: length, ``result`` a tensor as long as ``tensor`` (``tensor`` itself, or another one).
OwnerExchange = Callable[[torch.Tensor, Sequence[int], Sequence[int], torch.Tensor, torch.Tensor], OwnerRound]


@dataclass(frozen=True)
class ScatterGather:
    """Reduce-scatter and allgather over ranges of a flat tensor (the two halves of a ring allreduce).

    ``sum_scatter`` leaves in the caller's own range the SUM of that range over every process (the rest of the
    tensor is left partly reduced: scratch); ``gather`` copies every owner's range to every process. The
    deterministic allreduce uses them to send int64 only one way and fp32 back (12 bytes per element on the
    wire instead of an int64 allreduce's 16) and to convert only its own range back to fp32.
    """

    sum_scatter: RangeExchange
    gather: RangeExchange


def _ranges(bounds: Sequence[int], size: int) -> list[tuple[int, int]]:
    if len(bounds) != size + 1 or any(b > c for b, c in itertools.pairwise(bounds)) or bounds[0] != 0:
        raise ValueError(f"bounds must be {size + 1} increasing offsets from 0, got {list(bounds)!r}")
    return [(bounds[r], bounds[r + 1]) for r in range(size)]


#: pieces a ring step's slice is cut into, so that adding one piece overlaps receiving the next
RING_PIECES = 4
RING_MIN_PIECE = 1 << 16


def _pieces(lo: int, hi: int) -> list[tuple[int, int]]:
    n = hi - lo
    if n <= 0:
        return []
    count = max(1, min(RING_PIECES, n // RING_MIN_PIECE))
    step = -(-n // count)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def _started(work: Any) -> Any:
    if work is None:  # torch returns None for a peer outside the group: the group is the world here
        raise HpcElasticError("a point-to-point message was not started: this process is not in the default group")
    return work


def _pieces_between(cuts: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut at the ``cuts`` inside it (``lo`` and ``hi`` must be cuts)."""
    inside = [c for c in cuts if lo <= c <= hi]
    if hi > lo and (inside[:1] != [lo] or inside[-1:] != [hi]):
        raise ValueError(f"range [{lo}, {hi}) does not start and end at cuts")
    return [(a, b) for a, b in itertools.pairwise(inside) if b > a]


@dataclass(frozen=True)
class PointToPoint:
    """Non-blocking point-to-point messages of contiguous CPU tensors on one backend: ``isend(tensor, peer, tag)``
    and ``irecv(tensor, peer, tag)`` start a message and return a request, ``wait(request)`` waits for it."""

    rank: int
    size: int
    isend: Callable[[torch.Tensor, int, int], Any]
    irecv: Callable[[torch.Tensor, int, int], Any]
    wait: Callable[[Any], None]


class _OwnerRound:
    """:class:`OwnerRound` on non-blocking point-to-point messages, every message posted as early as it can be.

    The copies to the owners are all posted when the round starts (rotated, so that no process is everyone's first
    peer); the receives of the owners' results are posted then too when ``result`` is another tensor, and where the
    results land in the ranges just sent (``result`` is ``tensor``), once those sends have left (at the first
    :meth:`publish`).  Nothing here waits on another process's progress past that point, so
    the round cannot deadlock whatever order the processes reach their calls in.  Piece ``i``'s copy travels with
    tag ``2 i``, its result with ``2 i + 1``: small tags, as MPI only promises 32767."""

    def __init__(
        self,
        p2p: PointToPoint,
        tensor: torch.Tensor,
        bounds: Sequence[int],
        cuts: Sequence[int],
        *,
        inbox: torch.Tensor,
        result: torch.Tensor,
    ) -> None:
        if list(cuts) != sorted(set(cuts)) or not cuts or cuts[0] != 0 or cuts[-1] != tensor.numel():
            raise ValueError(f"cuts must be increasing offsets from 0 to {tensor.numel()}, got {list(cuts)!r}")
        if result.numel() != tensor.numel() or not result.is_contiguous():
            raise ValueError(f"result must be contiguous with {tensor.numel()} elements, got {tuple(result.shape)}")
        self._p2p = p2p
        self._result = result
        size, rank = p2p.size, p2p.rank
        self._owned = [_pieces_between(cuts, a, b) for a, b in _ranges(bounds, size)]
        self.pieces: list[tuple[int, int]] = self._owned[rank]
        lo, hi = bounds[rank], bounds[rank + 1]
        if inbox.dtype != tensor.dtype or tuple(inbox.shape) != (size * (hi - lo),):
            raise ValueError(
                f"inbox must be flat {tensor.dtype} of {size * (hi - lo)} elements, "
                f"got {inbox.dtype} {tuple(inbox.shape)}"
            )
        self._rows = [inbox[size * (a - lo) : size * (b - lo)].view(size, b - a) for a, b in self.pieces]
        self._sends: list[Any] = []
        self._arrivals: list[list[Any]] = [[] for _ in self.pieces]
        for i, rows in enumerate(self._rows):
            for k in range(1, size):
                self._arrivals[i].append(p2p.irecv(rows[k], (rank - k) % size, 2 * i))
        # piece-major: every owner's first piece is on the wire before anyone's second
        for i in range(max(map(len, self._owned))):
            for k in range(1, size):
                dst = (rank + k) % size
                if i < len(self._owned[dst]):
                    a, b = self._owned[dst][i]
                    self._sends.append(p2p.isend(tensor[a:b], dst, 2 * i))
        for (a, b), rows in zip(self.pieces, self._rows, strict=True):  # the own copy, while the others travel
            rows[0].copy_(tensor[a:b])
        self._results: list[Any] | None = None  # receives of the other owners' pieces
        self._published: list[Any] = []
        #: the results land in the buffer the copies are sent from
        self._overwrites = result.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        if not self._overwrites:
            self._receive_results()

    def _wait(self, requests: list[Any]) -> None:
        for req in requests:
            self._p2p.wait(req)

    def arrived(self, piece: int) -> torch.Tensor:
        self._wait(self._arrivals[piece])
        self._arrivals[piece] = []
        return self._rows[piece]

    def _receive_results(self) -> list[Any]:
        if self._results is None:
            if self._overwrites:  # the copies must have left before the results overwrite them
                self._wait(self._sends)
                self._sends = []
            p2p = self._p2p
            self._results = [
                p2p.irecv(self._result[a:b], owner, 2 * i + 1)
                for owner in range(p2p.size)
                if owner != p2p.rank
                for i, (a, b) in enumerate(self._owned[owner])
            ]
        return self._results

    def publish(self, piece: int) -> None:
        self._receive_results()
        a, b = self.pieces[piece]
        p2p = self._p2p
        for k in range(1, p2p.size):
            self._published.append(p2p.isend(self._result[a:b], (p2p.rank + k) % p2p.size, 2 * piece + 1))

    def finish(self) -> None:
        for i in range(len(self._arrivals)):
            self.arrived(i)
        self._wait([*self._receive_results(), *self._published, *self._sends])
        self._results, self._published, self._sends = [], [], []


def owner_exchange(p2p: PointToPoint) -> OwnerExchange:
    """The :data:`OwnerExchange` of a backend's point-to-point messages."""

    def start(
        tensor: torch.Tensor, bounds: Sequence[int], cuts: Sequence[int], inbox: torch.Tensor, result: torch.Tensor
    ) -> OwnerRound:
        return _OwnerRound(p2p, tensor, bounds, cuts, inbox=inbox, result=result)

    return start


def torch_p2p() -> PointToPoint:
    return PointToPoint(
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        isend=lambda t, peer, tag: _started(dist.isend(t, peer, tag=tag)),
        irecv=lambda t, peer, tag: _started(dist.irecv(t, peer, tag=tag)),
        wait=lambda req: req.wait(),
    )


def mpi_p2p(comm: Any) -> PointToPoint:
    """mpi4py's Isend/Irecv on the NumPy views of CPU tensors (the datatype follows the array's)."""
    return PointToPoint(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        isend=lambda t, peer, tag: comm.Isend(t.numpy(), dest=peer, tag=tag),
        irecv=lambda t, peer, tag: comm.Irecv(t.numpy(), source=peer, tag=tag),
        wait=lambda req: req.Wait(),
    )


def torch_ring() -> ScatterGather:
    """Ring reduce-scatter and allgather on torch.distributed point-to-point messages (gloo).

    Gloo's own ``reduce_scatter``/``all_gather`` are slower here than its allreduce (measured: 365 ms and 158 ms
    for 64 MB against 182 ms for an int64 allreduce of the same elements over 4 ranks on loopback), so the ring
    is spelled out: M - 1 steps, each sending one range to the next rank while receiving one from the previous.
    Integer sums are exact, so the order in which the ring adds does not change a bit of the result.
    """
    # the receive buffer, kept across calls: a fresh one costs its page faults on every step (tens of ms per
    # 64 MB here), as the reducer's one-EST path measured
    scratches: dict[torch.dtype, torch.Tensor] = {}

    def sum_scatter(tensor: torch.Tensor, bounds: Sequence[int]) -> None:
        size, rank = dist.get_world_size(), dist.get_rank()
        ranges = _ranges(bounds, size)
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        width = max(hi - lo for lo, hi in ranges)
        scratch = scratches.get(tensor.dtype)
        if scratch is None or scratch.numel() < width:
            scratch = scratches[tensor.dtype] = torch.empty(width, dtype=tensor.dtype)
        for step in range(size - 1):
            # after step s, rank r holds range (r - s - 2) summed over s + 2 ranks; it ends owning range r
            send_lo, send_hi = ranges[(rank - step - 1) % size]
            recv_lo, recv_hi = ranges[(rank - step - 2) % size]
            sends = [
                _started(dist.isend(tensor[a:b], nxt, tag=i)) for i, (a, b) in enumerate(_pieces(send_lo, send_hi))
            ]
            recv_pieces = _pieces(recv_lo, recv_hi)
            recvs = [
                _started(dist.irecv(scratch[a - recv_lo : b - recv_lo], prv, tag=i))
                for i, (a, b) in enumerate(recv_pieces)
            ]
            for (a, b), req in zip(recv_pieces, recvs, strict=True):
                req.wait()
                tensor[a:b].add_(scratch[a - recv_lo : b - recv_lo])
            for req in sends:
                req.wait()

    def gather(tensor: torch.Tensor, bounds: Sequence[int]) -> None:
        size, rank = dist.get_world_size(), dist.get_rank()
        ranges = _ranges(bounds, size)
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            send_lo, send_hi = ranges[(rank - step) % size]
            recv_lo, recv_hi = ranges[(rank - step - 1) % size]
            reqs = [_started(dist.isend(tensor[send_lo:send_hi], nxt))] if send_hi > send_lo else []
            if recv_hi > recv_lo:
                reqs.append(_started(dist.irecv(tensor[recv_lo:recv_hi], prv)))
            for req in reqs:
                req.wait()

    return ScatterGather(sum_scatter, gather)
