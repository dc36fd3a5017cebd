"""``hpc-elastic submit --mode ps``: the spec's checks (one line, exit 2, nothing submitted), the check against the
partition's cores, the batch script that starts the PS wrapper, and the wrapper's own options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import cli
from hpc_elastic.launch.batch import render_batch_script
from hpc_elastic.launch.spec import Mode, SubmitSpec, check_ps_fits, merge_layers, parse_range
from hpc_elastic.ps.allocation import parse_args
from hpc_elastic.ps.config import PsJobConfig

PS = ["--mode=ps", "--partition=cpu"]


def ps_spec(**values: object) -> SubmitSpec:
    return merge_layers(SubmitSpec(script=None), {"mode": "ps", **values})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--mode=tf", "--workers-range=1:2", "--ps-range=1:1"], "unknown --mode 'tf': one of est, ps"),
        (["--workers-range=3:2", "--ps-range=1:1"], "bad --workers-range 3:2"),
        (["--workers-range=-1:2", "--ps-range=1:1"], "bad --workers-range '-1:2'"),
        (["--workers-range=1:2", "--ps-range=0:1"], "bad --ps-range 0:1"),
        (["--workers-range=1:2", "--ps-range=2"], "bad --ps-range '2'"),
        (["--workers-range=1:99999999999999999999", "--ps-range=1:1"], "a PS-mode job runs at most 4096 of them"),
        (["--workers-range=1:2"], "--mode ps needs --workers-range A:B and --ps-range C:D"),
        (["--workers-range=1:2", "--ps-range=1:1", "--gpus=2"], "--mode ps runs on CPUs: --gpus 2 is refused"),
        (["--workers-range=1:2", "--ps-range=1:1", "--procs=3"], "--procs is refused with --mode ps"),
        (["--workers-range=1:2", "--ps-range=1:1", "--level=d2"], "--level is refused with --mode ps"),
    ],
)
def test_bad_ps_submit_is_one_line_and_exit_2(
    tmp_path: Path, options: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_SLURM_BACKEND", "cli")
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # nothing could be submitted
    mode = [] if any(o.startswith("--mode") for o in options) else ["--mode=ps"]
    result = CliRunner().invoke(cli, ["submit", f"--ckpt-root={tmp_path}", "--partition=cpu", *mode, *options])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("hpc-elastic: error: ")
    assert message in result.stderr and result.stdout == ""


def test_bad_ps_settings_file_is_named(tmp_path: Path) -> None:
    settings = tmp_path / "job.json"
    for text, message in (
        ('{"num_samples": -3}', "num_samples must be an integer >= 1, not -3"),
        ('{"worker_ballast_mb": -1}', "worker_ballast_mb must be an integer >= 0, not -1"),
        ('{"num_ps": 2}', "may not set num_ps: use --ps-range"),
        ("[1]", "must be a JSON object"),
        ('{"colour": 1}', "unknown PS job settings: ['colour']"),
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "the PS job's settings is not JSON: nested too deeply"),
    ):
        settings.write_text(text)
        args = ["submit", str(settings), f"--ckpt-root={tmp_path}", *PS, "--workers-range=1:1", "--ps-range=1:1"]
        result = CliRunner().invoke(cli, [*args, "--dry-run"])
        assert result.exit_code == 2 and message in result.stderr, (text[:80], result.output[-300:])
        assert len(result.stderr.splitlines()) == 1


def test_ranges_outside_ps_mode_are_refused() -> None:
    with pytest.raises(ValueError, match="need --mode ps"):
        merge_layers(SubmitSpec(script=Path("/x/train.py")), {"workers_range": "1:2"})


def test_the_allocation_holds_master_most_ps_and_most_workers() -> None:
    spec = ps_spec(workers_range="2:4", ps_range="1:3", cpus_per_worker=2, ps_config='{"epochs": 2}')
    assert spec.mode is Mode.PS and spec.gpus == 0
    assert spec.processes == 1 + 3 + 4 and spec.elastic_range == (8, 8)
    assert spec.ps_job_config() == PsJobConfig(num_ps=1, num_workers=4, epochs=2)
    assert spec.name == "ps"
    assert parse_range("2:5", "--x") == (2, 5)


def test_the_ps_must_fit_the_partitions_cores() -> None:
    cores = {"cpu": (8, 8), "gpu": (4,)}
    check_ps_fits(ps_spec(workers_range="4:4", ps_range="2:11", partition="cpu"), cores, "gpu")  # 16 of 16
    with pytest.raises(ValueError, match=r"--ps-range 2:17: 17 PS of 1 cores are more than partition cpu's 16 cores"):
        check_ps_fits(ps_spec(workers_range="1:1", ps_range="2:17", partition="cpu"), cores, "gpu")
    with pytest.raises(ValueError, match=r"need 18 cores; partition cpu has 16 \(2 nodes x 8 cores\)"):
        check_ps_fits(ps_spec(workers_range="3:3", ps_range="1:2", cpus_per_worker=3, partition="cpu"), cores, None)
    with pytest.raises(ValueError, match="--cpus-per-worker 5 is more than a node of partition gpu has"):
        check_ps_fits(ps_spec(workers_range="1:1", ps_range="1:1", cpus_per_worker=5), cores, "gpu")
    with pytest.raises(ValueError, match="no partition 'big'"):
        check_ps_fits(ps_spec(workers_range="1:1", ps_range="1:1", partition="big"), cores, "gpu")


def test_the_batch_script_starts_the_ps_wrapper_in_the_allocation() -> None:
    spec = ps_spec(
        workers_range="2:3", ps_range="1:2", partition="cpu", ckpt_root=Path("/g/jobs"), ps_config='{"epochs": 2}'
    )
    text = render_batch_script(spec, ["/py", "/w/hpc-elastic-run"])
    assert "#SBATCH --ntasks=6" in text and "#SBATCH --mem-per-cpu=1024" in text
    assert "--gpus-per-task" not in text
    run = text.splitlines()[-1]
    assert run.startswith("exec /py /w/hpc-elastic-run --mode=ps --ckpt-root=/g/jobs --workers-range=2:3")
    assert "--ps-range=1:2 --cpus-per-worker=1" in run and """'--ps-config={"epochs":2}'""" in run
    words = [*run.split()[3:-1], '--ps-config={"epochs":2}']
    config = parse_args(words)
    assert (config.workers_range, config.ps_range, config.ckpt_root) == ((2, 3), (1, 2), Path("/g/jobs"))
    assert config.job_config() == PsJobConfig(num_ps=1, num_workers=3, epochs=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ckpt-root=/g"], "usage"),
        (["--mode=ps", "--ckpt-root=/g", "--ps-range=1:1"], "--workers-range is required"),
        (["--mode=ps", "--ckpt-root=/g", "--ps-range=1:1", "--workers-range=1:1", "--ps=3"], "unknown or incomplete"),
        (["--mode=ps", "--ckpt-root=/g", "--ps-range=1:1", "--workers-range=1:1", "--ps-config=[]"], "JSON object"),
    ],
)
def test_bad_wrapper_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_settings_json_round_trips_compactly(tmp_path: Path) -> None:
    settings = tmp_path / "small.json"
    settings.write_text(json.dumps({"num_samples": 300, "seed": 4}, indent=2))
    args = ["submit", str(settings), f"--ckpt-root={tmp_path}", *PS, "--workers-range=1:2", "--ps-range=1:1"]
    result = CliRunner().invoke(cli, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --job-name=small" in result.stdout
    assert """'--ps-config={"num_samples":300,"seed":4}'""" in result.stdout


def test_brain_chooses_only_where_a_range_leaves_a_choice() -> None:
    fixed = parse_args(["--mode=ps", "--ckpt-root=/g", "--workers-range=3:3", "--ps-range=2:2"])
    assert fixed.brain() is None
    ranged = parse_args(["--mode=ps", "--ckpt-root=/g", "--workers-range=1:4", "--ps-range=1:2", "--cpus-per-worker=2"])
    agent = ranged.brain()
    assert agent is not None and agent.cores == (4 + 2) * 2
    first = agent.initial_plan()
    assert first.workers.count == 1 and first.workers.cores <= 2 and max(first.ps_cores) <= 2
    assert first.num_ps == 2 and first.total_cores <= agent.cores


def test_a_ps_jobs_time_limit_requeues_and_ranges_reach_the_wrapper_and_the_marker() -> None:
    spec = ps_spec(workers_range="1:4", ps_range="1:2", cpus_per_worker=2, max_requeues=3, partition="cpu")
    text = render_batch_script(spec, ["/py", "/w/hpc-elastic-run"])
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@" in text
    assert "ps_workers=1-4,ps_servers=1-2,cpw=2" in text  # the daemon and hpc-elastic scale read the ranges here
    run = text.splitlines()[-1].split()[3:]
    assert "--max-requeues=3" in run and parse_args(run).max_requeues == 3
