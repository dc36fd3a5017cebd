"""DL²'s supervised phase on Slurm's history (§4.2, ``hpc-elastic dl2 train --teacher sacct``): a model trained
on the samples of the hand-written sacct fixture loads, and bad input is one line, exit 2 and no model file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch", reason="DL² training needs torch")

from hpc_elastic.cli.main import cli
from hpc_elastic.dl2 import model_file
from hpc_elastic.dl2.history import TeacherSlot, collect, history_slots
from hpc_elastic.dl2.train import base_spec, history_samples, load_networks, save_model, train
from hpc_elastic.policy.slots import Servers
from hpc_elastic.sim.ps_jobs import JOB_TYPES
from hpc_elastic.slurm import parse
from hpc_elastic.slurm.client import CliSlurm
from hpc_elastic.slurm.runner import CommandResult
from tests.unit.dl2.test_train import CLI_SMALL
from tests.unit.dl2.test_train import TINY as TRAIN_TINY

FIXTURES = Path(__file__).parents[2] / "fixtures"
SINFO = Path(__file__).parents[2] / "data" / "slurm-22.05" / "sinfo.json"
START = datetime(2026, 11, 27, 0, 0, tzinfo=UTC)
END = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)

TINY = dataclasses.replace(TRAIN_TINY, rl_episodes=0)  # the supervised phase only: what the teacher changes


def fixture(name: str) -> str:
    return "".join(line for line in (FIXTURES / name).read_text().splitlines(True) if not line.startswith("#"))


def history() -> tuple[TeacherSlot, ...]:
    jobs = parse.parse_sacct_text(fixture("sacct_ps_jobs_handmade.txt"))
    steps = parse.parse_sacct_step_times(fixture("sacct_ps_steps_handmade.txt"))
    records = collect(jobs, steps, "cpu").records
    return history_slots(base_spec(TINY), JOB_TYPES, Servers((0, 0), (8, 8)), records, start=START, end=END).slots


def test_a_model_trained_on_sacct_samples_loads(tmp_path: Path) -> None:
    slots = history()
    result = train(TINY, history=slots, teacher={"teacher": "sacct", "samples": 11})
    assert result.supervised.samples == 11  # 3 slots: fewer than five, none held out
    assert result.supervised.held_out_samples == 0
    path = tmp_path / "m.dl2"
    save_model(path, result)
    loaded = model_file.load(path)
    assert loaded.spec == result.spec
    assert loaded.meta["teacher"] == {"teacher": "sacct", "samples": 11}
    assert loaded.meta["supervised"]["samples"] == 11
    config, _, _ = load_networks(loaded)
    assert config == TINY
    assert loaded.network()(np.zeros(loaded.spec.state_size)).shape == (loaded.spec.action_size,)


def test_the_latest_fifth_of_the_slots_is_held_out() -> None:
    slots = history()
    spec = base_spec(TINY)
    many = [dataclasses.replace(slot, slot=slot.slot + 3 * k) for k in range(4) for slot in slots]  # 12 slots
    samples, held = history_samples(spec, many)
    assert (len(samples.actions), len(held.actions)) == (11 * 4 - 4 - 4, 8)  # the last 2 slots: 4 actions each
    samples, held = history_samples(spec, slots)
    assert (len(samples.actions), len(held.actions)) == (11, 0)


def test_no_sacct_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="no training samples"):
        train(TINY, history=())


class Slurm:
    """Answers the commands ``dl2 train --teacher sacct`` runs from the fixtures (by sacct's --format)."""

    def __init__(self, jobs: str | None = None, steps: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.jobs = jobs if jobs is not None else fixture("sacct_ps_jobs_handmade.txt")
        self.steps = steps if steps is not None else fixture("sacct_ps_steps_handmade.txt")

    def run(self, argv: Sequence[str], *, stdin: str | None = None, idempotent: bool = True) -> CommandResult:
        self.calls.append(list(argv))
        if argv[0] == "sinfo":
            out = SINFO.read_text()
        elif any(a.startswith("--format=JobIDRaw,State") for a in argv):
            out = self.steps
        elif argv[0] == "sacct":
            out = self.jobs
        else:
            raise AssertionError(f"unexpected command {argv}")
        return CommandResult(tuple(argv), 0, out, "")


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> Slurm:
    fake = Slurm()
    monkeypatch.setattr("hpc_elastic.dl2.sacct.connect", lambda environment=None: CliSlurm(fake, use_json=True))  # type: ignore[arg-type]
    return fake


WINDOW = ["--since", "2026-11-27", "--until", "2026-11-27T01:00:00Z"]


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["dl2", "train", *args])
    return result.exit_code, result.stdout, result.stderr


def test_cli_trains_on_sacct(tmp_path: Path, slurm: Slurm) -> None:
    out = tmp_path / "m.dl2"
    code, text, err = run("--out", str(out), "--teacher", "sacct", *WINDOW, *CLI_SMALL, "--json")
    assert code == 0, text + err
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["teacher"] == "sacct" and summary["supervised_samples"] == 11
    teacher = model_file.load(out).meta["teacher"]
    assert teacher["partition"] == "cpu"  # the PS-mode jobs' partition
    assert teacher["unknown_types"] == {"wide-deep": 1} and teacher["not_ps_jobs"] == 1
    assert teacher["samples"] == 11 and teacher["inexpressible_slots"] == 0
    sacct = [call for call in slurm.calls if call[0] == "sacct"]
    assert len(sacct) == 2 and all("--starttime=2026-11-27T00:00:00" in call for call in sacct)


def test_cli_bad_input_exits_2_and_writes_no_model(tmp_path: Path, slurm: Slurm) -> None:
    out = tmp_path / "m.dl2"
    for args, message in (
        (["--teacher", "slurm"], "unknown --teacher 'slurm': one of drf, optimus, sacct"),
        (["--teacher", "sacct"], "--teacher sacct needs --since"),
        (["--teacher", "sacct", "--since", "2999-01-01"], "--since 2999-01-01 is in the future"),
        (["--teacher", "sacct", "--since", "yesterday"], "not an ISO 8601 date"),
        (["--since", "2026-11-27"], "go with --teacher sacct"),
        (["--teacher", "sacct", *WINDOW, "--partition", "gpu"], "no usable samples in sacct history of partition gpu"),
        (["--teacher", "sacct", "--since", "2026-11-27T00:30", "--until", "2026-11-27T00:40"], "shorter than one"),
    ):
        code, text, err = run("--out", str(out), *args, *CLI_SMALL)
        assert code == 2 and message in err and not text, (args, text, err)
        assert len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_cli_on_captured_sacct_names_the_unknown_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dev cluster's accounting after a CI run: PS-mode jobs named after the tests, no DL² type among them."""
    data = SINFO.parent
    fake = Slurm(
        (data / "sacct_ps_history_parsable2.txt").read_text(),
        (data / "sacct_ps_step_times_parsable2.txt").read_text(),
    )
    monkeypatch.setattr("hpc_elastic.dl2.sacct.connect", lambda environment=None: CliSlurm(fake, use_json=True))  # type: ignore[arg-type]
    out = tmp_path / "m.dl2"
    code, text, err = run("--out", str(out), "--teacher", "sacct", "--since", "2026-11-27", *CLI_SMALL)
    assert code == 2 and not out.exists(), text + err
    assert "no usable samples in sacct history of partition cpu" in err  # the partition found from the jobs' steps
    assert "ps-mode-test (8)" in err and "0 PS-mode jobs of a DL² type" in err
