"""The local store: SQLite file of summaries (and, later, diagnoses).

Faults (issue #11): every transaction rolls back on error, so one failed
write never leaves the connection inside a transaction that refuses all later
ones. ``StoreSink`` keeps windows whose write failed in a bounded backlog and
retries them (on the next window and on the pipeline's idle tick); a locked
store (another process holding a write transaction past ``busy_timeout_s``)
and a full disk are retried until the cause is gone, and reported by
``health()`` meanwhile; a record SQLite can never hold is dropped and
counted. What the backlog's bound pushes out is counted as
``drops{where="store_backlog"}``.

The embedded default's answer to "what did the pipeline produce": replay
writes its ``--stats-out`` from here, ``trainscope query`` reads it. Rows are
the protobuf records as blobs plus the columns queries filter on, indexed by
(signal, job, window) and by (signal, job, rank, window), so a question about
one rank or a few windows of a 10,000-rank job reads only those rows
(``records(..., rank=, first_window=)``, ``newest_per_rank``, ``ranks``,
``windows``).

Kernel names: ``KernelWindow`` rows carry kernel ids (``processor/kernel_names.py``); the
job's dictionary is the ``kernel_names`` table (job, id as signed 64-bit, name), written in the
window's own transaction (first entry of an id kept), never aged out (a job's distinct
kernels: kilobytes). ``records`` gives kernel windows with their names filled in;
``raw`` gives the bytes as stored, and ``kernel_names(job)`` the dictionary to read them with.

Retention: ``max_rows`` per signal (oldest deleted first) bounds the file; and
``keep_windows`` (default None: never) ages out, per job and window kind, the
records of windows older than the newest ``keep_windows`` — only when set,
checked every 10,000 rows written and by ``age_out()``; what it deletes is
counted in ``aged_out`` (rows) and logged.
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import pathlib
import re
import sqlite3
import threading
import time
from typing import Iterator, Sequence

from trainscope.processor.kernel_names import KERNEL_NAMES, Sent, fill_names, from_signed, to_signed
from trainscope.processor.model import WindowOutput
from trainscope.proto.contracts import RECORD_TYPES, SIGNALS, Signal
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError
from trainscope.proto.securefs import open_private

#: Most ranks one ``raw(ranks=...)`` filter takes (SQLite binds one parameter per rank).
MAX_RANKS_FILTER = 900

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
CREATE INDEX IF NOT EXISTS records_by_rank ON records (signal, job, rank, window_index);
CREATE TABLE IF NOT EXISTS kernel_names (
    job TEXT NOT NULL,
    id INTEGER NOT NULL,
    name TEXT NOT NULL,
    PRIMARY KEY (job, id)
);
"""
#: The processor's tables in a store file (the analyzer adds ``analyzer.store.TABLES``).
TABLES = frozenset({"records"})


log = logging.getLogger(__name__)


def open_sqlite(path: str, schema: str, *, timeout_s: float = 30.0, read_only: bool = False) -> sqlite3.Connection:
    """The local store's connection, shared by the processor and the analyzer
    (one file, several writers): WAL so readers never block writers, NORMAL
    sync (a crash may lose the last transactions, never corrupts; a full fsync
    per record would cap the processor at a few hundred windows/s), a busy
    timeout for the other process's transactions.

    ``read_only`` (``query``, ``report``): opened ``mode=ro``, so the file is never
    changed (no WAL switch, no tables added to someone else's database); a table of
    ``schema`` the file lacks is an empty TEMP table of this connection only."""
    if read_only:
        db = sqlite3.connect(_read_only_uri(path), uri=True, check_same_thread=False, isolation_level=None,
                             timeout=timeout_s)
        have = _tables(db)
        for stmt in schema.split(";"):
            m = re.match(r"\s*CREATE TABLE IF NOT EXISTS (\w+)", stmt)
            if m and m.group(1) not in have:
                db.execute(stmt.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
        return db
    if path != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        # created 0600 and never through a symlink; SQLite gives -wal and -shm the same mode
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=timeout_s)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    return db


def _read_only_uri(path: str) -> str:
    return pathlib.Path(os.path.abspath(path)).as_uri() + "?mode=ro"


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'")}


def tables_in(path: str) -> set[str]:
    """The table names of the SQLite file at ``path``, read without writing to it
    (``sqlite3.DatabaseError`` when it is not an SQLite database)."""
    db = sqlite3.connect(_read_only_uri(path), uri=True)
    try:
        return _tables(db)
    finally:
        db.close()


def _lock_path(path: str) -> str:
    # beside the database, not the database itself: closing any descriptor of the database file
    # would drop this process's POSIX locks that SQLite holds on it
    return path + "-lock"


def store_in_use(path: str) -> bool:
    """Whether a process has the store at ``path`` open for writing (a running processor, or a
    replay, sim or demo): each writing ``SqliteStore`` holds a shared ``flock`` on ``<path>-lock``
    while open, released by the kernel when that process ends, however it ends."""
    try:
        fd = os.open(_lock_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: no writer since it was made (or a store of an older version)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's own lock
    return False


class SqliteStore:
    def __init__(self, path: str, *, max_rows: int = 2_000_000, busy_timeout_s: float = 2.0,
                 read_only: bool = False, keep_windows: int | None = None) -> None:
        if keep_windows is not None and not (isinstance(keep_windows, int) and keep_windows >= 1):
            raise ConfigError("store.keep_windows", keep_windows, "must be an integer >= 1 (or None: keep every window)")
        self.path = path
        self.max_rows = max_rows
        self.keep_windows = keep_windows
        self.aged_out = 0  # rows deleted by keep_windows
        self._lock = threading.Lock()
        # short: a store locked by another process must not stall the processing thread for
        # long; the sink keeps the window and retries
        self._db = open_sqlite(path, SCHEMA, timeout_s=busy_timeout_s, read_only=read_only)
        self._inserted = 0
        self._held: int | None = None  # the shared flock that says "in use" (store_in_use)
        if not read_only and path != ":memory:":
            try:
                self._held = open_private(_lock_path(path), os.O_RDONLY)
                fcntl.flock(self._held, fcntl.LOCK_SH)  # an exclusive probe holds it for microseconds
            except (OSError, ConfigError) as e:  # e.g. another user's file: the store still works
                log.warning("store %s: cannot hold its in-use lock (%s); replay --force cannot see it is open",
                            path, e)

    def put(self, signal: str, rec) -> None:
        self.put_many([(signal, rec)])

    def put_many(self, items) -> None:
        """Insert (signal, record) pairs in one transaction; ``(KERNEL_NAMES, KernelNames)`` items
        go to the dictionary table."""
        names = [(n.job_id, to_signed(e.id), e.name) for signal, n in items if signal == KERNEL_NAMES
                 for e in n.names if e.id]
        rows = [(signal, rec.resource.job_id, rec.resource.rank, rec.window.kind, rec.window.index,
                 rec.window.start_ns, rec.window.end_ns, rec.SerializeToString()) for signal, rec in items
                if signal != KERNEL_NAMES]
        if not rows and not names:
            return

        def write(db) -> None:
            if names:
                db.executemany("INSERT OR IGNORE INTO kernel_names (job, id, name) VALUES (?,?,?)", names)
            db.executemany("INSERT INTO records (signal, job, rank, window_kind, window_index, window_start,"
                           " window_end, value) VALUES (?,?,?,?,?,?,?,?)", rows)

        with self._lock:
            self._transaction(write)
            before = self._inserted
            self._inserted += len(rows)
            if self._inserted // 10_000 != before // 10_000:
                try:
                    self._transaction(self._trim)
                except sqlite3.Error:
                    log.warning("store retention trim failed; retried after the next 10,000 rows",
                                exc_info=True)

    def _transaction(self, body) -> None:
        """Run ``body(db)`` in one transaction; on any error roll back, then re-raise."""
        self._db.execute("BEGIN")
        try:
            body(self._db)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    log.warning("store rollback failed", exc_info=True)
            raise

    def _trim(self, db: sqlite3.Connection) -> None:
        if self.keep_windows is not None:
            self._age_out(db, self.keep_windows)
        for signal in SIGNALS:
            db.execute(
                "DELETE FROM records WHERE signal = ? AND id <= ("
                " SELECT id FROM records WHERE signal = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (signal, signal, self.max_rows),
            )

    def _age_out(self, db: sqlite3.Connection, keep: int) -> int:
        """Delete, per job and window kind, the records of windows before the newest ``keep``."""
        deleted = 0
        newest = db.execute("SELECT job, window_kind, MAX(window_index) FROM records"
                            " GROUP BY job, window_kind").fetchall()
        for job, kind, top in newest:
            cur = db.execute("DELETE FROM records WHERE job = ? AND window_kind = ? AND window_index <= ?",
                             (job, kind, top - keep))
            deleted += max(cur.rowcount, 0)
        if deleted:
            self.aged_out += deleted
            log.info("store %s: aged out %d records of windows older than the newest %d per job",
                     self.path, deleted, keep)
        return deleted

    def age_out(self, keep_windows: int) -> int:
        """Delete the records of every job's windows before its newest ``keep_windows`` (per window
        kind) now; returns the rows deleted (also added to ``aged_out``)."""
        if not (isinstance(keep_windows, int) and keep_windows >= 1):
            raise ConfigError("store.keep_windows", keep_windows, "must be an integer >= 1")
        out = []
        with self._lock:
            self._transaction(lambda db: out.append(self._age_out(db, keep_windows)))
        return out[0]

    def _select(self, columns: str, signal: str, job: str | None, rank: int | None,
                first_window: int | None, tail: str = "", ranks: Sequence[int] | None = None):
        q = f"SELECT {columns} FROM records WHERE signal = ?"
        args: tuple = (signal,)
        for cond, val in (("job = ?", job), ("rank = ?", rank), ("window_index >= ?", first_window)):
            if val is not None:
                q += " AND " + cond
                args += (val,)
        if ranks is not None:
            ranks = sorted({int(r) for r in ranks})
            if len(ranks) > MAX_RANKS_FILTER:
                raise ValueError(f"at most {MAX_RANKS_FILTER} ranks in one filter, got {len(ranks)}")
            q += f" AND rank IN ({','.join('?' * len(ranks))})" if ranks else " AND 0"
            args += tuple(ranks)
        with self._lock:
            return self._db.execute(q + tail, args).fetchall()

    def records(self, signal: str, job: str | None = None, *, rank: int | None = None,
                first_window: int | None = None) -> Iterator:
        """Stored records of one signal (optionally one job, one rank, windows from ``first_window``
        on), in insertion order."""
        cls = RECORD_TYPES[signal]
        rows = self._select("value" if signal != Signal.KERNELS else "value, job", signal, job, rank, first_window,
                            " ORDER BY id")
        if signal != Signal.KERNELS:
            for (value,) in rows:
                yield cls.FromString(value)
            return
        books: dict[str, dict[int, str]] = {}
        for value, j in rows:
            kw = cls.FromString(value)
            book = books.get(j)
            if book is None:
                book = books[j] = self.kernel_names(j)
            fill_names(kw, book.get)
            yield kw

    def kernel_names(self, job: str) -> dict[int, str]:
        """The job's kernel-name dictionary, id -> name."""
        with self._lock:
            rows = self._db.execute("SELECT id, name FROM kernel_names WHERE job = ?", (job,)).fetchall()
        return {from_signed(i): n for i, n in rows}

    def raw(self, signal: str, job: str | None = None, *, rank: int | None = None,
            first_window: int | None = None, ranks: Sequence[int] | None = None) -> list[tuple[int, int, int, bytes]]:
        """(rank, window kind, window index, serialised record) of the records ``records`` yields,
        unparsed (for readers that decode many at once, ``analyzer/kernel_columns.py``); ``ranks``:
        only these (at most ``MAX_RANKS_FILTER``, read through the rank index)."""
        return self._select("rank, window_kind, window_index, value", signal, job, rank, first_window,
                            " ORDER BY id", ranks)

    def newest_per_rank(self, signals, job: str) -> dict[int, object]:
        """Each rank's record with the highest window index among ``signals`` (the newest row on a tie)."""
        signals = tuple(signals)
        marks = ",".join("?" * len(signals))
        with self._lock:
            rows = self._db.execute(
                f"SELECT r.rank, r.signal, r.value FROM records r JOIN ("
                f" SELECT rank, MAX(window_index) AS w FROM records WHERE signal IN ({marks}) AND job = ?"
                f" GROUP BY rank) m ON r.rank = m.rank AND r.window_index = m.w"
                f" WHERE r.signal IN ({marks}) AND r.job = ? ORDER BY r.id",
                (*signals, job, *signals, job)).fetchall()
        out = {}
        for rank, signal, value in rows:
            out[rank] = RECORD_TYPES[signal].FromString(value)   # the newest row of the window wins
        return out

    def ranks(self, signal: str, job: str) -> list[int]:
        """The ranks with records of ``signal`` (from the index alone)."""
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT DISTINCT rank FROM records WHERE signal = ? AND job = ? ORDER BY rank", (signal, job))]

    def windows(self, signal: str, job: str) -> list[tuple[int, int]]:
        """The (window kind, index) pairs with records of ``signal``, ascending."""
        with self._lock:
            return [tuple(r) for r in self._db.execute(
                "SELECT DISTINCT window_kind, window_index FROM records WHERE signal = ? AND job = ?"
                " ORDER BY window_index, window_kind", (signal, job))]

    def jobs(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT job FROM records ORDER BY job")]

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._held is not None:
                os.close(self._held)
                self._held = None


def _fault(e: BaseException) -> str | None:
    """The kind of a store failure that retrying can cure, or None when it cannot."""
    msg = str(e).lower()
    if isinstance(e, sqlite3.OperationalError):
        if "locked" in msg or "busy" in msg:
            return "locked"
        if "full" in msg:
            return "full"
        return "io"
    return None  # OverflowError, IntegrityError, ...: this record will never fit


def _records(items) -> int:
    """The window records among a window's items (its dictionary entries are not counted)."""
    return sum(1 for signal, _ in items if signal != KERNEL_NAMES)


class StoreSink:
    """Writes every window's records to the local store (a ``Sink``), retrying failed writes."""

    name = "store"

    def __init__(self, store: SqliteStore, metrics: SelfMetrics, *, backlog_max: int = 10_000,
                 retry_every_s: float = 1.0) -> None:
        self.store = store
        self.metrics = metrics
        self._backlog: collections.deque[list] = collections.deque()
        self._backlog_max = backlog_max
        self._retry_every = retry_every_s
        self._next_retry = 0.0
        self.fault: str | None = None       # what the last failed write said, until a write succeeds
        self.fault_since: float | None = None
        self._sent = Sent()                 # dictionary entries written, per job

    def export(self, out: WindowOutput) -> None:
        items = list(out.records())
        names = self._sent.new(out.kernel_names)
        if names is not None:   # written in the window's transaction, marked sent once it is
            items.insert(0, (KERNEL_NAMES, names))
        if not items:
            return
        if self._backlog:
            self._backlog.append(items)
            self._trim_backlog()
            self.retry()
        else:
            self._write_or_keep(items)

    def _write_or_keep(self, items: list) -> bool:
        try:
            self.store.put_many(items)
        except Exception as e:
            kind = _fault(e)
            self.metrics.inc("store_errors", kind=kind or "invalid")
            if kind is None:
                log.warning("store refused a window's records for good (%s: %s); dropped",
                            type(e).__name__, e)
                self.metrics.inc("drops", _records(items), where="store_invalid")
                return True
            if self.fault is None:
                self.fault_since = time.monotonic()
                log.warning("store write failed (%s: %s); keeping windows and retrying", kind, e)
            self.fault = kind
            self._backlog.appendleft(items)
            self._trim_backlog()
            self._next_retry = time.monotonic() + self._retry_every
            return False
        for signal, rec in items:
            self.metrics.inc("records_out", sink=self.name, signal=signal)
            if signal == KERNEL_NAMES:
                self._sent.mark(rec)
        if self.fault is not None:
            log.warning("store writes recovered after %.1f s (%s)",
                        time.monotonic() - (self.fault_since or 0.0), self.fault)
            self.fault = self.fault_since = None
        return True

    def _trim_backlog(self) -> None:
        while len(self._backlog) > self._backlog_max:
            lost = self._backlog.pop()  # the newest: keep the order of what is kept
            self.metrics.inc("drops", _records(lost), where="store_backlog")
        self.metrics.set("store_backlog", len(self._backlog))

    def retry(self, force: bool = False) -> bool:
        """Write the backlog, oldest first, until it is empty or a write fails; True when empty."""
        if not self._backlog:
            return True
        if not force and time.monotonic() < self._next_retry:
            return False
        while self._backlog:
            if not self._write_or_keep(self._backlog.popleft()):
                return False
        self.metrics.set("store_backlog", 0)
        return True

    def tick(self) -> None:
        """The pipeline's idle tick: retry a backlog even when no new window comes."""
        self.retry()

    def health(self) -> dict:
        return {"ok": self.fault is None, "fault": self.fault, "backlog_windows": len(self._backlog),
                "fault_for_s": round(time.monotonic() - self.fault_since, 1) if self.fault_since else 0.0}

    def flush(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.retry(force=True):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return True

    def close(self) -> None:
        if self._backlog:
            n = sum(_records(i) for i in self._backlog)
            log.error("store still failing at close (%s): %d records of %d windows not stored",
                      self.fault, n, len(self._backlog))
            self.metrics.inc("drops", n, where="store_backlog")
            self._backlog.clear()
