"""The daemons as an operator runs them: `trainscope processor` and
`trainscope analyzer` as separate processes on 127.0.0.1 sharing a home
directory (no broker), a collector per rank, one rank slow in forward."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from support.ports import free_port
from trainscope.analyzer.store import DiagnosisStore
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.sdk import Collector, CollectorConfig

pytestmark = pytest.mark.integration
MS = 1_000_000


def spawn(args, home, log):
    return subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", *args, "--home", str(home)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_processor_and_analyzer_daemons_find_the_slow_rank(tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    log = open(tmp_path / "daemons.log", "w")
    proc = spawn(["processor", "--listen", addr, "--window-mode", "iterations", "--window-iterations", "5"],
                 tmp_path, log)
    analyzer = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        analyzer_started = False
        cols = [Collector(CollectorConfig(job_id="djob", rank=r, world_size=4,
                                          exporter=ExporterConfig(target=addr, confirm_interval_s=0.2)))
                for r in range(4)]
        t0 = 1_000_000_000
        for it in range(15):
            for r, c in enumerate(cols):
                t = t0 + it * 200 * MS
                fwd = 50 * MS * (1.5 if r == 2 else 1.0)
                c.record_phase("forward", t, int(fwd), iteration=it)
                c.record_phase("backward", t + int(fwd), 100 * MS, iteration=it)
                c.iteration(it, start_ns=t, end_ns=t + 190 * MS)
            if it == 2 and not analyzer_started:
                analyzer = spawn(["analyzer", "--window-timeout-s", "20"], tmp_path, log)
                analyzer_started = True
        for c in cols:
            assert c.shutdown(10)
        store = tmp_path / "store.sqlite"
        deadline = time.monotonic() + 60
        found = None
        while time.monotonic() < deadline and found is None:
            if store.exists():
                ds = DiagnosisStore(str(store))
                for v in ds.verdicts("djob"):
                    if v.ranks:
                        found = v
                ds.close()
            time.sleep(0.3)
        assert found is not None, (tmp_path / "daemons.log").read_text()[-3000:]
        assert found.ranks[0].rank == 2 and "forward" in found.phases
    finally:
        if analyzer is not None:
            stop(analyzer)
        stop(proc)
        log.close()
    assert proc.returncode == 0 and analyzer.returncode == 0
