"""Restarts lose nothing silently (issue #11 item 5b): a real `trainscope processor` process killed
with SIGKILL and restarted on the same address and home, fed by the real exporter.

Before the restart contract (processor/durability.py) the batches of the windows the killed
process held in memory were lost while the exporter counted them as confirmed. Now every
event sent is stored exactly once: the store is read back and compared with what was sent.
"""
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import numpy as np

from support.pipeline import wait_for
from support.ports import free_port
from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.exporter_socket import reachable
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2

JOB = "restart-job"
PER_BATCH = 50


def spawn(addr, home, log):
    return subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", addr,
                             "--home", str(home), "--window-mode", "time", "--window-length-s", "1"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stored_kernel_events(store: str) -> tuple[int, int]:
    """(kernel events, kernel window records) of JOB in the store."""
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT value FROM records WHERE signal='kernels' AND job=?", (JOB,)).fetchall()
    finally:
        db.close()
    return sum(records_pb2.KernelWindow.FromString(v).events for (v,) in rows), len(rows)


def windows_stored_twice(store: str) -> int:
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM (SELECT window_index, COUNT(*) c FROM records WHERE "
                          "signal='kernels' AND job=? GROUP BY rank, window_index HAVING c > 1)", (JOB,)).fetchone()[0]
    finally:
        db.close()


def test_sigkill_and_restart_store_every_event_once(tmp_path):
    home = tmp_path / "home"
    addr = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "processor.log", "ab")
    proc = spawn(addr, home, log)
    exp = None
    try:
        assert wait_for(lambda: reachable(addr), 30), (tmp_path / "processor.log").read_text()
        exp = BatchExporter(Resource(job_id=JOB, rank=0, world_size=1),
                            ExporterConfig(target=addr, confirm_interval_s=0.2, backoff_initial_s=0.01,
                                           backoff_max_s=0.2))
        sent = 0
        stop = threading.Event()

        def feed():  # a rank: kernels stamped with its clock, every 20 ms
            nonlocal sent
            while not stop.is_set():
                t0 = time.time_ns()
                cols = KernelColumns.build(["gemm", "nccl:all_reduce"], t0 - 20_000_000 + np.arange(PER_BATCH) * 400_000,
                                           [100_000] * PER_BATCH, np.arange(PER_BATCH) % 2, [7] * PER_BATCH)
                if exp.submit(cols.to_pb(), PER_BATCH * 40):
                    sent += PER_BATCH
                time.sleep(0.02)

        t = threading.Thread(target=feed)
        t.start()
        time.sleep(3.5)
        proc.send_signal(signal.SIGKILL)      # windows held in memory die with it
        proc.wait(10)
        time.sleep(1.0)
        proc = spawn(addr, home, log)         # same address, same store
        assert wait_for(lambda: reachable(addr), 30)
        time.sleep(3.0)
        stop.set()
        t.join()
        assert exp.flush(20)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)      # drains: closes every window into the store
        assert proc.wait(60) == 0
        stats = exp.stats.snapshot()
        stored, _ = stored_kernel_events(str(home / "store.sqlite"))
        print(f"sent {sent} events, stored {stored}, exporter {stats}")
        assert stats["processor_restarts"] == 1 and stats["replayed"] > 0
        assert stats["dropped_total"] == 0 and stats["retain_evicted"] == 0
        assert stored == sent                  # nothing lost, nothing stored twice
        assert windows_stored_twice(str(home / "store.sqlite")) == 0
    finally:
        if exp is not None:
            exp.shutdown(0.5)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
