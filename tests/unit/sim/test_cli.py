"""``hpc-elastic simulate`` end to end (click runner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import cli
from hpc_elastic.cli.simulate import _clean
from hpc_elastic.policy import POLICY_NAMES
from tests.unit.sim.helpers import TRACES, needs_traces

KEYS = {
    "avg_jct",
    "median_jct",
    "p95_jct",
    "p99_jct",
    "avg_queue_delay",
    "max_queue_delay",
    "makespan",
    "preemptions",
    "utilization",
}


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.csv"
    rows = ["job_id,num_gpu,submit_time,iterations,model_name,duration,interval"]
    rows += [
        f"{i},{[1, 2, 4][i % 3]},{i * 7},0,{['vgg16', 'resnet50'][i % 2]},{30 + 11 * (i % 5)},7" for i in range(25)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_json_has_every_policy_and_metric(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(
        cli, ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster", "2x4", "--json"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(payload) == list(POLICY_NAMES)
    for metrics in payload.values():
        assert set(metrics) >= KEYS
        assert metrics["finished"] == metrics["jobs"] == 25
        assert 0 < metrics["utilization"] <= 1


def throughputs(tmp_path: Path) -> Path:
    """A Gavel-style throughputs file: ResNet-50 scales 1.8x on 2 GPUs and 3x on 4 (Recommendation: 1 GPU only)."""
    path = tmp_path / "throughputs.json"
    table = {
        "('ResNet-50 (batch size 64)', 1)": {"null": 10.0},
        "('ResNet-50 (batch size 64)', 2)": {"null": 18.0},
        "('ResNet-50 (batch size 64)', 4)": {"null": 30.0},
        "('Recommendation (batch size 2048)', 1)": {"null": 5.0},
    }
    path.write_text(json.dumps({"v100": table}))
    return path


def test_reference_model_and_elastic_jobs(runner: CliRunner, tmp_path: Path) -> None:
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster", "2x4", "--json"]
    policies = ["--policy", "tiresias-las", "--policy", "tiresias-las+elastic"]
    reference = runner.invoke(cli, [*args, *policies, "--model", "reference"])
    assert reference.exit_code == 0, reference.output
    assert json.loads(reference.stdout)["tiresias-las"]["preemption_cost"] == 0.0
    elastic = runner.invoke(cli, [*args, *policies, "--elastic", "2", "--throughputs", str(throughputs(tmp_path))])
    assert elastic.exit_code == 0, elastic.output
    metrics = json.loads(elastic.stdout)
    assert metrics["tiresias-las"]["resizes"] == 0 < metrics["tiresias-las+elastic"]["resizes"]
    assert metrics["tiresias-las+elastic"]["finished"] == 25


def test_heterogeneous_cluster_with_speeds_per_type(runner: CliRunner, tmp_path: Path) -> None:
    speeds = {"v100": 1.0, "p100": 0.6, "k80": 0.3}
    table = {
        t: {
            "('ResNet-50 (batch size 64)', 1)": {"null": 10.0 * f},
            "('ResNet-50 (batch size 64)', 2)": {"null": 18.0 * f},
            "('Recommendation (batch size 2048)', 1)": {"null": 5.0 * f},
        }
        for t, f in speeds.items()
    }
    path = tmp_path / "throughputs.json"
    path.write_text(json.dumps(table))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("name,gpus,gpu_type\nv0,4,v100\nk0,4,k80\n")
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster-file", str(nodes)]
    args += ["--elastic", "2", "--throughputs", str(path), "--requested-type", "v100", "--json"]
    result = runner.invoke(cli, [*args, "--policy", "easyscale-heter", "--policy", "easyscale-homo"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert metrics["easyscale-heter"]["finished"] == metrics["easyscale-homo"]["finished"] == 25
    assert metrics["easyscale-heter"]["resizes"] > 0
    wrong = runner.invoke(cli, [*args[:-3], "--requested-type", "t4"])
    assert wrong.exit_code == 2 and "'t4'" in wrong.stderr
    alone = runner.invoke(cli, [*args[:7], "--requested-type", "v100"])
    assert alone.exit_code == 2 and "needs --elastic and --throughputs" in alone.stderr
    held = runner.invoke(cli, [*args, "--policy", "easyscale-heter", "--fallback-hold", "60"])
    assert held.exit_code == 0, held.output
    bad = runner.invoke(cli, [*args, "--policy", "easyscale-heter", "--fallback-hold", "-1"])
    assert bad.exit_code == 2 and "fallback_hold" in bad.stderr


def test_repeated_policy_and_knobs_and_plot(runner: CliRunner, tmp_path: Path) -> None:
    png = tmp_path / "cdf.png"
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster", "1x4"]
    args += ["--policy", "fifo", "--policy", "tiresias-las", "--queues", "100,500", "--promote-knob", "4"]
    args += ["--load-scale", "2", "--json", "--plot", str(png)]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)) == ["fifo", "tiresias-las"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output(runner: CliRunner, tmp_path: Path) -> None:
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster", "2x4", "--policy", "srtf"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0 and "srtf" in result.stdout and "avg JCT" in result.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cluster", "2y4"], "cluster must look like NODESxGPUS"),
        (["--cluster", "2x4", "--queues", "100,abc"], "'abc'"),
        (["--cluster", "2x4", "--queues", "500,100"], "increasing"),
        (["--cluster", "2x4", "--load-scale", "0"], "load scale"),
        (["--cluster", "2x4", "--format", "pollux"], "header lacks"),
        (["--cluster", "2x4", "--elastic", "0.5"], "elastic factor"),
        (["--cluster", "2x4", "--throughputs", "t.json"], "needs --elastic"),
        (["--cluster", "2x4", "--min-history", "-1"], "min_history"),
        (["--cluster", "2x4", "--elastic", "2", "--throughputs", "/nonexistent.json"], "cannot read throughputs"),
        (["--cluster", "2x4", "--plot", "jct.txt"], "--plot 'jct.txt' must be an image file name ending in .png"),
        (["--cluster", "2x4", "--plot", "/nonexistent/jct.png"], "directory '/nonexistent' does not exist"),
    ],
)
def test_errors_are_one_line_exit_2(runner: CliRunner, tmp_path: Path, extra: list[str], message: str) -> None:
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", *extra]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cluster_and_cluster_file_exclusive(runner: CliRunner, tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("name,gpus\na,4\n")
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias"]
    assert runner.invoke(cli, [*args, "--cluster", "1x4", "--cluster-file", str(nodes)]).exit_code == 2
    assert runner.invoke(cli, args).exit_code == 2
    assert runner.invoke(cli, [*args, "--cluster-file", str(nodes), "--policy", "fifo"]).exit_code == 0


def test_malformed_row_names_line_and_skip(runner: CliRunner, tmp_path: Path) -> None:
    path = trace(tmp_path)
    path.write_text(path.read_text() + "99,x,5,0,vgg16,10,0\n")
    args = ["simulate", "--trace", str(path), "--format", "tiresias", "--cluster", "2x4", "--policy", "fifo"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2 and ":27: column 'num_gpu' must be an integer, got 'x'" in result.stderr
    result = runner.invoke(cli, [*args, "--skip-bad-rows", "--json"])
    assert result.exit_code == 0 and "1 malformed row(s) skipped" in result.stderr


@needs_traces
def test_shared_tiresias_trace(runner: CliRunner) -> None:
    args = ["simulate", "--trace", str(TRACES / "tiresias_60_job.csv"), "--format", "tiresias", "--cluster", "15x4"]
    result = runner.invoke(
        cli, [*args, "--policy", "tiresias-gittins", "--history", str(TRACES / "tiresias_yarn-gput1000.csv"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tiresias-gittins"]["finished"] == 60


def test_refit_pack_limit_reported(runner: CliRunner, tmp_path: Path) -> None:
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster", "2x4"]
    result = runner.invoke(cli, [*args, "--policy", "tiresias-las", "--refit-pack-limit", "--json"])
    assert result.exit_code == 0, result.output
    assert "tiresias-las: PACKLIMIT 0.5 ->" in result.stderr
    assert json.loads(result.stdout)["tiresias-las"]["finished"] == 25


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--promote-knob", "-1"], "PROMOTEKNOB"),
        (["--starve-limit", "0"], "starve_limit"),
        (["--pack-limit", "nan"], "PACKLIMIT"),
        (["--bandwidth", "0"], "bandwidth"),
        (["--time-slice", "0"], "time_slice"),
        (["--policy", "lottery"], "lottery"),
        (["--format", "csv"], "csv"),
        (["--starve-limit", "abc"], "'abc' is not a valid float"),
        (["--load-scale"], "Option '--load-scale' requires an argument"),
        (["--cluster-size", "4"], "No such option '--cluster-size'"),
    ],
)
def test_bad_knobs_are_one_line_exit_2(runner: CliRunner, tmp_path: Path, extra: list[str], message: str) -> None:
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster", "2x4", *extra]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_starve_limit_bounds_the_wait_of_a_job_a_stream_overtakes(runner: CliRunner, tmp_path: Path) -> None:
    """A 4-GPU job behind a stream of 1-GPU jobs (one every 30 s, 100 s each, on 4 GPUs) waits until the stream
    ends under 2D-LAS; with ``--starve-limit 600`` it starts once it has waited 600 s."""
    path = tmp_path / "stream.csv"
    rows = ["job_id,num_gpu,submit_time,iterations,model_name,duration,interval", "big,4,5,0,resnet50,100,0"]
    rows += [f"s{i},1,{30 * i},0,resnet50,100,0" for i in range(60)]
    path.write_text("\n".join(rows) + "\n")
    args = ["simulate", "--trace", str(path), "--format", "tiresias", "--cluster", "1x4", "--policy", "tiresias-las"]
    waits = {}
    for limit in ("inf", "600"):
        result = runner.invoke(cli, [*args, "--starve-limit", limit, "--json"])
        assert result.exit_code == 0, result.output
        waits[limit] = json.loads(result.stdout)["tiresias-las"]["max_queue_delay"]
    assert waits["inf"] > 30 * 59 - 5
    assert waits["600"] == pytest.approx(600.0)


def test_jobs_larger_than_the_cluster_are_named_on_stderr(runner: CliRunner, tmp_path: Path) -> None:
    """Twelve 8-GPU jobs on a 1x4 cluster: the count, the first ten names (a trace's names are shown as they are,
    never read as markup) and how many more."""
    path = tmp_path / "big.csv"
    rows = ["job_id,num_gpu,submit_time,iterations,model_name,duration,interval", "ok,1,0,0,vgg16,30,7"]
    rows += [f"b[red]{i}[/],8,{i},0,vgg16,30,7" for i in range(12)]
    path.write_text("\n".join(rows) + "\n")
    args = ["simulate", "--trace", str(path), "--format", "tiresias", "--cluster", "1x4", "--policy", "fifo", "--json"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    names = ", ".join(f"b[red]{i}[/]" for i in range(10))
    assert (
        f"12 job(s) need more GPUs than any pool of a GPU type they may use has, and were left out: {names} and 2 more"
        in result.stderr
    )
    assert json.loads(result.stdout.strip().splitlines()[-1])["fifo"]["finished"] == 1


def test_times_past_the_replay_horizon_and_huge_elastic_factors_are_one_line(runner: CliRunner, tmp_path: Path) -> None:
    """A duration of 1e308 s made a job's end overflow to infinity (a traceback), a load scale of 1e-300 the
    arrivals, and ``--elastic 1e9`` built a table of a billion ESTs per job (24 GB before the OOM killer)."""
    head = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval"
    cases = {
        "long.csv": ([head, "a,1,0,0,vgg16,100,0", "b,1,5,0,vgg16,1e308,0"], [], "long.csv:3: duration 1e+308 s"),
        "late.csv": ([head, "a,1,0,0,vgg16,100,0", "b,1,2e9,0,vgg16,5,0"], [], "late.csv:3: job 'b' arrives 2e+09 s"),
        "scaled.csv": (
            [head, "a,1,0,0,vgg16,100,0", "b,1,10,0,vgg16,5,0"],
            ["--load-scale", "1e-300"],
            "at load scale",
        ),
        "elastic.csv": (
            [head, "a,1,0,0,vgg16,100,0"],
            ["--elastic", "1e9"],
            "elastic factor must be a number in [1, 64]",
        ),
        "ests.csv": ([head, "a,512,0,0,vgg16,100,0"], ["--elastic", "64"], "would run 32768 ESTs"),
    }
    for name, (rows, extra, message) in cases.items():
        path = tmp_path / name
        path.write_text("\n".join(rows) + "\n")
        args = ["simulate", "--trace", str(path), "--format", "tiresias", "--cluster", "1x4", "--policy", "fifo"]
        result = runner.invoke(cli, [*args, *extra])
        assert result.exit_code == 2, (name, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_replay_that_cannot_end_and_a_trace_of_only_dropped_jobs_are_one_line(
    runner: CliRunner, tmp_path: Path
) -> None:
    path = tmp_path / "pair.csv"
    path.write_text("job_id,num_gpu,submit_time,iterations,model_name,duration,interval\na,4,0,1,vgg19,100,0\n"
                    "b,4,0,1,vgg19,100,0\n")  # fmt: skip
    args = ["simulate", "--trace", str(path), "--format", "tiresias", "--policy", "tiresias-las", "--json"]
    stalled = runner.invoke(cli, [*args, "--cluster", "1x4", "--queues", "2", "--promote-knob", "1"])
    assert stalled.exit_code == 2 and "preempted job 'a' 1000 times in a row" in stalled.stderr
    assert len(stalled.stderr.strip().splitlines()) == 1
    small = runner.invoke(cli, [*args, "--cluster", "1x2"])
    assert small.exit_code == 2 and "every job of pair.csv needs more GPUs" in small.stderr


def test_json_metrics_are_finite_or_null() -> None:
    assert _clean(float("inf")) is None and _clean(float("-inf")) is None and _clean(float("nan")) is None
    assert _clean(2.5) == 2.5


def test_numbers_in_traces_and_cluster_files_are_plain_ascii(runner: CliRunner, tmp_path: Path) -> None:
    """Python's int and float take ``1_0``, full-width and Arabic-Indic digits: a trace or cluster file holding
    them is one line naming the row, as for any other malformed number."""
    head = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval"
    for value, column in (("1_0", "num_gpu"), ("\uff11", "num_gpu"), ("\u0663", "num_gpu"), ("1_00", "duration")):
        row = f"a,{value},0,0,vgg16,100,0" if column == "num_gpu" else f"a,1,0,0,vgg16,{value},0"
        path = tmp_path / "t.csv"
        path.write_text(f"{head}\n{row}\n", encoding="utf-8")
        args = ["simulate", "--trace", str(path), "--format", "tiresias", "--cluster", "1x4", "--policy", "fifo"]
        result = runner.invoke(cli, args)
        assert result.exit_code == 2 and f"t.csv:2: column '{column}' must be" in result.stderr, result.output
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("name,gpus\nn1,\uff14\n", encoding="utf-8")
    args = ["simulate", "--trace", str(trace(tmp_path)), "--format", "tiresias", "--cluster-file", str(nodes)]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2 and "nodes.csv:2: GPU count must be an integer" in result.stderr
