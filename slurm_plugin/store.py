"""Durable per-job accounting: attained service, executed and waiting time, queue, preemptions; and the grows
``tiresias-las+easyscale`` watches (EasyScale §3.4 Role 3).

One SQLite database in the state directory (``state.sqlite3``), written in one transaction per pass, so a
daemon restart (or crash mid-pass) loses nothing that was committed. Records are plain frozen dataclasses;
how they evolve from Slurm's view is pure and lives in :mod:`slurm_plugin.observe` and
:mod:`slurm_plugin.easyscale`.

PACKLIMIT's refit keeps the jobs' placement reports in a table of their own too, ``placements`` (one row per job
incarnation, the newest :data:`~slurm_plugin.pack_limit.MAX_REPORTS`; a row that does not make a valid report is
dropped alone, said in the log).

Role 3's record has its own table, ``grows`` (one row per job the daemon grew: throughput before, the GPUs per
type before, the restart count then, the throughput observed after and the GPUs per type it was observed on, when
the grow was seen slower (the fallback) and how many grows in a row before it were, for the back-off of the cap),
rather than columns of ``jobs``: it exists for few jobs, only under one policy, and a row that does not make a
valid record is dropped alone (the job is then simply not watched) where a bad ``jobs`` row means a corrupt
database. An older database gains the table, or the columns its table lacks, when a daemon opens it for writing;
read-only, a database without the table has no grows, and one without a column reads it as its default (no
fallback time, no earlier failure, GPUs after not known).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from slurm_plugin.easyscale import ScaleOutWatch, parse_split, split_text
from slurm_plugin.pack_limit import PlacementReport

DB_NAME = "state.sqlite3"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What the daemon remembers of one managed job (times are epoch seconds).

    ``banked_service``/``banked_exec``: GPU-seconds / seconds of runs that ended (since the last promotion,
    Tiresias §3.2.3). ``run_start``/``run_gpus``/``run_exec``: the current run as last seen. ``waiting_since``:
    when the job last began to wait (arrival, end of a run, promotion). ``banked_wait``: seconds of the waiting
    spells that ended since the job first ran after its arrival or last promotion (δ_J adds them up, §3.2.3).

    A stop in flight (checkpoint requested, requeue not yet seen): ``stop_kind`` (``preempt`` or ``resize``),
    ``stop_at`` (when it was requested), ``stop_restarts`` (the job's restart count then). ``resize_to``: the
    GPUs an elastic job is being resized to; ``resize_set``: the size already set on the pending job;
    ``resize_split``: its new GPUs per type when its plans may span types (``a100:2,v100:3``; '' otherwise).
    ``resize_keep``: the Slurm reservation that holds the nodes of such a job's plan for it from its stop until it
    runs again, and those nodes (``hpc-elastic-keep-12-0:node2,node3``; '' when none; it outlives ``resize_to``,
    which ends when the job runs again, until the daemon has ended the reservation).
    """

    job_id: int
    first_seen: float
    waiting_since: float
    banked_service: float = 0.0
    banked_exec: float = 0.0
    run_start: float | None = None
    run_gpus: int = 0
    run_exec: float = 0.0
    first_start: float | None = None
    queue: int = 0
    preemptions: int = 0
    last_preempt: float | None = None
    placement: str = ""
    stop_kind: str = ""
    stop_at: float | None = None
    stop_restarts: int = 0
    resize_to: int = 0
    resize_set: int = 0
    resize_split: str = ""
    resize_keep: str = ""
    missing_since: float | None = None
    #: Slurm's submit time when the daemon first saw the job (Slurm resets it on every requeue)
    submitted: float | None = None
    banked_wait: float = 0.0

    @property
    def running(self) -> bool:
        return self.run_start is not None

    @property
    def attained_service(self) -> float:
        """a_J = W_J x t_J summed over runs (Tiresias §3.2.2)."""
        return self.banked_service + (self.run_exec * self.run_gpus if self.running else 0.0)

    @property
    def executed_time(self) -> float:
        return self.banked_exec + (self.run_exec if self.running else 0.0)

    def waiting_time(self, now: float) -> float:
        """δ_J at ``now``: every waiting spell since the job first ran after its arrival or last promotion, the
        current one included (Tiresias §3.2.3; the public simulator counts the same). A running job keeps what
        it waited before; nothing counts before that first run. Only a promotion resets it."""
        if self.running or self.banked_exec <= 0.0:
            return self.banked_wait
        return self.banked_wait + max(0.0, now - self.waiting_since)


_COLUMNS = tuple(f.name for f in fields(JobRecord))
#: the columns of ``grows`` added after it was first written (Role 3's back-off), as an older database gains them
_GROWS_ADDED = {"fallen_at": "REAL", "earlier": "INTEGER NOT NULL DEFAULT 0", "grown": "TEXT NOT NULL DEFAULT ''"}
#: what a read-only view of an older ``grows`` reads for them
_GROWS_DEFAULT = {"fallen_at": "NULL", "earlier": "0", "grown": "''"}
_ADDED = (
    "placement",
    "stop_kind",
    "stop_restarts",
    "resize_to",
    "resize_set",
    "missing_since",
    "submitted",
    "banked_wait",
    "resize_split",
    "resize_keep",
)  # may be missing in old databases
_TYPES = {
    "job_id": "INTEGER PRIMARY KEY",
    "placement": "TEXT NOT NULL",
    "run_gpus": "INTEGER NOT NULL",
    "queue": "INTEGER NOT NULL",
    "preemptions": "INTEGER NOT NULL",
    "stop_kind": "TEXT NOT NULL DEFAULT ''",
    "stop_restarts": "INTEGER NOT NULL DEFAULT 0",
    "resize_to": "INTEGER NOT NULL DEFAULT 0",
    "resize_set": "INTEGER NOT NULL DEFAULT 0",
    "banked_wait": "REAL NOT NULL DEFAULT 0",
    "resize_split": "TEXT NOT NULL DEFAULT ''",
    "resize_keep": "TEXT NOT NULL DEFAULT ''",
}


def _check_row(record: JobRecord) -> None:
    if isinstance(record.job_id, bool) or not isinstance(record.job_id, int) or record.job_id < 1:
        raise ValueError(f"job_id {record.job_id!r}")
    for name in _COLUMNS:
        value = getattr(record, name)
        if name in {"placement", "stop_kind", "resize_split", "resize_keep"} or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name} {value!r}")


def _load_rows(db: sqlite3.Connection) -> dict[int, JobRecord]:
    """The records in ``db``; ``ValueError`` for a row that does not make a valid record."""
    have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    if not have:
        return {}
    columns = [name for name in _COLUMNS if name in have]  # a read-only view of an older database
    rows = db.execute(f"SELECT {', '.join(columns)} FROM jobs").fetchall()  # noqa: S608 - fixed names
    out: dict[int, JobRecord] = {}
    for row in rows:
        values: dict[str, Any] = dict.fromkeys(_ADDED)
        values.update(zip(columns, row, strict=True))
        try:
            for name in ("placement", "stop_kind", "resize_split", "resize_keep"):
                values[name] = str(values[name] or "")
            for name in ("stop_restarts", "resize_to", "resize_set"):
                values[name] = int(values[name] or 0)
            values["banked_wait"] = float(values["banked_wait"] or 0.0)
            record = JobRecord(**values)
            _check_row(record)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"job record {values.get('job_id')!r} is invalid: {exc}") from None
        out[record.job_id] = record
    return out


#: sqlite's words for a database it cannot reach, as opposed to one whose content is bad
_UNAVAILABLE = re.compile(r"unable to open|readonly|read-only|locked|disk I/O|disk is full|permission", re.IGNORECASE)


class StoreUnavailable(RuntimeError):
    """The database cannot be opened or written (permissions, a read-only or full filesystem, a lock): its
    records are kept as they are, and the daemon does not start."""


class Store:
    """SQLite store of :class:`JobRecord` and small key/value metadata."""

    def __init__(self, state_dir: Path, *, read_only: bool = False) -> None:
        self.path = state_dir / DB_NAME
        self.read_only = read_only
        if not read_only:
            self._check_access()
        try:
            self._db = self._open()
        except (sqlite3.DatabaseError, ValueError) as exc:  # not a database, malformed, a wrong schema ...
            unreachable = isinstance(exc, sqlite3.OperationalError) and _UNAVAILABLE.search(str(exc))
            if unreachable and not read_only:  # ... or the filesystem or a lock, which says nothing of the content
                raise StoreUnavailable(f"job records at {self.path}: {exc}") from None
            self._db = self._recover(exc)

    def _check_access(self) -> None:
        """The daemon's user must be able to write the state directory and the database (and its WAL files)."""
        paths = [self.path.parent] + [
            p for p in (self.path.with_name(self.path.name + s) for s in ("", "-wal", "-shm")) if p.exists()
        ]
        for path in paths:
            if not os.access(path, os.R_OK | os.W_OK | (os.X_OK if path.is_dir() else 0)):
                raise StoreUnavailable(
                    f"job records at {self.path}: {path} is not readable and writable by uid {os.getuid()}"
                )

    def _recover(self, exc: Exception) -> sqlite3.Connection:
        """A database whose content cannot be trusted: a dry run starts from Slurm alone and moves nothing; the
        daemon moves it aside and starts an empty one (:meth:`_rebuild`)."""
        if self.read_only:
            log.warning("job records at %s are unreadable (%s): a dry run starts from Slurm alone", self.path, exc)
            return self._empty()
        return self._rebuild(exc)

    def _empty(self) -> sqlite3.Connection:
        db = sqlite3.connect(":memory:")
        self._create(db)
        return db

    def _open(self) -> sqlite3.Connection:
        if self.read_only and not self.path.exists():
            return self._empty()
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True) if self.read_only else sqlite3.connect(self.path)
        try:
            if not self.read_only:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
            if not self.read_only:
                self._create(db)
            _load_rows(db)  # every row must make a valid record
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def _create(db: sqlite3.Connection) -> None:
        columns = ", ".join(f"{name} {_TYPES.get(name, 'REAL')}" for name in _COLUMNS)
        with db:
            db.execute(f"CREATE TABLE IF NOT EXISTS jobs ({columns})")
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute(
                "CREATE TABLE IF NOT EXISTS grows (job_id INTEGER PRIMARY KEY, before REAL NOT NULL, "
                "previous TEXT NOT NULL, restart_count INTEGER NOT NULL, after REAL, fallen_at REAL, "
                "earlier INTEGER NOT NULL DEFAULT 0, grown TEXT NOT NULL DEFAULT '')"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS placements (job_id INTEGER NOT NULL, restart_count INTEGER NOT NULL, "
                "uid INTEGER NOT NULL, model TEXT NOT NULL, skew REAL NOT NULL, consolidated INTEGER NOT NULL, "
                "speed REAL NOT NULL, at REAL NOT NULL, PRIMARY KEY (job_id, restart_count))"
            )
            have_grows = {row[1] for row in db.execute("PRAGMA table_info(grows)")}
            for name, kind in _GROWS_ADDED.items():
                if name not in have_grows:
                    db.execute(f"ALTER TABLE grows ADD COLUMN {name} {kind}")
            # a database written by an older daemon: add the columns it lacks (their defaults apply)
            have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
            for name in _COLUMNS:
                if name not in have:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {_TYPES.get(name, 'REAL')}")

    def _rebuild(self, why: Exception) -> sqlite3.Connection:
        """Move a corrupt database (and its WAL files) aside, kept for a post-mortem, and start an empty one: the
        next pass rebuilds the records of the jobs in squeue (their current runs; banked service is lost)."""
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"  # never over an earlier one
        for suffix in ("", "-wal", "-shm"):
            source = self.path.with_name(self.path.name + suffix)
            with contextlib.suppress(FileNotFoundError):
                os.replace(source, self.path.with_name(f"{self.path.name}{suffix}.corrupt-{stamp}"))
        log.error("job records at %s were corrupt (%s): moved aside, rebuilding from Slurm", self.path, why)
        return self._open()

    def close(self) -> None:
        self._db.close()

    def load(self) -> dict[int, JobRecord]:
        """Every record; a database that went bad since it was opened is moved aside and rebuilt (empty)."""
        try:
            return _load_rows(self._db)
        except (sqlite3.DatabaseError, ValueError) as exc:
            if self.read_only:
                raise
            self._db.close()
            self._db = self._rebuild(exc)
            return {}

    def save(
        self,
        records: Iterable[JobRecord],
        forget: Iterable[int] = (),
        grows: Mapping[int, ScaleOutWatch] | None = None,
        placements: Iterable[PlacementReport] | None = None,
    ) -> None:
        """Insert or replace ``records`` and delete ``forget`` in one transaction (no-op when read-only); ``grows``
        (when given) replaces every grow watched, ``placements`` (when given) every placement report."""
        if self.read_only:
            return
        marks = ", ".join("?" for _ in _COLUMNS)
        with self._db:
            self._db.executemany(
                f"INSERT OR REPLACE INTO jobs ({', '.join(_COLUMNS)}) VALUES ({marks})",  # noqa: S608
                [tuple(asdict(record).values()) for record in records],
            )
            self._db.executemany("DELETE FROM jobs WHERE job_id = ?", [(job_id,) for job_id in forget])
            if grows is not None:
                self._db.execute("DELETE FROM grows")
                self._db.executemany(
                    "INSERT INTO grows (job_id, before, previous, restart_count, after, fallen_at, earlier, grown) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            job_id,
                            w.before,
                            split_text(dict(w.previous)),
                            w.restart_count,
                            w.after,
                            w.at,
                            w.earlier,
                            split_text(dict(w.grown)),
                        )
                        for job_id, w in sorted(grows.items())
                    ],
                )
            if placements is not None:
                self._db.execute("DELETE FROM placements")
                self._db.executemany(
                    "INSERT INTO placements (job_id, restart_count, uid, model, skew, consolidated, speed, at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (r.job_id, r.restart_count, r.uid, r.model, r.skew, int(r.consolidated), r.speed, r.at)
                        for r in placements
                    ],
                )

    def load_placements(self) -> tuple[PlacementReport, ...]:
        """The placement reports kept for PACKLIMIT's refit, oldest first; a row that does not make a valid
        report is left out, said in the log."""
        if not any(True for _ in self._db.execute("PRAGMA table_info(placements)")):
            return ()  # a read-only view of a database older than the table
        rows = self._db.execute(
            "SELECT job_id, restart_count, uid, model, skew, consolidated, speed, at FROM placements "
            "ORDER BY at, job_id, restart_count"
        ).fetchall()
        out: list[PlacementReport] = []
        for job_id, restart_count, uid, model, skew, consolidated, speed, at in rows:
            try:
                if consolidated not in (0, 1) or isinstance(consolidated, float):
                    raise ValueError(f"consolidated {consolidated!r}")
                out.append(PlacementReport(job_id, restart_count, uid, model, skew, bool(consolidated), speed, at))
            except ValueError as exc:
                log.warning("placement report of job %r in %s is invalid, left out: %s", job_id, self.path, exc)
        return tuple(out)

    def load_grows(self) -> dict[int, ScaleOutWatch]:
        """The grows watched (Role 3), by job id; a row that does not make a valid record is left out, said in the
        log (that job is not watched)."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(grows)")}
        if not have:  # a read-only view of a database older than the table
            return {}
        added = ", ".join(name if name in have else _GROWS_DEFAULT[name] for name in _GROWS_ADDED)
        rows = self._db.execute(
            f"SELECT job_id, before, previous, restart_count, after, {added} FROM grows"  # noqa: S608 - fixed names
        ).fetchall()
        out: dict[int, ScaleOutWatch] = {}
        for job_id, before, previous, restart_count, after, fallen_at, earlier, grown in rows:
            try:
                if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
                    raise ValueError(f"job_id {job_id!r}")
                if not isinstance(previous, str) or not isinstance(grown, str):
                    raise ValueError(f"GPUs per type {previous!r}, {grown!r}")
                split = tuple(sorted(parse_split(previous).items()))
                after_split = tuple(sorted(parse_split(grown).items()))
                out[job_id] = ScaleOutWatch(before, split, restart_count, after, fallen_at, earlier, after_split)
            except ValueError as exc:
                log.warning("grow record of job %r in %s is invalid, not watched: %s", job_id, self.path, exc)
        return out

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        if self.read_only:
            return
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
