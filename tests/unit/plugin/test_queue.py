"""``hpc-elastic queue [--json]`` over the state a daemon pass wrote."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from click.testing import CliRunner

from hpc_elastic.cli.main import cli
from hpc_elastic.slurm import Job, Node
from slurm_plugin.config import parse_config
from tests.unit.plugin.conftest import at, start_of
from tests.unit.plugin.test_daemon import PREEMPTING, FakeSlurm, make


def _config_file(tmp_path: Path, state: Path) -> Path:
    path = tmp_path / "sched.toml"
    path.write_text(
        f'state_dir = "{state}"\nckpt_roots = ["{tmp_path / "jobs"}"]\n[preemption]\nmin_run_time_s = 30\n'
        "[tiresias]\nthresholds = [100.0]\n"
    )
    return path


def test_queue_shows_the_last_pass(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    jobs, nodes = busy
    state = tmp_path / "state"
    state.mkdir()
    path = _config_file(tmp_path, state)
    cfg = parse_config({"state_dir": str(state), "ckpt_roots": [str(tmp_path / "jobs")], **PREEMPTING})
    (tmp_path / "jobs" / "fill|a100-24" / "control").mkdir(parents=True)
    daemon, _ = make(cfg, FakeSlurm(jobs, nodes), at(start_of(jobs, 24), 60))
    daemon.run_pass()
    out = CliRunner().invoke(cli, ["queue", "--config", str(path), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    by_id = {job["job_id"]: job for job in doc["jobs"]}
    assert set(by_id) == {24, 25}
    assert by_id[25]["rank"] == 1 and by_id[24]["rank"] == 2  # 24 was demoted to Q2 (queue index 1)
    assert by_id[24]["queue"] == 1 and by_id[24]["attained_gpu_s"] == 480.0 and by_id[24]["in_flight"] == "preempt"
    assert by_id[24]["planned"] == "preempt" and by_id[25]["planned"] == "order"
    table = CliRunner().invoke(cli, ["queue", "--config", str(path)])
    assert table.exit_code == 0 and "fill|a100" in table.output and "waiter" in table.output
    assert "PACKLIMIT 0.5 (0 placement reports)" in table.output  # the configured one: no job reported a speed


def test_queue_errors_exit_2_with_the_reason(tmp_path: Path) -> None:
    missing = CliRunner().invoke(cli, ["queue", "--config", str(_config_file(tmp_path, tmp_path))])
    assert missing.exit_code == 2 and "no daemon state in" in missing.output
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "state.json").write_text('{"jobs": [{"job_id": 1}]}')
    out = CliRunner().invoke(cli, ["queue", "--config", str(_config_file(tmp_path, incomplete))])
    assert out.exit_code == 2 and "a job entry lacks name, state, gpus, queue, attained_gpu_s" in out.output
    (incomplete / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    out = CliRunner().invoke(cli, ["queue", "--config", str(_config_file(tmp_path, incomplete))])
    assert out.exit_code == 2 and out.stderr.endswith("state.json is not JSON: nested too deeply\n")
    bad = tmp_path / "bad.toml"
    bad.write_text(f'state_dir = "{tmp_path}"\ninterval_s = -1\nfrobnicate = 1\n')
    out = CliRunner().invoke(cli, ["queue", "--config", str(bad)])
    assert out.exit_code == 2
    assert "interval_s" in out.output and "unknown key 'frobnicate'" in out.output


def test_queue_lists_a_held_managed_job_without_rank(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    """A managed job the policy does not see (held) is listed with its reason, its record, and no rank or wait."""
    jobs, nodes = busy
    waiter = next(j for j in jobs if j.job_id == 25)
    held = dataclasses.replace(waiter, job_id=26, pending_reason="JobHeldUser")
    state = tmp_path / "state"
    state.mkdir()
    path = _config_file(tmp_path, state)
    cfg = parse_config({"state_dir": str(state), "ckpt_roots": [str(tmp_path / "jobs")], **PREEMPTING})
    daemon, _ = make(cfg, FakeSlurm([*jobs, held], nodes), at(start_of(jobs, 24), 60))
    daemon.run_pass()
    out = CliRunner().invoke(cli, ["queue", "--config", str(path), "--json"])
    assert out.exit_code == 0, out.output
    by_id = {job["job_id"]: job for job in json.loads(out.output)["jobs"]}
    assert set(by_id) == {24, 25, 26}
    row = by_id[26]
    assert row["state"] == "pending (JobHeldUser)" and row["rank"] is None and row["waiting_s"] is None
    assert row["gpus"] == waiter.gpu_count and row["attained_gpu_s"] == 0.0 and row["planned"] == ""
    assert by_id[25]["rank"] == 1 and by_id[25]["waiting_s"] is not None


def test_queue_prints_job_names_as_plain_text(tmp_path: Path, busy: tuple[list[Job], list[Node]]) -> None:
    """A user's job name is neither rich markup (``[/]`` would fail the view for everyone, ``[link=...]`` would
    put hyperlinks into an admin's terminal) nor terminal escapes."""
    jobs, nodes = busy
    hostile = "wait[/]er[link=https://evil.example]x[/link]\x1b[5;31m\nz"
    jobs = [dataclasses.replace(j, name=hostile) if j.job_id == 25 else j for j in jobs]
    state = tmp_path / "state"
    state.mkdir()
    path = _config_file(tmp_path, state)
    cfg = parse_config({"state_dir": str(state), "ckpt_roots": [str(tmp_path / "jobs")], **PREEMPTING})
    daemon, _ = make(cfg, FakeSlurm(jobs, nodes), at(start_of(jobs, 24), 60))
    daemon.run_pass()
    table = CliRunner().invoke(cli, ["queue", "--config", str(path)])
    assert table.exit_code == 0, table.output
    assert "wait[/]er[link=https://evil.example]x[/link]?[5;31m?z" in table.output.replace("\n", "")
    assert "\x1b" not in table.output
