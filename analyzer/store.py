"""Diagnoses and verdicts in the local store (the same SQLite file as the
processor's records by default, so ``trainscope query`` needs one path).

Rows keep the protobuf record as a blob plus the columns queries filter on;
a diagnosis id is stable for (job, level, kind, window, scope, suspects), so
re-analysing a window replaces rather than duplicates it.

Indexes serve the questions of ``trainscope query``: diagnoses by (job, kind,
time) and (job, window), verdicts by (job, window). Retention: ``max_rows``
diagnoses (oldest deleted first); and ``keep_windows`` (default None: never)
ages out, per job, the diagnoses and verdicts of windows older than the newest
``keep_windows`` (per window kind for verdicts; diagnoses carry no kind, so a
job with both kinds keeps its diagnoses of the kind with the larger indices),
checked every 1,000 writes and by ``age_out()``, counted in ``aged_out``.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable, Iterator

from trainscope.processor.store import open_sqlite
from trainscope.proto.errors import ConfigError
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
CREATE INDEX IF NOT EXISTS diagnoses_by_kind ON diagnoses (job, kind, created_ns);
CREATE INDEX IF NOT EXISTS diagnoses_by_window ON diagnoses (job, window_index);
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

log = logging.getLogger(__name__)


class DiagnosisStore:
    def __init__(self, path: str, *, max_rows: int = 1_000_000, read_only: bool = False,
                 keep_windows: int | None = None) -> None:
        if keep_windows is not None and not (isinstance(keep_windows, int) and keep_windows >= 1):
            raise ConfigError("store.keep_windows", keep_windows, "must be an integer >= 1 (or None: keep every window)")
        self.path = path
        self.max_rows = max_rows
        self.keep_windows = keep_windows
        self.aged_out = {"diagnoses": 0, "verdicts": 0}  # rows deleted by keep_windows
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
                if self.keep_windows is not None:
                    self._age_out(self.keep_windows)
                self._db.execute("DELETE FROM diagnoses WHERE rowid <= (SELECT rowid FROM diagnoses"
                                 " ORDER BY rowid DESC LIMIT 1 OFFSET ?)", (self.max_rows,))

    def _age_out(self, keep: int) -> tuple[int, int]:
        """Delete per job the verdicts (per window kind) and diagnoses of windows before the newest ``keep``."""
        gone_v = gone_d = 0
        for job, kind, top in self._db.execute("SELECT job, window_kind, MAX(window_index) FROM verdicts"
                                               " GROUP BY job, window_kind").fetchall():
            gone_v += max(self._db.execute("DELETE FROM verdicts WHERE job = ? AND window_kind = ? AND"
                                           " window_index <= ?", (job, kind, top - keep)).rowcount, 0)
        for job, top in self._db.execute("SELECT job, MAX(window_index) FROM diagnoses GROUP BY job").fetchall():
            gone_d += max(self._db.execute("DELETE FROM diagnoses WHERE job = ? AND window_index <= ?",
                                           (job, top - keep)).rowcount, 0)
        self.aged_out["verdicts"] += gone_v
        self.aged_out["diagnoses"] += gone_d
        if gone_v or gone_d:
            log.info("store %s: aged out %d diagnoses and %d verdicts of windows older than the newest %d per job",
                     self.path, gone_d, gone_v, keep)
        return gone_d, gone_v

    def age_out(self, keep_windows: int) -> tuple[int, int]:
        """Delete now every job's diagnoses and verdicts of windows before its newest ``keep_windows``;
        returns (diagnoses, verdicts) deleted (also added to ``aged_out``)."""
        if not (isinstance(keep_windows, int) and keep_windows >= 1):
            raise ConfigError("store.keep_windows", keep_windows, "must be an integer >= 1")
        with self._lock:
            self._db.execute("BEGIN")
            try:
                out = self._age_out(keep_windows)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        return out

    def diagnoses(self, job: str | None = None, since_ns: int = 0, level: str | None = None,
                  kind: str | None = None, *, kinds: Iterable[str] | None = None) -> Iterator[records_pb2.Diagnosis]:
        """Diagnoses made at or after ``since_ns`` (unix ns), optionally of one job, level, kind or of
        any of ``kinds``, in window order."""
        q, args = "SELECT value FROM diagnoses WHERE created_ns >= ?", [since_ns]
        for col, val in (("job", job), ("level", level), ("kind", kind)):
            if val is not None:
                q += f" AND {col} = ?"
                args.append(val)
        if kinds is not None:
            kinds = list(kinds)
            q += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += kinds
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

    def count_diagnoses(self, job: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM diagnoses WHERE job = ?", (job,)).fetchone()[0]

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
