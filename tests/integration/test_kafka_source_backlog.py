"""``KafkaSource.backlog`` on a real Kafka-protocol broker (Tansu or ``KAFKA_BOOTSTRAP``).

An analyzer that starts after its jobs wrote reads a backlog topic by topic and partition by partition:
a job's iterations can all be in before its phases and kernels. While records wait beyond the
consumer's position the source says so, and the analyzer's "progress" rule waits
(``Analyzer._ready``; beside a busy core a healthy 32-rank job read back from Kafka had a window
called "unknown, no comparison possible" with its phases and kernels still unread). The records here
are not valid protobuf: the source counts them as bad, which is all this test needs of them.
"""
import time
import uuid

import pytest
from confluent_kafka import Producer

from trainscope.analyzer.sources import KafkaSource
from trainscope.proto.contracts import topic_for

pytestmark = pytest.mark.integration

N = 30_000


def test_the_source_says_it_is_behind_until_it_has_read_the_backlog(kafka_bootstrap):
    prefix = f"ts{uuid.uuid4().hex[:8]}"
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    for i in range(N):
        p.produce(topic_for("iterations", prefix), key=b"job", value=b"\x00not-protobuf-%d" % i)
        if i % 5000 == 0:
            p.poll(0)
    assert p.flush(60) == 0
    source = KafkaSource(kafka_bootstrap, group_id=f"g{uuid.uuid4().hex[:8]}", prefix=prefix,
                         extra={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    try:
        seen_behind, read, deadline = False, 0, time.monotonic() + 60
        while read < N and time.monotonic() < deadline:
            got = source.poll(0.5)
            read = source.bad_total + len(got)
            if read and read < N:
                seen_behind |= source.backlog      # records consumed and more waiting: behind
        assert read == N, read
        assert seen_behind                         # at most 10,000 a poll: it was behind for a while
        source.poll(0.5)
        assert source.backlog is False             # all read: nothing waits
    finally:
        source.close()
