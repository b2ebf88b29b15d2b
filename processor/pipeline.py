"""The processing thread: windows → summaries → sinks.

gRPC handler threads only validate and enqueue (``accept``); one thread owns
the windower and the sinks, so no per-rank state needs a lock. The queue is
bounded: when it stays full for ``accept_timeout_s`` the batch is refused
(``batches_rejected{reason="overloaded"}``), which pushes the backlog back to
the collectors' own bounded queues instead of growing here.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

from trainscope.processor.ingest import Decoded
from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.sink import Sink
from trainscope.processor.windows import WindowConfig, Windower
from trainscope.proto.contracts import Signal

log = logging.getLogger(__name__)


class _Barrier:
    def __init__(self, flush_windows: bool) -> None:
        self.flush_windows = flush_windows
        self.done = threading.Event()


class Pipeline:
    def __init__(
        self,
        window: WindowConfig,
        summarize: Callable[[ClosedWindow], WindowOutput],
        sinks: Sequence[Sink],
        metrics: SelfMetrics,
        *,
        queue_max: int = 10_000,
        accept_timeout_s: float = 1.0,
        idle_check_s: float = 1.0,
    ) -> None:
        self.metrics = metrics
        self.sinks = list(sinks)
        self._summarize = summarize
        self.windower = Windower(window, self._on_close, metrics)
        self._q: "queue.Queue[Decoded | _Barrier | None]" = queue.Queue(maxsize=queue_max)
        self._accept_timeout = accept_timeout_s
        self._idle_check = idle_check_s
        self._thread = threading.Thread(target=self._run, name="trainscope-pipeline", daemon=True)
        self._started = False

    def start(self) -> "Pipeline":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def accept(self, d: Decoded) -> bool:
        try:
            self._q.put(d, timeout=self._accept_timeout)
            return True
        except queue.Full:
            return False

    def drain(self, timeout_s: float = 30.0, *, close_windows: bool = True) -> bool:
        """Process everything queued so far; with ``close_windows`` also close all windows
        and flush the sinks. True when it finished within the timeout."""
        deadline = time.monotonic() + timeout_s
        b = _Barrier(close_windows)
        try:
            self._q.put(b, timeout=timeout_s)
        except queue.Full:
            return False
        if not b.done.wait(max(0.0, deadline - time.monotonic())):
            return False
        if close_windows:
            return all(s.flush(max(0.1, deadline - time.monotonic())) for s in self.sinks)
        return True

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._started:
            self.drain(timeout_s)
            self._q.put(None)
            self._thread.join(timeout=timeout_s)
        for s in self.sinks:
            try:
                s.close()
            except Exception:
                log.exception("closing sink %s", getattr(s, "name", s))
                self.metrics.inc("sink_errors", sink=getattr(s, "name", "?"))

    # ----------------------------------------------------------- the thread
    def _run(self) -> None:
        w = self.windower
        next_idle = time.monotonic() + self._idle_check
        while True:
            try:
                item = self._q.get(timeout=self._idle_check)
            except queue.Empty:
                item = _Barrier(False)  # nothing came: just an idle check
                item.done.set()
            if item is None:
                return
            try:
                if isinstance(item, _Barrier):
                    if item.flush_windows:
                        w.flush()
                    item.done.set()
                elif item.signal == Signal.KERNELS:
                    w.add_kernels(item.resource, item.payload)
                elif item.signal == Signal.PHASES:
                    w.add_phases(item.resource, item.payload)
                elif item.signal == Signal.ITERATIONS:
                    w.add_iterations(item.resource, item.payload)
                elif item.signal == Signal.STACKS:
                    w.add_stacks(item.resource, item.payload)
                elif item.signal == "final":
                    w.finish_rank(item.resource)
            except Exception:
                # A bug on one batch must not stop the processor.
                log.exception("pipeline failed on a batch")
                self.metrics.inc("batches_rejected", reason="internal_error")
                if isinstance(item, _Barrier):
                    item.done.set()
            now = time.monotonic()
            if now >= next_idle:
                next_idle = now + self._idle_check
                w.close_idle()

    def _on_close(self, cw: ClosedWindow) -> None:
        out = self._summarize(cw)
        for s in self.sinks:
            try:
                s.export(out)
            except Exception:
                log.exception("sink %s failed", getattr(s, "name", s))
                self.metrics.inc("sink_errors", sink=getattr(s, "name", "?"))
