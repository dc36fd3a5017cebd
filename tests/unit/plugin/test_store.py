from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from slurm_plugin.store import JobRecord, Store, StoreUnavailable


def test_records_survive_a_reopen(tmp_path: Path) -> None:
    records = [
        JobRecord(
            job_id=7,
            first_seen=100.0,
            waiting_since=100.0,
            banked_service=320.0,
            banked_exec=80.0,
            run_start=500.0,
            run_gpus=4,
            run_exec=25.5,
            first_start=120.0,
            queue=1,
            preemptions=2,
            last_preempt=400.0,
            placement="N=1;L=",
        ),
        JobRecord(job_id=8, first_seen=110.0, waiting_since=110.0),
    ]
    store = Store(tmp_path)
    store.save(records)
    store.set_meta("history_at", "123.5")
    store.close()

    again = Store(tmp_path)
    loaded = again.load()
    assert loaded == {7: records[0], 8: records[1]}
    assert loaded[7].attained_service == 320.0 + 4 * 25.5 and loaded[7].executed_time == 80.0 + 25.5
    assert again.get_meta("history_at") == "123.5"
    again.save([], forget=[8])
    again.close()
    assert set(Store(tmp_path).load()) == {7}


def test_read_only_store_writes_nothing(tmp_path: Path) -> None:
    Store(tmp_path).save([JobRecord(job_id=1, first_seen=1.0, waiting_since=1.0)])
    ro = Store(tmp_path, read_only=True)
    ro.save([JobRecord(job_id=2, first_seen=1.0, waiting_since=1.0)])
    assert set(ro.load()) == {1}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert Store(empty, read_only=True).load() == {}
    assert not (empty / "state.sqlite3").exists()


def test_a_file_that_is_not_a_database_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    (tmp_path / "state.sqlite3").write_bytes(b"this is not SQLite" * 100)
    store = Store(tmp_path)
    assert store.load() == {}
    store.save([JobRecord(job_id=3, first_seen=1.0, waiting_since=1.0)])
    assert set(Store(tmp_path).load()) == {3}
    aside = [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("state.sqlite3.corrupt-")
    assert (tmp_path / aside[0]).read_bytes().startswith(b"this is not SQLite")  # kept for a post-mortem


def test_a_database_that_cannot_be_opened_is_unavailable_and_never_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Permissions, a read-only filesystem or a lock say nothing of the records: nothing is moved aside or lost."""
    first = Store(tmp_path)
    first.save([JobRecord(job_id=4, first_seen=1.0, waiting_since=1.0)])
    first.close()
    monkeypatch.setattr("os.access", lambda path, mode: Path(path).name != "state.sqlite3")
    with pytest.raises(StoreUnavailable, match="state.sqlite3 is not readable and writable by uid"):
        Store(tmp_path)
    monkeypatch.undo()
    assert set(Store(tmp_path, read_only=True).load()) == {4}
    other = tmp_path / "other"
    (other / "state.sqlite3").mkdir(parents=True)  # sqlite: "unable to open database file"
    with pytest.raises(StoreUnavailable, match="unable to open database file"):
        Store(other)
    assert sorted(p.name for p in other.iterdir()) == ["state.sqlite3"]
    assert set(Store(tmp_path).load()) == {4}


def test_a_damaged_page_or_an_impossible_row_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.save([JobRecord(job_id=n, first_seen=1.0, waiting_since=1.0) for n in range(1, 200)])
    store.close()
    with sqlite3.connect(tmp_path / "state.sqlite3") as db:
        db.execute("UPDATE jobs SET first_seen = 'soon' WHERE job_id = 5")
    db.close()
    first = Store(tmp_path)
    assert first.load() == {}  # a record that cannot be trusted: start again from Slurm
    first.close()
    store = Store(tmp_path)
    store.save([JobRecord(job_id=n, first_seen=1.0, waiting_since=1.0) for n in range(1, 200)])
    store.close()
    path = tmp_path / "state.sqlite3"
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = b"\xff" * (len(data) - page)  # every page after the first is garbage: a torn write, a bad disk
    path.write_bytes(bytes(data))
    assert not path.with_name("state.sqlite3-wal").exists()  # everything was in the damaged file
    rebuilt = Store(tmp_path)
    assert rebuilt.load() == {}
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("state.sqlite3.corrupt-")]) >= 2


def test_a_dry_run_never_moves_a_corrupt_database(tmp_path: Path) -> None:
    (tmp_path / "state.sqlite3").write_bytes(b"garbage" * 10)
    assert Store(tmp_path, read_only=True).load() == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.sqlite3"]


def test_the_nodes_held_for_a_resize_survive_a_reopen_and_an_older_database_gains_them(tmp_path: Path) -> None:
    keep = "hpc-elastic-keep-5-1:node2"
    held = JobRecord(job_id=5, first_seen=1.0, waiting_since=1.0, resize_to=2, resize_split="a100:2", resize_keep=keep)
    store = Store(tmp_path)
    store.save([held])
    store.close()
    assert Store(tmp_path).load()[5] == held
    with sqlite3.connect(tmp_path / "state.sqlite3") as db:  # the database of a daemon before the column
        db.execute("ALTER TABLE jobs DROP COLUMN resize_keep")
    older = Store(tmp_path)
    assert older.load()[5].resize_keep == ""
    older.save([held])
    older.close()
    assert Store(tmp_path).load()[5].resize_keep == keep
