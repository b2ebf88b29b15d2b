"""The Kafka sink's give-up bound on a dead broker (processor/kafka_sink.py, design note 5).

A shutdown flushes the sink several times (final drain, pipeline stop, close); each used to wait
its caller's whole timeout on a broker that takes nothing (replay: 15 + 30 + 10 s). The flushes
now share one budget of ``close_timeout_s``. Integration tier (it opens sockets): the sink's
librdkafka client is pointed at 127.0.0.1:1, where nothing listens; no process is started.
"""
import logging
import threading

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from trainscope.processor import kafka_sink
from trainscope.processor.kafka_config import KafkaSinkConfig
from trainscope.processor.kafka_sink import KafkaSink
from trainscope.processor.spool import DiskSpool

pytestmark = pytest.mark.integration


class _CountingCondition(threading.Condition):
    """The sink's ``_drained`` condition, counting the waits of flush (only flush waits on it)."""

    waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def test_flushes_share_one_budget_say_once_what_stays_and_keep_it_spooled(tmp_path, caplog):
    spool = tmp_path / "spool"
    sink = KafkaSink(KafkaSinkConfig(bootstrap="127.0.0.1:1", spool_dir=str(spool), close_timeout_s=0.5,
                                     probe_interval_s=0.2))
    sink._drained = cond = _CountingCondition()
    try:
        for i in range(3):
            assert sink.export_record("iterations", Timestamp(seconds=i), key="job-a", rank=i)
        with caplog.at_level(logging.WARNING, logger=kafka_sink.__name__):
            assert sink.flush(30.0) is False  # gives up after the 0.5 s budget, not 30 s
            assert cond.waits > 0 and sink._idle_flush_s >= 0.5
            first = cond.waits
            assert sink.flush(30.0) is False  # the budget is spent: no waiting again
            sink.close()  # nor in close's own flush
        assert cond.waits == first, (first, cond.waits)
    finally:
        sink.close()
    said = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    assert len(said) == 1 and "3 records" in said[0] and str(spool) in said[0], said
    kept = DiskSpool(spool, 1 << 20)
    try:
        assert kept.frames == 3  # kept locally for the next start
    finally:
        kept.close()
