"""``hpc-elastic profile``: run / list / show / plot, errors as one line and exit 2, --submit."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hpc_elastic.cli.main import cli
from hpc_elastic.profile import load_profile, save_profile, submit
from hpc_elastic.slurm.errors import SlurmCommandError

from .helpers import make_profile

TINY = "tests.unit.profile.tiny_models:tiny"
FAST = ["--batch-sizes", "1,4", "--iters", "1", "--repeats", "2", "--warmup", "0"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def assert_one_line_error(result: Result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hpc-elastic: error: ")
    assert fragment in lines[0]


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ("not a spec", "MODEL must be package.module:factory"),
        ("train.txt", "or a training script path/to/train.py[:factory]"),
        ("missing_dir/train.py", "no script file"),
        ("no_colon.module", "MODEL must be package.module:factory"),
        ("nosuch_pkg.mod:factory", "cannot import module 'nosuch_pkg.mod'"),
        ("tests.unit.profile.tiny_models:missing", "has no callable 'missing'"),
        ("tests.unit.profile.tiny_models:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
        ("tests.unit.profile.tiny_models:not_a_module", "where a torch.nn.Module belongs"),
        ("tests.unit.profile.tiny_models:raises", "calling raises() failed: RuntimeError: weights missing"),
    ],
)
def test_bad_model_is_one_line_and_exit_2(model: str, fragment: str, tmp_path: Path) -> None:
    result = invoke("profile", "run", model, "--no-memory-limit", "--profiles-dir", str(tmp_path), *FAST)
    assert_one_line_error(result, fragment)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--device", "tpu"], "device must be cpu, cuda or cuda:INDEX, got 'tpu'"),
        (["--device", "cpu:1"], "the cpu device takes no index"),
        (["--batch-sizes", "8,x"], "bad item 'x'"),
        (["--iters", "0"], "iters must be an integer >= 1, got 0"),
        (["--threads", "0"], "threads must be a positive integer, got 0"),
        (["--device", "cuda", "--clock", "process"], "a CUDA profile needs the wall clock"),
        (["--memory-cap", "lots"], "not a memory size"),
        (["--ps-shards", "0"], "--ps-shards must be comma-separated positive integers"),
        (["--ps-shards", "99999999999999999999"], "shard counts must be at most 16,777,216, got 99999999999999999999"),
        (["--batch-sizes", "4,99999999999999999999"], "batch sizes must be at most 16,777,216"),
        (["--name", "a/b"], "a profile name takes"),
        (["--partition", "gpu"], "--partition and --gpu-type go with --submit"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args: list[str], fragment: str, tmp_path: Path) -> None:
    result = invoke("profile", "run", TINY, "--profiles-dir", str(tmp_path), *args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr and len(result.stderr.splitlines()) == 1


def test_run_then_list_show_plot(tmp_path: Path) -> None:
    result = invoke(
        "profile", "run", TINY, "--profiles-dir", str(tmp_path), "--max-batch", "8", "--device-type", "Test CPU", *FAST
    )
    assert result.exit_code == 0, result.output + result.stderr
    path = tmp_path / "tiny@test-cpu.json"
    assert result.output.startswith(f"wrote {path}\n")
    profile = load_profile(path)
    assert [p.batch_size for p in profile.points] == [1, 4]
    assert profile.model.num_parameters == 8 * 16 + 16 + 16 * 4 + 4
    assert profile.memory_limit is not None
    assert (profile.memory_limit.batch_size, profile.memory_limit.capped) == (8, True)
    assert [probe.batch_size for probe in profile.memory_limit.probes] == [1, 2, 4, 8]
    assert all(probe.peak_bytes for probe in profile.memory_limit.probes)
    assert profile.gamma is not None

    listed = invoke("profile", "list", "--profiles-dir", str(tmp_path))
    assert listed.exit_code == 0
    assert listed.output.splitlines()[1].split()[:3] == ["tiny@test-cpu", "tiny", "test-cpu"]

    shown = invoke("profile", "show", "tiny", "--profiles-dir", str(tmp_path))
    assert shown.exit_code == 0
    assert "x^o >= 8" in shown.output and "Γ(0) =" in shown.output

    as_json = invoke("profile", "show", "tiny@test-cpu", "--json", "--profiles-dir", str(tmp_path))
    assert as_json.exit_code == 0
    assert json.loads(as_json.output) == json.loads(path.read_text())

    image = tmp_path / "plots" / "tiny.png"
    plotted = invoke("profile", "plot", "tiny", "-o", str(image), "--profiles-dir", str(tmp_path))
    assert plotted.exit_code == 2 and "directory" in plotted.stderr and "does not exist" in plotted.stderr
    image.parent.mkdir()
    plotted = invoke("profile", "plot", "tiny", "-o", str(image), "--profiles-dir", str(tmp_path))
    assert plotted.exit_code == 0, plotted.output + plotted.stderr
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plotted.output == f"wrote {image}\n"
    for name in (image.parent / "tiny", image.parent / "tiny.gif", ""):  # would be tiny.png, refused gif, ./.png
        refused = invoke("profile", "plot", "tiny", "-o", str(name), "--profiles-dir", str(tmp_path))
        assert refused.exit_code == 2 and "must be an image file name" in refused.stderr, refused.stderr
    assert [p.name for p in image.parent.iterdir()] == ["tiny.png"]


TRAINING_SCRIPT = """\
import sys

import torch
from torch import nn

import hpc_elastic


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def batch(batch_size):
    return torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))


def profile_model():
    return build(), batch


def main() -> int:
    session = hpc_elastic.init()
    model = build()
    state = session.state(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    state.restore()
    return 0


if __name__ == "__main__":
    raise SystemExit("training must not start when the script is profiled")
"""


@pytest.fixture
def training_script(tmp_path: Path) -> Path:
    """A training script on the hpc_elastic session API with a ``profile_model`` factory."""
    path = tmp_path / "job" / "train.py"
    path.parent.mkdir()
    path.write_text(TRAINING_SCRIPT)
    return path


def test_run_a_training_script(tmp_path: Path, training_script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as Python runs by default: caches what it imports
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    out = tmp_path / "profiles"
    result = invoke(
        "profile", "run", str(training_script), "--max-batch", "2", "--device-type", "cpu-x",
        "--profiles-dir", str(out), *FAST,
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    profile = load_profile(out / "train@cpu-x.json")
    assert profile.model.spec == str(training_script)
    assert profile.model.name == "train"
    assert [t.shape for t in profile.model.tensors] == [[5, 6], [5], [3, 5], [3]]
    assert profile.memory_limit is not None and profile.memory_limit.batch_size == 2  # probes load it by path
    assert [p.name for p in training_script.parent.iterdir()] == ["train.py"]  # no __pycache__ left beside it
    named = invoke("profile", "run", f"{training_script}:build", "--no-memory-limit", "--profiles-dir", str(out), *FAST)
    assert named.exit_code == 2
    assert "MODEL" in named.stderr and "must return (module, sample_batch)" in named.stderr


def test_a_name_too_long_for_a_file_is_refused_before_anything_is_measured(tmp_path: Path) -> None:
    out = tmp_path / "profiles"
    given = invoke("profile", "run", TINY, "--name", "n" * 201, "--profiles-dir", str(out), *FAST)
    assert_one_line_error(given, "a profile name may have at most 200 characters, got 201")
    derived = invoke("profile", "run", TINY, "--device-type", "d" * 200, "--profiles-dir", str(out), *FAST)
    assert_one_line_error(derived, "characters, more than 200")
    assert not out.exists() and "Γ(x)" not in derived.output


def test_a_profiles_dir_that_cannot_be_written_is_refused_before_anything_is_measured() -> None:
    result = invoke("profile", "run", TINY, "--profiles-dir", "/proc/profiles", *FAST)
    assert_one_line_error(result, "--profiles-dir '/proc/profiles': cannot write in '/proc'")


def test_memory_cap_below_one_sample_is_one_line(tmp_path: Path) -> None:
    result = invoke("profile", "run", TINY, "--memory-cap", "1M", "--max-batch", "4", "--profiles-dir", str(tmp_path))
    assert_one_line_error(result, "not even batch 1 fits under the memory cap 1.00 MiB")


def test_show_and_list_errors(tmp_path: Path) -> None:
    assert_one_line_error(invoke("profile", "show", "nope", "--profiles-dir", str(tmp_path)), "no profile named")
    (tmp_path / "x.json").write_text('{"schema_version": 9}')
    assert_one_line_error(
        invoke("profile", "list", "--profiles-dir", str(tmp_path)), "unsupported profile schema_version 9"
    )
    empty = invoke("profile", "list", "--profiles-dir", str(tmp_path / "none"))
    assert empty.exit_code == 0 and "no profiles" in empty.output


def test_show_a_saved_profile(tmp_path: Path) -> None:
    save_profile(make_profile(), tmp_path)
    result = invoke("profile", "show", "toy@cpu-test", "--profiles-dir", str(tmp_path))
    assert result.exit_code == 0
    assert "largest tensor a.weight [4, 3] = 52.2% of the model" in result.output
    assert "x^o = 40 under a 1.00 MiB cap (rss) (batch 41 did not fit)" in result.output


def test_sbatch_argv_and_script_are_exact() -> None:
    request = submit.SubmitRequest(
        partition="gpu",
        gpu_type="h100",
        run_args=submit.remote_run_args(
            "pkg.mod:net",
            gpu_type="h100",
            options=[("--iters", "5"), ("--profiles-dir", "/shared/profiles"), ("--quiet", None)],
        ),
        job_name="profile-net",
        time_limit="01:00:00",
        program=("/venv/bin/python", "-m", "hpc_elastic"),
    )
    assert submit.build_sbatch_argv(request) == [
        "sbatch",
        "--parsable",
        "--job-name=profile-net",
        "--partition=gpu",
        "--nodes=1",
        "--ntasks=1",
        "--gres=gpu:h100:1",
        "--time=01:00:00",
    ]
    assert submit.build_sbatch_argv(request)[2:] == submit.sbatch_options(request)
    assert submit.profile_job_command(request) == [
        "/venv/bin/python", "-m", "hpc_elastic", "profile", "run", "pkg.mod:net",
        "--device", "cuda", "--device-type", "h100",
        "--iters", "5", "--profiles-dir", "/shared/profiles", "--quiet",
    ]  # fmt: skip
    assert submit.job_script(request) == (
        "#!/bin/bash\n"
        "# hpc-elastic profile job: measures one model on this node's device type.\n"
        "set -euo pipefail\n"
        "exec /venv/bin/python -m hpc_elastic profile run pkg.mod:net --device cuda --device-type h100 "
        "--iters 5 --profiles-dir /shared/profiles --quiet\n"
    )
    cpu_job = submit.SubmitRequest(partition="cpu", run_args=("pkg.mod:net",))
    assert "--gres" not in " ".join(submit.build_sbatch_argv(cpu_job))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"partition": "gpu; rm"}, "partition must be a Slurm name"),
        ({"gpu_type": "h 100"}, "GPU type must be a Slurm name"),
        ({"time_limit": "soon"}, "time limit"),
        ({"run_args": ()}, "at least the MODEL"),
    ],
)
def test_bad_submit_requests(fields: dict[str, Any], fragment: str) -> None:
    arguments: dict[str, Any] = {"partition": "gpu", "run_args": ("m:f",), **fields}
    with pytest.raises(ValueError, match=fragment):
        submit.SubmitRequest(**arguments)


class FakeSlurm:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def submit(self, script_path: str | None = None, options: Any = (), *, script_text: str | None = None) -> int:
        self.calls.append({"script_path": script_path, "options": list(options), "script_text": script_text})
        return 4242


def test_submit_hands_the_job_to_the_slurm_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSlurm()
    monkeypatch.setattr("hpc_elastic.cli.profile.connect", lambda environment=None: fake)
    result = invoke(
        "profile", "run", TINY, "--submit", "--partition", "gpu", "--gpu-type", "a100",
        "--iters", "7", "--profiles-dir", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert result.output.startswith("submitted profile job 4242")
    (call,) = fake.calls
    assert call["script_path"] is None
    assert call["options"] == [
        "--job-name=profile-tiny",
        "--partition=gpu",
        "--nodes=1",
        "--ntasks=1",
        "--gres=gpu:a100:1",
        "--time=00:30:00",
        f"--output={tmp_path.resolve()}/logs/profile-%j.out",
    ]
    assert call["script_text"].splitlines()[-1] == (
        f"exec {sys.executable} -m hpc_elastic profile run {TINY} --device cuda --device-type a100 "
        f"--batch-sizes auto --iters 7 --warmup 2 --repeats 5 --max-batch 1024 --ps-shards 2,4,8 --seed 0 "
        f"--profiles-dir {tmp_path.resolve()} --quiet"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["logs"]  # sbatch needs the --output directory to exist
    assert result.output.splitlines()[-1] == f"  log:  {tmp_path.resolve()}/logs/profile-4242.out"


def test_a_profile_job_sbatch_refuses_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(environment: object = None) -> FakeSlurm:
        fake = FakeSlurm()

        def submit(*_: object, **__: object) -> int:
            raise SlurmCommandError(["sbatch"], 1, "sbatch: error: invalid partition specified: gpu")

        fake.submit = submit  # type: ignore[method-assign]
        return fake

    monkeypatch.setattr("hpc_elastic.cli.profile.connect", refusing)
    profiles = tmp_path / "new" / "profiles"
    result = invoke("profile", "run", TINY, "--submit", "--partition", "gpu", "--profiles-dir", str(profiles))
    assert result.exit_code == 2 and "invalid partition" in result.stderr and len(result.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_submit_a_script_passes_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, training_script: Path
) -> None:
    fake = FakeSlurm()
    monkeypatch.setattr("hpc_elastic.cli.profile.connect", lambda environment=None: fake)
    monkeypatch.chdir(training_script.parent)
    result = invoke("profile", "run", "train.py", "--submit", "--partition", "cpu", "--profiles-dir", str(tmp_path))
    assert result.exit_code == 0, result.output + result.stderr
    (call,) = fake.calls
    assert "--job-name=profile-train" in call["options"]
    assert not any(option.startswith("--gres") for option in call["options"])
    assert f"profile run {training_script} --batch-sizes auto" in call["script_text"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--iters", "0"], "iters must be an integer >= 1"),
        (["--repeats", "-1"], "repeats must be an integer >= 1"),
        (["--threads", "0"], "threads must be a positive integer"),
        (["--name", "../evil"], "a profile name takes"),
        (["--clock", "process", "--gpu-type", "a100"], "a CUDA profile needs the wall clock"),
        (["--time-limit", "bogus"], "time limit must look like"),
    ],
)
def test_submit_refuses_what_the_local_run_refuses_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], fragment: str
) -> None:
    fake = FakeSlurm()
    monkeypatch.setattr("hpc_elastic.cli.profile.connect", lambda environment=None: fake)
    profiles = tmp_path / "profiles"
    result = invoke("profile", "run", TINY, "--submit", "--partition", "gpu", "--profiles-dir", str(profiles), *extra)
    assert result.exit_code == 2 and fragment in result.stderr and len(result.stderr.splitlines()) == 1
    assert fake.calls == [] and not profiles.exists()


def test_submit_refuses_a_model_that_is_not_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSlurm()
    monkeypatch.setattr("hpc_elastic.cli.profile.connect", lambda environment=None: fake)
    monkeypatch.chdir(tmp_path)
    for model, fragment in (("missing.py", "no script missing.py"), ("nosuchpkg.mod:f", "no module 'nosuchpkg'")):
        result = invoke("profile", "run", model, "--submit", "--partition", "gpu")
        assert result.exit_code == 2 and fragment in result.stderr
    assert fake.calls == []


def test_submit_needs_a_partition() -> None:
    result = invoke("profile", "run", TINY, "--submit")
    assert result.exit_code == 2
    assert "--submit needs --partition" in result.stderr


def test_a_script_that_fails_on_import_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nraise SystemExit('no data here')\n")
    result = invoke("profile", "run", str(script), "--no-memory-limit", "--profiles-dir", str(tmp_path), *FAST)
    assert_one_line_error(result, "cannot import script")
    assert "SystemExit: no data here" in result.stderr
