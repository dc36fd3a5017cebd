"""``policy = "dl2"``: DL²'s network sizes the running ps-mode jobs of CPU partitions once per slot (a scale notice
in the job's AdminComment, then USR2 to its batch shell), GPU jobs as under tiresias-las, and a clean fallback to
2D-LAS alone, said once, in state.json."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hpc_elastic.dl2 import model_file
from hpc_elastic.jobdir import JobDir, Progress, ScaleNotice, ScaleReply, ScaleRequest, parse_scale
from hpc_elastic.policy.dl2 import Network, StateSpec, decide
from hpc_elastic.policy.slots import SlotAction
from hpc_elastic.ps.model import MODEL_NAME
from hpc_elastic.sim.ps_jobs import CPU_JOB_TYPES, TYPES_BY_NAME
from hpc_elastic.slurm import Job, JobRef, Node
from slurm_plugin.config import ConfigError, PluginConfig, parse_config
from slurm_plugin.daemon import STATE_NAME
from slurm_plugin.dl2_slots import PsSlotView, plan_slot, slot_input
from slurm_plugin.store import JobRecord, Store
from tests.unit.plugin.conftest import at, config, start_of
from tests.unit.plugin.test_cpu_policy import cpu_jobs
from tests.unit.plugin.test_daemon import FakeSlurm, RefusesAdminComment, make

SPEC = StateSpec(jobs=4, type_names=(MODEL_NAME,), slot_seconds=1200.0, max_slots_run=100, max_epochs_left=100.0)


def logits(spec: StateSpec, prefer: dict[tuple[int, SlotAction], float]) -> np.ndarray:
    """Constant logits: the given (job row, action) pairs above void (1.0), every other action below it."""
    out = np.zeros(spec.action_size, dtype=np.float32)
    out[spec.void] = 1.0
    for (row, action), value in prefer.items():
        out[3 * row + (0 if action is SlotAction.WORKER else 1 if action is SlotAction.PS else 2)] = value
    return out


def hand_set_model(path: Path, spec: StateSpec, prefer: dict[tuple[int, SlotAction], float]) -> None:
    """A model file whose policy network ignores its state: one linear layer, zero weights, the logits as bias."""
    weight = np.zeros((spec.action_size, spec.state_size), dtype=np.float32)
    model_file.save(
        path, spec, {}, {}, {"policy.layers.0.weight": weight, "policy.layers.0.bias": logits(spec, prefer)}
    )


def view(job_id: int, workers: int, ps: int, **kw: object) -> PsSlotView:
    fields: dict[str, object] = {
        "job_id": job_id,
        "partition": "cpu",
        "model": MODEL_NAME,
        "submitted": float(job_id),
        "executed_s": 3000.0,
        "epochs_done": 1.0,
        "epochs_total": 5.0,
        "workers": workers,
        "ps": ps,
        "workers_range": (1, 4),
        "ps_range": (1, 2),
        "cores_per_task": 1,
    }
    fields.update(kw)
    return PsSlotView(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ configuration


def test_config_accepts_a_dl2_section_and_rejects_each_problem_on_its_own_line(tmp_path: Path) -> None:
    cfg = config(tmp_path, policy="dl2", dl2={"model": "/etc/hpc-elastic/dl2.model", "slot_s": 600})
    assert cfg.policy == "dl2" and cfg.dl2.model == Path("/etc/hpc-elastic/dl2.model") and cfg.dl2.slot_s == 600
    assert config(tmp_path).dl2.slot_s == 1200.0  # DL²'s 20-minute slot by default
    base = {"state_dir": str(tmp_path), "policy": "dl2"}
    with pytest.raises(ConfigError) as missing:
        parse_config(base)
    assert missing.value.problems == ['config: (top level): policy "dl2" needs [dl2] model = "<absolute path of the '
                                      'model file>"']  # fmt: skip
    with pytest.raises(ConfigError) as bad:
        parse_config({**base, "dl2": {"model": "dl2.model", "slot_s": 0, "slot": 3}})
    assert sorted(bad.value.problems) == [
        "config: dl2.model: model must be an absolute path, got 'dl2.model'",
        "config: dl2.slot_s: Input should be greater than 0",
        "config: unknown key 'dl2.slot'",
    ]


# ------------------------------------------------------------------------------------------- the pure decision


def test_the_builder_gives_dl2_the_partitions_nodes_and_the_jobs_as_the_pass_saw_them() -> None:
    jobs = [view(9, 2, 1, submitted=50.0, executed_s=2500.0, cores_per_task=3), view(4, 1, 1, submitted=60.0)]
    inp = slot_input(SPEC, TYPES_BY_NAME, (8, 8), jobs, slot=7, slot_seconds=1200.0)
    assert not isinstance(inp, str)
    assert inp.slot == 7 and inp.slot_seconds == 1200.0
    assert inp.servers.gpus == (0, 0) and inp.servers.cpus == (8, 8)
    (kind,) = inp.types
    assert kind.name == MODEL_NAME and kind.worker_gpus == 0 and (kind.worker_cpus, kind.ps_cpus) == (3, 3)
    assert kind.theta == CPU_JOB_TYPES[0].theta
    first, second = inp.jobs
    assert (first.job_id, first.arrival, second.job_id, second.arrival) == (9, 0, 4, 1)  # submission order
    assert (first.slots_run, first.epochs_done, first.epochs_total) == (2, 1.0, 5.0)
    assert (first.workers, first.ps, first.max_workers, first.max_ps) == (2, 1, 4, 2)
    assert (first.request_workers, first.request_ps) == (4, 1)  # the size it started with
    # what the state cannot show: a reason, not a slot
    assert slot_input(SPEC, TYPES_BY_NAME, (8,), [view(1, 1, 1, model="deepfm")], slot=0, slot_seconds=1200.0) == (
        "job 1 trains 'deepfm', not one of the model's job types"
    )
    no_epochs = view(2, 1, 1, epochs_done=None, epochs_total=None)
    assert slot_input(SPEC, TYPES_BY_NAME, (8,), [no_epochs], slot=0, slot_seconds=1200.0) == (
        "job 2 has recorded no epochs yet"
    )
    table1 = replace(SPEC, type_names=("resnet-50", MODEL_NAME))  # a wide-deep job needs resnet-50's column too
    inp = slot_input(table1, TYPES_BY_NAME, (8,), [view(1, 1, 1)], slot=0, slot_seconds=1200.0)
    assert not isinstance(inp, str) and [k.name for k in inp.types] == ["resnet-50", MODEL_NAME]


def test_targets_only_for_jobs_whose_size_changes_within_their_ranges_and_the_free_cores() -> None:
    prefer = {(0, SlotAction.BOTH): 3.0, (0, SlotAction.WORKER): 2.0}  # job row 0: grow to its most, row 1: none
    network = Network(
        [(np.zeros((SPEC.action_size, SPEC.state_size), dtype=np.float32), logits(SPEC, prefer))], [], SPEC.columns
    )
    jobs = [view(1, 2, 1), view(2, 1, 1), view(3, 2, 2)]
    inp = slot_input(SPEC, TYPES_BY_NAME, (8, 8), jobs, slot=3, slot_seconds=1200.0)
    assert not isinstance(inp, str)
    assert decide(SPEC, inp, network).of(1) == (4, 2)  # both up to its most PS, then workers up to its most
    plan = plan_slot(SPEC, network, "cpu", inp, jobs=jobs, free_cores=8)
    assert plan.fallback == ""
    # job 1 grows to (4, 2); job 2 got nothing, kept at its ranges' lows (1, 1): unchanged; job 3 shrinks
    got = [(t.job_id, t.workers, t.ps, t.old_workers, t.old_ps) for t in plan.targets]
    assert got == [(1, 4, 2, 2, 1), (3, 1, 1, 2, 2)]
    assert plan.targets[0].reason.startswith("DL² slot 3: 4 workers and 2 PS")
    # a grow needing more cores than are free is left out (shrinking frees none); a request unanswered: nothing
    assert [t.job_id for t in plan_slot(SPEC, network, "cpu", inp, jobs=jobs, free_cores=2).targets] == [3]
    assert [t.job_id for t in plan_slot(SPEC, network, "cpu", inp, jobs=jobs, free_cores=3).targets] == [1, 3]
    pending = [replace(jobs[0], scale_pending=True), jobs[1], replace(jobs[2], scale_pending=True)]
    assert plan_slot(SPEC, network, "cpu", inp, jobs=pending, free_cores=8).targets == ()
    # out of the training range: the reason, no target
    far = [view(1, 2, 1, epochs_total=1000.0)]
    inp = slot_input(SPEC, TYPES_BY_NAME, (8, 8), far, slot=3, slot_seconds=1200.0)
    assert plan_slot(SPEC, network, "cpu", inp, jobs=far, free_cores=8).fallback == (
        "job 1 has 999 epochs left, training saw at most 100"
    )


# ---------------------------------------------------------------------------------------------- the daemon


def ps_cluster(root: Path, sizes: dict[int, tuple[int, int]]) -> tuple[list[Job], list[Node], dict[int, JobDir]]:
    """Ps jobs 26 and 28 run on the cpu partition (ranges 1-4 workers, 1-2 PS, one core each; 14 cores free), as
    this user's, each with a progress record of its ``sizes`` (workers, PS), 1 of 5 epochs done."""
    jobs, nodes = cpu_jobs(Path(__file__).parents[2] / "data" / "slurm-22.05")
    jobs = [replace(j, user_id=os.getuid()) for j in jobs if j.job_id in (26, 28)]
    dirs = {}
    for job in jobs:
        job_dir = JobDir.of(root, job.name, job.ref.job_id, job.ref.array_task_id).prepare()
        workers, ps = sizes[job.job_id]
        job_dir.record_progress(
            Progress(10, 1.0, None, workers, job.restart_count, 0, ps=ps, epochs_done=1.0, epochs_total=5.0)
        )
        dirs[job.job_id] = job_dir
    return jobs, nodes, dirs


WORKERS_FIRST = {(0, SlotAction.WORKER): 3.0, (1, SlotAction.WORKER): 2.0}  # every worker it may have, no more PS


def notices(calls: list[tuple[str, object]]) -> dict[int, tuple[int, int]]:
    """The scale notices a daemon sent, by job id: (workers, PS), each set in the AdminComment right before USR2
    to the job's batch shell (an array task addressed as ``<array>_<task>``: job 28 is 26_0)."""
    out: dict[object, tuple[int, int]] = {}
    for k, (kind, args) in enumerate(calls):
        if kind != "update" or not isinstance(args, tuple) or "AdminComment" not in args[1]:
            continue
        notice = ScaleNotice.decode(args[1]["AdminComment"])
        if notice is None:
            continue
        assert calls[k + 1] == ("cancel", ([args[0]], "USR2", True))
        out[args[0]] = (notice.workers, notice.ps)
    return {ARRAY_TASKS[ref] if ref in ARRAY_TASKS else int(str(ref)): sizes for ref, sizes in out.items()}


#: the captured ps jobs are the tasks of array job 26: 26_0 is job 28, 26_1 is job 26
ARRAY_TASKS: dict[object, int] = {JobRef(26, 0): 28, JobRef(26, 1): 26}


def without_notices(calls: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The calls but the scale notices and their USR2."""
    return [
        (kind, args)
        for kind, args in calls
        if not (
            kind == "update"
            and isinstance(args, tuple)
            and ScaleNotice.decode(str(args[1].get("AdminComment", ""))) is not None
        )
        and not (kind == "cancel" and isinstance(args, tuple) and args[1] == "USR2")
    ]


def dl2_config(tmp_path: Path, model: Path, **sections: object) -> PluginConfig:
    return config(tmp_path, policy="dl2", dl2={"model": str(model)}, **sections)


def test_the_daemon_sends_a_scale_notice_only_to_the_job_whose_size_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "dl2.model"
    hand_set_model(model, SPEC, WORKERS_FIRST)
    jobs, nodes, dirs = ps_cluster(tmp_path / "jobs", {26: (4, 1), 28: (2, 1)})
    fake = FakeSlurm(jobs, nodes)
    cfg = dl2_config(tmp_path, model)
    daemon, clock = make(cfg, fake, at(start_of(jobs, 28), 1000.0))
    caplog.set_level(logging.INFO, "slurm_plugin.dl2_daemon")
    daemon.run_pass()
    assert notices(fake.calls) == {28: (4, 1)}  # 26 runs DL²'s (4 workers, 1 PS) already
    assert without_notices(fake.calls) == []  # nothing else: nothing pending, nobody preempted
    assert not dirs[28].scale_path.exists()  # nothing written into the job's directory
    state = json.loads((tmp_path / STATE_NAME).read_text())
    assert state["dl2"]["status"] == "active"
    assert [(r["job_id"], r["workers"], r["ps"], r["written"]) for r in state["dl2"]["requests"]] == [(28, 4, 1, True)]
    # the slot is decided: a later pass of the same slot sends nothing
    fake.calls.clear()
    clock.sleep(30.0)
    daemon.run_pass()
    assert notices(fake.calls) == {}
    # the next slot, the notice unanswered and younger than a slot: nothing more is asked of job 28 (its workers
    # are still 2); a restarted daemon reads the notice back from the job's AdminComment the same way
    clock.sleep(1100.0)
    daemon.run_pass()
    restarted, clock = make(cfg, fake, clock.now)
    restarted.run_pass()
    assert notices(fake.calls) == {}
    # answered (refused: the job's workers stay 2): the next slot asks again
    asked = ScaleNotice.decode(next(j for j in fake.jobs() if j.job_id == 28).admin_comment)
    assert asked is not None
    dirs[28].reply_scale(ScaleReply(asked.requested_at, False, "refused: no room", 2, 1, asked.requested_at + 1))
    clock.sleep(1200.0)
    restarted.run_pass()
    assert notices(fake.calls) == {28: (4, 1)}
    assert [m for m in caplog.messages if "dl2:" in m] == [
        f"dl2: the model {model} sizes the ps jobs once per 1200s slot"
    ] * 2  # the first daemon, the restarted one


def test_a_refused_notice_is_reported_not_sent_and_a_dry_run_sends_none(tmp_path: Path) -> None:
    """The scale notices go through the daemon's applier like its other actions: a notice Slurm refuses is an
    action that failed (said in the state file, no USR2 without its notice), ``--dry-run`` changes nothing."""
    model = tmp_path / "dl2.model"
    hand_set_model(model, SPEC, WORKERS_FIRST)
    jobs, nodes, _dirs = ps_cluster(tmp_path / "jobs", {26: (4, 1), 28: (2, 1)})

    fake = RefusesAdminComment(jobs, nodes)
    daemon, _ = make(dl2_config(tmp_path, model), fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    assert fake.calls == []  # no USR2 without the notice it announces
    state = json.loads((tmp_path / STATE_NAME).read_text())
    (request,) = state["dl2"]["requests"]
    assert (request["job_id"], request["written"]) == (28, False)
    assert request["detail"].startswith("not sent: ") and "permission denied" in request["detail"]
    assert [(a["kind"], a["job_id"], a["ok"]) for a in state["recent_actions"]] == [("scale", 28, False)]
    assert daemon.metrics.errors.labels("apply")._value.get() == 1

    dry = FakeSlurm(jobs, nodes)
    daemon, _ = make(dl2_config(tmp_path, model), dry, at(start_of(jobs, 28), 1000.0), dry_run=True)
    report = daemon.run_pass()
    assert dry.calls == []
    assert report.dl2 is not None
    assert [(r.target.job_id, r.written, r.detail) for r in report.dl2.requests] == [(28, False, "dry-run")]


def test_a_users_scale_request_waiting_in_the_job_directory_is_left_to_it(tmp_path: Path) -> None:
    model = tmp_path / "dl2.model"
    hand_set_model(model, SPEC, WORKERS_FIRST)
    jobs, nodes, dirs = ps_cluster(tmp_path / "jobs", {26: (1, 1), 28: (1, 1)})
    dirs[26].request_scale(ScaleRequest(2, None, 5.0))  # the user's own, not taken yet
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(dl2_config(tmp_path, model), fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    assert parse_scale(dirs[26].scale_path.read_text()) == ScaleRequest(2, None, 5.0)
    assert notices(fake.calls) == {28: (4, 1)}


def actions_of(cfg: PluginConfig, jobs: list[Job], nodes: list[Node]) -> tuple[object, list[dict[str, object]]]:
    """The Slurm calls and the state file's jobs of one pass of a daemon of ``cfg``."""
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    state = json.loads((cfg.state_dir / STATE_NAME).read_text())
    return without_notices(fake.calls), state["jobs"]


def corrupt(path: Path) -> None:
    hand_set_model(path, SPEC, WORKERS_FIRST)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def symlinked(path: Path) -> None:
    hand_set_model(path.with_suffix(".real"), SPEC, WORKERS_FIRST)
    path.symlink_to(path.with_suffix(".real"))


#: GPU job 24 is preempted for 25 (tiresias-las), ps jobs 26 and 28 run on the cpu partition
MIXED: dict[str, object] = {
    "tiresias": {"thresholds": [100.0]},
    "preemption": {"min_run_time_s": 30, "grace_s": 20},
}


def mixed_cluster(root: Path) -> tuple[list[Job], list[Node], dict[int, JobDir]]:
    jobs, nodes, dirs = ps_cluster(root, {26: (1, 1), 28: (2, 1)})
    gpu, _ = cpu_jobs(Path(__file__).parents[2] / "data" / "slurm-22.05")
    return [j for j in gpu if j.job_id in (24, 25)] + jobs, nodes, dirs


def las_config(tmp_path: Path) -> PluginConfig:
    (tmp_path / "las").mkdir()
    return config(tmp_path / "las", ckpt_roots=[str(tmp_path / "jobs")], **MIXED)


@pytest.mark.parametrize(
    ("make_model", "why"),
    [
        (lambda path: None, "model unusable: {model}: no model file"),
        (corrupt, "model unusable: {model}: checksum mismatch (corrupt or truncated)"),
        (symlinked, "model unusable: {model.name} under {model.parent} is a symbolic link or not a directory"),
        (
            lambda path: hand_set_model(path, replace(SPEC, slot_seconds=600.0), WORKERS_FIRST),
            "partition cpu: slot of 1200 s, trained on 600 s slots",
        ),
        (
            lambda path: hand_set_model(path, replace(SPEC, max_tasks=2), WORKERS_FIRST),
            "partition cpu: job 26 may have 4 workers or PS, training saw at most 2",
        ),
    ],
    ids=["missing", "corrupt", "symlink", "slot-length", "out-of-range"],
)
def test_the_fallback_is_exactly_tiresias_and_said_once_and_in_state_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_model: object, why: str
) -> None:
    jobs, nodes, _dirs = mixed_cluster(tmp_path / "jobs")
    las = actions_of(las_config(tmp_path), jobs, nodes)
    model = tmp_path / "dl2.model"
    make_model(model)  # type: ignore[operator]
    caplog.set_level(logging.INFO, "slurm_plugin.dl2_daemon")
    fake = FakeSlurm(jobs, nodes)
    daemon, clock = make(dl2_config(tmp_path, model, **MIXED), fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    state = json.loads((tmp_path / STATE_NAME).read_text())
    assert (fake.calls, state["jobs"]) == las
    assert state["dl2"]["status"] == why.format(model=model)
    clock.sleep(5.0)
    daemon.run_pass()  # the same reason: not logged again
    assert notices(fake.calls) == {}
    assert [m for m in caplog.messages if "dl2:" in m] == [
        f"dl2: falling back to 2D-LAS for ps jobs: {why.format(model=model)}"
    ]


def test_the_same_cluster_with_a_usable_model_scales_a_ps_job_and_changes_nothing_else(tmp_path: Path) -> None:
    jobs, nodes, _dirs = mixed_cluster(tmp_path / "jobs")
    las = actions_of(las_config(tmp_path), jobs, nodes)
    model = tmp_path / "dl2.model"
    hand_set_model(model, SPEC, WORKERS_FIRST)
    fake = FakeSlurm(jobs, nodes)
    cfg = dl2_config(tmp_path, model, **MIXED)
    daemon, _ = make(cfg, fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    state = json.loads((cfg.state_dir / STATE_NAME).read_text())
    scaled = {26, 28}
    # the state file's jobs as tiresias-las's, but the two scaled jobs' planned action
    assert [j["planned"] for j in state["jobs"] if j["job_id"] in scaled] == ["scale", "scale"]
    assert [j["planned"] for j in las[1] if j["job_id"] in scaled] == ["", ""]
    unplanned = [{**j, "planned": ""} if j["job_id"] in scaled else j for j in state["jobs"]]
    assert (without_notices(fake.calls), unplanned) == las
    # GPU job 25's order and the preemption of 24 (no job directory: requeued at once), as tiresias-las's
    assert las[0] == [("update", (25, {"SiteFactor": 11_000})), ("requeue", [24])]
    assert notices(fake.calls) == {26: (4, 1), 28: (4, 1)}
    scales = [a for a in state["recent_actions"] if a["kind"] == "scale"]
    assert [(a["job_id"], a["ok"]) for a in scales] == [(26, True), (28, True)]


def test_a_model_file_over_the_size_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "dl2.model"
    hand_set_model(model, SPEC, WORKERS_FIRST)
    monkeypatch.setattr(model_file, "MAX_BYTES", 100)
    jobs, nodes, _dirs = ps_cluster(tmp_path / "jobs", {26: (1, 1), 28: (1, 1)})
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(dl2_config(tmp_path, model), fake, at(start_of(jobs, 28), 1000.0))
    daemon.run_pass()
    state = json.loads((tmp_path / STATE_NAME).read_text())
    size = model.stat().st_size
    assert state["dl2"]["status"] == f"model unusable: {model} holds {size} bytes, more than the 100 allowed"
    assert notices(fake.calls) == {}


# ------------------------------------------------------------------------------ a trained model, in its range


@pytest.fixture(scope="session")
def trained_cpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DL² model trained on the CPU partition's catalogue (DRF bootstrap only, a few traces): enough to be
    in range for the dev cluster's ps jobs, not to schedule well."""
    training = pytest.importorskip("hpc_elastic.dl2.train", reason="DL² training needs torch")
    cfg = training.TrainConfig(
        seed=0, jobs=12, traces=2, held_out=1, validation_jobs=8, load=2.0, servers=(2, 0, 8), catalogue="cpu",
        max_jobs=4, supervised_epochs=3, rl_episodes=0,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("dl2") / "cpu.model"
    training.save_model(path, training.train(cfg))
    return path


def test_a_model_trained_on_the_cpu_catalogue_decides_the_dev_clusters_ps_jobs(
    tmp_path: Path, trained_cpu_model: Path
) -> None:
    loaded = model_file.load(trained_cpu_model)
    assert loaded.spec.type_names == (MODEL_NAME,)
    sizes = {26: (1, 1), 28: (3, 2)}
    jobs, nodes, _dirs = ps_cluster(tmp_path / "jobs", sizes)
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(dl2_config(tmp_path, trained_cpu_model), fake, at(start_of(jobs, 28), 1000.0))
    report = daemon.run_pass()
    assert report.dl2 is not None and report.dl2.status == "active"
    # what the network decided, brought into the ranges: a request exactly where it differs from what runs
    assert [p.partition for p in report.dl2.plans] == ["cpu"]
    views = daemon.dl2._views(report.observation, frozenset(), report.now)  # type: ignore[union-attr,arg-type]
    inp = slot_input(loaded.spec, TYPES_BY_NAME, (8, 8), views, slot=report.dl2.slot or 0, slot_seconds=1200.0)
    assert not isinstance(inp, str)
    decision = decide(loaded.spec, inp, loaded.network())
    sent = notices(fake.calls)
    for job_id, (workers, ps) in sizes.items():
        w, p = decision.of(job_id)
        want = (min(max(w, 1), 4), min(max(p, 1), 2))
        assert sent.get(job_id) == (None if want == (workers, ps) else want)


def test_a_ps_job_whose_stop_is_under_way_is_not_resized(tmp_path: Path) -> None:
    model = tmp_path / "dl2.model"
    hand_set_model(model, SPEC, WORKERS_FIRST)
    jobs, nodes, _dirs = ps_cluster(tmp_path / "jobs", {26: (1, 1), 28: (1, 1)})
    now = at(start_of(jobs, 28), 1000.0)
    stopping = JobRecord(28, now - 1000.0, now - 1000.0, stop_kind="preempt", stop_at=now - 5.0, stop_restarts=0)
    Store(tmp_path).save([stopping], (), None)
    fake = FakeSlurm(jobs, nodes)
    daemon, _ = make(dl2_config(tmp_path, model), fake, now)
    daemon.run_pass()
    assert notices(fake.calls) == {26: (4, 1)}  # 28 checkpoints for its preemption: it stops, it is not resized
