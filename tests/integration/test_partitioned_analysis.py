"""Partitioned analysis (issue #15 item 3): two `trainscope analyzer --partitioned` processes in one
consumer group give the verdicts one analyzer gives, on the same records.

Real pieces: a dedicated Tansu broker, the simulator through the embedded processor's Kafka sink
with kernel windows keyed by (job, dp group) (``key_by="group"``), two analyzer child processes
sharing the group's partitions, and, as the reference, one in-test ``Analyzer`` on a
``KafkaSource`` of its own group (the single-process path, unchanged). Jobs: a GPU throttled on
rank 13 (L3/L2 must name it) and a healthy one (nobody named, anywhere). The job ids are chosen so
their dp groups' keys hash to partitions on both halves of the range assignment (CRC-32, as
librdkafka's default partitioner), and the test checks from the partials topic that both
processes did part of the L3.
"""
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
import zlib

import pytest

from support.pipeline import wait_for
from support.sim_jobs import SimJob, run_sims
from trainscope.analyzer.partition import PARTIALS
from trainscope.analyzer.service import Analyzer, AnalyzerConfig
from trainscope.analyzer.sources import KafkaSource
from trainscope.proto.contracts import topic_for

pytestmark = pytest.mark.integration

RANKS, TP, PP, ITERATIONS, PER_WINDOW, CULPRIT = 32, 2, 2, 20, 10, 13
WINDOWS = ITERATIONS // PER_WINDOW
PARTITIONS = 6
SESSION_S = 6.0


def split_job(stem: str) -> str:
    """A job id whose 4 dp groups (keys ``<job>/dp<g>``) land on partitions of both halves."""
    for i in range(100):
        job = f"{stem}{i}"
        parts = {zlib.crc32(f"{job}/dp{g}".encode()) % PARTITIONS for g in range(TP * PP)}
        if parts & {0, 1, 2} and parts & {3, 4, 5}:
            return job
    raise AssertionError("no job id splits")


def verdicts(store: str) -> dict[tuple[str, int], tuple]:
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    except sqlite3.OperationalError:
        return {}
    try:
        from trainscope.proto.v1 import records_pb2
        out = {}
        for (raw,) in db.execute("SELECT value FROM verdicts"):
            v = records_pb2.Verdict.FromString(raw)
            out[(v.job_id, v.window.index)] = v
        return out
    except sqlite3.OperationalError:
        return {}
    finally:
        db.close()


def spawn(bootstrap, home, log):
    return subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "analyzer", "--kafka-bootstrap", bootstrap,
                             "--partitioned", "--group-id", "partitioned-g", "--home", str(home),
                             "--window-timeout-s", "10", "--session-timeout-s", str(SESSION_S)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def partial_members(bootstrap: str) -> dict[str, set[str]]:
    """Per job, the members that published a partial (read back from the partials topic)."""
    from confluent_kafka import Consumer, TopicPartition
    from google.protobuf import json_format

    from trainscope.proto.v1 import records_pb2
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"peek{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False})
    c.assign([TopicPartition(topic_for(PARTIALS), p, 0) for p in range(PARTITIONS)])
    out: dict[str, set[str]] = {}
    quiet = time.monotonic() + 3.0
    while time.monotonic() < quiet:
        for m in c.consume(1000, 0.3):
            if m.error():
                continue
            quiet = time.monotonic() + 1.0
            d = records_pb2.Diagnosis.FromString(m.value())
            out.setdefault(d.job_id, set()).add(json_format.MessageToDict(d.evidence)["member"])
    c.close()
    return out


def test_two_partitioned_analyzers_give_one_analyzers_verdicts(tansu_broker, tmp_path):
    bootstrap = tansu_broker.bootstrap
    faulty, healthy = split_job("throttle"), split_job("healthy")
    jobs = [SimJob(dict(ranks=RANKS, tp=TP, pp=PP, iterations=ITERATIONS, seed=3, job_id=job,
                        faults=[f"gpu_throttle:rank={CULPRIT},onset=3s,factor=1.5"] if job == faulty else [],
                        home=str(tmp_path / job), window_iterations=PER_WINDOW),
                   dict(bootstrap=bootstrap, spool_dir=str(tmp_path / job / "spool"), linger_ms=5,
                        key_by="group", partitions=PARTITIONS))
            for job in (faulty, healthy)]
    t0 = time.monotonic()
    for res in run_sims(jobs):
        assert res.dropped == 0
    print(f"sims {time.monotonic() - t0:.1f} s")
    log = open(tmp_path / "analyzers.log", "ab")
    homes = [tmp_path / "a", tmp_path / "b"]
    procs = [spawn(bootstrap, h, log) for h in homes]
    try:
        # the reference: one analyzer, the single-process path, its own group
        source = KafkaSource(bootstrap, group_id=f"single{uuid.uuid4().hex[:6]}",
                             extra={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
        single = Analyzer(AnalyzerConfig(grace_s=0.2), source)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(single.verdicts) < 2 * WINDOWS:
            single.step(0.5)
        source.close()
        ref = {(v.job_id, v.window.index): v for v in single.verdicts}
        print(f"single-process verdicts {time.monotonic() - t0:.1f} s")
        assert len(ref) == 2 * WINDOWS

        def both():
            out = {}
            for h in homes:
                out.update(verdicts(str(h / "store.sqlite")))
            return out
        assert wait_for(lambda: len(both()) >= 2 * WINDOWS, 60), (tmp_path / "analyzers.log").read_text()[-3000:]
        got = both()
        print(f"partitioned verdicts {time.monotonic() - t0:.1f} s")
        assert sorted(got) == sorted(ref)
        for key, v in ref.items():
            p = got[key]
            assert p.state == v.state, (key, p.summary, v.summary)
            assert [r.rank for r in p.ranks] == [r.rank for r in v.ranks], (key, p.summary, v.summary)
            assert list(p.kernels) == list(v.kernels), key
        named = [v for (job, _), v in got.items() if job == faulty and v.ranks]
        assert named and all(v.ranks[0].rank == CULPRIT for v in named), [v.summary for v in got.values()]
        assert all(v.state == "healthy" and not v.ranks and not v.pending
                   for (job, _), v in got.items() if job == healthy), [v.summary for v in got.values()]
        # the L3 of each job was shared: both processes published partials of it
        members = partial_members(bootstrap)
        assert len(members[faulty]) == 2 and len(members[healthy]) == 2, members
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        log.close()
