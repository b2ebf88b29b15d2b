"""The local store: SQLite file of summaries (and, later, diagnoses).

The embedded default's answer to "what did the pipeline produce": replay
writes its ``--stats-out`` from here, ``trainscope query`` reads it. Rows are
the protobuf records as blobs plus the columns queries filter on. Retention is
bounded by ``max_rows`` per signal (oldest deleted first).
"""
from __future__ import annotations

import os
import sqlite3
import threading
from typing import Iterator

from trainscope.processor.model import WindowOutput
from trainscope.proto.contracts import RECORD_TYPES, SIGNALS
from trainscope.processor.selfmetrics import SelfMetrics


SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    signal TEXT NOT NULL,
    job TEXT NOT NULL,
    rank INTEGER NOT NULL,
    window_kind INTEGER NOT NULL,
    window_index INTEGER NOT NULL,
    window_start INTEGER NOT NULL,
    window_end INTEGER NOT NULL,
    value BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS records_by_job ON records (signal, job, window_index, rank);
"""


def open_sqlite(path: str, schema: str) -> sqlite3.Connection:
    """The local store's connection, shared by the processor and the analyzer
    (one file, several writers): WAL so readers never block writers, NORMAL
    sync (a crash may lose the last transactions, never corrupts; a full fsync
    per record would cap the processor at a few hundred windows/s), a busy
    timeout for the other process's transactions."""
    if path != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    return db


class SqliteStore:
    def __init__(self, path: str, *, max_rows: int = 2_000_000) -> None:
        self.path = path
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._db = open_sqlite(path, SCHEMA)
        self._inserted = 0

    def put(self, signal: str, rec) -> None:
        self.put_many([(signal, rec)])

    def put_many(self, items) -> None:
        """Insert (signal, record) pairs in one transaction."""
        rows = [(signal, rec.resource.job_id, rec.resource.rank, rec.window.kind, rec.window.index,
                 rec.window.start_ns, rec.window.end_ns, rec.SerializeToString()) for signal, rec in items]
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT INTO records (signal, job, rank, window_kind, window_index, window_start,"
                " window_end, value) VALUES (?,?,?,?,?,?,?,?)", rows)
            self._db.execute("COMMIT")
            before = self._inserted
            self._inserted += len(rows)
            if self._inserted // 10_000 != before // 10_000:
                self._trim()

    def _trim(self) -> None:
        for signal in SIGNALS:
            self._db.execute(
                "DELETE FROM records WHERE signal = ? AND id <= ("
                " SELECT id FROM records WHERE signal = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (signal, signal, self.max_rows),
            )

    def records(self, signal: str, job: str | None = None) -> Iterator:
        """Stored records of one signal (optionally one job), in insertion order."""
        cls = RECORD_TYPES[signal]
        q = "SELECT value FROM records WHERE signal = ?"
        args: tuple = (signal,)
        if job is not None:
            q += " AND job = ?"
            args += (job,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY id", args).fetchall()
        for (value,) in rows:
            yield cls.FromString(value)

    def jobs(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT job FROM records ORDER BY job")]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class StoreSink:
    """Writes every window's records to the local store (a ``Sink``)."""

    name = "store"

    def __init__(self, store: SqliteStore, metrics: SelfMetrics) -> None:
        self.store = store
        self.metrics = metrics

    def export(self, out: WindowOutput) -> None:
        items = list(out.records())
        self.store.put_many(items)
        for signal, _ in items:
            self.metrics.inc("records_out", sink=self.name, signal=signal)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def close(self) -> None:
        pass
