"""Kafka sink: window summaries to one topic per signal, through a disk spool.

Design (why it looks like this):

1. ``export`` serialises each record and appends it to a :class:`DiskSpool`
   (one buffered ``write``); it never touches the network, never blocks on
   the broker, never raises for delivery trouble. A full spool refuses the
   record, which is counted as ``drops{where="kafka_spool"}``.
2. One sender thread owns the producer. It takes frames from the spool in
   order, hands a bounded window of them to librdkafka, and commits the
   spool only up to the longest prefix the broker acknowledged. Everything
   goes through the spool, so order holds by construction: while a backlog
   is spooled, new records are simply behind it.
3. The producer is idempotent (``enable.idempotence``, ``acks=all``):
   librdkafka's own retries never duplicate or reorder within a partition.
   The key is the job id, so every rank of a job (the ranks the analyzer
   compares with each other) lands on one partition and one consumer; with
   ``key_by="group"`` kernel windows are keyed by (job, data-parallel
   comparison group) instead (``group_key``), so one job's L3 spreads over
   the partitions and the members of the analyzer group (``analyzer/partition.py``).
4. Outage: ``_ALL_BROKERS_DOWN`` or a fatal error (``error_cb``), a failed
   delivery, or no delivery progress for a while marks the broker down. The
   sender purges the producer, rewinds the spool to the last commit (skipping
   frames already acknowledged) and probes metadata with backoff. When the
   broker answers it re-creates the topics that are missing (a broker with
   memory storage, e.g. Tansu, comes back empty) and a fresh producer (the
   old idempotent producer id is unknown to a restarted broker), then replays
   the spool in order. Delivery is at-least-once: a record in flight when the
   connection broke may be sent again.
5. ``flush`` waits for the spool to drain; ``close`` flushes with a bound and
   stops the thread. What is left stays in the spool for the next start.
   Giving up is bounded once, not once per call: a shutdown flushes several
   times (final drain, pipeline stop, close) and a dead broker cost each the
   caller's whole timeout (replay: 15 + 30 + 10 s). Now the flushes share one
   budget of ``close_timeout_s`` spent waiting with nothing acknowledged; when
   it is used up the sink says once what stays spooled, and later flushes return
   at once until a record is delivered again (which refills the budget).
6. The kernel-name dictionary (``processor/kernel_names.py``): a window's new (job, id →
   name) entries are spooled before the window, one record per entry keyed ``<job>/<id>``
   on ``<prefix>.kernel_names.v1``, created with ``cleanup.policy=compact`` (the newest
   record per key is kept for ever: a consumer that starts later reads the whole dictionary
   from offset 0). After an outage every entry counts as unsent again (a broker with memory
   storage comes back without them); re-sent entries are identical, so harmless.
"""
from __future__ import annotations

import collections
import functools
import logging
import random
import threading
import time

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from google.protobuf.message import Message

from trainscope.processor.kafka_config import _NAME, KafkaSinkConfig
from trainscope.processor.kernel_names import KERNEL_NAMES, Sent, split
from trainscope.processor.model import WindowOutput
from trainscope.proto.contracts import SIGNALS, Signal, topic_for
from trainscope.proto.model import group_number
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.spool import DiskSpool, SpoolFrame
from trainscope.proto.errors import ConfigError, SinkError, scrub

log = logging.getLogger(__name__)


def group_key(resource, dim: str = "dp") -> str:
    """``<job>/<dim><index>``: the key of a rank's kernel windows when they are keyed by comparison group.

    Ranks compared with each other along ``dim`` share every other coordinate, so the index is
    the mixed-radix number of those (the analyzer's ``topology.group_index``); a rank without
    coordinates is in the job's one group (key: the job id).
    """
    c = resource.coords
    if not any((c.dp_size, c.tp_size, c.pp_size, c.ep_size, c.cp_size)):
        return resource.job_id
    return f"{resource.job_id}/{dim}{group_number(c, dim)}"


class _Demoted(logging.LoggerAdapter):
    """librdkafka's log lines at DEBUG: during an outage it repeats "connection
    refused" every backoff; the sink logs state changes and first errors itself."""

    def log(self, level, msg, *args, **kwargs):
        super().log(logging.DEBUG, msg, *args, **kwargs)


_rdkafka_log = _Demoted(logging.getLogger(__name__ + ".librdkafka"), {})
#: Errors that retrying the same record can never fix: the record is dropped and counted.
_PERMANENT = frozenset((KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.INVALID_MSG,
                        KafkaError.RECORD_LIST_TOO_LARGE, KafkaError._INVALID_ARG))
_PURGED = frozenset((KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT))


_NEW, _PENDING, _OK, _FAILED, _SKIPPED = range(5)


class _Entry:
    """A frame taken from the spool and its delivery state."""

    __slots__ = ("frame", "signal", "state", "gen")

    def __init__(self, frame: SpoolFrame) -> None:
        self.frame = frame
        raw = frame.header("signal")
        self.signal = raw.decode(errors="replace") if raw else "unknown"
        self.state = _NEW
        self.gen = -1


class KafkaSink:
    """The Kafka :class:`~trainscope.processor.sink.Sink`: spooled, ordered, idempotent."""

    name = "kafka"
    #: Frames and bytes handed to librdkafka at once: bounds memory, and what
    #: may be resent after a broken connection.
    WINDOW_FRAMES = 2000
    WINDOW_BYTES = 16 << 20
    #: In-flight frames with no delivery report for this long: recreate the producer.
    STALL_S = 10.0

    def __init__(self, config: KafkaSinkConfig, metrics: SelfMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else SelfMetrics()
        try:
            self._spool = DiskSpool(config.spool_dir, config.spool_max_bytes)
        except (SinkError, OSError) as e:
            raise ConfigError("kafka.spool_dir", config.spool_dir, str(e)) from e
        try:
            self._producer = self._new_producer()
            self._admin = AdminClient({**config.admin_settings(), "logger": _rdkafka_log})
        except KafkaException as e:
            self._spool.close()
            raise ConfigError("kafka.extra", dict(config.extra), scrub(str(e), config.extra)) from None
        self._topics: dict[str, str] = {}
        self._wanted = {self.topic_for(s) for s in SIGNALS}  # created at start; others on first use
        self._names_topic = self.topic_for(KERNEL_NAMES)
        self._wanted.add(self._names_topic)
        self._sent = Sent()              # dictionary entries spooled, per job (processor thread)
        self._resend_names = False       # set by the sender after an outage
        self._ensured: set[str] = set()  # topics settled on this broker incarnation
        self._present: set[str] = set()  # ... of which seen in metadata (must not vanish)
        self._window: collections.deque[_Entry] = collections.deque()
        self._window_bytes = 0
        self._inflight = 0
        self._skip: set[int] = set()
        self._since_rewind = 0
        self._gen = 0
        self._up = False
        self._next_refuse_log = 0.0
        self._down_reason: str | None = None
        self._suspect = False
        self._backoff = 0.1
        self._next_probe = 0.0
        self._last_probe = 0.0
        self._last_progress = time.monotonic()
        self._corrupt_seen = 0
        self._errors_logged: set[int] = set()  # error codes already logged in this outage
        self._outage_logged = False
        self._flushing = 0
        self._idle_flush_s = 0.0  # time spent in flush() with nothing acknowledged (see flush)
        self._idle_counted_to = 0.0  # monotonic time up to which it is counted (concurrent flushes)
        self._acked_at = 0.0  # monotonic time of the last spool commit
        self._gave_up_said = False
        self._closed = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._drained = threading.Condition()
        self._note_corruption()
        self._set_gauge()
        self._thread = threading.Thread(target=self._run, name="trainscope-kafka-sink", daemon=True)
        self._thread.start()

    # -- the Sink protocol (processor thread) ------------------------------
    def topic_for(self, signal: str) -> str:
        """``<prefix>.<signal>.v1``: one topic per signal and wire-format version."""
        topic = self._topics.get(signal)
        if topic is None:
            if not _NAME.match(signal):
                raise ValueError(f"signal {signal!r} cannot be part of a topic name")
            topic = self._topics[signal] = topic_for(signal, self.config.topic_prefix)
        return topic

    def export(self, out: WindowOutput) -> None:
        if self._resend_names:
            self._resend_names = False
            self._sent.forget()
        names = self._sent.new(out.kernel_names)
        if names is not None:   # before the window: one compacted record per entry
            if all([self.export_record(KERNEL_NAMES, one, key=key) for key, one in split(names)]):
                self._sent.mark(names)
        by_group = self.config.key_by == "group"
        for signal, record in out.records():
            res = record.resource
            key = group_key(res) if by_group and signal == Signal.KERNELS else res.job_id
            self.export_record(signal, record, key=key, rank=res.rank)

    def export_record(self, signal: str, record: Message, *, key: str, rank: int | None = None) -> bool:
        """Spool one protobuf record for ``topic_for(signal)``; False if it was dropped.

        Also the entry point for records that are not window summaries (the
        analyzer's diagnoses): ``key`` is the job id.
        """
        topic = self.topic_for(signal)
        headers = [("signal", signal.encode()), ("schema", record.DESCRIPTOR.full_name.encode())]
        if rank is not None:
            headers.append(("rank", str(rank).encode()))
        if self._closed:
            self.metrics.inc("drops", where="kafka_closed")
            return False
        value = record.SerializeToString()
        if not self._spool.append(topic, key.encode(), value, headers):
            return self._spool_refused(topic, key, value, headers, signal)
        if topic not in self._wanted:
            self._wanted = self._wanted | {topic}
        self._set_gauge()
        self._wake.set()
        return True

    def _spool_refused(self, topic: str, key: str, value: bytes, headers, signal: str) -> bool:
        """The spool would not take a record: say so (rate-limited), count it, and when the disk
        is what refused and nothing is queued ahead, hand it to a connected broker directly.

        A full spool disk must not stop live delivery: with an empty spool there is no order
        to keep, so the record goes straight to the producer (at-most-once for these records:
        a delivery failure is counted as ``drops{where="kafka_direct"}``).
        """
        why = self._spool.refused or "full"
        now = time.monotonic()
        if now >= self._next_refuse_log:
            self._next_refuse_log = now + 10.0
            log.warning("kafka sink: spool %s refused a record (%s%s); %s", self.config.spool_dir, why,
                        f": {self._spool.disk_error}" if why == "disk" else
                        f": {self.config.spool_max_bytes} bytes held" if why == "full" else "",
                        "sending it directly" if why == "disk" and self._up else "dropped")
        if why == "disk" and self._up and self._spool.frames == 0 and self._producer is not None:
            try:
                self._producer.produce(topic, value, key.encode(), headers=headers,
                                       on_delivery=lambda err, msg: self._on_direct(signal, len(value), err))
                self.metrics.inc("spool_bypassed", sink=self.name)
                return True
            except Exception as e:  # BufferError (queue full), KafkaException
                log.debug("kafka sink: direct produce failed: %s", e)
        self.metrics.inc("drops", where="kafka_spool_disk" if why == "disk" else "kafka_spool")
        return False

    def _on_direct(self, signal: str, nbytes: int, err) -> None:
        if err is None:
            self.metrics.inc("records_out", sink=self.name, signal=signal)
            self.metrics.inc("bytes_out", nbytes, sink=self.name, signal=signal)
        else:
            self.metrics.inc("drops", where="kafka_direct")

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every spooled record is acknowledged; True if none is left.

        1. Wait at most ``timeout_s``, waking the sender (it probes a down broker every 0.2 s
           while someone flushes).
        2. Count the time waited with nothing acknowledged in ``_idle_flush_s``, across calls
           (a shutdown flushes three times) and without double counting concurrent callers;
           a spool commit resets it to zero.
        3. Stop once that count reaches ``close_timeout_s``: a dead broker holds a shutdown that
           long in all, not once per call. The first time, say what stays in the spool.
        """
        deadline = time.monotonic() + timeout_s
        budget = self.config.close_timeout_s
        with self._drained:
            self._flushing += 1
        try:
            self._wake.set()
            with self._drained:
                mark = time.monotonic()
                while self._spool.frames and self._thread.is_alive():
                    now = time.monotonic()
                    self._idle_flush_s += max(0.0, now - max(mark, self._idle_counted_to, self._acked_at))
                    self._idle_counted_to = mark = now
                    left = min(deadline - now, budget - self._idle_flush_s)
                    if left <= 0:
                        break
                    self._drained.wait(min(left, 0.1))
                if self._spool.frames and self._idle_flush_s >= budget and not self._gave_up_said:
                    self._gave_up_said = True
                    log.warning("kafka sink: nothing delivered to %s in %.1f s of flushing; giving up: "
                                "%d records (%s bytes) stay in the spool %s for the next start",
                                self.config.bootstrap, budget, self._spool.frames, f"{self._spool.bytes:,}",
                                self.config.spool_dir)
            self._set_gauge()  # the sender may not have refreshed it since its last commit
            return self._spool.frames == 0
        finally:
            with self._drained:
                self._flushing -= 1

    def close(self) -> None:
        """Flush for at most ``close_timeout_s`` (less when earlier flushes already waited on a
        broker that took nothing: see :meth:`flush`), stop the sender; keeps the rest on disk."""
        if self._closed:
            return
        self.flush(self.config.close_timeout_s)
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(self.config.close_timeout_s + 5.0)
        if self._thread.is_alive():
            log.warning("kafka sink: sender thread did not stop; %d records stay spooled", self._spool.frames)
        self._spool.close()

    # -- sender thread -----------------------------------------------------
    def _new_producer(self) -> Producer:
        return Producer({**self.config.producer_settings(), "error_cb": self._on_error, "logger": _rdkafka_log})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as e:  # the sender must outlive any surprise
                log.exception("kafka sink: sender step failed")
                self.metrics.inc("sink_errors", sink=self.name)
                self._down_reason = self._down_reason or f"internal error: {e!r}"
                self._stop.wait(0.5)
        if self._producer is not None:
            self._producer.purge()
            self._producer.poll(0)
            self._producer = None
        self._admin = None

    def _step(self) -> None:
        now = time.monotonic()
        if not self._up:
            if now >= self._next_probe or (self._flushing and now - self._last_probe >= 0.2):
                self._try_up()
            if not self._up:
                self._wake.wait(max(0.02, min(self._next_probe - time.monotonic(), 0.2)))
                self._wake.clear()
                return
        self._fill()
        self._produce()
        self._producer.poll(0.05 if self._inflight else 0)
        self._commit()
        if self._down_reason is None and (self._suspect or self._stalled()):
            self._check_health()
        if self._down_reason is not None:
            self._go_down()
        elif not self._inflight and not self._has_new():
            self._wake.wait(0.2)
            self._wake.clear()

    def _has_new(self) -> bool:
        return any(e.state == _NEW for e in self._window) or self._spool.frames > len(self._window)

    def _stalled(self) -> bool:
        limit = min(self.STALL_S, self.config.delivery_timeout_s)
        return bool(self._inflight) and time.monotonic() - self._last_progress > limit

    def _fill(self) -> None:
        """Take frames from the spool into the window, marking ones delivered before a rewind."""
        room = self.WINDOW_FRAMES - len(self._window)
        room_bytes = self.WINDOW_BYTES - self._window_bytes
        if room <= 0 or room_bytes <= 0:
            return
        frames = self._spool.read(min(room, 500), room_bytes)
        self._note_corruption()
        for frame in frames:
            entry = _Entry(frame)
            if self._since_rewind in self._skip:
                entry.state = _SKIPPED
            self._since_rewind += 1
            self._window.append(entry)
            self._window_bytes += len(frame.value)

    def _produce(self) -> None:
        for entry in self._window:
            if entry.state != _NEW:
                continue
            frame = entry.frame
            if frame.topic not in self._ensured and not self._ensure_topics({frame.topic}):
                self._down_reason = self._down_reason or f"cannot create topic {frame.topic}"
                return
            entry.state, entry.gen = _PENDING, self._gen
            try:
                self._producer.produce(
                    frame.topic, frame.value, frame.key, headers=list(frame.headers),
                    on_delivery=functools.partial(self._on_delivery, entry),
                )
            except BufferError:
                entry.state = _NEW
                return  # librdkafka's queue is full: serve reports, continue next step
            except KafkaException as e:
                entry.state, err = _NEW, e.args[0]
                if err.code() in _PERMANENT:
                    self._reject(entry, err)
                    continue
                self._down_reason = self._down_reason or f"produce failed: {err}"
                return
            if not self._inflight:
                self._last_progress = time.monotonic()
            self._inflight += 1

    def _on_delivery(self, entry: _Entry, err, msg) -> None:
        """Delivery report, served by ``poll`` on the sender thread."""
        if entry.gen != self._gen or entry.state != _PENDING:
            return
        self._inflight -= 1
        self._last_progress = time.monotonic()
        if err is None:
            entry.state = _OK
            self.metrics.inc("records_out", sink=self.name, signal=entry.signal)
            self.metrics.inc("bytes_out", len(entry.frame.value), sink=self.name, signal=entry.signal)
        elif err.code() in _PURGED:
            entry.state = _FAILED  # our own purge during an outage: replayed, not an error
        elif err.code() in _PERMANENT:
            self._reject(entry, err)
        else:
            entry.state = _FAILED
            self.metrics.inc("sink_errors", sink=self.name)
            self._down_reason = self._down_reason or f"delivery failed: {err.str()}"

    def _reject(self, entry: _Entry, err) -> None:
        """A record no broker will ever take (too large, invalid): drop it, keep the queue moving."""
        entry.state = _SKIPPED
        self.metrics.inc("sink_errors", sink=self.name)
        self.metrics.inc("drops", where="kafka_rejected")
        log.error("kafka sink: dropping a %s record for %s: %s", entry.signal, entry.frame.topic, err)

    def _on_error(self, err) -> None:
        """librdkafka client-level errors, served by ``poll`` on the sender thread."""
        self.metrics.inc("sink_errors", sink=self.name)
        if err.code() == KafkaError._ALL_BROKERS_DOWN or err.fatal():
            self._down_reason = self._down_reason or err.str()
        else:  # e.g. one connection dropped: check the broker is the same one
            self._suspect = True
        if err.code() not in self._errors_logged:  # once per code per outage, not per retry
            self._errors_logged.add(err.code())
            log.warning("kafka sink: %s", err.str())

    def _commit(self) -> None:
        """Release the acknowledged prefix of the window from the spool."""
        n = 0
        while self._window and self._window[0].state in (_OK, _SKIPPED):
            self._window_bytes -= len(self._window.popleft().frame.value)
            n += 1
        if n:
            self._spool.commit(n)
            self._set_gauge()
            with self._drained:
                self._acked_at = time.monotonic()
                self._idle_flush_s = 0.0  # delivering again: a later flush gets its whole budget
                self._gave_up_said = False
                self._drained.notify_all()

    def _check_health(self) -> None:
        """Metadata probe while up: lost connection, lost topics, or a stuck producer."""
        self._suspect = False
        md = self._metadata()
        if md is None:
            self._down_reason = "metadata probe failed"
        elif self._present - set(md.topics):
            self._down_reason = "topics vanished: the broker came back empty"
        elif self._stalled():
            self._down_reason = "no delivery progress"

    def _go_down(self) -> None:
        """Abandon the producer, keep what was acknowledged, rewind the rest."""
        reason, self._down_reason = self._down_reason, None
        log.warning("kafka sink: broker unavailable (%s); spooling to %s", reason, self.config.spool_dir)
        self._outage_logged = True
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.purge()
            deadline = time.monotonic() + 2.0
            while self._inflight and time.monotonic() < deadline:
                producer.poll(0.05)
        self._gen += 1
        self._inflight = 0
        self._commit()
        self._skip = {i for i, e in enumerate(self._window) if e.state in (_OK, _SKIPPED)}
        self._window.clear()
        self._window_bytes = 0
        self._since_rewind = 0
        self._spool.rewind()
        self._up = False
        self._resend_names = True   # the broker may come back without the dictionary
        self._ensured, self._present = set(), set()
        self._suspect = False
        self._backoff = 0.1
        self._next_probe = time.monotonic()

    def _try_up(self) -> None:
        md = self._metadata()
        if md is not None and self._ensure_topics(set(self._wanted), md):
            if self._producer is None:
                self._producer = self._new_producer()
            self._up = True
            self._down_reason = None  # stale: raised while we were down anyway
            self._errors_logged.clear()
            self._outage_logged = False
            self._last_progress = time.monotonic()
            self._backoff = 0.1
            log.info("kafka sink: broker reachable; %d records to replay", self._spool.frames)
            return
        if not self._outage_logged:  # e.g. unreachable from the start
            log.warning("kafka sink: no usable broker at %s; spooling to %s",
                        self.config.bootstrap, self.config.spool_dir)
            self._outage_logged = True
        self._next_probe = time.monotonic() + self._backoff * random.uniform(0.8, 1.2)
        self._backoff = min(self._backoff * 2, self.config.probe_interval_s)

    def _metadata(self):
        self._last_probe = time.monotonic()
        try:
            md = self._admin.list_topics(timeout=min(self.config.probe_interval_s, 5.0))
        except KafkaException as e:
            self.metrics.inc("sink_errors", sink=self.name)
            log.debug("kafka sink: metadata probe failed: %s", e)
            return None
        finally:
            self._admin.poll(0)  # serve queued librdkafka logs
        return md if md.brokers else None

    def _ensure_topics(self, topics: set[str], md=None) -> bool:
        """Create the missing ones (tolerating 'already exists'); True when all are usable."""
        if not self.config.create_topics:
            self._ensured |= topics
            return True
        if md is None:
            md = self._metadata()
            if md is None:
                return False
        missing = sorted(t for t in topics if t not in md.topics or md.topics[t].error is not None)
        self._present |= topics.difference(missing)
        ok = True
        timeout = min(self.config.delivery_timeout_s, 10.0)
        new = [NewTopic(t, num_partitions=self.config.partitions, replication_factor=self.config.replication_factor,
                        config={"cleanup.policy": "compact"} if t == self._names_topic else {})
               for t in missing]
        for topic, fut in (self._admin.create_topics(new, request_timeout=timeout) if new else {}).items():
            try:
                fut.result(timeout=timeout + 1.0)
            except Exception as e:  # KafkaException, or the future timing out
                err = e.args[0] if isinstance(e, KafkaException) else None
                if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    self.metrics.inc("sink_errors", sink=self.name)
                    log.warning("kafka sink: cannot create topic %s: %s", topic, err or repr(e))
                    if err is None or err.retriable() or err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT):
                        ok = False  # try again with the next probe
                    continue  # else (e.g. not authorised) ops may have made it: let produce decide
            self._present.add(topic)
        self._admin.poll(0)
        if ok:
            self._ensured |= topics
        return ok

    def _note_corruption(self) -> None:
        if self._spool.corrupt > self._corrupt_seen:
            self.metrics.inc("drops", self._spool.corrupt - self._corrupt_seen, where="kafka_spool_corrupt")
            log.error("kafka sink: skipped %d corrupt spool regions", self._spool.corrupt - self._corrupt_seen)
            self._corrupt_seen = self._spool.corrupt

    def _set_gauge(self) -> None:
        self.metrics.set("spool_bytes", self._spool.bytes, sink=self.name)

