"""The training-curve plot of a DL² run (DL² Fig. 10's shape): supervised loss per epoch, then the validation
average JCT of the greedy policy along the online phase, next to DRF's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpc_elastic.dl2.train import CurvePoint
from hpc_elastic.plotting import pyplot, save


def plot_curve(path: Path, losses: Sequence[float], curve: Sequence[CurvePoint], drf_jct: float) -> None:
    """Two panels into ``path`` (PNG): the cross-entropy per supervised epoch; validation JCT (slots of 20 min)
    against actor-critic updates, with DRF's as a line."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(range(1, len(losses) + 1), list(losses), marker=".")
    left.set_xlabel("supervised epoch")
    left.set_ylabel("cross entropy vs DRF")
    left.set_title("Offline supervised (§4.2)")
    updates = [point.update for point in curve]
    right.plot(updates, [point.avg_jct / 1200.0 for point in curve], marker=".", label="DL² (greedy)")
    right.axhline(drf_jct / 1200.0, color="grey", linestyle="--", label="DRF")
    right.set_xlabel("actor-critic updates (one per slot)")
    right.set_ylabel("validation avg JCT (slots)")
    right.set_title("Online RL (§4.3)")
    right.legend()
    fig.tight_layout()
    save(fig, path, dpi=100)
