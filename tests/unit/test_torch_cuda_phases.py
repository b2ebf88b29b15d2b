"""Phase timing with CUDA events, resolved by the poller (fake events here; the GPU test is in
test_cupti.py), and on the host clock."""
from __future__ import annotations

import threading
import time

import pytest

from trainscope.collector.cuda_phases import CLOCK_CPU, CLOCK_CUDA, Phases, PhaseTimerConfig
from trainscope.proto.errors import ConfigError


class Sink:
    def __init__(self):
        self.rows = []
        self.lock = threading.Lock()

    def record_phase(self, name, start_ns, duration_ns, **kw):
        with self.lock:
            self.rows.append((name, start_ns, duration_ns, kw))


class FakeEvent:
    """A CUDA event the test completes by hand; elapsed_time in ms like torch's."""

    def __init__(self, clock):
        self.clock, self.t, self.done, self.stream = clock, None, False, None

    def record(self, stream=None):
        self.stream, self.t, self.done = stream, self.clock[0], False

    def query(self):
        return self.done

    def elapsed_time(self, other):
        return (other.t - self.t) / 1e6


class FakeStream:
    stream_id = 7


class FakeCuda:
    def __init__(self):
        self.clock = [0]
        self.events: list[FakeEvent] = []
        self.stream = FakeStream()

    def Event(self, enable_timing=False):
        e = FakeEvent(self.clock)
        self.events.append(e)
        return e

    def current_stream(self):
        return self.stream

    def complete_all(self):
        for e in self.events:
            e.done = True


def test_cuda_phase_is_resolved_off_the_training_thread_without_waiting():
    cuda, sink = FakeCuda(), Sink()
    ph = Phases(sink, PhaseTimerConfig(poll_interval_s=0.01), cuda=cuda, iteration=lambda: 5)
    span = ph.begin("forward")
    cuda.clock[0] = 3_000_000  # the GPU reached the end event 3 ms later
    ph.end(span)
    assert sink.rows == []  # end() queued it: the GPU is not done yet, nobody waits
    cuda.complete_all()
    assert ph.flush(2.0)
    (name, start, dur, kw), = sink.rows
    assert (name, dur, kw["clock"], kw["stream"], kw["iteration"]) == ("forward", 3_000_000, CLOCK_CUDA, 7, 5)
    assert start > 0
    ph.stop()


def test_events_come_back_to_the_pool():
    cuda, sink = FakeCuda(), Sink()
    ph = Phases(sink, PhaseTimerConfig(max_pending=4), cuda=cuda)
    for _ in range(50):
        ph.end(ph.begin("x"))
        cuda.complete_all()
        ph.poll()
    assert len(sink.rows) == 50 and len(cuda.events) == 2  # one pair, reused
    ph.stop()


def test_bounded_pending_phases_are_dropped_and_counted():
    cuda, sink = FakeCuda(), Sink()
    ph = Phases(sink, PhaseTimerConfig(max_pending=3, poll_interval_s=10), cuda=cuda)
    t0 = time.perf_counter()
    for _ in range(20):
        ph.end(ph.begin("x"))  # the GPU never finishes: nothing may block or grow
    assert time.perf_counter() - t0 < 0.5
    assert len(cuda.events) <= 2 * 2 * 3  # pairs: at most 2 x max_pending, ever
    assert sum(ph.dropped.values()) == 20 - 3
    ph.stop(timeout_s=0.05)
    assert ph.dropped["shutdown"] == 3


def test_no_events_are_recorded_while_a_cuda_graph_is_being_captured():
    cuda, sink = FakeCuda(), Sink()
    cuda.is_current_stream_capturing = lambda: True
    ph = Phases(sink, PhaseTimerConfig(), cuda=cuda)
    with ph.span("forward"):
        pass
    assert cuda.events == [] and ph.dropped["graph_capture"] == 1


def test_self_timing_work_handles_are_read_once_complete():
    class Work:
        def __init__(self):
            self.completed = False

        def is_completed(self):
            return self.completed

        def _get_duration(self):
            return 2.5  # ms, measured by the process group on the NCCL stream

    sink, w = Sink(), Work()
    ph = Phases(sink, PhaseTimerConfig(), cuda=FakeCuda())
    ph.add_work("dp-allreduce", w, start_wall=123, iteration=4)
    assert ph.poll() == 1 and sink.rows == []
    w.completed = True
    assert ph.poll() == 0
    assert sink.rows == [("dp-allreduce", 123, 2_500_000, {"stream": 0, "clock": CLOCK_CUDA, "iteration": 4})]
    ph.stop()


def test_host_clock_without_cuda_and_for_host_side_phases():
    sink = Sink()
    ph = Phases(sink, PhaseTimerConfig(), cuda=FakeCuda())
    with ph.span("dataloader", device_side=False):
        time.sleep(0.01)
    ph2 = Phases(sink, PhaseTimerConfig(use_cuda=False), cuda=FakeCuda())
    with ph2.span("forward"):
        pass
    assert [(r[0], r[3]["clock"]) for r in sink.rows] == [("dataloader", CLOCK_CPU), ("forward", CLOCK_CPU)]
    assert sink.rows[0][2] >= 10_000_000


def test_span_is_a_reentrant_decorator():
    sink = Sink()
    ph = Phases(sink, PhaseTimerConfig(use_cuda=False))

    @ph.span("rec")
    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    assert fib(5) == 5
    assert len(sink.rows) == 15 and all(r[2] >= 0 for r in sink.rows)


def test_a_failing_event_api_is_counted_never_raised():
    class Broken(FakeCuda):
        def Event(self, enable_timing=False):
            raise RuntimeError("CUDA error: out of memory")

    sink = Sink()
    ph = Phases(sink, PhaseTimerConfig(), cuda=Broken())
    with ph.span("forward"):
        pass
    assert ph.dropped["error"] == 1 and sink.rows == []


@pytest.mark.parametrize("kw", [dict(max_pending=0), dict(poll_interval_s=0)])
def test_bad_config_names_the_setting(kw):
    with pytest.raises(ConfigError, match="phases."):
        PhaseTimerConfig(**kw)


def test_flush_waits_for_a_phase_the_poller_thread_is_resolving():
    """The poll/flush race (issue #11 item 10): the poller thread had taken the queue out and was
    handing a phase to the sink when flush() polled, found the queue empty and returned True; the
    collector then shut the exporter down before that phase. Deterministic: the sink holds the
    poller inside record_phase until the test lets it go."""
    entered, release = threading.Event(), threading.Event()

    class SlowSink(Sink):
        def record_phase(self, *a, **kw):
            entered.set()
            release.wait(10)
            super().record_phase(*a, **kw)

    cuda, sink = FakeCuda(), SlowSink()
    ph = Phases(sink, PhaseTimerConfig(poll_interval_s=0.01), cuda=cuda)
    span = ph.begin("backward")
    cuda.clock[0] = 2_000_000
    ph.end(span)
    cuda.complete_all()
    assert entered.wait(5)                   # the poller thread holds the phase, not yet recorded
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("flushed", ph.flush(5.0)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and sink.rows == []  # flush may not say "done" while a phase is in flight
    release.set()
    t.join(5)
    assert result["flushed"] is True and len(sink.rows) == 1 and ph.recorded == 1
    ph.stop()
