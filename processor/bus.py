"""The embedded bus: Kafka's role in-process, for the no-broker default.

Topics are bounded logs with offsets, so the analyzer reads the embedded bus
and Kafka through the same shape of API (poll from an offset, keys, headers).
Topic names are the Kafka ones (``topic_for``) so nothing changes when a
broker is configured. A job's kernel-name dictionary entries go to
``<prefix>.kernel_names.v1`` before the first window that uses them
(``processor/kernel_names.py``); readers read that topic from offset 0. The oldest records are dropped past ``max_records``
per topic and counted (``drops{where="bus"}``).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Deque

from trainscope.processor.kernel_names import KERNEL_NAMES, Sent
from trainscope.processor.model import WindowOutput
from trainscope.proto.contracts import TOPIC_PREFIX, topic_for
from trainscope.processor.selfmetrics import SelfMetrics

DEFAULT_PREFIX = TOPIC_PREFIX


@dataclasses.dataclass(frozen=True, slots=True)
class BusRecord:
    topic: str
    offset: int
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


class EmbeddedBus:
    def __init__(self, max_records: int = 100_000, metrics: SelfMetrics | None = None) -> None:
        self.max_records = max_records
        self.metrics = metrics
        self._logs: dict[str, Deque[BusRecord]] = collections.defaultdict(collections.deque)
        self._next: dict[str, int] = collections.defaultdict(int)
        self._cond = threading.Condition()

    def publish(self, topic: str, key: bytes, value: bytes, headers=()) -> int:
        with self._cond:
            off = self._next[topic]
            self._next[topic] = off + 1
            log = self._logs[topic]
            log.append(BusRecord(topic, off, key, value, tuple(headers)))
            if len(log) > self.max_records:
                log.popleft()
                if self.metrics is not None:
                    self.metrics.inc("drops", where="bus")
            self._cond.notify_all()
            return off

    def poll(self, topic: str, offset: int, max_records: int = 10_000, timeout_s: float = 0.0) -> list[BusRecord]:
        """Records of ``topic`` from ``offset`` on (older ones may have been dropped)."""
        with self._cond:
            if self._next[topic] <= offset and timeout_s > 0:
                self._cond.wait_for(lambda: self._next[topic] > offset, timeout=timeout_s)
            log = self._logs.get(topic)
            if not log:
                return []
            start = max(0, offset - log[0].offset)
            return [log[i] for i in range(start, min(len(log), start + max_records))]

    def end_offset(self, topic: str) -> int:
        with self._cond:
            return self._next[topic]


class BusSink:
    """Publishes each window's records on the embedded bus (a ``Sink``)."""

    name = "bus"

    def __init__(self, bus: EmbeddedBus, metrics: SelfMetrics, prefix: str = DEFAULT_PREFIX) -> None:
        self.bus = bus
        self.metrics = metrics
        self.prefix = prefix
        self._sent = Sent()

    def export(self, out: WindowOutput) -> None:
        key = out.raw.resource.job_id.encode()
        names = self._sent.new(out.kernel_names)
        if names is not None:  # the window's new dictionary entries, before the window
            value = names.SerializeToString()
            self.bus.publish(topic_for(KERNEL_NAMES, self.prefix), key, value, (("signal", KERNEL_NAMES.encode()),))
            self._sent.mark(names)
            self.metrics.inc("records_out", sink=self.name, signal=KERNEL_NAMES)
            self.metrics.inc("bytes_out", len(value), sink=self.name, signal=KERNEL_NAMES)
        for signal, rec in out.records():
            value = rec.SerializeToString()
            self.bus.publish(topic_for(signal, self.prefix), key, value,
                             (("signal", signal.encode()), ("rank", str(out.raw.resource.rank).encode())))
            self.metrics.inc("records_out", sink=self.name, signal=signal)
            self.metrics.inc("bytes_out", len(value), sink=self.name, signal=signal)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def close(self) -> None:
        pass
