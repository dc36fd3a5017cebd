"""Submit settings: validation, #HPC-ELASTIC directives, the job marker, and the batch script (golden files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.balance.mode import BalanceMode
from hpc_elastic.collective import Backend
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.launch.batch import render_batch_script
from hpc_elastic.launch.spec import (
    SubmitSpec,
    check_gpu_type,
    decode_marker,
    encode_marker,
    merge,
    merge_layers,
    parse_directives,
    parse_sbatch_lines,
    sbatch_arg,
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
        (
            # every sbatch option of its own, with values the dev cluster accepts (sbatch --test-only in
            # tests/integration/test_sbatch_parity.py; the reservation is made there)
            "sbatch_options",
            {
                "gpus": 2,
                "gpu_type": "a100",
                "partition": "gpu-a100",
                "account": "root",
                "qos": "normal",
                "reservation": "hpc-elastic-test",
                "mem": "4G",
                "constraint": "a100",
                "exclusive": True,
                "time": "30",
                "dependency": "singleton",
                "mail_type": "end,FAIL",
                "mail_user": "dev@example.org",
                "extra": ("--begin=now+1hour", "--nice=10"),
            },
        ),
        ("mem_per_gpu", {"gpus": 2, "partition": "gpu", "mem_per_gpu": "2000M"}),
        (
            "array_cpu",
            {"gpus": 0, "procs": 2, "partition": "cpu", "mem_per_cpu": "500M", "array": "0-15%4", "job_name": "sweep"},
        ),
        (
            "balance_est",
            {"gpus": 2, "max_gpus": 4, "workers": 8, "gpu_type": "a100", "balance": BalanceMode.EST},
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
        ({"balance": BalanceMode.EST, "level": DeterminismLevel.D0}, "balance mode est needs determinism level d1"),
        ({"gpus": 2, "workers": 4, "balance": BalanceMode.LBBSP}, r"--workers \(4\) must equal the processes \(2\)"),
        ({"gpus": 2, "max_gpus": 4, "workers": 4, "balance": BalanceMode.LBBSP}, "cannot be resized"),
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
        ({"extra": ("-x",)}, "--name or --name=value, without spaces or quotes"),
        ({"extra": ("--begin=now; rm",)}, "without spaces or quotes"),
        ({"extra": ("--requeue",)}, "sbatch option --requeue is refused: every hpc-elastic job is requeueable"),
        ({"extra": ("--account=x",)}, "sbatch option --account is refused: use hpc-elastic submit --account"),
        ({"account": "a b"}, "bad --account 'a b'"),
        ({"qos": "x'y"}, "bad --qos"),
        ({"reservation": "r\n"}, "bad --reservation"),
        ({"mem": "4 G"}, r"bad --mem '4 G': a size like 4096, 500M, 16G or 1T"),
        ({"mem": "4G", "mem_per_cpu": "1G"}, "--mem and --mem-per-cpu exclude each other"),
        ({"gpus": 0, "mem_per_gpu": "1G"}, "--mem-per-gpu needs --gpus >= 1"),
        ({"constraint": "a100 && x"}, "bad --constraint"),
        ({"dependency": "after:abc"}, "bad --dependency 'after:abc'"),
        ({"mail_type": "END,SOMETIMES"}, "bad --mail-type 'END,SOMETIMES'"),
        ({"mail_user": "a@b c"}, "bad --mail-user"),
        ({"array": "3-1"}, "bad --array '3-1': range 3-1 runs backwards"),
        ({"array": "0-3%0"}, "the limit after % must be a number >= 1"),
        ({"array": "x"}, "bad --array 'x'"),
        ({"array": "0-5000"}, "index 5000 is above 1000"),
        ({"array": "0-3", "gpus": 2, "max_gpus": 4}, "--array needs a fixed size, got the elastic range 2-4 GPUs"),
        ({"array": "0-3", "dependency": "singleton"}, "--array with --dependency=singleton"),
        ({"max_requeues": -1}, "--max-requeues must be between 0 and 1000, got -1"),
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


@pytest.mark.parametrize(
    ("text", "indices"),
    [("0-3", (0, 1, 2, 3)), ("1,3,5", (1, 3, 5)), ("0-15%4", tuple(range(16))), ("0-9:3,20", (0, 3, 6, 9, 20))],
)
def test_array_indices(text: str, indices: tuple[int, ...]) -> None:
    assert spec(array=text).array_indices == indices


@pytest.mark.parametrize(
    ("arg", "kept"),
    [
        ("--begin=now+1hour", "--begin=now+1hour"),
        ("--begin now", "--begin=now"),
        ("--hold", "--hold"),
        ("-x node1", "--exclude=node1"),
        ("-wnode2", "--nodelist=node2"),
        ("-H", "--hold"),
    ],
)
def test_sbatch_arg_forms(arg: str, kept: str) -> None:
    assert sbatch_arg(arg) == kept


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("-n 4", "sbatch option --ntasks is refused: the tasks follow --gpus / --procs"),
        ("--gres=gpu:2", "--gres is refused: use --gpus / --gpu-type"),
        ("-o out.txt", "--output is refused"),
        ("--export=NONE", "--export is refused: the wrapper needs the submitting environment"),
        ("-J x", "--job-name is refused: use hpc-elastic submit --job-name"),
        ("-p cpu", "--partition is refused: use hpc-elastic submit --partition"),
        ("--array=0-3", "--array is refused: use hpc-elastic submit --array"),
        ("--wrap=true", "--wrap is refused"),
        ("--signal=B:USR1@60", "--signal is refused"),
        ("--begin=now --hold", "takes one sbatch option"),
        ("-Z", "not an sbatch option: '-Z'"),
        ("begin", "not an sbatch option: 'begin'"),
    ],
)
def test_refused_sbatch_args(arg: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sbatch_arg(arg)


SCRIPT_WITH_SBATCH = """#!/usr/bin/env python3
#SBATCH --account=proj1 -q normal
#SBATCH --mem=8G  # a comment
#SBATCH --begin=now+1hour
#SBATCH -t 1:00:00 --exclusive
#HPC-ELASTIC --gpus 2 --mem-per-gpu 4G --sbatch-arg=--begin=now+2hours
import os
#SBATCH --qos=late
"""


def test_sbatch_lines_are_honoured_below_directives_and_the_command_line() -> None:
    found, extra = parse_sbatch_lines(SCRIPT_WITH_SBATCH)
    assert found == {"account": "proj1", "qos": "normal", "mem": "8G", "time": "1:00:00", "exclusive": True}
    assert extra == ("--begin=now+1hour",)  # a #SBATCH line after the first command does not count
    merged = merge_layers(spec(), {**found, "extra": extra}, parse_directives(SCRIPT_WITH_SBATCH), {"qos": "high"})
    assert (merged.account, merged.qos, merged.time, merged.exclusive) == ("proj1", "high", "1:00:00", True)
    assert (merged.mem, merged.mem_per_gpu) == (None, "4G")  # a memory option replaces the script's other one
    assert merged.extra == ("--begin=now+2hours",)
    assert "#SBATCH --begin=now+2hours" in render_batch_script(merged, WRAPPER)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("#!/bin/sh\n#SBATCH --ntasks=4\n", "script line 2: sbatch option --ntasks is refused"),
        ("#SBATCH -o out.txt\n", "script line 1: sbatch option --output is refused"),
        ("#SBATCH --gres=gpu:2\n", "script line 1: sbatch option --gres is refused: use --gpus / --gpu-type"),
        ("# x\n#SBATCH --nodes=1-2\n", "script line 2: bad value for #SBATCH --nodes: '1-2'"),
        ("#SBATCH --account\n", "script line 1: #SBATCH --account needs a value"),
        ("#SBATCH hetjob\n", "script line 1: not an sbatch option: 'hetjob'"),
        ("#SBATCH --begin='now\n", "script line 1: No closing quotation"),
        ("#SBATCH --comment=hi\n", "script line 1: sbatch option --comment is refused"),
    ],
)
def test_sbatch_lines_refused_with_their_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sbatch_lines(text)


def test_sbatch_lines_translate_to_first_class_options() -> None:
    found, extra = parse_sbatch_lines("#SBATCH -J run1 -p cpu -N 2 -c 4 -a 0-3 -C cpu -d afterok:12\n#SBATCHX --x\n")
    assert found == {
        "job_name": "run1",
        "partition": "cpu",
        "nodes": 2,
        "cpus_per_worker": 4,
        "array": "0-3",
        "constraint": "cpu",
        "dependency": "afterok:12",
    }
    assert extra == ()


def test_balance_directive_and_merge() -> None:
    assert merge(parse_directives("#HPC-ELASTIC --balance lbbsp\n"), {}, spec()).balance is BalanceMode.LBBSP
    assert merge(parse_directives("#HPC-ELASTIC --balance lbbsp\n"), {"balance": "est"}, spec()).balance is (
        BalanceMode.EST
    )
    with pytest.raises(ValueError, match="balance mode must be one of none, est, lbbsp, got 'fast'"):
        merge({"balance": "fast"}, {}, spec())
    assert "--balance" not in render_batch_script(spec(), WRAPPER)  # unset: the runtime's default
