"""Where diagnoses go: the local store, a bus topic, a Kafka topic.

(The Prometheus side is ``prom.AnalyzerMetrics``, also a DiagnosisSink.)
Topics: ``<prefix>.diagnoses.v1`` (one ``Diagnosis`` per finding) and
``<prefix>.verdicts.v1`` (one ``Verdict`` per job and window), keyed by job.
"""
from __future__ import annotations

from trainscope.analyzer.store import DiagnosisStore
from trainscope.processor.bus import EmbeddedBus
from trainscope.proto.contracts import AnalyzerOutput, topic_for
from trainscope.proto.v1 import records_pb2


class StoreDiagnosisSink:
    name = "store"

    def __init__(self, store: DiagnosisStore) -> None:
        self.store = store

    def publish(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict | None) -> None:
        self.store.put(diagnoses, verdict)

    def close(self) -> None:
        self.store.close()


class BusDiagnosisSink:
    name = "bus"

    def __init__(self, bus: EmbeddedBus, prefix: str = "trainscope") -> None:
        self.bus = bus
        self.prefix = prefix

    def publish(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict | None) -> None:
        for d in diagnoses:
            self.bus.publish(topic_for(AnalyzerOutput.DIAGNOSES, self.prefix), d.job_id.encode(), d.SerializeToString())
        if verdict is not None:
            self.bus.publish(topic_for(AnalyzerOutput.VERDICTS, self.prefix), verdict.job_id.encode(),
                             verdict.SerializeToString())

    def close(self) -> None:
        pass


class KafkaDiagnosisSink:
    """Publishes through a ``KafkaSink`` (same spool, idempotent producer, ordering)."""

    name = "kafka"

    def __init__(self, kafka_sink) -> None:
        self.kafka = kafka_sink

    def publish(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict | None) -> None:
        for d in diagnoses:
            self.kafka.export_record("diagnoses", d, key=d.job_id)
        if verdict is not None:
            self.kafka.export_record("verdicts", verdict, key=verdict.job_id)

    def close(self) -> None:
        self.kafka.close()
