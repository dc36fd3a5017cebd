"""``hpc-elastic submit`` bad input: one line on stderr, exit code 2, nothing submitted (no Slurm is reached)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import cli


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("#!/usr/bin/env python3\n#SBATCH --account=root\nprint('hi')\n")
    return path


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--sbatch-arg=--ntasks=8"], "sbatch option --ntasks is refused: the tasks follow --gpus / --procs"),
        (["--sbatch-arg=-J other"], "sbatch option --job-name is refused: use hpc-elastic submit --job-name"),
        (["--sbatch-arg=--begin=now --hold"], "--sbatch-arg takes one sbatch option"),
        (["--array=0-3", "--gpus=2", "--max-gpus=4"], "--array needs a fixed size, got the elastic range 2-4 GPUs"),
        (["--array=0-3", "--dependency=singleton"], "--array with --dependency=singleton runs the tasks one after"),
        (["--array=3-1"], "bad --array '3-1'"),
        (["--mem=1G", "--mem-per-cpu=1G"], "--mem and --mem-per-cpu exclude each other"),
        (["--account=a;b"], "bad --account 'a;b'"),
        (["--balance=fast"], "balance mode must be one of none, est, lbbsp, got 'fast'"),
        (["--balance=est", "--level=d0"], "balance mode est needs determinism level d1 or d2"),
        (["--gpus=20000"], "--gpus must be at most 16384, got 20000"),
        (["--workers=99999999"], "--workers must be at most 16384, got 99999999"),
    ],
)
def test_bad_submit_is_one_line_and_exit_2(
    script: Path, tmp_path: Path, options: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_SLURM_BACKEND", "cli")
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # nothing could be submitted
    root = tmp_path / "jobs"
    result = CliRunner().invoke(cli, ["submit", str(script), f"--ckpt-root={root}", *options])
    assert result.exit_code == 2 and not root.exists()
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("hpc-elastic: error: ")
    assert message in result.stderr and result.stdout == ""


def test_dry_run_shows_the_script_sbatch_lines_translated(script: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "submit",
            str(script),
            f"--ckpt-root={tmp_path}",
            "--gpus=0",
            "--dry-run",
            "--sbatch-arg=-x node1",
            "-q",
            "normal",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --account=root" in lines and "#SBATCH --qos=normal" in lines
    assert lines[-1] == "#SBATCH --exclude=node1"


def test_a_refused_submit_leaves_no_checkpoint_root_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('hi')\n")  # no --account: the first Slurm command is sbatch
    monkeypatch.setenv("HPC_ELASTIC_SLURM_BACKEND", "cli")
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # sbatch not found: refused after the checks
    root = tmp_path / "gpfs" / "jobs"
    result = CliRunner().invoke(cli, ["submit", str(script), f"--ckpt-root={root}", "--gpus=0"])
    assert result.exit_code == 2 and "sbatch not found" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "gpfs").exists()  # neither the root nor its parent, both made for this submit
    root.mkdir(parents=True)
    (root / "earlier-job").mkdir()
    result = CliRunner().invoke(cli, ["submit", str(script), f"--ckpt-root={root}", "--gpus=0"])
    assert result.exit_code == 2 and [p.name for p in root.iterdir()] == ["earlier-job"]  # what was there stays
