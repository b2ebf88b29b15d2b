"""The local store survives its faults (issue #11 item 4): a write that fails rolls back, the
window is kept in a bounded backlog and retried, /healthz-style health reports the fault, and
everything is stored once the cause is gone. Real SQLite files, a real processor on 127.0.0.1:0.

A full disk is produced with ``PRAGMA max_page_count``: SQLite then fails the write with
SQLITE_FULL ("database or disk is full"), the same error it returns when the file system is out
of space (filling a real disk is not possible in the test sandbox).
"""
import sqlite3
import stat

import numpy as np

from support.pipeline import batch, raw_stream, start_processor, wait_for
from trainscope.processor.store import StoreSink
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource

S = 10**9


def send_windows(proc, n_windows, job="job", first=0):
    res = Resource(job_id=job, rank=0, world_size=1)
    msgs = [batch(res, first + w + 1, KernelColumns.build(["gemm"], np.arange(20) * 1000 + (first + w) * 10 * S,
                                                          [500] * 20, [0] * 20, [7] * 20))
            for w in range(n_windows)]
    s = raw_stream(proc.address, msgs)
    assert s.batches_accepted == n_windows


def stored(proc, job="job"):
    return sum(1 for _ in proc.store.records("kernels", job))


def store_sink(proc) -> StoreSink:
    return next(s for s in proc.sinks if isinstance(s, StoreSink))


def test_a_locked_store_is_reported_and_recovers_without_losing_windows(tmp_path):
    path = str(tmp_path / "store.sqlite")
    proc = start_processor(store_path=path)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        send_windows(proc, 6)
        assert proc.pipeline.drain(30, close_windows=False)
        assert wait_for(lambda: proc.metrics.get("store_errors", kind="locked") >= 1, 20)
        h = proc.health()
        assert not h["ok"] and h["store"]["fault"] == "locked" and h["store"]["backlog_windows"] >= 1
        other.execute("COMMIT")  # the cause is gone
        assert proc.drain(30)
        assert stored(proc) == 6
        assert proc.health()["ok"] and proc.metrics.get("store_backlog") == 0
        assert proc.metrics.get("drops", where="store_backlog") == 0
        send_windows(proc, 3, first=7)  # and it goes on storing
        assert proc.drain(30)
        assert stored(proc) == 9
    finally:
        other.close()
        proc.stop()


def test_a_full_store_is_counted_retried_and_drains_once_there_is_room(tmp_path):
    proc = start_processor(store_path=str(tmp_path / "store.sqlite"))
    try:
        send_windows(proc, 2)
        assert proc.drain(30)
        base = stored(proc)
        pages = proc.store._db.execute("PRAGMA page_count").fetchone()[0]
        proc.store._db.execute(f"PRAGMA max_page_count={pages}")  # no room for one more page
        send_windows(proc, 30, first=3)
        assert not proc.drain(3)  # the sink cannot flush while the store is full
        assert proc.metrics.get("store_errors", kind="full") >= 1
        assert proc.health()["store"]["fault"] == "full"
        proc.store._db.execute("PRAGMA max_page_count=1073741823")  # room again
        assert proc.drain(30)
        assert stored(proc) == base + 30
        assert proc.health()["ok"]
    finally:
        proc.stop()


def test_a_record_sqlite_cannot_hold_is_dropped_counted_and_later_writes_succeed(tmp_path):
    proc = start_processor(store_path=str(tmp_path / "store.sqlite"))
    try:
        from trainscope.proto.v1 import records_pb2
        bad = records_pb2.KernelWindow()
        bad.resource.job_id = "x"
        bad.window.start_ns = 2**63  # past SQLite's INTEGER: OverflowError inside the transaction
        sink = store_sink(proc)
        sink._write_or_keep([("kernels", bad)])
        assert proc.metrics.get("store_errors", kind="invalid") == 1
        assert proc.metrics.get("drops", where="store_invalid") == 1
        assert not proc.store._db.in_transaction  # rolled back, not left open
        send_windows(proc, 3)
        assert proc.drain(30)
        assert stored(proc) == 3
    finally:
        proc.stop()


def test_the_backlog_is_bounded_and_what_it_pushes_out_is_counted(tmp_path):
    proc = start_processor(store_path=str(tmp_path / "store.sqlite"))
    other = sqlite3.connect(str(tmp_path / "store.sqlite"), isolation_level=None, timeout=0)
    try:
        sink = store_sink(proc)
        sink._backlog_max = 3
        proc.store._db.execute("PRAGMA busy_timeout=50")
        other.execute("BEGIN IMMEDIATE")
        send_windows(proc, 8)
        assert proc.pipeline.drain(30, close_windows=False)
        assert wait_for(lambda: proc.metrics.get("store_errors", kind="locked") >= 1, 20)
        assert not proc.pipeline.drain(2, close_windows=True)  # windows closed; the store cannot flush
        kept = len(sink._backlog)
        assert kept <= 3
        other.execute("COMMIT")
        assert proc.drain(30)
        lost = proc.metrics.get("drops", where="store_backlog")
        assert lost > 0 and stored(proc) + lost == 8  # every window stored or counted as lost
    finally:
        other.close()
        proc.stop()


def test_the_store_file_is_private_and_not_followed_through_a_symlink(tmp_path):
    proc = start_processor(store_path=str(tmp_path / "store.sqlite"))
    try:
        send_windows(proc, 1)
        assert proc.drain(30)
    finally:
        proc.stop()
    for name in ("store.sqlite", "store.sqlite-wal", "store.sqlite-shm"):
        p = tmp_path / name
        if p.exists():
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, name
    target = tmp_path / "victim"
    target.write_text("keep me")
    (tmp_path / "link.sqlite").symlink_to(target)
    import pytest
    with pytest.raises(OSError):
        start_processor(store_path=str(tmp_path / "link.sqlite"))
    assert target.read_text() == "keep me"
