"""The kernel-name dictionary through a real Kafka-protocol broker (Tansu, or $KAFKA_BOOTSTRAP).

simulator → exporters → gRPC → processor → KafkaSink (kernel windows with ids only, the names on
the compacted ``kernel_names`` topic) → KafkaSource → analyzer. Checked: the windows on Kafka
carry no kernel names; the verdict of a throttled GPU still names its rank and the slowed kernel
by name; bad input on the dictionary topic (an entry naming a known id differently, a window
whose id nobody names, bytes that are no record) is counted and never stops the analyzer.
"""
from __future__ import annotations

import logging
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from trainscope.analyzer.evaluate import evaluate, load_truth
from trainscope.analyzer.service import Analyzer, AnalyzerConfig
from trainscope.analyzer.sources import KafkaSource
from trainscope.collector.sim import sim_config
from trainscope.deploy.embedded import run_sim_embedded
from trainscope.processor.kafka_config import KafkaSinkConfig
from trainscope.processor.kernel_names import kernel_id, label
from trainscope.proto.v1 import common_pb2, records_pb2

pytestmark = pytest.mark.integration

RANKS, ITERATIONS, PER_WINDOW, CULPRIT = 16, 20, 10, 5


def _read_all(bootstrap: str, topic: str, want: int, timeout_s: float = 20.0) -> list:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False})
    out = []
    try:
        md = c.list_topics(topic, timeout=10)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.topics[topic].partitions])
        deadline = time.monotonic() + timeout_s
        while len(out) < want and time.monotonic() < deadline:
            out += [m for m in c.consume(1000, 0.3) if not m.error()]
    finally:
        c.close()
    return out


def test_verdict_names_the_kernel_from_ids_and_bad_entries_are_counted(kafka_bootstrap, tmp_path):
    prefix = f"ts{uuid.uuid4().hex[:8]}"
    job = "names"
    res = run_sim_embedded(
        sim_config(ranks=RANKS, tp=2, pp=2, iterations=ITERATIONS, seed=3, job_id=job, home=str(tmp_path / "sim"),
                   window_iterations=PER_WINDOW, faults=[f"gpu_throttle:rank={CULPRIT},onset=10s,factor=1.6"]),
        processor_options={"kafka": KafkaSinkConfig(bootstrap=kafka_bootstrap, topic_prefix=prefix,
                                                    spool_dir=str(tmp_path / "spool"), linger_ms=5)})
    assert res.dropped == 0
    truth = load_truth(res.ground_truth_path)

    # 1. the windows on Kafka carry ids and no names; the dictionary names every id once
    windows = [records_pb2.KernelWindow.FromString(m.value())
               for m in _read_all(kafka_bootstrap, f"{prefix}.kernels.v1", RANKS * ITERATIONS // PER_WINDOW)]
    assert len(windows) >= RANKS * ITERATIONS // PER_WINDOW
    stats = [ks for kw in windows for ks in kw.kernels]
    assert stats and all(ks.kernel == "" and ks.kernel_id for ks in stats)
    ids = {ks.kernel_id for ks in stats}
    entries = _read_all(kafka_bootstrap, f"{prefix}.kernel_names.v1", len(ids))
    book = {}
    for m in entries:
        (e,) = records_pb2.KernelNames.FromString(m.value()).names
        book[e.id] = e.name
    assert set(book) == ids and all(kernel_id(n) == i for i, n in book.items())
    assert len(entries) == len(ids)          # each entry once (one processor, no outage)

    # 2. bad input, after the real entries: a conflicting name for a real id (same key, same
    #    partition, so after the genuine one), garbage bytes, and a window of another job whose id
    #    nobody ever names
    some_id = next(iter(ids))
    ghost = 0x1234_5678_9ABC_DEF0
    p = Producer({"bootstrap.servers": kafka_bootstrap, "logger": logging.getLogger("tests.kernel_names.kafka")})
    p.produce(f"{prefix}.kernel_names.v1", records_pb2.KernelNames(
        job_id=job, names=[records_pb2.KernelName(id=some_id, name="impostor")]).SerializeToString(),
        f"{job}/{some_id:016x}".encode())
    p.produce(f"{prefix}.kernel_names.v1", b"\xff\x00garbage", b"junk")
    stray = records_pb2.KernelWindow(resource=common_pb2.Resource(job_id="stray", rank=0, world_size=1),
                                     window=records_pb2.Window(index=0))
    stray.kernels.add(kernel_id=ghost, stream=7, count=3, total_ns=3e3).clusters.add(count=3, p50_ns=1e3, p99_ns=1e3)
    p.produce(f"{prefix}.kernels.v1", stray.SerializeToString(), b"stray")
    assert p.flush(10) == 0

    # 3. the analyzer reads everything through Kafka and resolves the names
    group = f"g{uuid.uuid4().hex[:8]}"
    source = KafkaSource(kafka_bootstrap, group_id=group, prefix=prefix,
                         extra={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    source.names.hold_s = 1.0
    analyzer = Analyzer(AnalyzerConfig(grace_s=0.2), source)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (len([v for v in analyzer.verdicts if v.job_id == job])
                                           < ITERATIONS // PER_WINDOW or source.names.held):
        analyzer.step(0.3)
    analyzer.finish()
    source.close()
    mine = [v for v in analyzer.verdicts if v.job_id == job]
    assert len(mine) == ITERATIONS // PER_WINDOW
    ev = evaluate(mine, truth, PER_WINDOW)
    f = ev.faults[0]
    assert f.caught and f.top1 and f.kernel, f.verdict     # the rank, and the kernel by its name
    named = {k for v in mine for k in v.kernels if not k.startswith("[")}   # "[compute]": a category
    assert named and named <= set(book.values()) and not any(k.startswith("kernel#") for k in named)
    assert ev.false_alarm_windows == 0
    c = source.names.counters
    assert c["names_conflicts"] == 1 and c["names_bad"] == 1       # counted; the first name kept
    assert c["names_unknown"] == 1 and c["windows_labelled"] == 1  # the stray window, labelled
    assert source.names.name(job, some_id) == book[some_id]
    stray_verdicts = [v for v in analyzer.verdicts if v.job_id == "stray"]
    assert all(not v.ranks for v in stray_verdicts)
    assert label(ghost) == "kernel#123456789abcdef0"

    # 4. restart: a new analyzer of the same group resumes the windows after its committed offsets,
    #    and still names a later window's ids (the dictionary is read again from offset 0)
    later = records_pb2.KernelWindow(resource=common_pb2.Resource(job_id=job, rank=0, world_size=RANKS),
                                     window=records_pb2.Window(index=99))
    later.kernels.add(kernel_id=some_id, stream=7, count=1)
    p.produce(f"{prefix}.kernels.v1", later.SerializeToString(), job.encode())
    assert p.flush(10) == 0
    again = KafkaSource(kafka_bootstrap, group_id=group, prefix=prefix,
                        extra={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    got = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not got:
        got = [rec for sig, rec in again.poll(0.5) if sig == "kernels"]
    again.close()
    assert [(rec.window.index, [ks.kernel for ks in rec.kernels]) for rec in got] == [(99, [book[some_id]])]
