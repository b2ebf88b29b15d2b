"""``trainscope analyzer``: the analyzer as a long-running service, assembled once.

Mirrors ``processor/daemon.py``: a validated config, a class that wires the
parts, ``start``/``stop`` and a context manager.

1. Source: a Kafka consumer group when ``kafka_bootstrap`` is set, else a
   tail of the processor's local store. With ``partitioned`` (opt-in, needs
   Kafka and processors with ``key_by="group"``) the members of the group share
   each job's L3 by comparison group (``analyzer/partition_member.py``): more
   analyzers, shorter analysis of a large job's window.
2. Sinks: the local diagnosis store always; Kafka's diagnosis topic as well
   when there is a broker (its own spool under ``spool_dir``).
3. Metrics: flagged suspects on ``127.0.0.1:prometheus_port/metrics`` when a
   port is given (loopback only, STYLE.md: secure by default).
4. ``run(stop)`` steps the analyzer until ``stop`` is set and calls
   ``on_verdict`` with every verdict that names someone.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable, Mapping

from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AnalyzerDaemonConfig:
    store_path: str
    """The processor's SQLite store: where diagnoses go, and the source without Kafka."""
    spool_dir: str
    """Where the Kafka diagnosis sink spools while the broker is away."""
    kafka_bootstrap: str | None = None
    """Kafka bootstrap servers; None reads the local store instead."""
    group_id: str = "trainscope-analyzer"
    """Kafka consumer group."""
    window_timeout_s: float = 60.0
    """Analyse a window with the ranks that have arrived after this long."""
    prometheus_port: int | None = None
    """Serve the analyzer's metrics on 127.0.0.1:PORT (0 = any); None: no endpoint."""
    kafka_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """More librdkafka settings for the consumer and the diagnosis producer: ``security.protocol``,
    ``sasl.*``, ``ssl.*`` (``processor.kafka_config.security_settings``). Never printed."""
    group_instance_id: str | None = None
    """Static group membership (KIP-345): a restarted analyzer with the same id resumes its partitions
    from the committed offsets without waiting out the dead member's session. Unique per analyzer."""
    session_timeout_s: float = 10.0
    """Kafka consumer session timeout: how long a vanished analyzer holds its partitions."""
    metrics_security: Any = None
    """``proto.security.ServerSecurity`` of the metrics endpoint (TLS, bearer token); None: plain."""
    keep_windows: int | None = None
    """Age out each job's diagnoses and verdicts of windows older than its newest N (``analyzer/store.py``);
    None: keep all."""
    deep_dive_processors: tuple[str, ...] = ()
    """Processors (one per host of the jobs) the deep-dive triggers send their requests to
    (``analyzer/triggers.py``); empty: decisions are made and counted, nothing is requested."""
    verdict: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """``AnalyzerConfig`` fields that decide when a finding names a rank: ``impact`` (the floor),
    ``persist_k``/``persist_n`` (from ``--impact-floor``/``--persist``)."""
    partitioned: bool = False
    """Share each job's L3 with the other members of the consumer group, by comparison group
    (``analyzer/partition.py``); needs Kafka, and processors keying kernel windows by group."""
    partitions: int = 6
    """Partitions of the topics the partitioned mode creates when missing (as the processor's sink)."""

    def __post_init__(self) -> None:
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise ConfigError("--prometheus-port", self.prometheus_port, "must be in 0..65535, 0 meaning any free port")
        if self.partitioned and not self.kafka_bootstrap:
            raise ConfigError("--partitioned", True, "needs a Kafka broker (--kafka-bootstrap)")
        if not 1.0 <= self.session_timeout_s <= 300.0:
            raise ConfigError("--session-timeout-s", self.session_timeout_s, "must be in [1, 300]")
        if not self.kafka_bootstrap and not os.path.exists(self.store_path):
            raise ConfigError("--store", self.store_path, "no processor store there (start `trainscope "
                              "processor` first, or give --kafka-bootstrap)")
        if os.path.lexists(self.store_path):
            # before anything opens it for writing: someone else's database is refused, never given our tables
            from trainscope.deploy.report_cmd import check_store
            from trainscope.processor.store import TABLES
            check_store(self.store_path, "--store", need=frozenset() if self.kafka_bootstrap else TABLES)


def default_instance_id(home: str) -> str:
    """``<host>-<hash of the home directory>``: the same analyzer (same host, same state) after a
    restart, and different for a second analyzer beside it with its own ``--home``."""
    import hashlib
    import socket
    return f"{socket.gethostname()}-{hashlib.sha1(os.path.abspath(home).encode()).hexdigest()[:10]}"


class AnalyzerDaemon:
    def __init__(self, config: AnalyzerDaemonConfig) -> None:
        from trainscope.analyzer.metrics import AnalyzerMetrics
        from trainscope.analyzer.service import Analyzer, AnalyzerConfig
        from trainscope.analyzer.diagnosis_sinks import KafkaDiagnosisSink, StoreDiagnosisSink
        from trainscope.analyzer.sources import KafkaSource, StoreSource
        from trainscope.analyzer.store import DiagnosisStore

        self.config = config
        sinks: list = [StoreDiagnosisSink(DiagnosisStore(config.store_path, keep_windows=config.keep_windows))]  # step 2
        kafka_sink = None
        if config.kafka_bootstrap:  # step 1
            from trainscope.processor.kafka_config import KafkaSinkConfig
            from trainscope.processor.kafka_sink import KafkaSink
            if not config.partitioned:
                self.source = KafkaSource(config.kafka_bootstrap, group_id=config.group_id,
                                          extra=dict(config.kafka_extra), instance_id=config.group_instance_id,
                                          session_timeout_s=config.session_timeout_s)
            kafka_sink = KafkaSink(KafkaSinkConfig(
                bootstrap=config.kafka_bootstrap, client_id="trainscope-analyzer", spool_dir=config.spool_dir,
                partitions=config.partitions,
                extra={k: v for k, v in config.kafka_extra.items() if k.startswith(("security.", "sasl.", "ssl."))}))
            sinks.append(KafkaDiagnosisSink(kafka_sink))
            self.where = (f"Kafka {config.kafka_bootstrap} (group {config.group_id}"
                          f"{', partitioned by comparison group' if config.partitioned else ''})")
        else:
            self.source = StoreSource(config.store_path)
            self.where = f"store {config.store_path}"
        from trainscope.analyzer.triggers import DeepDiveTriggers, processor_sender
        self.triggers = DeepDiveTriggers(sender=processor_sender(config.deep_dive_processors)
                                         if config.deep_dive_processors else None)
        sinks.append(self.triggers)
        self.metrics = AnalyzerMetrics()
        analyzer_config = AnalyzerConfig(window_timeout_s=config.window_timeout_s, **config.verdict)
        if config.partitioned:
            from trainscope.analyzer.partition import PARTIALS
            from trainscope.analyzer.partition_member import PartitionedMember
            self.source = PartitionedMember(
                analyzer_config, config.kafka_bootstrap, sinks=sinks, metrics=self.metrics,
                publish=lambda d: kafka_sink.export_record(PARTIALS, d, key=d.job_id),
                group_id=config.group_id, extra=dict(config.kafka_extra), instance_id=config.group_instance_id,
                session_timeout_s=config.session_timeout_s, partitions=config.partitions,
                member=config.group_instance_id or "")
            self.analyzer = self.source.analyzer
            self._stepper = self.source
        else:
            self.analyzer = Analyzer(analyzer_config, self.source, sinks, metrics=self.metrics)
            self._stepper = self.analyzer
        self.metrics_server = None

    def start(self) -> "AnalyzerDaemon":
        if self.config.prometheus_port is not None:  # step 3
            from prometheus_client import CollectorRegistry

            from trainscope.processor.prom_exporter import start_metrics_server
            registry = CollectorRegistry()
            registry.register(self.metrics)
            registry.register(self.triggers)
            try:
                self.metrics_server = start_metrics_server(registry, "127.0.0.1", self.config.prometheus_port,
                                                           security=self.config.metrics_security)
            except OSError as e:  # a taken port is the user's to fix: one line, exit 2
                raise ConfigError("--prometheus-port", self.config.prometheus_port,
                                  f"cannot serve /metrics on 127.0.0.1: {e.strerror}") from None
        return self

    def run(self, stop: threading.Event, on_verdict: Callable | None = None) -> None:
        """Step 4: analyse until ``stop`` is set."""
        while not stop.is_set():
            for v in self._stepper.step(0.5):
                if on_verdict is not None and (v.ranks or v.findings):
                    on_verdict(v)

    def stop(self) -> None:
        self.source.close()
        for s in self.analyzer.sinks:
            s.close()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def __enter__(self) -> "AnalyzerDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
