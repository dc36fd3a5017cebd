from __future__ import annotations

from pathlib import Path

from slurm_plugin.store import JobRecord, Store


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
