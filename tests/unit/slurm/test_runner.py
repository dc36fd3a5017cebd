"""Error mapping, retries and backoff of the command runner, with an injected executor."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.slurm.errors import JobNotFound, PermissionDenied, SlurmCommandError, SlurmUnavailable
from hpc_elastic.slurm.parse import parse_squeue_json
from hpc_elastic.slurm.runner import RetryPolicy, Runner, backoff_delays, classify, spawn


class FakeExecute:
    """Replays a list of outcomes: a (returncode, stdout, stderr) tuple or an exception to raise."""

    def __init__(self, outcomes: Sequence[Any]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append({"argv": argv, **kwargs})
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        code, out, err = outcome
        if code and kwargs.get("check"):
            raise subprocess.CalledProcessError(code, argv, out, err)
        return subprocess.CompletedProcess(argv, code, out, err)


def runner(outcomes: Sequence[Any], attempts: int = 3) -> tuple[Runner, FakeExecute, list[float]]:
    fake = FakeExecute(outcomes)
    sleeps: list[float] = []
    return Runner(10.0, RetryPolicy(attempts, 1.0, 4.0), fake, sleeps.append, random.Random(1)), fake, sleeps


def test_success_runs_argv_without_shell_and_with_timeout_and_utc() -> None:
    run, fake, _ = runner([(0, "ok\n", "")])
    result = run.run(["squeue", "--json"])
    assert result.stdout == "ok\n" and result.argv == ("squeue", "--json")
    call = fake.calls[0]
    assert call["argv"] == ["squeue", "--json"] and call["shell"] is False and call["timeout"] == 10.0
    assert call["env"]["TZ"] == "UTC" and call["env"]["SLURM_TIME_FORMAT"] == "standard"


@pytest.mark.parametrize(
    ("stderr", "error"),
    [
        ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", SlurmUnavailable),
        ("scontrol: error: Invalid job id specified", JobNotFound),
        ("scontrol_update_job error: Access/permission denied", PermissionDenied),
        ("sbatch: error: Batch job submission failed: Invalid partition name specified", SlurmCommandError),
    ],
)
def test_classify(stderr: str, error: type[Exception]) -> None:
    found = classify(["scontrol", "x"], 1, stderr)
    assert type(found) is error


def test_ping_of_a_down_controller_is_unavailable() -> None:
    found = classify(["scontrol", "ping"], 1, "", "Slurmctld(primary) at vm is DOWN\n")
    assert isinstance(found, SlurmUnavailable)


def test_scancel_invalid_job_with_exit_zero_is_not_found() -> None:
    stderr = "scancel: error: Kill job error on job id 99: Invalid job id specified"
    assert isinstance(classify(["scancel", "99"], 0, stderr), JobNotFound)
    assert classify(["squeue"], 0, "warning: Invalid job id in cache") is None


def test_command_error_is_chained_and_carries_argv_and_stderr() -> None:
    run, _, sleeps = runner([(1, "", "scontrol: error: Invalid job id specified\n")])
    with pytest.raises(JobNotFound) as info:
        run.run(["scontrol", "requeue", "99"])
    assert info.value.argv == ("scontrol", "requeue", "99")
    assert "Invalid job id" in info.value.stderr and info.value.returncode == 1
    assert isinstance(info.value.__cause__, subprocess.CalledProcessError)
    assert sleeps == []  # not retried


def test_unavailable_is_retried_then_succeeds() -> None:
    down = (1, "", "Unable to contact slurm controller (connect failure)")
    run, fake, sleeps = runner([down, down, (0, "1\n", "")])
    assert run.run(["squeue"]).stdout == "1\n"
    assert len(fake.calls) == 3 and len(sleeps) == 2


def test_unavailable_after_all_attempts() -> None:
    down = (1, "", "Unable to contact slurm controller (connect failure)")
    run, fake, sleeps = runner([down, down, down])
    with pytest.raises(SlurmUnavailable, match="not reachable"):
        run.run(["squeue"])
    assert len(fake.calls) == 3 and len(sleeps) == 2


def test_timeout_of_a_write_is_not_retried() -> None:
    run, fake, _ = runner([subprocess.TimeoutExpired(["sbatch"], 10.0)])
    with pytest.raises(SlurmUnavailable, match="did not answer within 10s") as info:
        run.run(["sbatch", "--parsable"], stdin="#!/bin/sh\n", idempotent=False)
    assert isinstance(info.value.__cause__, subprocess.TimeoutExpired) and len(fake.calls) == 1
    assert fake.calls[0]["input"] == "#!/bin/sh\n"


def test_timeout_of_a_read_is_retried() -> None:
    run, fake, _ = runner([subprocess.TimeoutExpired(["squeue"], 10.0), (0, "", "")])
    run.run(["squeue"])
    assert len(fake.calls) == 2


def test_missing_binary_is_unavailable_at_once() -> None:
    run, fake, _ = runner([FileNotFoundError("squeue")])
    with pytest.raises(SlurmUnavailable, match="not found"):
        run.run(["squeue"])
    assert len(fake.calls) == 1


def test_backoff_is_capped_exponential_with_jitter() -> None:
    policy = RetryPolicy(attempts=8, base_s=0.5, cap_s=4.0)
    delays = list(backoff_delays(policy, random.Random(0)))
    assert len(delays) == 7
    caps = [min(4.0, 0.5 * 2**k) for k in range(7)]
    assert all(0.0 <= d <= cap for d, cap in zip(delays, caps, strict=True))
    assert delays == list(backoff_delays(policy, random.Random(0)))  # reproducible for a given rng
    assert len(set(delays)) == 7  # jittered, not a fixed ladder
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="base <= cap"):
        RetryPolicy(base_s=5, cap_s=1)


def test_output_that_is_not_utf8_is_read_with_replacements(slurm_data: Path) -> None:
    """squeue --json of Slurm 22.05 passes a job name's bytes through as they are (captured: a name and a comment
    with byte 0xff); the real executor reads them with U+FFFD instead of failing the daemon's pass."""
    path = slurm_data / "squeue_hostile_name.json"
    assert b"\xff" in path.read_bytes()
    out = Runner(10.0).run(["cat", str(path)]).stdout
    jobs = {job.job_id: job for job in parse_squeue_json(out)}
    assert jobs[1392].name == "pay\ufffdload\nname|x" and jobs[1392].comment == "hpc-elastic:v=1\ufffd|y"
    assert jobs[1386].name == "nl\nname|x" and jobs[1389].name == "ls\u2028x"  # (JSON escapes, and UTF-8 as is)


def test_spawn_starts_a_step_with_its_output_and_its_own_process_group(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    with log.open("ab") as out:
        proc = spawn(["sh", "-c", "echo out; echo err >&2; ps -o pgid= -p $$"], {"PATH": "/usr/bin:/bin"}, output=out)
    assert proc.wait(timeout=30) == 0
    lines = log.read_text().split()
    assert lines[:2] == ["out", "err"] and int(lines[2]) == proc.pid  # the leader of its own group
    inherited = spawn(["sh", "-c", "exit 0"], new_session=False, cwd=str(tmp_path))
    assert inherited.wait(timeout=30) == 0
    with pytest.raises(SlurmUnavailable, match="no-such-srun not found"):
        spawn(["no-such-srun", "--version"])
