"""The processing thread: windows → summaries → sinks.

gRPC handler threads only validate and enqueue (``accept``); one thread owns
the windower and the sinks, so no per-rank state needs a lock. The queue is
bounded: when it stays full for ``accept_timeout_s`` the stream is ended with
RESOURCE_EXHAUSTED (``batches_rejected{reason="overloaded"}``); the collector
keeps the unconfirmed batches and resends them after its backoff (those already
taken are dropped once as duplicates), so the backlog is pushed back to the
collectors' own bounded queues instead of growing here, and nothing is lost.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows
from trainscope.processor.ingest import Decoded
from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.processor.perfetto_sink import SINK as PERFETTO_SINK
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.sink import Sink
from trainscope.processor.windows import WindowConfig, Windower
from trainscope.proto.contracts import Signal

log = logging.getLogger(__name__)


class _Barrier:
    def __init__(self, flush_windows: bool, flush_collectives: bool = False) -> None:
        self.flush_windows = flush_windows
        self.flush_collectives = flush_windows or flush_collectives
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
        collectives: CollectiveWindowConfig = CollectiveWindowConfig(),
    ) -> None:
        self.metrics = metrics
        self.sinks = list(sinks)
        self._summarize = summarize
        self.windower = Windower(window, self._on_close, metrics)
        # collective records: short windows of their own (processor/collectives.py)
        self.collectives = CollectiveWindows(collectives, self._on_collectives, metrics)
        self._q: "queue.Queue[Decoded | _Barrier | None]" = queue.Queue(maxsize=queue_max)
        self._accept_timeout = accept_timeout_s
        self._idle_check = idle_check_s
        self._thread = threading.Thread(target=self._supervise, name="trainscope-pipeline", daemon=True)
        self._started = False
        self._stopping = False
        self.heartbeat = time.monotonic()   # last time the loop went round
        self.restarts = 0
        self.dead = False                   # gave up: too many failures in a row
        self.max_restarts = 5

    def start(self) -> "Pipeline":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def accept(self, d: Decoded) -> bool:
        if self.dead:
            return False  # refused, so the collector keeps it rather than it vanishing here
        try:
            self._q.put(d, timeout=self._accept_timeout)
            return True
        except queue.Full:
            self.metrics.set("queue_depth", self._q.qsize())
            return False

    def drain(self, timeout_s: float = 30.0, *, close_windows: bool = True, close_collectives: bool = False) -> bool:
        """Process everything queued so far; with ``close_windows`` also close all windows
        and flush the sinks; with ``close_collectives`` close the collective windows only (the
        simulator's barrier: its clock, not the processor's, says when a window's collectives
        are all in). True when it finished within the timeout."""
        deadline = time.monotonic() + timeout_s
        if not self.alive():
            return False  # nobody would ever answer the barrier
        b = _Barrier(close_windows, close_collectives)
        try:
            self._q.put(b, timeout=timeout_s)
        except queue.Full:
            return False
        if not b.done.wait(max(0.0, deadline - time.monotonic())):
            return False
        if close_windows:
            return all(s.flush(max(0.1, deadline - time.monotonic())) for s in self.sinks)
        return True

    def alive(self) -> bool:
        return self._started and self._thread.is_alive() and not self.dead

    def health(self, stale_s: float = 30.0) -> dict:
        """The processing thread's state for ``/healthz``: alive, how long since it went round."""
        age = time.monotonic() - self.heartbeat
        return {"ok": self.alive() and age < stale_s, "alive": self.alive(),
                "heartbeat_age_s": round(age, 3), "restarts": self.restarts,
                "queue_depth": self._q.qsize(), "queue_max": self._q.maxsize}

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain, then end the thread; bounded by ``timeout_s`` even when the thread is dead or stuck."""
        if self._started:
            deadline = time.monotonic() + timeout_s
            self.drain(timeout_s)
            self._stopping = True
            try:
                self._q.put(None, timeout=max(0.1, deadline - time.monotonic()))
            except queue.Full:
                pass  # the thread also sees _stopping at its next idle check
            self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        for s in self.sinks:
            try:
                s.close()
            except Exception:
                log.exception("closing sink %s", getattr(s, "name", s))
                self.metrics.inc("sink_errors", sink=getattr(s, "name", "?"))

    # ----------------------------------------------------------- the thread
    def _supervise(self) -> None:
        """Run the loop; a failure outside one batch restarts it, counted and logged at ERROR.

        ``max_restarts`` failures each within 10 s of the last mean
        the state itself is broken: the pipeline is marked dead, refuses
        batches (the collectors keep them), and ``/healthz`` answers 503.
        """
        streak, last_fail = 0, -1e9
        while not self._stopping:
            try:
                self._run()
                return
            except BaseException:
                self.restarts += 1
                now = time.monotonic()
                streak = streak + 1 if now - last_fail < 10.0 else 1
                last_fail = now
                self.metrics.inc("thread_restarts", thread="pipeline")
                log.critical("processing thread failed (restart %d)", self.restarts, exc_info=True)
                if streak >= self.max_restarts:
                    self.dead = True
                    log.critical("processing thread failed %d times in a row: giving up; "
                                 "batches are refused until the processor is restarted", streak)
                    return

    def _run(self) -> None:
        w = self.windower
        next_idle = time.monotonic() + self._idle_check
        while True:
            try:
                item = self._q.get(timeout=self._idle_check)
            except queue.Empty:
                if self._stopping:
                    return
                item = _Barrier(False)  # nothing came: just an idle check
                item.done.set()
            self.heartbeat = time.monotonic()
            if item is None:
                return
            try:
                if isinstance(item, _Barrier):
                    if item.flush_windows:
                        w.flush()
                    if item.flush_collectives:
                        self.collectives.flush()
                    item.done.set()
                elif item.signal == Signal.KERNELS:
                    w.add_kernels(item.resource, item.payload)
                elif item.signal == Signal.PHASES:
                    w.add_phases(item.resource, item.payload)
                elif item.signal == Signal.ITERATIONS:
                    w.add_iterations(item.resource, item.payload)
                elif item.signal == Signal.STACKS:
                    w.add_stacks(item.resource, item.payload)
                elif item.signal == Signal.COLLECTIVES:
                    self.collectives.add(item.resource, item.payload)
                elif item.signal == "final":
                    w.finish_rank(item.resource)
                    self.collectives.finish_rank(item.resource)
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
                self.collectives.tick()
                self.metrics.set("queue_depth", self._q.qsize())
                self.metrics.expire_jobs(self.windower.config.rank_expire_s)
                for s in self.sinks:
                    if hasattr(s, "tick"):  # e.g. the store retrying its backlog
                        s.tick()

    def _on_collectives(self, out: WindowOutput) -> None:
        # summaries only: the Perfetto sink draws a rank's iteration windows (same file names)
        self._export(out, skip=PERFETTO_SINK)

    def _on_close(self, cw: ClosedWindow) -> None:
        self._export(self._summarize(cw))

    def _export(self, out: WindowOutput, skip: str = "") -> None:
        for s in self.sinks:
            if skip and getattr(s, "name", "") == skip:
                continue
            try:
                s.export(out)
            except Exception:
                log.exception("sink %s failed", getattr(s, "name", s))
                self.metrics.inc("sink_errors", sink=getattr(s, "name", "?"))
