"""``wait_for_lock``: the integration tests' and the demo's one way to wait for the cluster's session locks."""

from __future__ import annotations

import fcntl
from pathlib import Path

from hpc_elastic.files import wait_for_lock


def test_a_free_lock_is_taken_and_a_held_one_is_not_until_it_is_released(tmp_path: Path) -> None:
    path = tmp_path / ".session.lock"
    calls: list[str] = []
    with path.open("a") as first, path.open("a") as second:
        assert wait_for_lock(first, fcntl.LOCK_EX, 0.0)
        # flock locks belong to the open file: the second open of the same file waits for the first
        assert not wait_for_lock(second, fcntl.LOCK_SH, 0.05, on_wait=lambda: calls.append("busy"), poll_s=0.01)
        assert calls == ["busy"]  # told once, however many tries
        fcntl.flock(first, fcntl.LOCK_UN)
        assert wait_for_lock(second, fcntl.LOCK_SH, 0.0)
        # shared with shared
        assert wait_for_lock(first, fcntl.LOCK_SH, 0.0)
