"""An analyzer killed and restarted resumes from its committed offsets (issue #11 item 5a).

Real pieces: a Tansu broker, the simulator through the embedded processor's
Kafka sink, and `trainscope analyzer` as a child process (static group
membership by default). The analyzer is SIGKILLed after it judged a first
job; a second job is produced while it is dead; the restarted analyzer must
give every window of that job a verdict. The rejoin time is printed (issue:
81 s, windows 112-159 without a verdict).
"""
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from support.pipeline import wait_for
from trainscope.collector.sim import sim_config
from trainscope.deploy.embedded import run_sim_embedded
from trainscope.processor.kafka_config import KafkaSinkConfig

pytestmark = pytest.mark.integration

RANKS, ITERATIONS, PER_WINDOW = 8, 20, 5
WINDOWS = ITERATIONS // PER_WINDOW
#: The stock-Kafka minimum: Tansu answers a JoinGroup after about half of it, and this test joins twice
#: (10 s cost it ~4 s more; the resume it checks does not depend on it: the member is static)
SESSION_S = 6.0


def produce(job, bootstrap, home):
    cfg = sim_config(ranks=RANKS, iterations=ITERATIONS, seed=5, job_id=job, home=str(home / job),
                     window_iterations=PER_WINDOW)
    kafka = KafkaSinkConfig(bootstrap=bootstrap, spool_dir=str(home / job / "spool"), linger_ms=5)
    res = run_sim_embedded(cfg, processor_options={"kafka": kafka})
    assert res.dropped == 0


def verdict_windows(store, job) -> set[int]:
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
        try:
            return {w for (w,) in db.execute("SELECT window_index FROM verdicts WHERE job=?", (job,))}
        finally:
            db.close()
    except sqlite3.OperationalError:
        return set()


def spawn(bootstrap, home, log):
    return subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "analyzer", "--kafka-bootstrap", bootstrap,
                             "--group-id", "restart-g", "--home", str(home), "--window-timeout-s", "3",
                             "--session-timeout-s", str(SESSION_S)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def test_a_killed_analyzer_resumes_from_committed_offsets(tansu_broker, tmp_path):
    home = tmp_path / "analyzer"
    store = str(home / "store.sqlite")
    log = open(tmp_path / "analyzer.log", "ab")
    produce("before", tansu_broker.bootstrap, tmp_path)
    an = spawn(tansu_broker.bootstrap, home, log)
    try:
        assert wait_for(lambda: len(verdict_windows(store, "before")) >= WINDOWS, 90), \
            (tmp_path / "analyzer.log").read_text()[-3000:]
        time.sleep(1.5)  # past one offset commit (every 1 s)
        an.send_signal(signal.SIGKILL)
        an.wait(10)
        produce("between", tansu_broker.bootstrap, tmp_path)  # while no analyzer runs
        assert verdict_windows(store, "between") == set()
        t0 = time.monotonic()
        an = spawn(tansu_broker.bootstrap, home, log)
        assert wait_for(lambda: verdict_windows(store, "between"), 120), \
            (tmp_path / "analyzer.log").read_text()[-3000:]
        first = time.monotonic() - t0
        assert wait_for(lambda: len(verdict_windows(store, "between")) >= WINDOWS, 60)
        print(f"restart to first verdict of the windows produced while it was dead: {first:.1f} s "
              f"(session timeout {SESSION_S:g} s, window timeout 3 s)")
        assert verdict_windows(store, "between") == set(range(WINDOWS))
        assert verdict_windows(store, "before") == set(range(WINDOWS))  # kept across the restart
        assert first < SESSION_S + 3 + 10  # within one session timeout (+ window timeout, start-up)
    finally:
        if an.poll() is None:
            an.send_signal(signal.SIGTERM)
            try:
                an.wait(20)
            except subprocess.TimeoutExpired:
                an.kill()
                an.wait(10)
        log.close()
