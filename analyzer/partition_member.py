"""One member of the analyzer's consumer group in partitioned mode (``partition.py``).

1. One confluent-kafka consumer in the group subscribes to every signal topic
   and the partials topic, with the range assignor (partition p of every
   topic goes to one member, so a job's records and its partials, keyed by
   job, meet at its owner) and manual commits. The topics must have one
   partition count: checked at start (``ensure_topics``), one clear error if not.
2. Kernel windows go to the ``GroupStage``, partials to the ``PartialStore``,
   everything else to an ``Analyzer`` whose L3 level is ``L3Partials``, held
   by ``PartialStore.gate`` and filled by ``PartialStore.fill``. Kernel windows
   carrying kernel ids get their names from the jobs' dictionaries
   (``<prefix>.kernel_names.v1``, read whole by every member, as ``KafkaSource``
   does) when their window is analysed: names are sent before the windows that
   use them, and by then the window waited for its groups.
3. Each step: the group stage's ready windows are analysed and their partials
   handed to ``publish`` (the daemon's Kafka sink: spooled, ordered,
   idempotent); then the analyzer steps.
4. Offsets: per partition the commit position is the lowest offset that an
   open window still holds (group stage, analyzer, or a partial not merged
   yet), else the next offset to read. A member that dies or loses a partition
   never committed past a record whose window it had not finished; its
   successor reads from there (at-least-once). A group analysed twice gives
   one entry per group at the owner (the latest), and a window analysed twice
   the same verdict, stored by (job, window) (``INSERT OR REPLACE``): no
   verdict is lost, none is stored twice.
5. Rebalance: on revocation the member commits what it may, then forgets the
   revoked partitions' records (group stage) and jobs (analyzer); a new
   assignment starts from the committed offsets.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Sequence

from trainscope.analyzer.partition import PARTIALS, GroupStage, L3Partials, PartialStore
from trainscope.analyzer.service import Analyzer, AnalyzerConfig, default_detectors
from trainscope.analyzer.sources import RateLimitedLog, _Parsing
from trainscope.processor.kernel_names import KERNEL_NAMES
from trainscope.proto.contracts import SIGNALS, Signal, topic_for
from trainscope.proto.errors import ConfigError, scrub
from trainscope.proto.v1 import records_pb2

log = logging.getLogger(__name__)


class _Nothing:
    """The analyzer's source: the member feeds it (``Analyzer.ingest``)."""

    def poll(self, timeout_s: float = 0.0) -> list:
        return []

    def close(self) -> None:
        pass


def ensure_topics(bootstrap: str, topics: Sequence[str], partitions: int, extra: dict | None = None,
                  timeout_s: float = 10.0) -> int:
    """Create the missing topics with ``partitions`` partitions; return the one partition count they
    share, or raise ``ConfigError`` when they differ (a job's partials would miss its owner)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({**(extra or {}), "bootstrap.servers": bootstrap,
                         "logger": RateLimitedLog(logging.getLogger(__name__ + ".librdkafka"))})
    md = admin.list_topics(timeout=timeout_s)
    missing = [t for t in topics if t not in md.topics or md.topics[t].error is not None]
    if missing:
        futs = admin.create_topics([NewTopic(t, num_partitions=partitions) for t in missing],
                                   request_timeout=timeout_s)
        for t, fut in futs.items():
            try:
                fut.result(timeout=timeout_s + 1)
            except KafkaException as e:
                if "ALREADY_EXISTS" not in e.args[0].name():
                    raise ConfigError("kafka.topics", t, f"cannot create it: {e.args[0].str()}") from None
        md = admin.list_topics(timeout=timeout_s)
    counts = {t: len(md.topics[t].partitions) for t in topics if t in md.topics}
    if len(set(counts.values())) > 1:
        raise ConfigError("kafka.topics", counts, "partitioned analysis needs one partition count on every "
                                                  "topic (a job's partials must reach the member that owns it)")
    return next(iter(counts.values()), partitions)


class PartitionedMember(_Parsing):
    """Steps 1-5: one analyzer of the group; ``step`` like ``Analyzer.step``."""

    def __init__(self, config: AnalyzerConfig, bootstrap: str, *, publish: Callable[[records_pb2.Diagnosis], bool],
                 sinks: Sequence = (), metrics=None, group_id: str = "trainscope-analyzer",
                 prefix: str = "trainscope", extra: dict | None = None, instance_id: str | None = None,
                 session_timeout_s: float = 10.0, partitions: int = 6, member: str = "",
                 commit_interval_s: float = 1.0, first_partial_wait_s: float | None = None,
                 partials_signal: str = PARTIALS) -> None:
        super().__init__()
        from confluent_kafka import Consumer, KafkaException

        self.topics = {topic_for(s, prefix): s for s in SIGNALS}
        # partials_signal: the partials topic's middle name (benchmarks give each run its own)
        self.partials_topic = topic_for(partials_signal, prefix)
        self.topics[self.partials_topic] = PARTIALS
        extra = dict(extra or {})
        ensure_topics(bootstrap, list(self.topics), partitions,
                      {k: v for k, v in extra.items() if k.startswith(("security.", "sasl.", "ssl."))})
        self.publish = publish
        self.member = member or f"m{id(self):x}"
        self.stage = GroupStage(config.l3, grace_s=config.grace_s, window_timeout_s=config.window_timeout_s,
                                progress_windows=config.progress_windows)
        # a job's first window waits for a first partial up to window_timeout_s: reading and scoring a
        # 100,000-rank window's kernels takes longer than any fixed guess; a job with no kernels pays it once
        self.store = PartialStore(config.l3, first_wait_s=first_partial_wait_s if first_partial_wait_s is not None
                                  else config.window_timeout_s)
        self.analyzer = Analyzer(config, _Nothing(), sinks, metrics=metrics, window_gate=self.store.gate,
                                 before_analysis=self.store.fill)
        self.analyzer.detectors = [L3Partials(self.store) if d.level == "L3" else d
                                   for d in default_detectors(config, self.analyzer.metrics)]
        self._held: dict[tuple, dict] = {}        # (job, kind, index) -> {(topic, partition): lowest offset}
        self._partial_held: dict[tuple, dict] = {}
        self._next: dict[tuple[str, int], int] = {}   # next offset to read, per assigned partition
        self._committed: dict[tuple[str, int], int] = {}
        self._job_tp: dict[str, set] = {}
        self._commit_every = commit_interval_s
        self._last_commit = 0.0
        self.partials_out = 0
        self.cpu_s: collections.Counter = collections.Counter()
        """CPU seconds spent filing records, on the group stage (L3) and on the job-level analysis."""
        self._rdkafka_log = RateLimitedLog(logging.getLogger(__name__ + ".librdkafka"))
        settings = {
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
            "partition.assignment.strategy": "range",
            "session.timeout.ms": int(session_timeout_s * 1000),
            "heartbeat.interval.ms": max(100, int(session_timeout_s * 1000) // 5),
            **({"group.instance.id": instance_id} if instance_id else {}),
            **extra,
            "bootstrap.servers": bootstrap, "group.id": group_id, "logger": self._rdkafka_log,
            "error_cb": lambda err: self._rdkafka_log.log(logging.WARNING, "kafka %s: %s", err.name(), err.str()),
        }
        try:
            self._consumer = Consumer(settings)
        except KafkaException as e:
            raise ConfigError("kafka.extra", extra, scrub(str(e), extra)) from None
        self._holding = False
        self.assigned: set[tuple[str, int]] = set()
        self._consumer.subscribe(list(self.topics), on_assign=self._on_assign, on_revoke=self._on_revoke)
        # the kernel-name dictionaries: every member reads all of them (assigned, no group commits)
        self.names_topic = topic_for(KERNEL_NAMES, prefix)
        self._names = Consumer({**{k: v for k, v in settings.items() if k != "group.instance.id"},
                                "group.id": f"{group_id}.kernel-names"})
        self._names_parts: set[int] = set()
        self._names_check = 0.0
        self._books: dict[str, dict[int, str]] = {}
        self.stage.lookup = lambda job: self._books.get(job, {}).get

    def _poll_names(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

        if time.monotonic() >= self._names_check:
            self._names_check = time.monotonic() + (5.0 if not self._names_parts else 60.0)
            try:
                t = self._names.list_topics(self.names_topic, timeout=2.0).topics.get(self.names_topic)
            except KafkaException:
                t = None
            if t is not None and t.error is None:
                new = sorted(set(t.partitions) - self._names_parts)
                if new:
                    self._names.incremental_assign([TopicPartition(self.names_topic, p, OFFSET_BEGINNING)
                                                    for p in new])
                    self._names_parts.update(new)
        if not self._names_parts:
            return
        for m in self._names.consume(num_messages=10_000, timeout=0):
            if m.error():
                continue
            try:
                rec = records_pb2.KernelNames.FromString(m.value())
            except Exception:   # DecodeError
                self.bad_total += 1
                continue
            if rec.job_id:
                book = self._books.setdefault(rec.job_id, {})
                for e in rec.names:
                    if e.id and e.name:
                        book.setdefault(e.id, e.name)

    @property
    def verdicts(self):
        return self.analyzer.verdicts

    # ------------------------------------------------------------ steps 2-3
    def step(self, timeout_s: float = 0.2) -> list[records_pb2.Verdict]:
        self._poll_names()
        msgs = self._consumer.consume(num_messages=10_000, timeout=max(timeout_s, 0.0))
        t0 = time.process_time()
        for m in msgs:
            if m.error():
                continue
            signal = self.topics.get(m.topic())
            if signal is None:
                continue
            tp, off = (m.topic(), m.partition()), m.offset()
            self._next[tp] = max(self._next.get(tp, 0), off + 1)
            if signal == PARTIALS:
                d = self._parse_partial(m.value())
                if d is not None:
                    self.store.add(d)
                    key = (d.job_id, d.window.kind, d.window.index)
                    self._partial_held.setdefault(key, {}).setdefault(tp, off)
                continue
            rec = self.parse(signal, m.value())
            if rec is None:
                continue
            if signal == Signal.KERNELS:
                self.stage.add(rec, tp, off)
                continue
            job = rec.resource.job_id
            self._job_tp.setdefault(job, set()).add(tp)
            self.analyzer.ingest(signal, rec)
            if signal != Signal.COLLECTIVES:
                key = (job, rec.window.kind, rec.window.index)
                held = self._held.setdefault(key, {})
                held[tp] = min(held.get(tp, off), off)
        t1 = time.process_time()
        ready = self.stage.ready()
        if ready:
            self._poll_names()
        for key in ready:
            partials, _ = self.stage.analyse(key, self.member)
            for partial in partials:
                if self.publish(partial):
                    self.partials_out += 1
        t2 = time.process_time()
        out = self.analyzer.step(0)
        self._release()
        t3 = time.process_time()
        self.cpu_s["records"] += t1 - t0
        self.cpu_s["groups"] += t2 - t1
        self.cpu_s["job"] += t3 - t2
        if time.monotonic() - self._last_commit >= self._commit_every:
            self.commit()
        return out

    def finish(self) -> list[records_pb2.Verdict]:
        """Analyse what is open now (end of a run; the other members' partials may be missing)."""
        for key in self.stage.ready() or list(self.stage.open):
            for partial in self.stage.analyse(key, self.member)[0]:
                self.publish(partial)
        return self.analyzer.finish()

    def _parse_partial(self, raw: bytes) -> records_pb2.Diagnosis | None:
        try:
            d = records_pb2.Diagnosis.FromString(raw)
        except Exception as e:   # DecodeError
            self.bad_total += 1
            log.debug("bad partial: %s", e)
            return None
        return d if d.job_id and d.kind == "group_partial" else None

    # ------------------------------------------------------------ steps 4-5
    def _release(self) -> None:
        for key in list(self._held):
            job, kind, index = key
            if (kind, index) not in self.analyzer.open_windows(job):
                del self._held[key]
        for key in list(self._partial_held):
            if self.analyzer.analysed(*key):     # a partial that came after its window was judged
                self.store.discard(*key)
            if self.store.covered(key[0], records_pb2.Window(kind=key[1], index=key[2])) == 0:
                del self._partial_held[key]      # merged (taken) by the owner's L3 level, or too late

    def positions(self) -> dict[tuple[str, int], int]:
        """Step 4: per partition read, the offset it is safe to commit."""
        low = dict(self._next)
        for held in (self.stage.held(), *self._held.values(), *self._partial_held.values()):
            for tp, off in held.items():
                if tp in low:
                    low[tp] = min(low[tp], off)
        return low

    def commit(self, partitions: set | None = None, asynchronous: bool = True) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        self._last_commit = time.monotonic()
        todo = [TopicPartition(t, p, off) for (t, p), off in self.positions().items()
                if (partitions is None or (t, p) in partitions) and off > self._committed.get((t, p), -1)]
        if not todo:
            return
        try:
            self._consumer.commit(offsets=todo, asynchronous=asynchronous)
            for tp in todo:
                self._committed[(tp.topic, tp.partition)] = tp.offset
        except KafkaException as e:
            log.debug("commit failed: %s", e)

    def hold(self) -> None:
        """Join and keep the assignment, but read nothing until ``release`` (benchmarks: time the
        analysis of records already in the broker, not the group's join)."""
        self._holding = True
        if self.assigned:
            self._consumer.pause(self._consumer.assignment())

    def release(self) -> None:
        self._holding = False
        self._consumer.resume(self._consumer.assignment())

    def _on_assign(self, consumer, partitions) -> None:
        consumer.assign(partitions)
        if self._holding:
            consumer.pause(partitions)
        self.assigned = {(p.topic, p.partition) for p in partitions}

    def _on_revoke(self, consumer, partitions) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        self.assigned -= gone
        self.commit(gone, asynchronous=False)
        self.stage.drop(gone)
        for job, tps in list(self._job_tp.items()):
            if tps & gone:
                self.analyzer.forget_job(job)
                del self._job_tp[job]
                for key in [k for k in self._held if k[0] == job]:
                    del self._held[key]
        for key in [k for k, held in self._partial_held.items() if set(held) & gone]:
            del self._partial_held[key]
            self.store.discard(*key)
        for tp in gone:
            self._next.pop(tp, None)
            self._committed.pop(tp, None)

    def close(self) -> None:
        try:
            self.commit(asynchronous=False)
        finally:
            self._consumer.close()
            self._names.close()
