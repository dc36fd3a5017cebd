"""Slurm's history as DL²'s supervised samples (DL² §4.2, :mod:`hpc_elastic.dl2.history`): slots cut by
hand on two PS-mode jobs, the samples against :func:`teacher_steps` of the hand-made decision, what is skipped and
counted, and the sacct reading it rests on (the hand-written fixture in ``tests/fixtures``, in sacct's layout)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest

from hpc_elastic.dl2.history import (
    ASSUMED_EPOCHS,
    Collected,
    JobRecord,
    Role,
    TaskRecord,
    collect,
    concurrent,
    history_slots,
    partition_servers,
    ps_partitions,
    step_role,
)
from hpc_elastic.policy.dl2 import StateSpec, teacher_steps
from hpc_elastic.policy.slots import Packing, Servers, SlotAction
from hpc_elastic.sim.ps_jobs import JOB_TYPES, SLOT_SECONDS
from hpc_elastic.slurm import commands, parse
from hpc_elastic.slurm.client import CliSlurm
from hpc_elastic.slurm.errors import SlurmParseError
from hpc_elastic.slurm.runner import CommandResult

FIXTURES = Path(__file__).parents[2] / "fixtures"
START = datetime(2026, 11, 27, 0, 0, tzinfo=UTC)
END = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)
#: the cpu partition of the dev cluster: node5 and node6, 8 cores each
CPU = Servers((0, 0), (8, 8))
SPEC = StateSpec(jobs=8, type_names=tuple(kind.name for kind in JOB_TYPES), slot_seconds=SLOT_SECONDS)
CTC, DSSM = SPEC.type_names.index("ctc"), SPEC.type_names.index("dssm")


def fixture(name: str) -> str:
    """A fixture's sacct output without its '#' header."""
    return "".join(line for line in (FIXTURES / name).read_text().splitlines(True) if not line.startswith("#"))


def collected() -> Collected:
    jobs = parse.parse_sacct_text(fixture("sacct_ps_jobs_handmade.txt"))
    steps = parse.parse_sacct_step_times(fixture("sacct_ps_steps_handmade.txt"))
    return collect(jobs, steps, "cpu")


def at(minute: int, second: int = 0) -> float:
    return datetime(2026, 11, 27, 0, minute, second, tzinfo=UTC).timestamp()


def test_step_roles_by_name() -> None:
    names = ("w0", "w12", "r1w0", "ps3", "master", "batch", "extern", "w", "psx", "r1ps0")
    assert [step_role(n) for n in names] == [Role.WORKER] * 3 + [Role.PS] + [None] * 6


def test_step_times_read_from_sacct() -> None:
    steps = parse.parse_sacct_step_times(fixture("sacct_ps_steps_handmade.txt"))
    assert len(steps) == 23  # the jobs' own lines are not steps
    w1 = next(s for s in steps if s.job_id == 101 and s.name == "w1")
    assert w1.step_id == "3" and w1.start_time == datetime(2026, 11, 27, 0, 5, 31, tzinfo=UTC)
    assert w1.end_time == datetime(2026, 11, 27, 0, 25, tzinfo=UTC)
    running = next(s for s in steps if s.job_id == 103 and s.name == "w0")
    assert running.end_time is None
    with pytest.raises(SlurmParseError, match="expected 6 fields"):
        parse.parse_sacct_step_times("12.0|RUNNING|Unknown\n")
    assert w1.cpus == 1
    with pytest.raises(SlurmParseError, match="bad step id"):
        parse.parse_sacct_step_times("x.0|RUNNING|Unknown|Unknown|1|w0\n")


def test_step_history_is_one_sacct_over_the_window() -> None:
    calls: list[list[str]] = []

    class Runner:
        def run(self, argv: list[str], *, stdin: str | None = None, idempotent: bool = True) -> CommandResult:
            calls.append(list(argv))
            return CommandResult(tuple(argv), 0, fixture("sacct_ps_steps_handmade.txt"), "")

    steps = CliSlurm(Runner()).step_history(START, END)  # type: ignore[arg-type]
    assert len(steps) == 23
    assert calls == [commands.sacct_step_times(START, END)]
    assert calls[0][:4] == ["sacct", "--parsable2", "--noheader", "--format=JobIDRaw,State,Start,End,AllocCPUS,JobName"]
    assert "--starttime=2026-11-27T00:00:00" in calls[0] and "--endtime=2026-11-27T01:00:00" in calls[0]


def test_collect_keeps_the_partitions_ps_mode_jobs_with_their_worker_and_ps_steps() -> None:
    found = collected()
    assert [r.job_id for r in found.records] == [101, 102, 103]
    assert found.not_ps == 1 and found.bad_marker == 0  # job 104 is a plain batch job
    ctc = found.records[0]
    assert (ctc.model, ctc.request_workers, ctc.request_ps, ctc.cores) == ("ctc", 2, 1, 1)
    assert (ctc.submit, ctc.start, ctc.end) == (at(5), at(5), at(50))
    assert [t.role for t in ctc.tasks] == [Role.PS, Role.WORKER, Role.WORKER, Role.WORKER]  # no master
    assert found.records[2].end is None  # still running
    jobs = parse.parse_sacct_text(fixture("sacct_ps_jobs_handmade.txt"))
    steps = parse.parse_sacct_step_times(fixture("sacct_ps_steps_handmade.txt"))
    assert ps_partitions(jobs, steps) == frozenset({"cpu"})
    elsewhere = collect(jobs, [], "gpu")
    assert elsewhere.records == () and elsewhere.other_partition == 3


def test_partition_servers_are_the_nodes_cores_without_gpus() -> None:
    nodes = parse.parse_sinfo_json((Path(__file__).parents[2] / "data" / "slurm-22.05" / "sinfo.json").read_text())
    assert partition_servers(nodes, "cpu") == CPU
    with pytest.raises(ValueError, match="'nope' has no nodes"):
        partition_servers(nodes, "nope")


def test_concurrent_counts_a_replaced_worker_once() -> None:
    tasks = (
        TaskRecord(Role.WORKER, at(5, 30), at(49, 55)),
        TaskRecord(Role.WORKER, at(5, 31), at(25)),
        TaskRecord(Role.WORKER, at(25, 40), at(49, 55)),
        TaskRecord(Role.PS, at(5, 20), None),
    )
    assert concurrent(tasks, Role.WORKER, at(20), at(40)) == 2
    assert concurrent(tasks, Role.WORKER, at(0), at(5, 30)) == 0  # [start, end): the start at 5:30 is out
    assert concurrent(tasks, Role.WORKER, at(0), at(20)) == 2
    assert concurrent(tasks, Role.PS, at(40), at(59)) == 1


def test_two_jobs_cut_into_slots_by_hand() -> None:
    history = history_slots(SPEC, JOB_TYPES, CPU, collected().records, start=START, end=END)
    assert [s.slot for s in history.slots] == [0, 1, 2]
    assert history.jobs == 2 and history.unknown_types == (("wide-deep", 1),) and history.mixed_cores == 0
    rows = [[(j.job_id, j.arrival, j.slots_run, j.workers, j.ps) for j in s.inp.jobs] for s in history.slots]
    # ctc (101) runs 00:05-00:50 with 2 workers and 1 PS; dssm (102) waits from 00:10, runs 00:30-00:55
    assert rows == [
        [(101, 0, 0, 0, 0), (102, 0, 0, 0, 0)],
        [(101, 0, 1, 2, 1), (102, 0, 0, 0, 0)],
        [(101, 0, 2, 2, 1), (102, 0, 1, 2, 1)],
    ]
    held = [[s.decision.of(job) for job in (101, 102)] for s in history.slots]
    assert held == [[(2, 1), (0, 0)], [(2, 1), (2, 1)], [(2, 1), (2, 1)]]
    # epochs: the assumed total, done in proportion to the run elapsed (ctc: 15 of its 45 minutes at 00:20)
    first, second, third = history.slots
    assert all(j.epochs_total == ASSUMED_EPOCHS for j in first.inp.jobs)
    assert second.inp.jobs[0].epochs_done == pytest.approx(ASSUMED_EPOCHS / 3)
    assert second.inp.jobs[1].epochs_done == 0.0  # not started at the slot's start
    assert third.inp.jobs[1].epochs_done == pytest.approx(ASSUMED_EPOCHS * 10 / 25)
    # the slot's types: the catalogue's names with the jobs' demands (cores per process, no GPU)
    kinds = second.inp.types
    assert (kinds[CTC].worker_gpus, kinds[CTC].worker_cpus, kinds[CTC].ps_cpus) == (0, 1, 1)
    assert (kinds[DSSM].worker_gpus, kinds[DSSM].worker_cpus, kinds[DSSM].ps_cpus) == (0, 2, 2)
    assert [j.job_type for j in second.inp.jobs] == [CTC, DSSM]
    assert (second.inp.jobs[1].request_workers, second.inp.jobs[1].max_workers) == (2, 2)


def test_samples_are_teacher_steps_of_the_hand_made_decision() -> None:
    history = history_slots(SPEC, JOB_TYPES, CPU, collected().records, start=START, end=END)
    by_hand = {
        # slot 0: ctc gains a pair and a worker; cores are left (dssm waited for node6): void
        0: [(0, SlotAction.BOTH), (0, SlotAction.WORKER), (-1, SlotAction.VOID)],
        # slot 1: ctc keeps its tasks, then dssm gains its pair and worker; both at their maximum: no void
        1: [(0, SlotAction.BOTH), (0, SlotAction.WORKER), (1, SlotAction.BOTH), (1, SlotAction.WORKER)],
        # slot 2: both keep what they held
        2: [(0, SlotAction.BOTH), (0, SlotAction.WORKER), (1, SlotAction.BOTH), (1, SlotAction.WORKER)],
    }
    for slot in history.slots:
        packing = Packing(slot.inp)
        for row, action in by_hand[slot.slot]:
            assert packing.add(row, action)
        decision = packing.decision()
        assert slot.decision == decision
        expected = teacher_steps(SPEC, slot.inp, decision)
        assert expected is not None and slot.steps is not None
        assert [s.action for s in slot.steps] == [s.action for s in expected]
        for got, want in zip(slot.steps, expected, strict=True):
            assert (got.state == want.state).all() and (got.mask == want.mask).all()
    assert [s.action for s in history.slots[1].steps or ()] == [2, 0, 5, 3]
    assert history.samples == 3 + 4 + 4 and history.inexpressible == 0


def test_what_cannot_be_expressed_is_counted_not_guessed() -> None:
    records = collected().records
    # a partition of one 4-core node: dssm's pair and worker (2 cores each) do not fit beside ctc
    small = history_slots(SPEC, JOB_TYPES, Servers((0,), (4,)), records, start=START, end=END)
    assert small.inexpressible == 2 and [s.steps is None for s in small.slots] == [False, True, True]
    # J = 1: a slot of two jobs has no state of one batch
    one = history_slots(dataclasses.replace(SPEC, jobs=1), JOB_TYPES, CPU, records, start=START, end=END)
    assert one.inexpressible == 3 and one.samples == 0
    # two jobs of one type with different cores per process
    mixed = [dataclasses.replace(records[1], model="ctc"), *records]
    history = history_slots(SPEC, JOB_TYPES, CPU, mixed, start=START, end=END)
    assert history.mixed_cores == 3 and history.slots == ()
    # unknown model names, by name
    unknown = [dataclasses.replace(r, model="bert") for r in records]
    history = history_slots(SPEC, JOB_TYPES, CPU, unknown, start=START, end=END)
    assert history.unknown_types == (("bert", 3),) and history.jobs == 0 and history.samples == 0


def test_only_whole_slots_of_the_window() -> None:
    records = collected().records
    half = datetime(2026, 11, 27, 0, 50, tzinfo=UTC)
    assert [s.slot for s in history_slots(SPEC, JOB_TYPES, CPU, records, start=START, end=half).slots] == [0, 1]
    with pytest.raises(ValueError, match="shorter than one slot"):
        history_slots(SPEC, JOB_TYPES, CPU, records, start=START, end=datetime(2026, 11, 27, 0, 10, tzinfo=UTC))
    with pytest.raises(ValueError, match="not the spec's"):
        history_slots(SPEC, JOB_TYPES[:2], CPU, records, start=START, end=END)


def test_job_record_checks_its_values() -> None:
    with pytest.raises(ValueError, match="cores must be an int >= 1, got 0"):
        JobRecord(1, "ctc", 0.0, None, None, 1, 1, 0)
    with pytest.raises(ValueError, match="epochs_total"):
        JobRecord(1, "ctc", 0.0, None, None, 1, 1, 1, epochs_total=0.0)
    with pytest.raises(ValueError, match="bad times"):
        TaskRecord(Role.PS, 10.0, 5.0)


#: captured on the dev cluster (Slurm 22.05) after a CI run of the integration tests, in the layouts above
CAPTURED = Path(__file__).parents[2] / "data" / "slurm-22.05"


def captured() -> Collected:
    jobs = parse.parse_sacct_text((CAPTURED / "sacct_ps_history_parsable2.txt").read_text())
    steps = parse.parse_sacct_step_times((CAPTURED / "sacct_ps_step_times_parsable2.txt").read_text())
    return collect(jobs, steps, "cpu")


def test_captured_accounting_holds_no_comment_so_ps_mode_jobs_are_known_by_their_steps() -> None:
    found = captured()
    # AccountingStoreFlags=job_comment is not set: no marker in sacct, every PS-mode job known by its steps
    assert found.by_steps == len(found.records) == 12 and found.bad_marker == 0
    by_id = {r.job_id: r for r in found.records}
    # 2 PS and 3 workers of one core (the integration test's default), 8 s of training
    assert (by_id[15].model, by_id[15].request_workers, by_id[15].request_ps, by_id[15].cores) == (
        "ps-mode-test",
        3,
        2,
        1,
    )
    # requeued once: its workers of the second run are r1w0-r1w2; one job, ending with its last run
    requeued = by_id[19]
    assert len([t for t in requeued.tasks if t.role is Role.WORKER]) == 6
    assert requeued.end == datetime(2026, 11, 27, 18, 30, 54, tzinfo=UTC).timestamp()
    # Brain resized job 18 (a worker of 4 cores, a PS of 2): its usual sizes are one core each
    assert (by_id[18].cores, by_id[18].ps_cores, by_id[18].request_workers, by_id[18].request_ps) == (1, None, 4, 2)


def test_captured_jobs_have_no_dl2_type_and_are_counted() -> None:
    start, end = datetime(2026, 11, 27, tzinfo=UTC), datetime(2026, 11, 27, 19, 0, tzinfo=UTC)
    history = history_slots(SPEC, JOB_TYPES, CPU, captured().records, start=start, end=end)
    assert history.samples == 0 and history.jobs == 0
    assert dict(history.unknown_types)["ps-mode-test"] == 8


def test_captured_jobs_give_samples_on_a_slot_as_short_as_they_are() -> None:
    """The integration tests' jobs run for seconds: in a 20-minute slot their most tasks at once add up to more
    than the partition (jobs that ran one after the other); on 10 s slots every slot is expressible."""
    found = captured().records
    sizes = sorted({(r.cores, r.ps_cores) for r in found}, key=str)  # one DL² type per size of worker and PS
    records = [dataclasses.replace(r, model=SPEC.type_names[sizes.index((r.cores, r.ps_cores))]) for r in found]
    start, end = datetime(2026, 11, 27, 18, 20, tzinfo=UTC), datetime(2026, 11, 27, 18, 52, tzinfo=UTC)
    short = dataclasses.replace(SPEC, slot_seconds=10.0)
    history = history_slots(short, JOB_TYPES, CPU, records, start=start, end=end)
    assert history.samples > 100 and history.inexpressible == 0 and history.mixed_cores == 0
    for slot in history.slots:
        assert slot.steps is not None
        again = teacher_steps(short, slot.inp, slot.decision)
        assert again is not None and [s.action for s in again] == [s.action for s in slot.steps]
    long = history_slots(SPEC, JOB_TYPES, CPU, records, start=start, end=end)
    assert long.samples == 0 and long.inexpressible == 1  # the one whole slot, 18:20-18:40
