"""Where the analyzer reads the processor's records from.

One small Protocol, three implementations:

* ``BusSource``: the in-process embedded bus (replay, demo, sim on a laptop);
* ``StoreSource``: tails the processor's SQLite store on the same host, so
  ``trainscope analyzer`` works beside ``trainscope processor`` without a broker;
* ``KafkaSource``: a confluent-kafka consumer group on the per-signal topics
  (the scale-out path). A record that cannot be parsed is counted and kept
  (``bad_records``) with its raw bytes, never fatal (confluent-kafka's
  ``ConsumeError`` carries the message the same way).

Kernel windows carry kernel ids; every source also reads the jobs' kernel-name
dictionaries (``<prefix>.kernel_names.v1`` from offset 0, or the store's
``kernel_names`` table) and hands on kernel windows with their names filled in
(``kernel_names.NameResolver``: a window whose names have not come yet waits,
bounded, with the rest of its job). ``names.counters`` counts bad and
conflicting entries and ids that stayed unknown.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Protocol

from google.protobuf.message import DecodeError, Message

from trainscope.analyzer.kernel_names import NameResolver
from trainscope.processor.bus import EmbeddedBus
from trainscope.processor.kernel_names import KERNEL_NAMES, from_signed
from trainscope.proto.contracts import RECORD_TYPES, SIGNALS, Signal, topic_for
from trainscope.proto.v1 import records_pb2

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True, slots=True)
class BadRecord:
    signal: str
    reason: str
    raw: bytes


class RecordSource(Protocol):
    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, Message]]:
        """Records that arrived since the last poll, as (signal, record)."""
        ...

    def close(self) -> None: ...


class _Parsing:
    def __init__(self, max_bad: int = 1000) -> None:
        self.bad_records: collections.deque[BadRecord] = collections.deque(maxlen=max_bad)
        self.bad_total = 0
        self.names = NameResolver()

    def parse(self, signal: str, raw: bytes) -> Message | None:
        try:
            rec = RECORD_TYPES[signal].FromString(raw)
        except (DecodeError, KeyError, ValueError) as e:
            self.bad_total += 1
            self.bad_records.append(BadRecord(signal, str(e), raw))
            return None
        if not rec.resource.job_id:
            self.bad_total += 1
            self.bad_records.append(BadRecord(signal, "no job_id", raw))
            return None
        return rec


class BusSource(_Parsing):
    def __init__(self, bus: EmbeddedBus, prefix: str = "trainscope", from_beginning: bool = True) -> None:
        super().__init__()
        self.bus = bus
        self.topics = {topic_for(s, prefix): s for s in SIGNALS}
        self.offsets = {t: 0 if from_beginning else bus.end_offset(t) for t in self.topics}
        self.names_topic = topic_for(KERNEL_NAMES, prefix)
        self.names_offset = 0   # the dictionary: always from the beginning

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, Message]]:
        out = []
        names = self.bus.poll(self.names_topic, self.names_offset)   # before the windows that use them
        if names:
            self.names_offset = names[-1].offset + 1
        for r in names:
            self.names.add_raw(r.value)
        for topic, signal in self.topics.items():
            recs = self.bus.poll(topic, self.offsets[topic])
            if recs:
                self.offsets[topic] = recs[-1].offset + 1
            for r in recs:
                rec = self.parse(signal, r.value)
                if rec is not None:
                    out.append((signal, rec))
        out = self.names.resolve(out)
        if not out and not self.names.held and timeout_s > 0:
            # wait on one topic; others are picked up on the next poll
            t = next(iter(self.topics))
            self.bus.poll(t, self.offsets[t], max_records=1, timeout_s=timeout_s)
        return out

    def close(self) -> None:
        pass


class StoreSource(_Parsing):
    """Tails the ``records`` table of a processor's SQLite store by row id."""

    def __init__(self, path: str, from_id: int = 0) -> None:
        super().__init__()
        import sqlite3
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.last_id = from_id
        self.last_name_row = 0

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, Message]]:
        import sqlite3
        import time
        try:
            rows = self._db.execute(
                "SELECT id, signal, value FROM records WHERE id > ? ORDER BY id LIMIT 10000",
                (self.last_id,)).fetchall()
        except sqlite3.OperationalError as e:   # store not created yet, or busy
            log.debug("store poll: %s", e)
            rows = []
        try:   # after the records: entries are committed with (or before) the windows that use them
            names = self._db.execute("SELECT rowid, job, id, name FROM kernel_names WHERE rowid > ? ORDER BY rowid",
                                     (self.last_name_row,)).fetchall()
        except sqlite3.OperationalError as e:   # a store of an older version: no dictionary
            log.debug("store poll (kernel names): %s", e)
            names = []
        if names:
            self.last_name_row = names[-1][0]
            by_job: dict = collections.defaultdict(list)
            for _, job, kid, name in names:
                by_job[job].append(records_pb2.KernelName(id=from_signed(kid), name=name))
            for job, entries in by_job.items():
                self.names.add(records_pb2.KernelNames(job_id=job, names=entries))
        if not rows and timeout_s > 0:
            time.sleep(min(timeout_s, 0.2))
        out = []
        for rid, signal, value in rows:
            self.last_id = rid
            rec = self.parse(signal, value)
            if rec is not None:
                out.append((signal, rec))
        return self.names.resolve(out)

    def close(self) -> None:
        self._db.close()


class RateLimitedLog:
    """librdkafka's log lines through ``logging``, at most one per ``every_s`` of each kind.

    With a broker down librdkafka repeats "Connect ... failed" every reconnect
    backoff (hundreds of lines a minute on stderr when no ``logger`` is set).
    A kind is (level, facility, e.g. ``FAIL``); lines held back are counted in
    the next one of their kind that is let through.
    """

    def __init__(self, logger: logging.Logger, every_s: float = 30.0, clock=None) -> None:
        import time

        self.logger = logger
        self.every_s = every_s
        self._clock = clock or time.monotonic
        self._last: dict[tuple, float] = {}
        self._held: collections.Counter = collections.Counter()

    def log(self, level: int, msg: str, *args, **kwargs) -> None:
        key = (level, str(args[0]) if args else msg[:40])
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] += 1
            return
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            msg += f" (and {held} more like it in the last {self.every_s:g} s)"
        self.logger.log(level, msg, *args, **kwargs)


class KafkaSource(_Parsing):
    """A consumer group member on the per-signal topics.

    Restarts (issue #11 item 5): offsets are committed every second
    (at-least-once: a killed analyzer re-reads at most that much), and with
    ``instance_id`` the member is static (KIP-345): a restarted analyzer with
    the same id takes its partitions back without waiting for the dead
    member's session to expire. Measured on Tansu 0.6 (session 10 s): a
    dynamic member's replacement got its first record 18.8 s after the kill,
    a static one 8.7 s (the issue saw 81 s with the 45 s default).
    """

    def __init__(self, bootstrap: str, *, group_id: str = "trainscope-analyzer",
                 prefix: str = "trainscope", extra: dict | None = None,
                 instance_id: str | None = None, session_timeout_s: float = 10.0) -> None:
        super().__init__()
        from confluent_kafka import Consumer, KafkaException

        from trainscope.proto.errors import ConfigError, scrub
        self.topics = {topic_for(s, prefix): s for s in SIGNALS}
        self._rdkafka_log = RateLimitedLog(logging.getLogger(__name__ + ".librdkafka"))
        extra = dict(extra or {})
        settings = {
            "auto.offset.reset": "earliest", "enable.auto.commit": True, "auto.commit.interval.ms": 1000,
            "session.timeout.ms": int(session_timeout_s * 1000),
            "heartbeat.interval.ms": max(100, int(session_timeout_s * 1000) // 5),
            **({"group.instance.id": instance_id} if instance_id else {}),
            **extra,  # security.protocol, sasl.*, ssl.*, session.timeout.ms ... (never logged: secrets)
            "bootstrap.servers": bootstrap, "group.id": group_id,
            "logger": self._rdkafka_log,  # not raw lines on stderr: logging, rate-limited
            "error_cb": lambda err: self._rdkafka_log.log(logging.WARNING, "kafka %s: %s", err.name(), err.str()),
        }
        try:
            self._consumer = Consumer(settings)
        except KafkaException as e:
            raise ConfigError("kafka.extra", extra, scrub(str(e), extra)) from None
        self._consumer.subscribe(list(self.topics))
        self.errors = 0
        #: Records known to wait beyond the consumer's position after the last poll (``_behind``).
        self.backlog = False
        # the dictionary: every member reads all of it from the beginning (assigned, no group, no
        # commits), on restart too; partitions are (re)assigned as the topic appears or grows
        self.names_topic = topic_for(KERNEL_NAMES, prefix)
        self._names = Consumer({**{k: v for k, v in settings.items() if k not in ("group.instance.id",)},
                                "group.id": f"{group_id}.kernel-names", "enable.auto.commit": False,
                                "auto.offset.reset": "earliest"})
        self._names_parts: set[int] = set()
        self._names_check = 0.0
        self._assign_names()

    def _assign_names(self) -> None:
        import time

        from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition
        self._names_check = time.monotonic() + (5.0 if not self._names_parts else 60.0)
        try:
            md = self._names.list_topics(timeout=2.0)   # all topics: naming it would auto-create it uncompacted
        except KafkaException as e:
            log.debug("kernel names: no metadata yet: %s", e)
            return
        t = md.topics.get(self.names_topic)
        if t is None or t.error is not None:
            return
        new = sorted(set(t.partitions) - self._names_parts)
        if new:
            self._names.incremental_assign([TopicPartition(self.names_topic, p, OFFSET_BEGINNING) for p in new])
            self._names_parts.update(new)

    def _poll_names(self, timeout_s: float) -> None:
        import time

        if time.monotonic() >= self._names_check:
            self._assign_names()
        if not self._names_parts:
            return
        for m in self._names.consume(num_messages=10_000, timeout=timeout_s):
            if m.error():
                self.errors += 1
                log.debug("kafka consume error (kernel names): %s", m.error())
                continue
            self.names.add_raw(m.value())

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, Message]]:
        self._poll_names(0.0)
        msgs = self._consumer.consume(num_messages=10_000, timeout=max(timeout_s, 0.0))
        self.backlog = self._behind()
        out = []
        for m in msgs:
            if m.error():
                self.errors += 1
                log.debug("kafka consume error: %s", m.error())
                continue
            signal = self.topics.get(m.topic())
            if signal is None:
                continue
            rec = self.parse(signal, m.value())
            if rec is not None:
                out.append((signal, rec))
        if self.names.held or any(s == Signal.KERNELS for s, _ in out):
            self._poll_names(0.05 if self.names.held else 0.0)   # names sent just before their windows
        return self.names.resolve(out)

    def _behind(self) -> bool:
        """Whether records wait in an assigned partition beyond this consumer's position: the partition's
        high watermark as of its last fetch (librdkafka's cache, no broker call) above the position.
        A backlog (an analyzer started or restarted after its jobs wrote) is read partition by partition
        at different rates: one rank's later windows can be in before another's earlier ones. A
        partition not fetched yet (no watermark cached) counts as behind: a topic whose first fetch
        came after the others' (beside a busy core) held the records that made a window whole."""
        from confluent_kafka import KafkaException
        try:
            parts = self._consumer.assignment()
            if not parts:
                return False
            for tp in self._consumer.position(parts):
                _, high = self._consumer.get_watermark_offsets(tp, cached=True)
                if high < 0:   # never fetched yet: it may hold the ranks' missing records
                    return True
                if tp.offset < 0 and high > 0 or 0 <= tp.offset < high:
                    return True
        except KafkaException as e:   # no assignment or metadata yet: nothing known to wait
            log.debug("kafka backlog check: %s", e)
        return False

    def close(self) -> None:
        self._consumer.close()
        self._names.close()
