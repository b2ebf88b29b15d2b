"""The per-host processor: gRPC ingest → windows → summaries → sinks.

``Processor`` is the facade the CLI, ``trainscope replay`` and the tests use:
build it from a ``ProcessorConfig``, ``start()``, point collectors at
``address``, ``drain()`` to close every window and flush the sinks, ``stop()``.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import stat
import threading
from typing import Any, Sequence

import grpc
from prometheus_client import CollectorRegistry

from trainscope.proto import env
from trainscope.processor.bus import EmbeddedBus, BusSink
from trainscope.processor.durability import Durability, stored_until
from trainscope.processor.control import ControlConfig, ControlHub, ControlServicer
from trainscope.processor.ingest import IngestServicer
from trainscope.processor.limits import IngestLimits
from trainscope.proto.securefs import private_dir
from trainscope.proto.security import ServerSecurity
from trainscope.processor.collectives import CollectiveWindowConfig
from trainscope.processor.pipeline import Pipeline
from trainscope.processor.selfmetrics import SelfMetrics, deep_dive_control_metrics
from trainscope.processor.sink import Sink
from trainscope.processor.store import SqliteStore, StoreSink
from trainscope.processor.summarize import SummaryConfig, Summarizer
from trainscope.processor.windows import WindowConfig
from trainscope.proto.errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProcessorConfig:
    listen: str = env.DEFAULT_PROCESSOR_TARGET
    """gRPC listen address: ``unix:///path`` (default, ARGUS §5.1) or ``host:port`` (port 0 = any)."""
    max_message_bytes: int = 16 << 20
    """Largest accepted message; larger ones get RESOURCE_EXHAUSTED."""
    grpc_workers: int = 64
    """gRPC handler threads; each open collector stream holds one while it is open."""
    stream_idle_s: float = 10.0
    """An ingest stream with no batch accepted for this long is closed (collectors' streams last ~2 s)."""
    stream_max_s: float = 300.0
    """An ingest stream open longer than this is closed (a collector's stream ends within its
    ``confirm_interval_s`` + max(5 s, it) + 5 s: 12 s by default; it then reconnects)."""
    stream_max_malformed: int = 32
    """An ingest stream that sends this many unparsable messages in a row is closed (INVALID_ARGUMENT)."""
    queue_max_batches: int = 10_000
    """Bound on validated batches waiting for the processing thread."""
    max_job_series: int = 1024
    """Bound on the per-job self-metric series (``collector_dropped{job,rank}``, one per sending
    rank, made at 0); beyond it they are counted in ``job_series_refused``."""
    window: WindowConfig = dataclasses.field(default_factory=WindowConfig)
    """How telemetry is cut into windows."""
    limits: IngestLimits = dataclasses.field(default_factory=IngestLimits)
    """What ingest accepts (``processor/limits.py``)."""
    summary: SummaryConfig = dataclasses.field(default_factory=SummaryConfig)
    """Kernel clustering and stack summary settings."""
    store_path: str | None = None
    """SQLite file for the local store (embedded default); None disables it."""
    store_keep_windows: int | None = None
    """Age out each job's records of windows older than its newest N (``processor/store.py``); None: keep all."""
    collectives: CollectiveWindowConfig = dataclasses.field(default_factory=CollectiveWindowConfig)
    """Collective windows and Mycroft's triggers (``processor/collectives.py``); ``trigger.raw_records``
    ``triggered`` keeps raw records only around a trigger (``--collective-raw triggered``)."""
    embedded_bus: bool = True
    """Publish records on the in-process bus (the analyzer's source when there is no broker)."""
    kafka: Any = None
    """``KafkaSinkConfig`` or None (no Kafka)."""
    prometheus: Any = None
    """``PrometheusConfig`` or None (no /metrics endpoint)."""
    perfetto: Any = None
    """``PerfettoConfig`` or None (no trace files)."""
    control: ControlConfig = dataclasses.field(default_factory=ControlConfig)
    """The deep-dive control path (``processor/control.py``): collectors' Subscribe streams, requests."""
    deep_dive_upload: Any = None
    """``processor/dive_upload.DiveUploadConfig``: upload each rank's deep-dive trace to object storage; None: keep local only."""
    security: ServerSecurity = dataclasses.field(default_factory=ServerSecurity)
    """TLS (server certificate, optionally required client certificates) and bearer token of the
    gRPC port (``proto/security.py``); the default is neither, fit for the per-user unix socket."""

    def __post_init__(self) -> None:
        if not self.listen:
            raise ConfigError("processor.listen", self.listen, "must be an address")
        env.check_target("processor.listen", self.listen, listen=True)
        if self.max_message_bytes < 1024:
            raise ConfigError("processor.max_message_bytes", self.max_message_bytes, "must be >= 1024")
        if self.grpc_workers < 1:
            raise ConfigError("processor.grpc_workers", self.grpc_workers, "must be >= 1")
        if not self.stream_idle_s > 0:
            raise ConfigError("processor.stream_idle_s", self.stream_idle_s, "must be > 0")
        if not self.stream_max_s > 0:
            raise ConfigError("processor.stream_max_s", self.stream_max_s, "must be > 0")
        if self.stream_max_malformed < 1:
            raise ConfigError("processor.stream_max_malformed", self.stream_max_malformed, "must be >= 1")
        if self.queue_max_batches < 1:
            raise ConfigError("processor.queue_max_batches", self.queue_max_batches, "must be >= 1")
        if self.max_job_series < 1:
            raise ConfigError("processor.max_job_series", self.max_job_series, "must be >= 1")


def _loopback(host: str) -> bool:
    import ipaddress
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class Processor:
    def __init__(
        self,
        config: ProcessorConfig = ProcessorConfig(),
        *,
        sinks: Sequence[Sink] = (),
        metrics: SelfMetrics | None = None,
        bus: EmbeddedBus | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or SelfMetrics()
        self.metrics.max_job_series = config.max_job_series
        self.registry = CollectorRegistry()
        self.registry.register(self.metrics)
        self.bus = bus if bus is not None else (EmbeddedBus(metrics=self.metrics) if config.embedded_bus else None)
        self.store = (SqliteStore(config.store_path, keep_windows=config.store_keep_windows)
                      if config.store_path else None)
        self.metrics_server = None
        self.remote_writer = None
        self.sinks: list[Sink] = list(sinks) + self._build_sinks()
        # last: a window counts as durable once every sink before it has it (processor/durability.py)
        store_sink = next((s for s in self.sinks if isinstance(s, StoreSink)), None)
        self.durability = Durability(
            enabled=self.store is not None,
            store_backlog=(lambda: store_sink.health()["backlog_windows"]) if store_sink else (lambda: 0),
            stored_until=stored_until(self.store) if self.store is not None else None)
        self.sinks.append(self.durability)
        self.pipeline = Pipeline(
            config.window, Summarizer(config.summary), self.sinks, self.metrics,
            queue_max=config.queue_max_batches, collectives=config.collectives,
        )
        self.dive_uploader = None
        if config.deep_dive_upload is not None:  # traces to object storage (processor/dive_upload.py)
            from trainscope.processor.dive_upload import DiveUploader
            self.dive_uploader = DiveUploader(config.deep_dive_upload)
            self.registry.register(self.dive_uploader.metrics)  # deep_dive_uploads_total{what,outcome}, bytes, retries
        # control streams hold handler threads too: at most half of them, ingest keeps the rest
        self.control = ControlHub(dataclasses.replace(
            config.control, max_subscribers=max(1, min(config.control.max_subscribers, config.grpc_workers // 2))),
            uploader=self.dive_uploader)
        self.control_servicer = ControlServicer(self.control, config.security)
        self.registry.register(deep_dive_control_metrics(self.control.stats))  # deep_dive_events_total{event}
        self.pipeline.collectives.grids.control = self.control  # a collective trigger asks for the stack grid
        accept, observe = self.pipeline.accept, self.control.observe

        def accept_and_observe(d) -> bool:
            ok = accept(d)
            if ok:
                try:
                    observe(d)  # the job's latest iteration: where a deep dive can start
                except Exception:
                    log.debug("control observe failed", exc_info=True)
            return ok

        self.servicer = IngestServicer(accept_and_observe, self.metrics, config.limits,
                                       stream_idle_s=config.stream_idle_s, stream_max_s=config.stream_max_s,
                                       stream_max_malformed=config.stream_max_malformed,
                                       security=config.security,
                                       durability=self.durability)
        self._server: grpc.Server | None = None
        self.address = ""

    def _build_sinks(self) -> list[Sink]:
        cfg = self.config
        sinks: list[Sink] = []
        if self.bus is not None:
            sinks.append(BusSink(self.bus, self.metrics))
        if self.store is not None:
            sinks.append(StoreSink(self.store, self.metrics))
        if cfg.kafka is not None:
            from trainscope.processor.kafka_sink import KafkaSink
            sinks.append(KafkaSink(cfg.kafka, self.metrics))
        if cfg.prometheus is not None:
            from trainscope.processor.prom_exporter import PrometheusSink
            prom = PrometheusSink(cfg.prometheus, self.metrics)
            self.registry.register(prom)
            sinks.append(prom)
        if cfg.perfetto is not None:
            from trainscope.processor.perfetto_sink import PerfettoSink
            sinks.append(PerfettoSink(cfg.perfetto, self.metrics))
        return sinks

    def start(self) -> "Processor":
        """Bind, start the pipeline and the sinks' servers; a bad address or a taken port is a ConfigError.

        Whatever was started before the failure is stopped again, so a caller
        that gets the error has nothing left running.
        """
        try:
            return self._start()
        except BaseException:
            self.stop(0.0)
            raise

    def _start(self) -> "Processor":
        cfg = self.config
        listen = cfg.listen
        if listen.startswith("unix://"):
            path = env.unix_path(listen)
            try:
                # the socket's directory must be ours and closed to others: whoever can write
                # it can replace the socket and receive every rank's telemetry
                private_dir(os.path.dirname(os.path.abspath(path)), "processor.listen")
            except OSError as e:
                raise ConfigError("processor.listen", listen, f"cannot create its directory: {e.strerror}") from None
            if os.path.lexists(path):
                st = os.lstat(path)
                if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                    raise ConfigError("processor.listen", listen,
                                      "exists and is not a socket of this user; not removed")
                if _socket_answers(path):  # never take a live processor's socket away from it
                    raise ConfigError("processor.listen", listen,
                                      "another processor is listening on it; stop that one or pass another --listen")
                os.unlink(path)  # a stale socket from a previous run: nobody answers on it
        elif listen.startswith("unix:") or ":" not in listen:
            raise ConfigError("processor.listen", listen, "expected unix:///path or host:port")
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, thread_name_prefix="ingest"),
            handlers=[self.servicer.handler(), self.control_servicer.handler()],
            # beyond the handler threads, refuse at once (RESOURCE_EXHAUSTED, retried by the
            # exporter) rather than queue a stream behind idle ones until the sender times out
            maximum_concurrent_rpcs=cfg.grpc_workers,
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        try:
            if cfg.security.tls:
                port = self._server.add_secure_port(listen, cfg.security.grpc_credentials())
            else:
                port = self._server.add_insecure_port(listen)
        except RuntimeError:  # grpc's answer to an address it cannot bind (taken, malformed, no permission)
            port = 0
        if port == 0 or (listen.startswith("unix:") and not os.path.exists(env.unix_path(listen))):
            raise ConfigError("processor.listen", listen, "could not bind (taken, malformed or not permitted)")
        if listen.startswith("unix:"):
            self.address = listen
        else:
            host = listen.rsplit(":", 1)[0]
            self.address = f"{host}:{port}"
        self.pipeline.start()
        self._server.start()
        if cfg.prometheus is not None:
            from trainscope.processor.prom_exporter import start_metrics_server
            try:
                self.metrics_server = start_metrics_server(
                    self.registry, cfg.prometheus.host, cfg.prometheus.port, health=self.health,
                    security=cfg.prometheus.security,
                    on_denied=lambda: self.metrics.inc("auth_rejected", endpoint="metrics"))
            except OSError as e:
                raise ConfigError("--prometheus-port", cfg.prometheus.port,
                                  f"cannot serve /metrics on {cfg.prometheus.host}: {e.strerror}") from None
            if cfg.prometheus.remote_write_url:
                from trainscope.processor.remote_write import RemoteWriter
                self.remote_writer = RemoteWriter.from_config(cfg.prometheus, self.registry, metrics=self.metrics)
                self.remote_writer.start()
        if not listen.startswith("unix:") and not _loopback(listen.rsplit(":", 1)[0]):
            # anyone who reaches the port can send telemetry unless TLS and a client check are on
            # (issue #11 item 8); say so every time
            sec = cfg.security
            if not sec.tls:
                log.warning("processor listening on %s, a non-loopback address, WITHOUT TLS: telemetry "
                            "and any token cross the network in clear text (--tls-cert/--tls-key)", self.address)
            elif sec.token is None and not sec.client_ca_file:
                log.warning("processor listening on %s with TLS but WITHOUT authentication: any host "
                            "that reaches it can send telemetry (--token-file or --tls-client-ca)", self.address)
        if cfg.prometheus is not None and self.metrics_server is not None and not _loopback(cfg.prometheus.host):
            ms = cfg.prometheus.security
            if ms is None or not ms.tls or ms.token is None:
                log.warning("/metrics served on %s, a non-loopback address, without %s", cfg.prometheus.host,
                            " and ".join(w for w, on in (("TLS", ms is not None and ms.tls),
                                                         ("a bearer token", ms is not None and ms.token))
                                         if not on))
        log.info("processor listening on %s", self.address)
        return self

    def health(self) -> dict:
        """What ``/healthz`` answers: the processing thread's state (``ok`` false when it is dead or stuck)."""
        h = {"pipeline": self.pipeline.health()}
        for sink in self.sinks:
            if hasattr(sink, "health"):
                h[sink.name] = sink.health()
        h["ok"] = all(part["ok"] for part in h.values())
        return h

    def serve(self, stop: threading.Event, poll_s: float = 1.0) -> int:
        """Serve until ``stop`` is set (0), or until the processing thread has died (1, logged).

        A processor whose pipeline is gone must not go on answering collectors
        as if it stored their batches: it exits non-zero so a supervisor restarts it.
        """
        while not stop.wait(poll_s):
            if not self.pipeline.alive():
                log.critical("the processing thread is dead: exiting so that the processor is restarted")
                return 1
        return 0

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Process everything received, close all windows, flush the sinks."""
        return self.pipeline.drain(timeout_s)

    def stop(self, grace_s: float = 2.0) -> None:
        self.control_servicer.close()  # the collectors' control streams end now, not at the grace
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1)
            self._server = None
        self.servicer.close()
        self.pipeline.stop()
        if self.dive_uploader is not None:
            self.dive_uploader.close()  # the queued traces written (bounded wait), the worker ended
        if self.remote_writer is not None:
            self.remote_writer.write_once()  # push the final values before going away
            self.remote_writer.close()
            self.remote_writer = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "Processor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _socket_answers(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path`` (a live processor)."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
