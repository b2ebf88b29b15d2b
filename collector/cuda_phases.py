"""Phase timing: CUDA events on the stream where the phase runs, or the host clock (ARGUS §4.2).

    phases = Phases(collector)
    with phases.span("forward"):          # also a decorator: @phases.span("forward")
        loss = model(batch)

1. ``begin`` picks the clock. When CUDA is initialised in this process the
   phase gets a pair of timing events from a bounded pool; the start event is
   recorded on the stream the phase runs on (the caller's current stream by
   default; collectives pass their own, see ``torch_hooks``). Otherwise the
   host's monotonic clock is read.
2. ``end`` records the end event on the same stream and queues the pair. It
   never waits for the GPU: a CUDA event is timestamped only when the GPU
   reaches it, so the pair measures device-side execution of that interval.
3. A poller thread checks the queue every ``poll_interval_s`` with
   ``event.query()`` (non-blocking) and turns finished pairs into phase
   records (``elapsed_time``), then returns the events to the pool. The
   training thread never synchronises.
4. NCCL work handles whose process group times its own collectives on the
   NCCL stream (``TORCH_NCCL_ENABLE_TIMING=1``, which ``trainscope run``
   sets) are queued as they are: the poller reads ``work._get_duration()``
   once ``work.is_completed()``. This is ARGUS's "events on the stream the
   collective actually runs on" without reaching into NCCL's streams.

Bounds: at most ``max_pending`` phases wait for the GPU; beyond that, and
when the event pool is empty, a phase is dropped and counted, never waited
for. The host-clock start (``time.time_ns``) is kept as the phase's start on
the rank's clock; the duration comes from the events.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import sys
import threading
import time
from typing import Any, Callable

from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

CLOCK_CPU = telemetry_pb2.PHASE_CLOCK_CPU
CLOCK_CUDA = telemetry_pb2.PHASE_CLOCK_CUDA_EVENT


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTimerConfig:
    max_pending: int = 4096
    """Phases waiting for their CUDA events at most; more are dropped and counted."""
    poll_interval_s: float = 0.05
    """How often the poller thread checks pending CUDA events."""
    use_cuda: bool = True
    """Time with CUDA events when CUDA is initialised; False forces the host clock."""

    def __post_init__(self) -> None:
        if type(self.max_pending) is not int or self.max_pending < 1:
            raise ConfigError("phases.max_pending", self.max_pending, "must be an integer >= 1")
        if not self.poll_interval_s > 0:
            raise ConfigError("phases.poll_interval_s", self.poll_interval_s, "must be > 0")


class _Span:
    """An open phase; ``pair`` is None on the host clock."""

    __slots__ = ("name", "wall", "perf", "iteration", "pair", "stream", "stream_id", "micro_batch")

    def __init__(self, name, wall, perf, iteration, pair=None, stream=None, stream_id=0, micro_batch=0):
        self.name, self.wall, self.perf, self.iteration = name, wall, perf, iteration
        self.pair, self.stream, self.stream_id, self.micro_batch = pair, stream, stream_id, micro_batch


class Phases:
    """Opens and closes phases on the right clock and hands them to ``sink.record_phase``.

    ``sink`` is a :class:`~trainscope.collector.sdk.Collector` (or anything
    with its ``record_phase`` signature). ``iteration`` returns the number of
    the iteration in progress (the iteration detector's), or None to let the
    collector use its own counter. ``cuda`` is the ``torch.cuda`` module (a
    fake in tests); by default it is looked up when torch is imported.
    """

    def __init__(self, sink, config: PhaseTimerConfig = PhaseTimerConfig(), *,
                 iteration: Callable[[], int | None] | None = None, cuda: Any = None) -> None:
        self.sink = sink
        self.config = config
        self._iteration = iteration or (lambda: None)
        self._cuda = cuda
        self._pool: list = []
        self._created = 0
        self._lock = threading.Lock()
        # One poll at a time: a poll takes the whole queue out to resolve it without holding
        # _lock, so a second poll (flush() on the shutdown path, beside the poller thread) saw
        # an empty queue and returned "nothing pending" while the first still held phases it
        # had not recorded yet: the flush returned and the exporter shut down before them
        # (tests/integration/test_cuda_phases lost 6 of 300 runs). Serialising polls closes it.
        self._poll_lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._polling = 0  # phases the poller took out of _pending and holds: they count toward the bound
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.dropped = collections.Counter()
        """Phases not recorded, by reason (``pool_empty``, ``pending_full``, ``graph_capture``, ``error``)."""
        self.recorded = 0

    # ------------------------------------------------------------- clocks
    def _cuda_module(self):
        if self._cuda is not None:
            return self._cuda
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        cuda = getattr(torch, "cuda", None)
        try:
            return cuda if cuda is not None and cuda.is_initialized() else None
        except Exception:
            return None

    def cuda_active(self) -> bool:
        """Whether phases are timed with CUDA events right now."""
        return self.config.use_cuda and self._cuda_module() is not None

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (no events may be recorded)."""
        cuda = self._cuda_module()
        f = getattr(cuda, "is_current_stream_capturing", None) if cuda is not None else None
        return bool(f is not None and f())

    def _take_pair(self, cuda):
        with self._lock:
            if self._pool:
                return self._pool.pop()
            if self._created >= 2 * self.config.max_pending:
                return None
            self._created += 1
        return (cuda.Event(enable_timing=True), cuda.Event(enable_timing=True))

    # ---------------------------------------------------------------- API
    def begin(self, name: str, *, stream=None, device_side: bool = True, micro_batch: int = 0,
              iteration: int | None = None) -> _Span | None:
        """Open a phase. ``device_side=False`` forces the host clock (data loading)."""
        try:
            it = self._iteration() if iteration is None else iteration
            wall, perf = time.time_ns(), time.perf_counter_ns()
            cuda = self._cuda_module() if (device_side and self.config.use_cuda) else None
            if cuda is None:
                return _Span(name, wall, perf, it, micro_batch=micro_batch)
            if self.capturing():
                self.dropped["graph_capture"] += 1  # recording an event would break the user's capture
                return None
            pair = self._take_pair(cuda)
            if pair is None:
                self.dropped["pool_empty"] += 1
                return None
            s = stream if stream is not None else cuda.current_stream()
            pair[0].record(s)
            return _Span(name, wall, perf, it, pair, s, int(getattr(s, "stream_id", 0)) & 0xFFFFFFFF,
                         micro_batch)
        except Exception:
            self.dropped["error"] += 1
            log.debug("phase begin failed", exc_info=True)
            return None

    def end(self, span: _Span | None, *, stream=None) -> None:
        """Close a phase opened by ``begin``; never waits for the GPU."""
        if span is None:
            return
        try:
            if span.pair is None:
                self.sink.record_phase(span.name, span.wall, time.perf_counter_ns() - span.perf,
                                       clock=CLOCK_CPU, micro_batch=span.micro_batch,
                                       iteration=span.iteration)
                self.recorded += 1
                return
            span.pair[1].record(stream if stream is not None else span.stream)
            self._queue(("events", span))
        except Exception:
            self.dropped["error"] += 1
            log.debug("phase end failed", exc_info=True)

    def add_work(self, name: str, work, *, start_wall: int, iteration: int | None = None,
                 stream_id: int = 0) -> None:
        """Queue a work handle that times itself (NCCL with TORCH_NCCL_ENABLE_TIMING=1)."""
        it = self._iteration() if iteration is None else iteration
        self._queue(("work", (name, work, start_wall, it, stream_id)))

    def span(self, name: str, **kw) -> "_PhaseCM":
        """Context manager and decorator timing one phase (re-entrant, thread-safe)."""
        return _PhaseCM(self, name, kw)

    # ------------------------------------------------------------- poller
    def _queue(self, item) -> None:
        with self._lock:
            if len(self._pending) + self._polling >= self.config.max_pending:
                self.dropped["pending_full"] += 1
                kind, obj = item
                if kind == "events":
                    self._pool.append(obj.pair)
                return
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trainscope-phases", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._wake.wait(self.config.poll_interval_s)
            self._wake.clear()
        self.poll()

    def poll(self) -> int:
        """Resolve every finished pending phase; returns how many are still pending.

        Serialised (``_poll_lock``): when it returns 0, every phase queued before the call
        has been handed to the sink, whichever thread resolved it."""
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> int:
        with self._lock:
            items, self._pending = self._pending, collections.deque()
            self._polling = len(items)
        keep = collections.deque()
        for item in items:
            kind, obj = item
            try:
                done = self._resolve_events(obj) if kind == "events" else self._resolve_work(obj)
            except Exception:
                done = True
                self.dropped["error"] += 1
                log.debug("resolving a phase failed", exc_info=True)
                if kind == "events":
                    with self._lock:
                        self._pool.append(obj.pair)
            if not done:
                keep.append(item)
        with self._lock:
            keep.extend(self._pending)
            self._pending = keep
            self._polling = 0
            return len(keep)

    def _resolve_events(self, span: _Span) -> bool:
        start, end = span.pair
        if not end.query():
            return False
        ms = start.elapsed_time(end)
        with self._lock:
            self._pool.append(span.pair)
        self.sink.record_phase(span.name, span.wall, max(int(ms * 1e6), 0), stream=span.stream_id,
                               clock=CLOCK_CUDA, micro_batch=span.micro_batch, iteration=span.iteration)
        self.recorded += 1
        return True

    def _resolve_work(self, obj) -> bool:
        name, work, wall, it, stream_id = obj
        if not work.is_completed():
            return False
        ms = work._get_duration()
        self.sink.record_phase(name, wall, max(int(ms * 1e6), 0), stream=stream_id,
                               clock=CLOCK_CUDA, iteration=it)
        self.recorded += 1
        return True

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Poll until nothing is pending or the timeout passes (for shutdown, not training)."""
        deadline = time.monotonic() + timeout_s
        while self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self.config.poll_interval_s, 0.01))
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
        with self._lock:
            left = len(self._pending)
            self._pending.clear()
        if left:
            self.dropped["shutdown"] += left


class _PhaseCM(contextlib.ContextDecorator):
    """``with phases.span(name):`` and ``@phases.span(name)``; a fresh span per use."""

    def __init__(self, phases: Phases, name: str, kw: dict) -> None:
        self._phases, self._name, self._kw = phases, name, kw
        self._span: _Span | None = None

    def _recreate_cm(self) -> "_PhaseCM":
        return _PhaseCM(self._phases, self._name, self._kw)

    def __enter__(self) -> "_PhaseCM":
        self._span = self._phases.begin(self._name, **self._kw)
        return self

    def __exit__(self, *exc) -> bool:
        self._phases.end(self._span)
        return False


_ACTIVE: Phases | None = None


def activate(phases: Phases | None) -> None:
    """Make ``phases`` the timer behind :func:`phase` (``torch_hooks.install`` does)."""
    global _ACTIVE
    _ACTIVE = phases


class _NoPhase(contextlib.ContextDecorator):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def phase(name: str, **kw):
    """``with phase("attention"):`` / ``@phase("attention")`` for framework or user code: the
    active timer's span (CUDA events or host clock), a no-op when the collector is not running."""
    phases = _ACTIVE
    return _NoPhase() if phases is None else phases.span(name, **kw)


__all__ = ["CLOCK_CPU", "CLOCK_CUDA", "PhaseTimerConfig", "Phases", "activate", "phase"]
