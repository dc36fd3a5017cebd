from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hpc_elastic.policy import ClusterState, Decision, JobTable, PassInput
from hpc_elastic.slurm import Job, Node
from slurm_plugin.actions import ActionKind, Place, Preempt, SetOrder, plan
from slurm_plugin.config import OrderField, PluginConfig
from slurm_plugin.daemon import build_policy
from slurm_plugin.observe import Observation, Selection, observe
from tests.unit.plugin.conftest import at, config, start_of


def decide(
    cfg: PluginConfig, jobs: list[Job], nodes: list[Node], now: float, skews: dict[int, float] | None = None
) -> tuple[Observation, Decision]:
    obs = observe(jobs, nodes, {}, Selection(), now=now, skews=skews)
    cluster = ClusterState.from_nodes(list(obs.nodes))
    return obs, build_policy(cfg).schedule(PassInput(now, JobTable.from_views(list(obs.jobs), cluster), cluster))


def test_demoted_job_is_preempted_for_a_waiting_job(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, tiresias={"thresholds": [100.0]}, preemption={"min_run_time_s": 30})
    now = at(start_of(jobs, 24), 60)  # 8 GPUs x 60 s = 480 GPU-s > 100: job 24 falls to Q2 (§3.2.3)
    obs, decision = decide(cfg, jobs, nodes, now)
    actions = plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit)
    preempts = [a for a in actions if isinstance(a, Preempt)]
    assert [(p.job_id, p.checkpointed) for p in preempts] == [(24, True)]
    assert "job(s) 25" in preempts[0].reason and "480 GPU-s" in preempts[0].reason
    orders = [a for a in actions if isinstance(a, SetOrder)]
    assert [(o.job_id, o.field, o.value) for o in orders] == [(25, OrderField.SITE_FACTOR, 10_000 + 1_000)]


def test_min_run_time_and_recent_preemption_protect_a_job(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path, tiresias={"thresholds": [100.0]}, preemption={"min_run_time_s": 300})
    obs, decision = decide(cfg, jobs, nodes, at(start_of(jobs, 24), 60))
    assert not [a for a in plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit) if a.kind is ActionKind.PREEMPT]
    cfg = config(tmp_path, tiresias={"thresholds": [100.0]}, preemption={"min_run_time_s": 30})
    now = at(start_of(jobs, 24), 60)
    obs, decision = decide(cfg, jobs, nodes, now)
    recent = {24: replace(obs.records[24], last_preempt=now - 10)}
    obs = replace(obs, records={**obs.records, **recent})
    assert not [a for a in plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit) if a.kind is ActionKind.PREEMPT]
    off = config(tmp_path, tiresias={"thresholds": [100.0]}, preemption={"enabled": False, "min_run_time_s": 30})
    assert not [a for a in plan(obs, decision, off, pack_limit=off.tiresias.pack_limit) if a.kind is ActionKind.PREEMPT]


def test_same_queue_keeps_the_running_job_and_orders_by_fifo(
    tmp_path: Path, busy: tuple[list[Job], list[Node]]
) -> None:
    jobs, nodes = busy
    cfg = config(tmp_path)  # default threshold 3200 GPU-s: both jobs stay in Q1, the started one goes first
    obs, decision = decide(cfg, jobs, nodes, at(start_of(jobs, 24), 60))
    actions = plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit)
    assert [a.kind for a in actions] == [ActionKind.ORDER]
    # the value Slurm already has is not set again
    waiting = next(j for j in jobs if j.job_id == 25)
    again = [replace(j, site_factor=11_000) if j is waiting else j for j in jobs]
    obs, decision = decide(cfg, again, nodes, at(start_of(jobs, 24), 60))
    assert plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit) == []


def test_skewed_job_is_consolidated(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    cfg = config(
        tmp_path, tiresias={"thresholds": [100.0]}, preemption={"min_run_time_s": 30}, placement={"pin_nodes": True}
    )
    obs, decision = decide(cfg, jobs, nodes, at(start_of(jobs, 24), 60), skews={25: 0.9})
    places = [a for a in plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit) if isinstance(a, Place)]
    assert len(places) == 1 and places[0].job_id == 25 and places[0].num_nodes == 1
    assert places[0].node_list in {"node1", "node2"} and "skew 0.90 > PACKLIMIT 0.50" in places[0].reason
    obs = replace(obs, records={**obs.records, 25: replace(obs.records[25], placement=places[0].signature)})
    assert not [
        a for a in plan(obs, decision, cfg, pack_limit=cfg.tiresias.pack_limit) if isinstance(a, Place)
    ]  # already applied
