"""Bounded memory and bounded server resources under hostile input (issue #11 item 2):
interned names are capped and rebuilt from what open windows hold, forgotten ranks free
their state, idle ingest streams are closed so a real collector still gets through, and
the queue depth is a metric."""
import threading
import time

import grpc
import numpy as np
import pytest

from support.pipeline import INGEST_METHOD, batch, raw_stream, start_processor, wait_for
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.windows import WindowConfig, Windower
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

S = 10**9
RES = Resource(job_id="j", rank=0, world_size=1)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def unique_names_batch(i, n, t0):
    names = [f"kernel_{i}_{j}" for j in range(n)]
    return KernelColumns.build(names, t0 + np.arange(n) * 1000, [500] * n, np.arange(n), [7] * n)


def test_ever_new_kernel_names_do_not_grow_the_table_without_end():
    closed, metrics = [], SelfMetrics()
    w = Windower(WindowConfig(mode="time", length_s=1, lateness_s=0, max_names_per_rank=5_000),
                 closed.append, metrics)
    for i in range(40):  # 40 batches of 2,000 new names, one window each
        w.add_kernels(RES, unique_names_batch(i, 2_000, i * S))
    st = w._ranks[("j", 0)]
    assert len(st.names) <= 2 * 5_000
    assert metrics.get("names_evicted") > 0
    w.flush()
    # every closed window still names its own kernels correctly after the rebuilds
    assert len(closed) == 40
    for i, cw in enumerate(closed):
        got = {cw.kernels.names[g] for g in cw.kernels.name_id.tolist()}
        assert got == {f"kernel_{i}_{j}" for j in range(2_000)}


def test_open_windows_holding_more_names_than_the_cap_keep_them_all():
    closed, metrics = [], SelfMetrics()
    w = Windower(WindowConfig(mode="time", length_s=100, lateness_s=0, max_names_per_rank=1_000),
                 closed.append, metrics)
    for i in range(5):  # all in one open window: nothing may be evicted that it still holds
        w.add_kernels(RES, unique_names_batch(i, 800, i * S))
    w.flush()
    assert len(closed) == 1
    cw = closed[0]
    assert len({cw.kernels.names[g] for g in cw.kernels.name_id.tolist()}) == 4_000


def test_iteration_marks_of_closed_windows_are_forgotten_and_late_events_still_dropped():
    # they were kept for ever: ~120 B and an O(n) list copy per kernel batch per iteration
    closed, metrics = [], SelfMetrics()
    w = Windower(WindowConfig(mode="iterations", iterations=10, lateness_s=0), closed.append, metrics)
    period = S // 100
    for i in range(3_000):
        w.add_iterations(RES, [telemetry_pb2.IterationMark(iteration=i, start_ns=i * period,
                                                           end_ns=(i + 1) * period - 1000)])
        w.add_kernels(RES, KernelColumns.build(["k"], [i * period + 5000], [500], [0], [7]))
    st = w._ranks[("j", 0)]
    assert len(st.mark_iters) <= 2 * 10 + 1 and len(st.mark_starts) == len(st.mark_ends) == len(st.mark_iters)
    assert len(closed) >= 298 and all(len(cw.kernels) == 10 for cw in closed)
    late = metrics.get("drops", where="late") or 0
    w.add_kernels(RES, KernelColumns.build(["k"], [5 * period], [500], [0], [7]))  # window 0: long closed
    w.add_kernels(RES, KernelColumns.build(["k"], [3_000 * period], [500], [0], [7]))  # past the last mark
    assert (metrics.get("drops", where="late") or 0) == late + 1
    w.flush()
    assert len(closed) == 300 and sum(len(cw.kernels) for cw in closed) == 3_001


def test_a_rank_silent_past_rank_expire_s_is_forgotten():
    closed, metrics, clock = [], SelfMetrics(), Clock()
    w = Windower(WindowConfig(mode="time", length_s=1, lateness_s=0, idle_close_s=5, rank_expire_s=60),
                 closed.append, metrics, clock=clock)
    for r in range(100):
        w.add_kernels(Resource(job_id=f"job{r}", rank=0, world_size=1), unique_names_batch(r, 10, 0))
    clock.t = 10.0
    w.close_idle()  # windows closed for being idle, state kept (the rank may come back)
    assert len(closed) == 100 and len(w._ranks) == 100
    clock.t = 100.0
    w.close_idle()
    assert len(w._ranks) == 0 and metrics.get("ranks_expired") == 100 and metrics.get("ranks") == 0


def test_idle_streams_are_closed_and_a_real_sender_gets_through():
    proc = start_processor(grpc_workers=8, stream_idle_s=1.0)
    stop = threading.Event()
    channels, calls = [], []
    try:
        def nothing():  # a stream that opens and never sends
            stop.wait(30)
            return
            yield
        for _ in range(8):
            ch = grpc.insecure_channel(proc.address)
            channels.append(ch)
            calls.append(ch.stream_unary(INGEST_METHOD, request_serializer=None).future(nothing(), timeout=30))
        assert wait_for(lambda: proc.metrics.get("open_streams") >= 8, 5)
        t0 = time.monotonic()
        s = None
        while s is None and time.monotonic() - t0 < 10:
            try:
                s = raw_stream(proc.address, [batch(RES, 1, unique_names_batch(0, 10, S))], timeout=5)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert s is not None and s.batches_accepted == 1
        assert time.monotonic() - t0 < 8
        assert wait_for(lambda: proc.metrics.get("streams_idle_closed") >= 8, 5)  # all idle ones, in the end
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        proc.stop()


def _trickle(proc, n, message, every_s, stop):
    """n streams that each write ``message`` every ``every_s`` until ``stop``; their channels."""
    def gen():
        while not stop.wait(every_s):
            yield message(gen)
    channels = []
    for _ in range(n):
        ch = grpc.insecure_channel(proc.address)
        ch.call = ch.stream_unary(INGEST_METHOD, request_serializer=None).future(gen(), timeout=60)  # kept alive
        channels.append(ch)
    return channels


def _real_sender_gets_through(proc, seq, within_s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            s = raw_stream(proc.address, [batch(RES, seq, unique_names_batch(seq, 10, seq * S))], timeout=3)
            return s.batches_accepted == 1, time.monotonic() - t0
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
            time.sleep(0.05)  # a collector backs off too
    return False, time.monotonic() - t0


def test_streams_trickling_garbage_do_not_keep_a_real_sender_out():
    """Audit: 8 streams writing one malformed byte every 0.4 s held all 8 handler threads, since any
    message refreshed the idle timer. Only an accepted batch does now."""
    proc = start_processor(grpc_workers=8, stream_idle_s=1.0)
    stop = threading.Event()
    channels = _trickle(proc, 8, lambda g: b"\xff", 0.4, stop)
    try:
        assert wait_for(lambda: proc.metrics.get("open_streams") >= 8, 5)
        ok, took = _real_sender_gets_through(proc, 1, 10)
        assert ok and took < 5, took
        assert wait_for(lambda: proc.metrics.get("streams_idle_closed") >= 8, 5)
        assert proc.metrics.get("batches_rejected", reason="malformed") > 0
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        proc.stop()


def test_streams_trickling_good_batches_forever_are_cut_at_stream_max_s():
    proc = start_processor(grpc_workers=4, stream_idle_s=5.0, stream_max_s=1.0)
    stop, seqs = threading.Event(), iter(range(100, 10**6))
    channels = _trickle(proc, 4, lambda g: batch(RES, next(seqs), unique_names_batch(0, 1, S)), 0.2, stop)
    try:
        assert wait_for(lambda: proc.metrics.get("open_streams") >= 4, 5)
        ok, took = _real_sender_gets_through(proc, 1, 10)
        assert ok and took < 5, took
        assert wait_for(lambda: proc.metrics.get("streams_cut", reason="lifetime") >= 4, 5)
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        proc.stop()


def test_a_stream_of_malformed_messages_is_ended_and_good_batches_before_it_are_kept():
    proc = start_processor(stream_max_malformed=32)
    try:
        with pytest.raises(grpc.RpcError) as e:
            raw_stream(proc.address, [batch(RES, 1, unique_names_batch(1, 10, S))] + [b"\xff"] * 40)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert proc.metrics.get("streams_cut", reason="malformed") == 1
        assert proc.metrics.get("batches_rejected", reason="malformed") == 32
        assert proc.metrics.get("batches_in", signal="kernels") == 1  # taken before the garbage
        s = raw_stream(proc.address, [batch(RES, 2, unique_names_batch(2, 10, 2 * S))])
        assert s.batches_accepted == 1
    finally:
        proc.stop()


def test_a_full_queue_refuses_the_stream_with_resource_exhausted_and_reports_its_depth():
    proc = start_processor(queue_max_batches=2)
    release = threading.Event()
    proc.pipeline._accept_timeout = 0.05
    orig = proc.pipeline.windower.add_kernels
    proc.pipeline.windower.add_kernels = lambda *a: (release.wait(20), orig(*a))
    try:
        with pytest.raises(grpc.RpcError) as e:
            raw_stream(proc.address, [batch(RES, i, unique_names_batch(i, 5, i * S)) for i in range(1, 9)])
        # back-pressure: the stream ends, the sender keeps what was not confirmed and retries
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert proc.metrics.get("queue_depth") == 2
        assert proc.metrics.get("batches_rejected", reason="overloaded") == 1
    finally:
        release.set()
        proc.stop()


def test_an_overloaded_processor_slows_a_real_exporter_down_and_loses_nothing():
    """The exporter resends a refused stream's batches; those the processor already took come
    back as duplicates and are dropped once, the refused one is taken on the resend."""
    from trainscope.collector.exporter import BatchExporter
    from trainscope.collector.exporter_config import ExporterConfig
    from support.pipeline import kernel_count

    proc = start_processor(queue_max_batches=2)
    proc.pipeline._accept_timeout = 0.02
    orig = proc.pipeline.windower.add_kernels
    proc.pipeline.windower.add_kernels = lambda *a: (time.sleep(0.05), orig(*a))  # a slow window
    exp = BatchExporter(RES, ExporterConfig(target=proc.address, confirm_interval_s=0.2,
                                            backoff_initial_s=0.01, backoff_max_s=0.1))
    try:
        for i in range(40):
            assert exp.submit(unique_names_batch(i, 25, i * S).to_pb(), 25 * 25)
        assert exp.flush(60)
        proc.drain(20)
        assert proc.metrics.get("batches_rejected", reason="overloaded") >= 1  # it was overloaded
        assert exp.stats.dropped_total == 0 and exp.stats.rejected_by_processor == 0
        assert kernel_count(proc) == 40 * 25  # every kernel once: no loss, no double count
    finally:
        exp.shutdown(1)
        proc.stop()


def test_per_job_self_metric_series_expire_after_the_job_is_idle():
    m = SelfMetrics(max_job_series=50_000)
    for j in range(20_000):
        m.set_max("collector_dropped", 1, job=f"job{j}", rank="0")
    assert m.expire_jobs(600.0, now=time.monotonic() + 1) == 0
    time.sleep(1.1)
    m.set_max("collector_dropped", 5, job="live", rank="0")
    assert m.expire_jobs(1.0) == 20_000
    assert m.get("collector_dropped", job="live", rank="0") == 5
    assert sum(1 for k in m.snapshot() if k.startswith("collector_dropped")) == 1


def test_per_job_series_are_capped():
    """Audit: 20k job ids made 20k ``collector_dropped`` series (a 1,323 KiB /metrics). Now at most
    ``max_job_series``, the rest counted. A series is made at 0 (the alert's ``increase()`` needs a
    sample before a rank's first drop)."""
    proc = start_processor(max_job_series=100)
    try:
        def job_batch(j, dropped):
            b = telemetry_pb2.TelemetryBatch(resource=Resource(job_id=f"job{j}", rank=0, world_size=1).to_pb(),
                                             seq=1, dropped_total=dropped)
            b.kernels.CopyFrom(unique_names_batch(j, 2, S).to_pb())
            return b.SerializeToString()
        series = lambda: sum(1 for k in proc.metrics.snapshot() if k.startswith("collector_dropped"))
        s = raw_stream(proc.address, [job_batch(j, 0) for j in range(60)])
        assert s.batches_accepted == 60
        assert series() == 60 and proc.metrics.get("collector_dropped", job="job7", rank="0") == 0
        s = raw_stream(proc.address, [job_batch(j, 3) for j in range(60, 500)])
        assert s.batches_accepted == 440
        assert series() == 100 and proc.metrics.get("job_series_refused") == 400
        assert proc.metrics.get("collector_dropped", job="job60", rank="0") == 3
        s = raw_stream(proc.address, [job_batch(7, 5)])  # a series already there keeps counting
        assert proc.metrics.get("collector_dropped", job="job7", rank="0") == 5
        s = raw_stream(proc.address, [batch(RES, 1, unique_names_batch(1, 10, S))])  # still serving
        assert s.batches_accepted == 1
    finally:
        proc.stop()
