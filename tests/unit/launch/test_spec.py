"""Submit settings: validation, #HPC-ELASTIC directives, the job marker, and the batch script (golden files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.collective import Backend
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.batch import render_batch_script
from hpc_elastic.launch.spec import (
    SubmitSpec,
    check_gpu_type,
    decode_marker,
    encode_marker,
    merge,
    parse_directives,
)
from tests.conftest import DATA

GOLDEN = DATA / "golden"
WRAPPER = ["/opt/venv/bin/python", "/opt/hpc-elastic/wrappers/hpc-elastic-run"]


def spec(**kw: object) -> SubmitSpec:
    base: dict[str, object] = {
        "script": Path("/home/u/train.py"),
        "python": "/opt/venv/bin/python",
        "ckpt_root": Path("/gpfs/jobs"),
    }
    base.update(kw)
    return SubmitSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        (
            "elastic_gpu",
            {
                "gpus": 4,
                "min_gpus": 2,
                "max_gpus": 8,
                "workers": 8,
                "gpu_type": "a100",
                "partition": "gpu",
                "time": "2:00:00",
                "profile": "resnet_like",
                "args": ("--lr", "0.1", "it's; rm -rf /", "$HOME"),
            },
        ),
        (
            "cpu_mpi",
            {
                "gpus": 0,
                "procs": 4,
                "cpus_per_worker": 2,
                "nodes": 2,
                "partition": "cpu",
                "backend": Backend.MPI,
                "job_name": "ps-job",
                "grace_s": 30,
                "max_restarts": 0,
            },
        ),
    ],
)
def test_batch_script_golden(name: str, settings: dict[str, object]) -> None:
    text = render_batch_script(spec(**settings), WRAPPER)
    golden = GOLDEN / f"{name}.sbatch"
    assert text == golden.read_text(), f"regenerate {golden} if the change is intended"


def test_everything_in_the_body_is_quoted() -> None:
    text = render_batch_script(spec(args=("a b", "'q'", "`x`")), WRAPPER)
    exec_line = next(line for line in text.splitlines() if line.startswith("exec "))
    assert exec_line.endswith("train.py 'a b' ''\"'\"'q'\"'\"'' '`x`'")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gpus": -1}, "--gpus must be >= 0, got -1"),
        ({"gpus": 0, "max_gpus": 2}, "need --gpus >= 1"),
        ({"gpus": 2, "min_gpus": 4, "max_gpus": 2}, r"--min-gpus \(4\) is greater than --max-gpus \(2\)"),
        ({"gpus": 1, "min_gpus": 2}, r"--gpus \(1\) is below --min-gpus \(2\)"),
        ({"gpus": 2, "max_gpus": 8, "workers": 4}, r"--workers \(4\) must be at least --max-gpus \(8\)"),
        ({"gpus": 0, "procs": 4, "workers": 3}, r"--workers \(3\) must be at least the number of processes \(4\)"),
        ({"time": "soon"}, "--time must be"),
        ({"job_name": "a b"}, "bad job name 'a b'"),
        ({"ckpt_root": Path("relative")}, "absolute path"),
        ({"ckpt_root": Path("/gpfs/my jobs")}, "must not contain spaces"),
        ({"grace_s": 0}, "--grace must be between"),
        ({"max_restarts": -1}, "--max-restarts must be between 0 and 100, got -1"),
        ({"max_requeues": -1}, "--max-requeues must be between 0 and 1000, got -1"),
        ({"extra": ("-x",)}, "one-line --long options"),
        ({"args": ("a\nb",)}, "one line"),
    ],
)
def test_bad_settings(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**settings)


def test_directives_then_command_line() -> None:
    text = (
        "#!/usr/bin/env python3\n#HPC-ELASTIC --gpus 2 --max-gpus=4\n# plain comment\n"
        "#HPC-ELASTIC --backend mpi\nimport x\n#HPC-ELASTIC --gpus 8\n"
    )
    found = parse_directives(text)
    assert found == {"gpus": 2, "max_gpus": 4, "backend": "mpi"}  # directives after code do not count
    merged = merge(found, {"gpus": 3}, spec())
    assert merged.gpus == 3 and merged.max_gpus == 4 and merged.backend is Backend.MPI


def test_max_requeues_from_a_directive_reaches_the_wrapper() -> None:
    found = parse_directives("#!/bin/sh\n#HPC-ELASTIC --time 30 --max-requeues 3\n")
    assert found == {"time": "30", "max_requeues": 3}
    merged = merge(found, {}, spec())
    exec_line = next(line for line in render_batch_script(merged, WRAPPER).splitlines() if line.startswith("exec "))
    assert " --max-requeues=3 " in exec_line
    assert "--max-requeues" not in render_batch_script(spec(), WRAPPER)  # the default (0) is the wrapper's too


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("#HPC-ELASTIC --colour red\n", "line 1: unknown #HPC-ELASTIC option '--colour'"),
        ("#!/bin/sh\n#HPC-ELASTIC --gpus\n", "line 2: --gpus needs a value"),
        ("#HPC-ELASTIC --gpus two\n", "line 1: bad value for --gpus: 'two'"),
        ("#HPC-ELASTIC --job-name 'x\n", "line 1: No closing quotation"),
    ],
)
def test_bad_directives(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_directives(text)


def test_any_number_of_gpus_up_to_the_logical_workers() -> None:
    """EasyScale §3: N ESTs on any M <= N processes; M need not divide N."""
    for gpus in (3, 5, 7):
        assert spec(gpus=gpus, min_gpus=2, max_gpus=8, workers=8).processes == gpus
    assert spec(gpus=0, procs=3, workers=4).logical_workers == 4


def test_unknown_backend_and_level() -> None:
    with pytest.raises(ValueError, match="backend must be one of torch, mpi, horovod, got 'foo'"):
        merge({"backend": "foo"}, {}, spec())
    with pytest.raises(ValueError, match="determinism level must be one of d0, d1, d2, got 'd5'"):
        merge({"level": "d5"}, {}, spec())
    assert merge(parse_directives("#HPC-ELASTIC --level d2\n"), {}, spec()).level is DeterminismLevel.D2


def test_gpu_type_must_be_one_of_the_partitions() -> None:
    types = {"gpu": frozenset({"a100", "v100"}), "gpu-v100": frozenset({"v100"}), "cpu": frozenset()}
    check_gpu_type(spec(gpu_type="a100", partition="gpu"), types, "gpu")
    check_gpu_type(spec(gpu_type="a100"), types, "gpu")  # the default partition
    with pytest.raises(ValueError, match=r"partition gpu-v100 has no a100 GPUs \(it has: v100\)"):
        check_gpu_type(spec(gpu_type="a100", partition="gpu-v100"), types, "gpu")
    with pytest.raises(ValueError, match=r"partition cpu has no h100 GPUs \(it has: no GPUs\)"):
        check_gpu_type(spec(gpu_type="h100", partition="cpu"), types, "gpu")
    with pytest.raises(ValueError, match="no partition 'nope'"):
        check_gpu_type(spec(gpu_type="a100", partition="nope"), types, "gpu")


def test_marker_round_trip() -> None:
    s = spec(gpus=4, min_gpus=2, max_gpus=8, workers=8, gpu_type="v100", profile="vgg_like")
    comment = encode_marker(s)
    assert " " not in comment and '"' not in comment
    marker = decode_marker(comment)
    assert marker is not None
    assert (marker.workers, marker.min, marker.max, marker.unit, marker.backend) == (8, 2, 8, "gpu", Backend.TORCH)
    assert marker.gpu_type == "v100" and marker.profile == "vgg_like" and marker.level is None
    assert decode_marker(marker.encode()) == marker
    d2 = decode_marker(encode_marker(spec(gpus=3, workers=8, level=DeterminismLevel.D2)))
    assert d2 is not None and d2.level is DeterminismLevel.D2 and d2.workers == 8
    assert decode_marker("just a comment") is None
    cpu = decode_marker(encode_marker(spec(gpus=0, procs=3)))
    assert cpu is not None and (cpu.unit, cpu.min, cpu.max, cpu.workers) == ("proc", 3, 3, 3)
