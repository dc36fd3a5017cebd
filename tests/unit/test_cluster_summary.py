"""The per-partition summary behind ``hpc-elastic cluster status``, from captured cluster output."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from hpc_elastic.cli import cluster as cluster_cli
from hpc_elastic.cli import main as cli_main
from hpc_elastic.cluster import summarize
from hpc_elastic.slurm import parse
from hpc_elastic.slurm.errors import SlurmUnavailable


def load(slurm_data: Path) -> tuple[list, list, list]:  # type: ignore[type-arg]
    parts = parse.parse_scontrol_partitions((slurm_data / "scontrol_show_partition.txt").read_text())
    nodes = parse.parse_sinfo_json((slurm_data / "sinfo_busy.json").read_text())
    jobs = parse.parse_squeue_json((slurm_data / "squeue_pending.json").read_text())
    return parts, nodes, jobs


def test_summary_counts(slurm_data: Path) -> None:
    parts, nodes, jobs = load(slurm_data)
    s = summarize(parts, nodes, jobs)
    assert s.nodes == 6 and s.gpus_total.as_dict() == {"a100": 8, "v100": 8}
    by_name = {p.name: p for p in s.partitions}
    a100 = by_name["gpu-a100"]
    assert a100.gpus_total.as_dict() == {"a100": 8} and a100.gpus_free.total == 0  # job 6 holds all 8
    assert a100.jobs_running == 1 and a100.jobs_pending == 1
    assert by_name["gpu"].gpus_free.as_dict() == {"v100": 8}
    assert by_name["cpu"].jobs_running == 2 and by_name["cpu"].gpus_total.total == 0
    js = s.to_json()
    assert js["gpus_total"] == {"a100": 8, "v100": 8}
    assert js["partitions"][0]["name"] == "gpu" and js["partitions"][0]["default"] is True


class StubClient:
    def __init__(self, slurm_data: Path, fail: bool = False) -> None:
        self.data = load(slurm_data)
        self.fail = fail

    def partitions(self) -> list:  # type: ignore[type-arg]
        if self.fail:
            raise SlurmUnavailable("scontrol: Slurm is not reachable: Unable to contact slurm controller")
        return self.data[0]

    def nodes(self) -> list:  # type: ignore[type-arg]
        return self.data[1]

    def jobs(self) -> list:  # type: ignore[type-arg]
        return self.data[2]


def test_cli_status_json_and_table(slurm_data: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cluster_cli, "connect", lambda env: StubClient(slurm_data))
    runner = CliRunner()
    out = runner.invoke(cli_main.cli, ["cluster", "status", "--json"])
    assert out.exit_code == 0, out.output
    assert '"a100": 8' in out.output
    table = runner.invoke(cli_main.cli, ["cluster", "status"])
    assert table.exit_code == 0 and "gpu-a100" in table.output and "node6" in table.output


def test_cli_unreachable_is_one_line_exit_2(slurm_data: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cluster_cli, "connect", lambda env: StubClient(slurm_data, fail=True))
    out = CliRunner().invoke(cli_main.cli, ["cluster", "status"])
    assert out.exit_code == 2
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpc-elastic: error: ") and "not reachable" in lines[0]
