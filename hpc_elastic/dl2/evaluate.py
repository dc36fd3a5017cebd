"""Evaluating a DL² model file: its policy against the slot baselines on a generated trace, in the slot simulator
(:mod:`hpc_elastic.sim.slots`), and the training curve the file stores."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.dl2 import model_file
from hpc_elastic.dl2.plot import plot_curve
from hpc_elastic.dl2.train import CurvePoint, TrainConfig, compare
from hpc_elastic.policy.dl2 import Dl2Policy
from hpc_elastic.policy.slot_registry import make_slot_policy
from hpc_elastic.sim.ps_jobs import SLOT_SECONDS, Arrival, generate
from hpc_elastic.sim.slots import SlotConfig


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """One ``dl2 evaluate`` run: the model against baselines on a generated trace."""

    model: Path
    seed: int
    jobs: int
    load: float
    arrival: Arrival
    variation: float
    policies: tuple[str, ...]
    plot: Path | None


def evaluate_model(config: EvalConfig) -> dict[str, float]:
    """Average JCT (slots) of the model (``dl2``) and of each baseline on one generated trace."""
    loaded = model_file.load(config.model)
    train_cfg = TrainConfig.from_dict(loaded.config)
    policies = [make_slot_policy(name) for name in config.policies]
    trace = generate(
        config.seed,
        config.jobs,
        train_cfg.cluster,
        arrival=config.arrival,
        load=config.load,
        variation=config.variation,
        types=train_cfg.types,
    )
    network = loaded.network()  # checked before anything is written
    if config.plot is not None:
        plot_model(config.plot, loaded)
    sim = SlotConfig(train_cfg.cluster, train_cfg.types)
    jct = compare(Dl2Policy(network, loaded.spec), policies, sim, trace)
    return {name: value / SLOT_SECONDS for name, value in jct.items()}


def plot_model(path: Path, loaded: model_file.ModelFile) -> None:
    """The training curve stored in a model file (its ``meta``: a file's header, checked here before plotting)."""
    meta = loaded.meta
    points, supervised = meta.get("curve", []), meta.get("supervised", {})
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ValueError("model file: the training curve is not a list of points")
    if not isinstance(supervised, dict) or not isinstance(losses := supervised.get("losses", []), list):
        raise ValueError("model file: the supervised losses are not a list")
    curve = []
    for p in points:
        update, episode = p.get("update"), p.get("episode")
        if not all(type(n) is int for n in (update, episode)):
            raise ValueError(f"model file: curve point {str(p)[:80]} lacks an integer update and episode")
        curve.append(CurvePoint(update, episode, _num(p.get("avg_jct")), _num(p.get("episode_reward"))))
    plot_curve(path, [_num(x) for x in losses], curve, _num(meta.get("drf_validation_jct")))


def _num(value: object) -> float:
    """A finite number of the file, else NaN (not plotted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        number = float(value)
    except OverflowError:
        return math.nan
    return number if math.isfinite(number) else math.nan
