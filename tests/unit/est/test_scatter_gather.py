"""The ring reduce-scatter + allgather the deterministic allreduce runs on gloo (hpc_elastic.est.exchange):
exact int64 sums in each rank's own range, a complete allgather and every copy of a range at its owner and back, over
uneven ranges (one empty), on real processes; and the reducer's two paths over them (one EST per process, binned)
giving the definition's bits.  The owner exchange and the reducer's paths over MPI too."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from hpc_elastic.est.exchange import _pieces, _pieces_between, _ranges
from hpc_elastic.est.reducer import OWNER_MIN_PIECE, OWNER_PIECES, piece_cuts
from tests.conftest import REPO
from tests.unit.session.launch import MPI_REASON, launch

WORKER = REPO / "tests" / "data" / "workers" / "scatter_gather.py"
SIZE = 4


def _results(out: Path) -> list[dict[str, bool]]:
    return [json.loads((out.parent / f"{out.name}.{r}").read_text()) for r in range(SIZE)]


def run(backend: str, out: Path) -> list[dict[str, bool]]:
    started = launch(backend, SIZE, out.parent / "job", [str(out)], workers=SIZE, logs=out.parent, script=WORKER)
    assert started.wait(180) == 0, "\n".join(started.outputs)[-3000:]
    return _results(out)


def test_gloo_ring_sums_each_range_exactly_and_gathers_all(tmp_path: Path) -> None:
    results = run("torch", tmp_path / "gloo")
    assert results == [{"own": True, "gathered": True, "owners": True, "published": True, "reducers": True}] * SIZE


@pytest.mark.skipif(MPI_REASON is not None, reason=f"MPI unavailable: {MPI_REASON}")
def test_mpi_owner_exchange_and_reducer_paths(tmp_path: Path) -> None:
    assert run("mpi", tmp_path / "mpi") == [{"owners": True, "published": True, "reducers": True}] * SIZE


def test_ranges_reject_bad_bounds() -> None:
    assert _ranges([0, 0, 5], 2) == [(0, 0), (0, 5)]
    for bad in ([0, 5], [0, 6, 5], [1, 2, 3]):
        with pytest.raises(ValueError, match="bounds must be"):
            _ranges(bad, 2)


def test_ring_pieces_cover_a_range_once() -> None:
    for lo, hi in [(0, 0), (3, 10), (0, 1 << 20), (7, 7 + (1 << 18) + 1)]:
        pieces = _pieces(lo, hi)
        covered = [i for a, b in pieces for i in range(a, b)] if hi - lo < 1000 else None
        assert sum(b - a for a, b in pieces) == hi - lo
        assert all(a < b for a, b in pieces) and all(p[1] == q[0] for p, q in itertools.pairwise(pieces))
        if covered is not None:
            assert covered == list(range(lo, hi))


def test_owner_pieces_follow_the_cuts() -> None:
    assert _pieces_between([0, 3, 9, 9, 20], 3, 20) == [(3, 9), (9, 20)]
    assert _pieces_between([0, 5], 5, 5) == []
    with pytest.raises(ValueError, match="does not start and end at cuts"):
        _pieces_between([0, 4, 10], 3, 10)


def test_piece_cuts_stay_in_one_bucket_on_chunk_starts() -> None:
    chunk = 64
    buckets = [0, 3 * OWNER_MIN_PIECE + 10, 3 * OWNER_MIN_PIECE + 10 + 640]  # the middle bucket: 10 chunks
    total = buckets[-1] + 9 * OWNER_MIN_PIECE + 1
    bounds = [0, 2 * OWNER_MIN_PIECE, buckets[2] + 64 * 5, total]
    cuts = piece_cuts(bounds, buckets, total, chunk)
    assert set(bounds) | set(buckets) <= set(cuts) and cuts == sorted(set(cuts))
    for a, b in itertools.pairwise(cuts):
        start = max(s for s in buckets if s <= a)
        assert (a - start) % chunk == 0 and (b == total or b in buckets or (b - start) % chunk == 0)
        assert not any(a < s < b for s in buckets)
    # the last bucket's part of the last range (9 minimum pieces long) is cut OWNER_PIECES times
    assert len([c for c in cuts if bounds[2] <= c < total]) == OWNER_PIECES
