"""The collector's exporter against a real in-process processor on 127.0.0.1."""
import time

import numpy as np
import pytest

from support.pipeline import kernel_count, start_processor, wait_for
from support.ports import free_port
from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource

RES = Resource(job_id="job", rank=0, world_size=2)
S = 10**9


def kb(i, n=100):
    return KernelColumns.build(["gemm"], np.arange(n) * 1000 + i * S // 100, [500] * n, [0] * n, [7] * n).to_pb()


def fast_config(target, **kw):
    kw.setdefault("confirm_interval_s", 0.2)
    kw.setdefault("backoff_initial_s", 0.01)
    kw.setdefault("backoff_max_s", 0.1)
    return ExporterConfig(target=target, **kw)


def test_batches_arrive_and_are_confirmed():
    proc = start_processor()
    exp = BatchExporter(RES, fast_config(proc.address))
    try:
        for i in range(50):
            assert exp.submit(kb(i), 2500)
        assert exp.flush(10)
        assert exp.stats.confirmed == 50 and exp.stats.dropped_total == 0
        proc.drain(10)
        assert kernel_count(proc) == 5000
    finally:
        exp.shutdown(1)
        proc.stop()


def test_processor_down_submit_never_blocks_and_drops_are_counted():
    port = free_port()
    exp = BatchExporter(RES, fast_config(f"127.0.0.1:{port}", max_queue_batches=100))
    try:
        t0 = time.perf_counter()
        results = [exp.submit(kb(i, 10), 250) for i in range(1000)]
        elapsed = time.perf_counter() - t0
        kept = exp.pending
        assert kept <= 100                     # memory stays bounded...
        assert exp.stats.dropped_total == 1000 - kept == exp.stats.dropped["queue_full"]  # ...losses counted
        # drop-oldest: a new batch displaces a queued one; it is refused only while
        # every slot holds a batch already handed to the (failing) stream
        assert sum(results) >= 1000 - exp.stats.dropped_total
        print(f"1000 submits with the processor down: {elapsed * 1e3:.1f} ms")
        # the processor comes up later on that address: the kept batches are delivered
        proc = start_processor(listen=f"127.0.0.1:{port}")
        try:
            assert exp.flush(15)
            proc.drain(10)
            assert kernel_count(proc) == kept * 10
            # the collector's own drop total reaches the processor's metrics with the next batch
            exp.submit(kb(2000, 1), 25)
            assert exp.flush(10)
            assert proc.metrics.get("collector_dropped", job="job", rank="0") == 1000 - kept
        finally:
            proc.stop()
    finally:
        exp.shutdown(1)


def test_drop_newest_policy_keeps_the_oldest():
    exp = BatchExporter(RES, fast_config(f"127.0.0.1:{free_port()}", max_queue_batches=5,
                                          drop_policy="newest"))
    try:
        assert [exp.submit(kb(i, 1), 25) for i in range(8)] == [True] * 5 + [False] * 3
    finally:
        exp.shutdown(0.2)


def test_processor_killed_mid_run_then_restarted_loses_nothing_queued():
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = start_processor(listen=addr)
    exp = BatchExporter(RES, fast_config(addr))
    try:
        for i in range(20):
            exp.submit(kb(i), 2500)
        assert exp.flush(10)
        proc.drain(10)
        first = kernel_count(proc)
        proc.stop(grace_s=0)
        for i in range(20, 40):
            exp.submit(kb(i), 2500)        # returns at once while nothing listens
        assert not exp.flush(0.5)
        proc = start_processor(listen=addr)
        assert exp.flush(15)
        proc.drain(10)
        assert first == 2000 and kernel_count(proc) == 2000
        assert exp.stats.dropped_total == 0 and exp.stats.reconnects >= 1
        assert proc.metrics.get("collector_dropped", job="job", rank="0") == 0
    finally:
        exp.shutdown(1)
        proc.stop()


def test_shutdown_with_processor_down_is_bounded_and_counts_losses():
    exp = BatchExporter(RES, fast_config(f"127.0.0.1:{free_port()}"))
    for i in range(10):
        exp.submit(kb(i), 2500)
    t0 = time.monotonic()
    assert exp.shutdown(0.5) is False
    assert time.monotonic() - t0 < 5
    assert exp.stats.dropped["shutdown"] == 10
    assert exp.submit(kb(0), 10) is False and exp.stats.dropped["closed"] == 1


def test_oversize_batches_are_dropped_before_sending():
    exp = BatchExporter(RES, fast_config(f"127.0.0.1:{free_port()}", max_batch_bytes=1000))
    try:
        assert exp.submit(kb(0, 1000), 25_000) is False
        assert exp.stats.dropped["oversize"] == 1
    finally:
        exp.shutdown(0.2)


def test_bad_config_names_the_setting():
    with pytest.raises(ConfigError, match="exporter.drop_policy"):
        ExporterConfig(drop_policy="random")
    with pytest.raises(ConfigError, match="exporter.max_queue_bytes"):
        ExporterConfig(max_queue_bytes=0)


def test_one_exporter_can_carry_several_ranks():
    from support.pipeline import bus_records
    proc = start_processor()
    exp = BatchExporter(RES, fast_config(proc.address))
    try:
        for r in range(4):
            exp.submit(kb(r, 10 + r), 300, resource=Resource(job_id="job", rank=r, world_size=4))
        assert exp.flush(10)
        proc.drain(10)
        got = {kw.resource.rank: kw.events for kw in bus_records(proc, "kernels")}
        assert got == {0: 10, 1: 11, 2: 12, 3: 13}
    finally:
        exp.shutdown(1)
        proc.stop()


def test_final_marker_closes_the_ranks_windows_marked_final():
    from support.pipeline import bus_records
    proc = start_processor()
    exp = BatchExporter(RES, fast_config(proc.address))
    try:
        exp.submit(kb(0, 10), 300)
        assert exp.submit_final()
        assert exp.flush(10)
        # no drain: the final marker alone must close the window
        assert wait_for(lambda: any(r.window.final for r in bus_records(proc, "iterations")))
        assert [kw.events for kw in bus_records(proc, "kernels")] == [10]
    finally:
        exp.shutdown(1)
        proc.stop()


def test_a_non_retryable_refusal_drops_the_batches_in_flight_instead_of_resending_them():
    """OpenTelemetry's rule: retry only the codes in ``RETRYABLE``.

    A gRPC server with no services (in-process, 127.0.0.1 port 0) answers every
    stream UNIMPLEMENTED, which sending again cannot fix: the batches are
    dropped and counted once, never resent; the exporter stays usable.
    """
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from trainscope.collector.exporter_config import RETRYABLE

    assert grpc.StatusCode.UNIMPLEMENTED not in RETRYABLE and grpc.StatusCode.UNAVAILABLE in RETRYABLE
    server = grpc.server(ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    exp = BatchExporter(RES, fast_config(f"127.0.0.1:{port}"))
    try:
        for i in range(5):
            assert exp.submit(kb(i), 2500)
        assert wait_for(lambda: exp.stats.dropped["non_retryable"] == 5, 10)
        assert exp.stats.resent == 0 and exp.stats.confirmed == 0
        assert exp.pending == 0
    finally:
        exp.shutdown(0.5)
        server.stop(0)


def test_batches_the_processor_rejects_are_counted_as_rejected_not_confirmed(caplog):
    """A world larger than the processor's limit: every batch is refused with a reason the
    exporter reports; good batches from the same exporter are still confirmed."""
    proc = start_processor()
    bad = Resource(job_id="job", rank=0, world_size=2**32 - 1)
    exp = BatchExporter(RES, fast_config(proc.address))
    try:
        with caplog.at_level("WARNING", logger="trainscope.collector.exporter"):
            for i in range(10):
                assert exp.submit(kb(i), 2500, resource=bad)
            assert exp.flush(10)
        for i in range(10, 15):
            assert exp.submit(kb(i), 2500)
        assert exp.flush(10)
        snap = exp.stats.snapshot()
        assert snap["rejected_by_processor"] == 10 and snap["confirmed"] == 5
        assert snap["rejected_by_reason"] == {"world_size": 10}
        assert any("world_size=" in r.getMessage() for r in caplog.records)
        assert proc.metrics.get("batches_rejected", reason="world_size") == 10
    finally:
        exp.shutdown(1)
        proc.stop()


def test_a_duplicate_answer_for_a_batch_sent_once_is_a_rejection_not_a_delivery():
    """Only a re-sent batch can be a duplicate the processor holds; a "duplicate" answer for batches
    written once (a poisoned processor, a forged sender) means they were not taken: rejected."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from trainscope.proto.contracts import INGEST_SERVICE
    from trainscope.proto.v1 import telemetry_pb2

    def stream(requests, context):
        context.send_initial_metadata(())  # the exporter waits for it before it writes
        n = sum(1 for _ in requests)
        s = telemetry_pb2.IngestSummary(batches_rejected=n)
        s.rejected_by_reason["duplicate"] = n
        return s

    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(INGEST_SERVICE, {
        "Stream": grpc.stream_unary_rpc_method_handler(
            stream, response_serializer=telemetry_pb2.IngestSummary.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    exp = BatchExporter(RES, fast_config(f"127.0.0.1:{port}"))
    try:
        for i in range(5):
            assert exp.submit(kb(i), 2500)
        assert exp.flush(10)
        snap = exp.stats.snapshot()
        assert snap["confirmed"] == 0 and snap["rejected_by_processor"] == 5
        assert snap["rejected_by_reason"] == {"duplicate": 5}
    finally:
        exp.shutdown(0.5)
        server.stop(0)
