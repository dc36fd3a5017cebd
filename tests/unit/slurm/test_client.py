"""The CLI client over a fake runner fed with output captured from the real dev cluster."""

from __future__ import annotations

import types
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from hpc_elastic.env import Environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.slurm import client as client_mod
from hpc_elastic.slurm.client import CliSlurm, connect, job_from_pyslurm, pyslurm_match
from hpc_elastic.slurm.errors import JobNotFound, SlurmCommandError
from hpc_elastic.slurm.runner import CommandResult
from hpc_elastic.slurm.types import JobRef, JobState


class FakeRunner:
    def __init__(self, answers: dict[str, str | Exception]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], str | None, bool]] = []

    def run(self, argv: Sequence[str], *, stdin: str | None = None, idempotent: bool = True) -> CommandResult:
        self.calls.append((list(argv), stdin, idempotent))
        key = " ".join(argv[:2])
        answer = self.answers.get(key, self.answers.get(argv[0], ""))
        if isinstance(answer, Exception):
            raise answer
        return CommandResult(tuple(argv), 0, answer, "")


def make(answers: dict[str, str | Exception]) -> tuple[CliSlurm, FakeRunner]:
    fake = FakeRunner(answers)
    return CliSlurm(fake), fake  # type: ignore[arg-type]


def test_jobs_one_query_for_many_ids_filtered_client_side(slurm_data: Path) -> None:
    cli, fake = make({"squeue --all": (slurm_data / "squeue.json").read_text()})
    jobs = cli.jobs([4, 1, 999])
    assert sorted(j.job_id for j in jobs) == [1, 4]
    assert len(fake.calls) == 1 and fake.calls[0][0] == ["squeue", "--all", "--json", "--jobs=1,4,999"]
    assert cli.jobs([]) == [] and len(fake.calls) == 1


def test_job_not_found(slurm_data: Path) -> None:
    cli, _ = make({"squeue --all": (slurm_data / "squeue.json").read_text()})
    with pytest.raises(JobNotFound, match="999"):
        cli.job(999)
    assert cli.job(3).name == "big"


def test_site_factors_for_pending_jobs(slurm_data: Path) -> None:
    sprio = (slurm_data / "sprio.txt").read_text()
    cli, fake = make({"squeue --all": (slurm_data / "squeue_pending.json").read_text(), "sprio": sprio})
    jobs = {j.name: j for j in cli.jobs(site_factors=True)}
    assert jobs["waiter"].state is JobState.PENDING and jobs["waiter"].site_factor == 250
    assert jobs["fill|a100"].site_factor is None
    assert fake.calls[1][0] == ["sprio", "--noheader", "--format=%i|%S", "--jobs=25,27"]


def test_falls_back_to_text_when_json_is_missing(slurm_data: Path) -> None:
    no_json = SlurmCommandError(["squeue", "--json"], 1, "squeue: unrecognized option '--json'")
    text = (slurm_data / "squeue_text.txt").read_text()
    calls: list[list[str]] = []

    class NoJsonRunner:
        def run(self, argv: Sequence[str], *, stdin: str | None = None, idempotent: bool = True) -> CommandResult:
            calls.append(list(argv))
            if "--json" in argv:
                raise no_json
            return CommandResult(tuple(argv), 0, text, "")

    cli = CliSlurm(NoJsonRunner())  # type: ignore[arg-type]
    assert {j.name for j in cli.jobs()} >= {"waiter", "fill|a100"}
    cli.jobs()
    assert [c[2] for c in calls] == ["--json", "--noheader", "--noheader"]  # JSON is tried once only


def test_other_json_errors_are_not_hidden() -> None:
    boom = SlurmCommandError(["sinfo", "--json"], 1, "sinfo: error: something else")
    cli, _ = make({"sinfo": boom})
    with pytest.raises(SlurmCommandError, match="something else"):
        cli.nodes()


def test_history_and_writes(slurm_data: Path) -> None:
    cli, fake = make(
        {
            "sacct --parsable2": (slurm_data / "sacct_parsable2.txt").read_text(),
            "sbatch": "31\n",
            "squeue --all": (slurm_data / "squeue.json").read_text(),
        }
    )
    hist = cli.history(datetime(2026, 11, 22, tzinfo=UTC))
    assert [j.state for j in hist if j.job_id == 1][:2] == [JobState.REQUEUED, JobState.COMPLETED]
    assert fake.calls[-1][0][:2] == ["sacct", "--parsable2"]
    json_history = CliSlurm(FakeRunner({"sacct --json": (slurm_data / "sacct.json").read_text()}), history_json=True)  # type: ignore[arg-type]
    assert [j.state for j in json_history.history(datetime(2026, 11, 22, tzinfo=UTC)) if j.job_id == 1] == [
        JobState.REQUEUED,
        JobState.COMPLETED,
    ]
    assert cli.submit(script_text="#!/bin/bash\ntrue\n", options=["--gres=gpu:1"]) == 31
    assert fake.calls[-1] == (["sbatch", "--parsable", "--gres=gpu:1"], "#!/bin/bash\ntrue\n", False)
    cli.set_site_factor(31, 100)
    cli.set_num_nodes(31, 1)
    cli.requeue([31])
    cli.cancel([3], "USR1", batch=True)
    assert [c[0] for c in fake.calls[-5:]] == [
        ["scontrol", "update", "JobId=31", "SiteFactor=100"],
        ["scontrol", "update", "JobId=31", "NumNodes=1"],
        ["scontrol", "requeue", "31"],
        ["squeue", "--all", "--json", "--jobs=3"],
        ["scancel", "--signal=USR1", "--batch", "3"],
    ]
    with pytest.raises(JobNotFound, match="31"):  # scancel would exit 0 for an unknown id: checked first
        cli.cancel([3, 31])
    assert fake.calls[-1][0][0] == "squeue"
    with pytest.raises(ValueError, match="exactly one of"):
        cli.submit()
    with pytest.raises(ValueError, match="must start with '#!'"):
        cli.submit(script_text="echo hi\n")


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_module = types.ModuleType("pyslurm")
    fake_module.__version__ = "25.11.1"  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "pyslurm", fake_module)
    module, reason = pyslurm_match("22.05.8")
    assert module is None and "does not match Slurm 22.05.8" in reason
    module, reason = pyslurm_match("25.11.0")
    assert module is fake_module and "matches" in reason

    monkeypatch.setattr(client_mod.CliSlurm, "version", lambda self: "22.05.8")
    assert type(connect(Environment(slurm_backend="auto"))) is CliSlurm
    assert type(connect(Environment(slurm_backend="cli"))) is CliSlurm
    with pytest.raises(HpcElasticError, match="pyslurm 25.11.1 does not match"):
        connect(Environment(slurm_backend="pyslurm"))
    monkeypatch.setattr(client_mod.CliSlurm, "version", lambda self: "25.11.0")
    assert connect(Environment(slurm_backend="auto")).name == "pyslurm"


def test_pyslurm_job_mapping() -> None:
    obj = types.SimpleNamespace(
        id=5,
        name="t",
        user_name="bob",
        state="RUNNING",
        partition="gpu",
        time_limit=60,
        nodes="node[1-2]",
        num_nodes=2,
        cpus=4,
        start_time=1700000000,
        tres_alloc_str="gres/gpu=4,gres/gpu:a100=4",
        requeue_count=2,
    )
    job = job_from_pyslurm(obj)
    assert job.job_id == 5 and job.state is JobState.RUNNING and job.nodes == ("node1", "node2")
    assert job.time_limit_s == 3600 and job.gpus.as_dict() == {"a100": 4} and job.restart_count == 2


def test_cancel_names_an_array_task_as_array_underscore_task(slurm_data: Path) -> None:
    """Array 510 (captured running): task 3's own id is 510, the array's, so its signal goes to ``510_3``; a task
    that is not in the queue is refused before scancel runs."""
    cli, fake = make({"squeue --all": (slurm_data / "squeue_array_running.json").read_text()})
    cli.cancel([JobRef(510, 3)], "USR1", batch=True)
    assert fake.calls[-1][0] == ["scancel", "--signal=USR1", "--batch", "510_3"]
    with pytest.raises(JobNotFound, match="510_7"):
        cli.cancel([JobRef(510, 7)])
    assert fake.calls[-1][0][0] == "squeue"


def test_steps_read_from_sacct_text() -> None:
    fixture = Path(__file__).parents[2] / "fixtures" / "sacct_steps_oom_22.05.txt"
    cli, fake = make({"sacct --parsable2": fixture.read_text()})
    steps = cli.steps(1600)
    assert [s.name for s in steps if s.out_of_memory] == ["w0"]
    assert fake.calls[0][0][-1] == "--jobs=1600"
