"""A process SIGKILLed inside ``atomic_write_bytes`` leaves its temporary beside an intact file; the sweep of the
next run removes it once stale, and leaves a write in progress, a link or a stranger's name alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc_elastic.files import STALE_TEMPORARY_S, TEMPORARY, atomic_write_bytes, sweep_temporaries
from hpc_elastic.jobdir import JobDir
from hpc_elastic.ps import checkpoint
from hpc_elastic.ps.config import PsJobConfig
from hpc_elastic.ps.server import ParameterServer
from hpc_elastic.ps.shards import ShardManager

#: a writer that stops between the temporary's fsync and its rename, and says so
WRITER = """
import os, sys, time
from pathlib import Path
from hpc_elastic import files

def stuck(src, dst):
    Path(sys.argv[2]).write_text("in")
    time.sleep(120)

files.os.replace = stuck
files.atomic_write_bytes(Path(sys.argv[1]), b"half of the new content")
"""


def killed_writing(path: Path, tmp_path: Path) -> Path:
    """SIGKILL a real process inside ``atomic_write_bytes(path, ...)``; the temporary it left."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(marker)])
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), f"the writer never reached the rename (exit code {proc.poll()})"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    left = [p for p in path.parent.iterdir() if TEMPORARY.fullmatch(p.name)]
    assert len(left) == 1 and left[0].name.startswith(f".{path.name}.tmp-{proc.pid}-")
    return left[0]


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_kill_inside_an_atomic_write_leaves_the_file_and_a_temporary_the_sweep_removes_once_stale(
    tmp_path: Path,
) -> None:
    target = tmp_path / "status.json"
    atomic_write_bytes(target, b"the old content")
    temporary = killed_writing(target, tmp_path)
    assert target.read_bytes() == b"the old content"
    assert sweep_temporaries(tmp_path, now=time.time()) == 0  # as young as a write in progress
    assert temporary.exists()
    link = tmp_path / ".stop.tmp-1-0123456789abcdef"
    link.symlink_to(target)
    lookalikes = [
        tmp_path / name for name in (".x.tmp-1-0123", "x.tmp-1-0123456789abcdef", ".x.tmp-1-0123456789abcdeg")
    ]
    for path in lookalikes:
        path.write_bytes(b"not ours")
    for path in (temporary, link, *lookalikes):
        age(path, STALE_TEMPORARY_S + 60)
    assert sweep_temporaries(tmp_path, now=time.time()) == 1
    assert not temporary.exists() and link.is_symlink() and all(p.exists() for p in lookalikes)
    assert target.read_bytes() == b"the old content"
    assert sweep_temporaries(tmp_path / "missing", now=time.time()) == 0


def test_a_job_directory_is_swept_where_its_files_are_written(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "train-7").prepare()
    job.ps.mkdir()
    stale = [where / f".{name}.tmp-42-{i:016x}" for i, (where, name) in enumerate(
        [(job.control, "stop"), (job.control, "ack.json"), (job.path, "progress.json"), (job.ps, "status.json")]
    )]  # fmt: skip
    for path in stale:
        path.write_bytes(b"{")
        age(path, STALE_TEMPORARY_S + 1)
    young = job.control / ".scale.tmp-43-00000000000000ff"
    young.write_bytes(b"{")
    assert job.sweep_temporaries(time.time()) == len(stale)
    assert not any(p.exists() for p in stale) and young.exists()


def test_a_ps_save_removes_what_a_killed_save_left(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    config = PsJobConfig(num_ps=1, num_samples=10, shard_size=5)
    state, parts = ShardManager(config.shards()).checkpoint(), [ParameterServer(config, 0, 1).snapshot()]
    checkpoint.write(root, 1, state, parts)
    latest_temporary = killed_writing(root / checkpoint.LATEST, tmp_path)
    age(latest_temporary, STALE_TEMPORARY_S + 1)
    checkpoint.write(root, 2, state, parts)
    assert not latest_temporary.exists()
    assert checkpoint.latest(root) == root / "ckpt-000000000002"
