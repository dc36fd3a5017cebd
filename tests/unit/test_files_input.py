"""Input files a user names to a command: a FIFO, a device or a directory is one error at once (never a read that
waits or never ends), a file over the limit is refused before it is read, and JSON from outside fails only as a
``ValueError`` naming what it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_elastic.cli.main import cli
from hpc_elastic.files import check_output_dir, check_output_file, loads_json, open_input, read_input, read_text_input

FIFO_SECONDS = 30


def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return fifo


def _finishes(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` on a thread; what it raised (None if nothing). A call still blocked after FIFO_SECONDS fails the
    test (its thread is a daemon and is left behind)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(FIFO_SECONDS)
    assert not thread.is_alive(), "blocked on an input that is not a regular file"
    return outcome[0]


def test_a_fifo_a_device_and_a_directory_are_refused_at_once(tmp_path: Path) -> None:
    for path in (_fifo(tmp_path), Path("/dev/zero"), tmp_path):
        for call in (lambda p=path: read_input(p), lambda p=path: open_input(p, encoding="utf-8").close()):
            error = _finishes(call)
            assert isinstance(error, OSError) and str(error.strerror).startswith("not a regular file"), (path, error)


def test_regular_files_are_read_whole_and_the_limit_holds(tmp_path: Path) -> None:
    file = tmp_path / "input.csv"
    file.write_bytes(b"name,gpus\nnode0,4\n")
    assert read_input(file) == b"name,gpus\nnode0,4\n"
    assert read_input(file, limit=18) == file.read_bytes()
    with pytest.raises(OSError, match="18 bytes, more than the 17 allowed"):
        read_input(file, limit=17)
    with open_input(file, encoding="utf-8", newline="") as fh:
        assert fh.read().splitlines() == ["name,gpus", "node0,4"]
    with pytest.raises(FileNotFoundError):
        read_input(tmp_path / "missing")
    assert read_text_input(file, "nodes from") == "name,gpus\nnode0,4\n"
    file.write_bytes(b"name,gpus\n\xff\n")
    with pytest.raises(ValueError, match="cannot read nodes from '.*input.csv': 'utf-8' codec can't decode"):
        read_text_input(file, "nodes from")
    with pytest.raises(ValueError, match="cannot read nodes from '/dev/zero': not a regular file"):
        read_text_input(Path("/dev/zero"), "nodes from")
    file.write_bytes(b"name,gpus\nnode0,4\n")
    link = tmp_path / "link"
    link.symlink_to(file)  # a user's own command follows the user's own links
    assert read_input(link) == file.read_bytes()


def test_loads_json_names_what_it_read() -> None:
    assert loads_json(b'{"a": [1, 2]}', "the doc") == {"a": [1, 2]}
    for text, reason in (
        ("{", "the doc is not JSON: Expecting property name"),
        (b"\xff\xfe\x00", "the doc is not JSON"),
        ("[" * 100_000 + "]" * 100_000, "the doc is not JSON: nested too deeply"),
    ):
        with pytest.raises(ValueError, match=reason):
            loads_json(text, "the doc")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--trace", "FIFO", "--format", "tiresias", "--cluster", "2x4"], "cannot read trace"),
        (["simulate", "--trace", "TRACE", "--format", "tiresias", "--cluster-file", "/dev/zero"], "cluster file"),
        (["dl2", "evaluate", "FIFO", "--jobs", "5"], "cannot read the model file"),
        (["profile", "show", "/dev/zero"], "cannot read profile"),
        (["queue", "--config", "FIFO"], "cannot read"),
    ],
)
def test_commands_refuse_a_fifo_or_a_device_in_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    fifo = _fifo(tmp_path)
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,num_gpu,submit_time,duration\n1,1,0,10\n")
    argv = [{"FIFO": str(fifo), "TRACE": str(trace)}.get(word, word) for word in argv]
    code = "import sys; from hpc_elastic.cli.main import main; sys.argv[0] = 'hpc-elastic'; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr and "not a regular file" in out.stderr


def test_the_daemon_refuses_a_config_that_is_a_device() -> None:
    code = "import sys; from slurm_plugin.cli import main; sys.argv[0] = 'hpc-elastic-sched'; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "--config", "/dev/zero", "--once", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2
    assert (
        out.stderr
        == "hpc-elastic-sched: /dev/zero: cannot read: not a regular file (a FIFO, a device or a directory)\n"
    )


def test_output_paths_are_checked_by_the_filesystem_before_the_work(tmp_path: Path) -> None:
    assert check_output_file(tmp_path / "model.dl2", "--out") == tmp_path / "model.dl2"
    assert check_output_dir(tmp_path / "new" / "profiles", "--profiles-dir") == tmp_path / "new" / "profiles"
    assert list(tmp_path.iterdir()) == []  # the probes leave nothing
    with pytest.raises(ValueError, match="--out '/proc/model.dl2': cannot write in '/proc': "):
        check_output_file(Path("/proc/model.dl2"), "--out")  # exists, a directory, and takes no new file
    with pytest.raises(ValueError, match="directory .*missing' does not exist"):
        check_output_file(tmp_path / "missing" / "model.dl2", "--out")
    with pytest.raises(ValueError, match="is a directory"):
        check_output_file(tmp_path, "--out")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="a-file' is not a directory"):
        check_output_dir(tmp_path / "a-file" / "profiles", "--profiles-dir")
    with pytest.raises(ValueError, match="cannot write in '/proc'"):
        check_output_dir(Path("/proc/x/profiles"), "--profiles-dir")


def test_dl2_train_refuses_a_plot_it_could_not_write_before_it_trains(tmp_path: Path) -> None:
    out = tmp_path / "m.dl2"
    argv = ["dl2", "train", "--out", str(out), "--jobs", "5", "--traces", "1", "--plot", "/proc/curve.png"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2 and "cannot write in '/proc'" in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()  # refused before training, so no model either
