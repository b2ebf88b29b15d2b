"""Whole path into a real Kafka-protocol broker: a real trace replayed through
exporter → gRPC → processor → KafkaSink → Tansu (or KAFKA_BOOTSTRAP), read back
by a consumer and compared with what the processor stored locally."""
import shutil
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from trainscope.deploy.replay import run_replay
from trainscope.processor.kafka_config import KafkaSinkConfig
from trainscope.processor.store import SqliteStore
from trainscope.proto.v1 import records_pb2

pytestmark = pytest.mark.integration

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"


@pytest.mark.skipif(not (SHARED / "job2-rank0-nccl.json.gz").exists(), reason=f"no traces under {SHARED}")
def test_replayed_trace_reaches_kafka_exactly(kafka_bootstrap, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    for r in range(2):
        shutil.copy(SHARED / "job2-rank0-nccl.json.gz", job / f"rank-{r}.json.gz")
    prefix = f"ts{uuid.uuid4().hex[:8]}"
    res = run_replay(str(job), home=str(tmp_path / "home"), window_iterations=1,
                     kafka=KafkaSinkConfig(bootstrap=kafka_bootstrap, topic_prefix=prefix,
                                           spool_dir=str(tmp_path / "spool"), linger_ms=5))
    assert res.processor.get("drops{where=kafka_spool}", 0) == 0
    store = SqliteStore(res.store_path)
    # compare parsed records (map fields such as Resource.attributes have no fixed byte order)
    canon = lambda raw: records_pb2.KernelWindow.FromString(raw).SerializeToString(deterministic=True)  # noqa: E731
    stored = sorted(canon(r[3]) for r in store.raw("kernels"))   # as stored: kernel ids, no names
    book = store.kernel_names(res.job_id)
    store.close()
    assert len(stored) >= 4  # 2 ranks x several iteration windows

    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    got, keys = [], set()
    try:
        consumer.subscribe([f"{prefix}.kernels.v1"])
        deadline = time.monotonic() + 60
        while len(set(got)) < len(stored) and time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is None or m.error():
                continue
            got.append(canon(m.value()))
            keys.add(m.key())
            headers = dict(m.headers())
            assert headers["schema"] == b"trainscope.v1.KernelWindow"
    finally:
        consumer.close()
    assert sorted(set(got)) == stored      # exactly the records the processor produced (at least once)
    assert keys == {res.job_id.encode()}   # keyed by job: all ranks on one partition
    total = sum(records_pb2.KernelWindow.FromString(v).events for v in got)
    assert total == sum(res.kernel_events_sent.values())
    # every id the windows carry is named on the compacted dictionary topic, as in the store
    ids = {ks.kernel_id for v in got for ks in records_pb2.KernelWindow.FromString(v).kernels}
    assert 0 not in ids and ids <= set(book)
    names: dict[int, str] = {}
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    try:
        md = consumer.list_topics(f"{prefix}.kernel_names.v1", timeout=10)
        consumer.assign([TopicPartition(f"{prefix}.kernel_names.v1", p, OFFSET_BEGINNING)
                         for p in md.topics[f"{prefix}.kernel_names.v1"].partitions])
        deadline = time.monotonic() + 30
        while not ids <= set(names) and time.monotonic() < deadline:
            for m in consumer.consume(1000, 0.5):
                if not m.error():
                    (e,) = records_pb2.KernelNames.FromString(m.value()).names   # one entry per record
                    assert m.key() == f"{res.job_id}/{e.id:016x}".encode()
                    names[e.id] = e.name
    finally:
        consumer.close()
    assert {i: names.get(i) for i in ids} == {i: book[i] for i in ids}
