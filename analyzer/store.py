"""Diagnoses and verdicts in the local store (the same SQLite file as the
processor's records by default, so ``trainscope query`` needs one path).

Rows keep the protobuf record as a blob plus the columns queries filter on;
a diagnosis id is stable for (job, level, kind, window, scope, suspects), so
re-analysing a window replaces rather than duplicates it.
"""
from __future__ import annotations

import threading
from typing import Iterator

from trainscope.processor.store import open_sqlite
from trainscope.proto.v1 import records_pb2

SCHEMA = """
CREATE TABLE IF NOT EXISTS diagnoses (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    level TEXT NOT NULL,
    kind TEXT NOT NULL,
    window_index INTEGER NOT NULL,
    window_start INTEGER NOT NULL,
    window_end INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    value BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS diagnoses_by_job ON diagnoses (job, created_ns);
CREATE TABLE IF NOT EXISTS verdicts (
    job TEXT NOT NULL,
    window_kind INTEGER NOT NULL,
    window_index INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (job, window_kind, window_index)
);
"""
#: The analyzer's tables in a store file (beside the processor's ``processor.store.TABLES``).
TABLES = frozenset({"diagnoses", "verdicts"})


class DiagnosisStore:
    def __init__(self, path: str, *, max_rows: int = 1_000_000, read_only: bool = False) -> None:
        self.path = path
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._db = open_sqlite(path, SCHEMA, read_only=read_only)  # read_only: query, report
        self._writes = 0

    def put(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict | None) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            for d in diagnoses:
                w = d.window
                self._db.execute(
                    "INSERT OR REPLACE INTO diagnoses VALUES (?,?,?,?,?,?,?,?,?)",
                    (d.id, d.job_id, d.level, d.kind, w.index, w.start_ns, w.end_ns,
                     d.created_unix_ns, d.SerializeToString()))
            if verdict is not None:
                w = verdict.window
                self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?,?,?,?,?)",
                                 (verdict.job_id, w.kind, w.index, verdict.created_unix_ns,
                                  verdict.SerializeToString()))
            self._db.execute("COMMIT")
            self._writes += 1
            if self._writes % 1000 == 0:
                self._db.execute("DELETE FROM diagnoses WHERE rowid <= (SELECT rowid FROM diagnoses"
                                 " ORDER BY rowid DESC LIMIT 1 OFFSET ?)", (self.max_rows,))

    def diagnoses(self, job: str | None = None, since_ns: int = 0, level: str | None = None,
                  kind: str | None = None) -> Iterator[records_pb2.Diagnosis]:
        q, args = "SELECT value FROM diagnoses WHERE created_ns >= ?", [since_ns]
        for col, val in (("job", job), ("level", level), ("kind", kind)):
            if val is not None:
                q += f" AND {col} = ?"
                args.append(val)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY window_index, created_ns", args).fetchall()
        for (v,) in rows:
            yield records_pb2.Diagnosis.FromString(v)

    def verdicts(self, job: str | None = None) -> list[records_pb2.Verdict]:
        q, args = "SELECT value FROM verdicts", []
        if job is not None:
            q += " WHERE job = ?"
            args.append(job)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY window_index", args).fetchall()
        return [records_pb2.Verdict.FromString(v) for (v,) in rows]

    def latest_verdict(self, job: str) -> records_pb2.Verdict | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM verdicts WHERE job = ? ORDER BY window_index DESC,"
                                   " created_ns DESC LIMIT 1", (job,)).fetchone()
        return records_pb2.Verdict.FromString(row[0]) if row else None

    def jobs(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT job FROM verdicts ORDER BY job")]

    def close(self) -> None:
        with self._lock:
            self._db.close()
