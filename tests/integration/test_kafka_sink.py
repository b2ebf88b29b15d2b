"""KafkaSink against a real Kafka-protocol broker (Tansu, $KAFKA_BOOTSTRAP, or testcontainers).

What is checked: every record comes back byte-identical, in order per job
(the key), with its headers; an outage spools, ``export`` stays fast, and the
replay after the broker returns (empty: Tansu keeps topics in memory) loses
nothing; a spool too small counts exactly what is missing as drops.
"""
from __future__ import annotations

import collections
import logging
import time
import uuid

import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from trainscope.processor.kafka_config import KafkaSinkConfig
from trainscope.processor.kafka_sink import KafkaSink
from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.proto.contracts import SIGNALS
from trainscope.processor.sink import Sink
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2, telemetry_pb2

pytestmark = pytest.mark.integration

WORLD = 4
JOBS = ("job-a", "job-b")
_quiet = logging.getLogger("tests.kafka.librdkafka")


# -- realistic window outputs ---------------------------------------------
def window_output(job: str, rank: int, index: int) -> WindowOutput:
    """One rank's closed window with all four summaries (stacks every other window)."""
    res = Resource(job_id=job, rank=rank, world_size=WORLD, host=f"node{rank // 2}", pid=4000 + rank,
                   local_rank=rank % 2, device=f"cuda:{rank % 2}", coords=coords_for_rank(rank, WORLD, tp=2))
    pb = res.to_pb()
    t0 = 1_000_000_000 * (index + 1)
    win = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=index, start_ns=t0,
                             end_ns=t0 + 900_000_000, first_iteration=index * 10, last_iteration=index * 10 + 9)
    gemm = records_pb2.KernelStats(
        kernel="sm90_xmma_gemm_bf16bf16_bf16f32", stream=7, kind=telemetry_pb2.KERNEL_KIND_KERNEL,
        clusters=[records_pb2.KernelCluster(count=300, p50_ns=41_000 + rank, p99_ns=44_000,
                                            min_ns=39_000, max_ns=47_000),
                  records_pb2.KernelCluster(count=20, p50_ns=90_000, p99_ns=95_000, min_ns=88_000, max_ns=99_000)],
        count=320, total_ns=14_100_000.0)
    nccl = records_pb2.KernelStats(
        kernel="ncclDevKernel_AllReduce_Sum_bf16_RING_LL", stream=13,
        clusters=[records_pb2.KernelCluster(count=10, p50_ns=2.1e6, p99_ns=2.4e6, min_ns=2e6, max_ns=2.5e6)],
        count=10, total_ns=2.15e7)
    phases = [records_pb2.PhaseStats(phase=p, count=10, mean_ns=m, p50_ns=m, p99_ns=m * 1.1, max_ns=m * 1.2,
                                     total_ns=m * 10, clock=telemetry_pb2.PHASE_CLOCK_CUDA_EVENT)
              for p, m in (("forward", 3.1e7), ("backward", 6.2e7), ("optimizer", 4e6))]
    marks = [telemetry_pb2.IterationMark(iteration=index * 10 + i, start_ns=t0 + i * 90_000_000,
                                         end_ns=t0 + (i + 1) * 90_000_000) for i in range(10)]
    stacks = records_pb2.StackWindow(
        resource=pb, window=win, samples=100, idle_samples=3,
        stacks=[telemetry_pb2.FoldedStack(stack="train.py:main;model.py:forward;torch/nn/modules/linear.py:forward",
                                          count=61, thread_id=1)])
    return WindowOutput(
        raw=ClosedWindow(resource=res, window=win, kernels=KernelColumns.empty()),
        kernels=records_pb2.KernelWindow(resource=pb, window=win, kernels=[gemm, nccl], events=330),
        phases=records_pb2.PhaseWindow(resource=pb, window=win, phases=phases),
        iterations=records_pb2.IterationWindow(resource=pb, window=win, marks=marks,
                                               mean_ns=9e7, p50_ns=9e7, max_ns=9.1e7),
        stacks=stacks if index % 2 == 0 else None,
    )


def outputs(windows: range) -> list[WindowOutput]:
    return [window_output(job, rank, w) for w in windows for job in JOBS for rank in range(WORLD)]


def expected(outs: list[WindowOutput], sink: KafkaSink) -> dict[tuple[str, bytes], list[tuple]]:
    """(topic, key) -> [(value, headers)] in export order."""
    want = collections.defaultdict(list)
    for out in outs:
        for signal, rec in out.records():
            headers = {"signal": signal.encode(), "schema": rec.DESCRIPTOR.full_name.encode(),
                       "rank": str(rec.resource.rank).encode()}
            want[(sink.topic_for(signal), rec.resource.job_id.encode())].append((rec.SerializeToString(), headers))
    return want


def count(want: dict) -> int:
    return sum(map(len, want.values()))


# -- reading back ----------------------------------------------------------
MARKER = 2**63  # window index of the end-of-test marker records
_TYPES = {"kernels": records_pb2.KernelWindow, "phases": records_pb2.PhaseWindow,
          "iterations": records_pb2.IterationWindow, "stacks": records_pb2.StackWindow,
          "collectives": records_pb2.CollectiveWindow}
MARKERS = len(SIGNALS) * len(JOBS)


def seal(sink: KafkaSink) -> None:
    """One marker per (signal, job), behind everything exported so far.

    A key's records stay in order on one partition and a replay resends in
    spool order, so once a key's marker is read, that key's records and any
    duplicate of them have been read too: an exact check with no idle wait.
    (Tansu's high watermark counts batches, not records, so offsets cannot
    be used for this.)
    """
    for signal, cls in _TYPES.items():
        for job in JOBS:
            marker = cls(resource={"job_id": job, "rank": -1}, window={"index": MARKER})
            assert sink.export_record(signal, marker, key=job, rank=-1)


def consume(bootstrap: str, *sinks: KafkaSink, timeout_s: float = 40.0) -> dict[tuple[str, bytes], list[tuple]]:
    """Seal, then read every record up to the markers with a fresh consumer group."""
    for sink in sinks:
        seal(sink)
        assert sink.flush(30), "markers not delivered"
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        # 6 s is the smallest session a stock Kafka broker accepts; Tansu
        # answers a JoinGroup after about half of it.
        "session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "logger": _quiet,
    })
    got = collections.defaultdict(list)
    sealed: set[tuple[str, bytes]] = set()
    try:
        consumer.subscribe([sink.topic_for(s) for sink in sinks for s in SIGNALS])
        deadline = time.monotonic() + timeout_s
        while len(sealed) < MARKERS * len(sinks) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            key = (msg.topic(), msg.key())
            assert key not in sealed, f"a record after the marker on {key}"
            headers = dict(msg.headers() or ())
            if headers.get("rank") == b"-1":
                sealed.add(key)
            else:
                got[key].append((msg.value(), headers))
        assert len(sealed) == MARKERS * len(sinks), f"saw {len(sealed)} markers within {timeout_s}s"
    finally:
        consumer.close()
    return dict(got)


def make_sink(bootstrap: str, tmp_path, **kw) -> KafkaSink:
    cfg = dict(bootstrap=bootstrap, topic_prefix=f"ts{uuid.uuid4().hex[:8]}",
               spool_dir=str(tmp_path / "spool"), partitions=3, probe_interval_s=0.5, linger_ms=5)
    return KafkaSink(KafkaSinkConfig(**{**cfg, **kw}))


# -- tests -----------------------------------------------------------------
@pytest.mark.parametrize("broker", ["kafka_bootstrap", "testcontainers_kafka_bootstrap"])
def test_round_trip_same_bytes_order_keys_headers(broker, request, tmp_path):
    bootstrap = request.getfixturevalue(broker)
    sink = make_sink(bootstrap, tmp_path)
    try:
        outs = outputs(range(12))
        for out in outs:
            sink.export(out)
        assert sink.flush(30), "spool not drained"
        want = expected(outs, sink)
        m = sink.metrics
        assert m.get("records_out") == count(want)
        assert m.get("bytes_out") == sum(len(v) for recs in want.values() for v, _ in recs)
        assert m.get("records_out", sink="kafka", signal="stacks") == len(JOBS) * WORLD * 6
        assert m.get("drops") == 0 and m.get("spool_bytes", sink="kafka") == 0
        assert consume(bootstrap, sink) == want
        md = AdminClient({"bootstrap.servers": bootstrap, "logger": _quiet}).list_topics(timeout=10)
        assert all(len(md.topics[sink.topic_for(s)].partitions) == 3 for s in SIGNALS)
    finally:
        sink.close()


def test_every_compression_codec_round_trips(kafka_bootstrap, tmp_path):
    sinks = [make_sink(kafka_bootstrap, tmp_path / c, compression=c) for c in ("zstd", "lz4", "gzip", "snappy", "none")]
    try:
        want, outs = {}, outputs(range(2))
        for sink in sinks:
            for out in outs:
                sink.export(out)
            want.update(expected(outs, sink))
        assert consume(kafka_bootstrap, *sinks) == want
    finally:
        for sink in sinks:
            sink.close()


def test_outage_spools_and_replays_in_order(tansu_broker, tmp_path):
    sink = make_sink(tansu_broker.bootstrap, tmp_path)
    try:
        before = outputs(range(0, 3))
        for out in before:
            sink.export(out)
        # Tansu keeps records in memory: read them before the broker dies.
        assert consume(tansu_broker.bootstrap, sink) == expected(before, sink)

        tansu_broker.stop()
        during = outputs(range(3, 15))
        t0 = time.perf_counter()
        for out in during:
            sink.export(out)
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, f"export took {elapsed:.2f}s with the broker down"
        assert sink.metrics.get("spool_bytes", sink="kafka") > 0
        assert not sink.flush(0.5)  # nothing can be delivered now

        tansu_broker.restart()  # same port, empty: no topics, no producer ids
        assert sink.flush(30), "spool not drained after the broker came back"
        want = expected(during, sink)
        assert consume(tansu_broker.bootstrap, sink) == want
        assert sink.metrics.get("drops") == 0
        assert sink.metrics.get("records_out") == count(expected(before, sink)) + count(want) + 2 * MARKERS
        md = AdminClient({"bootstrap.servers": tansu_broker.bootstrap, "logger": _quiet}).list_topics(timeout=10)
        assert all(len(md.topics[sink.topic_for(s)].partitions) == 3 for s in SIGNALS)  # re-created by the sink
    finally:
        sink.close()


def test_tiny_spool_counts_exactly_what_is_missing(tansu_broker, tmp_path):
    tansu_broker.stop()  # down from the start: the spool alone decides what survives
    sink = make_sink(tansu_broker.bootstrap, tmp_path, spool_max_bytes=8192)
    try:
        outs = outputs(range(0, 4))
        for out in outs:
            sink.export(out)
        sent = expected(outs, sink)
        dropped = int(sink.metrics.get("drops", where="kafka_spool"))
        assert 0 < dropped < count(sent)
        assert 0 < sink.metrics.get("spool_bytes", sink="kafka") <= 8192

        tansu_broker.start()
        assert sink.flush(30)
        got = consume(tansu_broker.bootstrap, sink)
        assert count(got) + dropped == count(sent)
        for key, recs in got.items():  # what arrived is in order: a subsequence of what was sent
            it = iter(sent[key])
            assert all(any(r == s for s in it) for r in recs), f"out of order on {key}"
        assert sink.metrics.get("records_out") == count(sent) - dropped + MARKERS
    finally:
        sink.close()


def test_undelivered_records_survive_a_sink_restart(tansu_broker, tmp_path):
    tansu_broker.stop()
    first = make_sink(tansu_broker.bootstrap, tmp_path, close_timeout_s=0.5)
    outs = outputs(range(0, 2))
    for out in outs:
        first.export(out)
    first.close()  # broker still down: everything stays in the spool
    tansu_broker.start()
    second = make_sink(tansu_broker.bootstrap, tmp_path, topic_prefix=first.config.topic_prefix)
    try:
        assert consume(tansu_broker.bootstrap, second) == expected(outs, second)
    finally:
        second.close()


def test_a_record_no_broker_accepts_is_dropped_not_blocking(kafka_bootstrap, tmp_path):
    sink = make_sink(kafka_bootstrap, tmp_path)
    try:
        huge = records_pb2.StackWindow(resource={"job_id": "job-a", "rank": 0},
                                       stacks=[telemetry_pb2.FoldedStack(stack="f;" * 1_000_000, count=1)])
        assert sink.export_record("stacks", huge, key="job-a", rank=0)  # spooled: too big only for Kafka
        outs = outputs(range(1))
        for out in outs:
            sink.export(out)
        assert sink.flush(20)
        assert sink.metrics.get("drops", where="kafka_rejected") == 1
        assert sink.metrics.get("records_out") == count(expected(outs, sink))
    finally:
        sink.close()


def test_config_errors_name_the_setting(tmp_path):
    bad = [dict(compression="brotli"), dict(bootstrap="nohostport"), dict(topic_prefix="a b"),
           dict(partitions=0), dict(replication_factor=0), dict(spool_max_bytes=10),
           dict(delivery_timeout_s=0), dict(extra={"enable.idempotence": False})]
    for kw in bad:
        with pytest.raises(ConfigError) as e:
            KafkaSinkConfig(**{"bootstrap": "127.0.0.1:9", **kw})
        assert e.value.setting == "kafka." + next(iter(kw))
    cfg = KafkaSinkConfig(bootstrap="127.0.0.1:9", spool_dir=str(tmp_path))
    sink = KafkaSink(cfg)
    try:
        assert isinstance(sink, Sink)
        with pytest.raises(ConfigError) as e:
            KafkaSink(cfg)  # the spool directory is taken
        assert e.value.setting == "kafka.spool_dir"
        assert sink.topic_for("diagnoses") == "trainscope.diagnoses.v1"
    finally:
        sink.close()


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 256 KiB tmpfs for the spool (needs root and mount; skipped otherwise)."""
    import subprocess
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(d)],
                       capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here to fill a real disk")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(directory) -> None:
    try:
        with open(directory / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass  # no space left: what we wanted


def test_a_full_spool_disk_is_logged_counted_and_never_blocks_live_delivery(tansu_broker, tiny_disk, caplog):
    """Issue #11 item 6: the spool's disk is full (really: a tmpfs with no byte left). With the broker
    up every record still arrives, sent directly; with it down, each loss is counted and logged."""
    sink = make_sink(tansu_broker.bootstrap, tiny_disk)
    try:
        assert wait_up(sink)
        fill(tiny_disk)
        outs = outputs(range(0, 3))
        with caplog.at_level(logging.WARNING, logger="trainscope.processor.kafka_sink"):
            for out in outs:
                sink.export(out)
        sent = expected(outs, sink)
        got = consume(tansu_broker.bootstrap, sink)
        assert count(got) == count(sent)  # nothing lost although the spool took nothing
        assert sink.metrics.get("drops", where="kafka_spool_disk") == 0
        assert sink.metrics.get("spool_bypassed", sink="kafka") == count(sent) + MARKERS
        assert any("refused a record (disk" in r.getMessage() for r in caplog.records)

        tansu_broker.stop()
        assert wait_for_down(sink)
        for out in outputs(range(3, 4)):
            sink.export(out)
        lost = count(expected(outputs(range(3, 4)), sink))
        assert sink.metrics.get("drops", where="kafka_spool_disk") == lost  # counted, one by one
    finally:
        tansu_broker.start()
        sink.close()


def wait_up(sink, timeout_s=20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not sink._up:
        time.sleep(0.05)
    return sink._up


def wait_for_down(sink, timeout_s=30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sink._up:
        time.sleep(0.05)
    return not sink._up
