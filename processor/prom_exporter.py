"""Per-rank iteration and phase series for Prometheus, built at scrape time.

The processor's windows become a handful of gauges and counters per
(job, rank) and per (job, rank, phase). Label cardinality is bounded on
purpose (ARCHITECTURE.md, "Processor"):

* labels are ``job``, ``rank`` and, for phase series, ``phase``; a rank's
  host and parallel coordinates live in one info series,
  ``trainscope_rank_info{job,rank,host,dp,tp,pp,ep,cp} 1``, to be joined in
  PromQL (``* on(job, rank) group_left(dp) trainscope_rank_info``) instead of
  multiplying every series by six labels;
* kernels get one per-rank event counter, never a series per kernel: kernel
  summaries go to Kafka, where the analyzer compares distributions;
* at most ``max_series`` label sets ((job, rank) and (job, rank, phase) keys)
  are kept; records that would add one past the bound are dropped and counted
  in ``trainscope_processor_drops_total{where="prometheus_series"}``;
* keys not updated for ``stale_after_s`` are forgotten, so ranks of finished
  jobs leave the exposition.

Like prometheus/client_python's custom collectors, nothing is registered per
series: :class:`PrometheusSink` keeps plain state under a lock and ``collect``
builds the metric families from it on each scrape (or remote write round).
Samples carry no timestamps, so Prometheus stamps them at scrape time.

Exposition: Prometheus scrape configs must set ``honor_labels: true`` for the
processor's target, or Prometheus renames our ``job`` label (the training
job) to ``exported_job`` in favour of the scrape job's name.
"""
from __future__ import annotations

import dataclasses
import math
import re
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from trainscope.proto.contracts import Signal
from trainscope.processor.model import WindowOutput
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError

NS = 1e-9
#: ``drops{where=...}`` label for records refused by the series bound.
DROP_SERIES = "prometheus_series"
INFO_LABELS = ("host", "dp", "tp", "pp", "ep", "cp")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrometheusConfig:
    """Scrape endpoint and optional remote write of the processor's series."""

    host: str = "127.0.0.1"
    """Address the ``/metrics`` endpoint binds to; loopback unless exposed on purpose."""

    port: int = 9464
    """Port of the ``/metrics`` endpoint; 0 picks a free one (tests)."""

    max_series: int = 100_000
    """Most (job, rank) plus (job, rank, phase) keys kept; each key is a fixed
    handful of series. Records that would add a key past it are dropped and
    counted (``drops{where="prometheus_series"}``)."""

    stale_after_s: float = 600.0
    """Keys not updated for this long leave the exposition (finished jobs,
    departed ranks). Longer than the slowest window of a live rank."""

    remote_write_url: str | None = None
    """Prometheus remote write 1.0 endpoint (e.g. ``http://prom:9090/api/v1/write``);
    None scrapes only."""

    remote_write_interval_s: float = 15.0
    """Seconds between remote write rounds (one round sends every series once)."""

    remote_write_timeout_s: float = 10.0
    """Deadline for delivering one request, retries included."""

    remote_write_max_samples_per_request: int = 2000
    """Samples per request; larger rounds are split (Prometheus' own default
    ``max_samples_per_send`` is 2000)."""

    remote_write_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Labels added to every remote-written series that lacks them, like
    Prometheus' ``external_labels``; set ``instance`` so that two processors'
    self-metrics do not land in one series (scrapes get it from the target)."""

    security: Any = None
    """``proto.security.ServerSecurity`` of ``/metrics`` and ``/healthz`` (TLS certificate and key, bearer
    token that Prometheus sends with ``authorization.credentials_file``); None: plain HTTP, no token."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("prometheus.host", self.host, "must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("prometheus.port", self.port, "must be an integer in [0, 65535]")
        if not isinstance(self.max_series, int) or self.max_series < 1:
            raise ConfigError("prometheus.max_series", self.max_series, "must be an integer >= 1")
        for name in ("stale_after_s", "remote_write_interval_s", "remote_write_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"prometheus.{name}", v, "must be a finite number > 0")
        n = self.remote_write_max_samples_per_request
        if not isinstance(n, int) or n < 1:
            raise ConfigError(
                "prometheus.remote_write_max_samples_per_request", n, "must be an integer >= 1"
            )
        if self.remote_write_url is not None:
            u = urllib.parse.urlsplit(self.remote_write_url)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise ConfigError(
                    "prometheus.remote_write_url", self.remote_write_url,
                    "must be an http:// or https:// URL",
                )
        for k, v in self.remote_write_labels.items():
            if not _LABEL_NAME.match(k) or k.startswith("__"):
                raise ConfigError(
                    "prometheus.remote_write_labels", k,
                    "label names match [a-zA-Z_][a-zA-Z0-9_]* and do not start with __",
                )
            if not v:
                raise ConfigError("prometheus.remote_write_labels", k, "value must not be empty")


@dataclasses.dataclass(slots=True)
class _Phase:
    seen: float
    end_ns: int = -1
    mean_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    count: float = 0.0  # counter
    total_s: float = 0.0  # counter


@dataclasses.dataclass(slots=True)
class _Rank:
    seen: float
    info: tuple[str, ...]
    iter_end_ns: int = -1
    iter_mean_s: float | None = None
    iter_p50_s: float = 0.0
    iter_max_s: float = 0.0
    iterations: float | None = None  # counter
    kernel_events: float | None = None  # counter
    phases: dict[str, _Phase] = dataclasses.field(default_factory=dict)


class PrometheusSink:
    """A :class:`~trainscope.processor.sink.Sink` that is also a scrape-time collector.

    ``export`` only updates in-memory state (no I/O, never blocks on the
    network); ``collect`` is called by ``CollectorRegistry`` on each scrape.
    ``clock`` is monotonic seconds, injectable so tests control expiry.
    """

    name = "prometheus"

    def __init__(
        self,
        config: PrometheusConfig | None = None,
        metrics: SelfMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or PrometheusConfig()
        self.metrics = metrics if metrics is not None else SelfMetrics()
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, str], _Rank] = {}
        self._keys = 0  # len(_ranks) + phases of every rank
        self._last_sweep = clock()
        # Sweeping walks every key; do it at most this often from export.
        self._sweep_every = min(1.0, self.config.stale_after_s / 4)
        self._closed = False

    # -- Sink -------------------------------------------------------------
    def export(self, out: WindowOutput) -> None:
        if self._closed:
            return
        now = self._clock()
        dropped = 0
        with self._lock:
            self._maybe_sweep(now)
            for signal, rec in ((Signal.ITERATIONS, out.iterations), (Signal.PHASES, out.phases),
                                (Signal.KERNELS, out.kernels)):
                if rec is None:
                    continue
                res = rec.resource if rec.HasField("resource") else out.raw.resource.to_pb()
                rank = self._rank(res, now)
                if rank is None:
                    dropped += 1
                    continue
                if signal == Signal.ITERATIONS:
                    self._iterations(rank, rec)
                elif signal == Signal.PHASES:
                    dropped += self._phases(rank, rec, now)
                else:
                    events = rec.events or sum(k.count for k in rec.kernels)
                    rank.kernel_events = (rank.kernel_events or 0.0) + events
                self.metrics.inc("records_out", sink=self.name, signal=signal)
        if dropped:
            self.metrics.inc("drops", dropped, where=DROP_SERIES)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True  # nothing is buffered: scrapes read the state directly

    def close(self) -> None:
        self._closed = True

    # -- state updates (under self._lock) --------------------------------
    def _rank(self, res, now: float) -> _Rank | None:
        key = (res.job_id, str(res.rank))
        c = res.coords
        info = (res.host, str(c.dp), str(c.tp), str(c.pp), str(c.ep), str(c.cp))
        st = self._ranks.get(key)
        if st is None:
            if self._keys >= self.config.max_series:
                return None
            st = self._ranks[key] = _Rank(seen=now, info=info)
            self._keys += 1
        st.seen = now
        st.info = info
        return st

    @staticmethod
    def _iterations(st: _Rank, rec) -> None:
        st.iterations = (st.iterations or 0.0) + len(rec.marks)
        # Gauges show the newest window; a late, older window only adds to
        # the counter. end_ns is on the rank's own clock: compared per rank only.
        if rec.marks and rec.window.end_ns >= st.iter_end_ns:  # an empty final window carries no times
            st.iter_end_ns = rec.window.end_ns
            st.iter_mean_s = rec.mean_ns * NS
            st.iter_p50_s = rec.p50_ns * NS
            st.iter_max_s = rec.max_ns * NS

    def _phases(self, st: _Rank, rec, now: float) -> int:
        dropped = 0
        for ps in rec.phases:
            ph = st.phases.get(ps.phase)
            if ph is None:
                if self._keys >= self.config.max_series:
                    dropped += 1
                    continue
                ph = st.phases[ps.phase] = _Phase(seen=now)
                self._keys += 1
            ph.seen = now
            ph.count += ps.count
            ph.total_s += ps.total_ns * NS
            if rec.window.end_ns >= ph.end_ns:
                ph.end_ns = rec.window.end_ns
                ph.mean_s = ps.mean_ns * NS
                ph.p99_s = ps.p99_ns * NS
                ph.max_s = ps.max_ns * NS
        return dropped

    def _maybe_sweep(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_sweep < self._sweep_every:
            return
        self._last_sweep = now
        horizon = now - self.config.stale_after_s
        for key in [k for k, st in self._ranks.items() if st.seen < horizon]:
            self._keys -= 1 + len(self._ranks.pop(key).phases)
        for st in self._ranks.values():
            for phase in [p for p, ph in st.phases.items() if ph.seen < horizon]:
                del st.phases[phase]
                self._keys -= 1

    def series_keys(self) -> int:
        """Keys held now ((job, rank) plus (job, rank, phase)); the bounded quantity."""
        with self._lock:
            return self._keys

    # -- prometheus_client custom-collector protocol ----------------------
    def describe(self) -> list[Metric]:
        return []  # families vary with what was exported; skip registry name checks

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._maybe_sweep(self._clock(), force=True)
            # Copies, so a scrape never reads a half-updated window.
            ranks = [
                (k, dataclasses.replace(
                    st, phases={p: dataclasses.replace(ph) for p, ph in st.phases.items()}))
                for k, st in self._ranks.items()
            ]
        jr = ["job", "rank"]
        jrp = ["job", "rank", "phase"]
        info = InfoMetricFamily(
            "trainscope_rank", "Host and parallel coordinates (dp, tp, pp, ep, cp) of a rank",
            labels=jr,
        )
        it_mean = GaugeMetricFamily(
            "trainscope_iteration_seconds", "Mean iteration time in the rank's latest window",
            labels=jr,
        )
        it_p50 = GaugeMetricFamily(
            "trainscope_iteration_p50_seconds", "Median iteration time in the rank's latest window",
            labels=jr,
        )
        it_max = GaugeMetricFamily(
            "trainscope_iteration_max_seconds", "Longest iteration in the rank's latest window",
            labels=jr,
        )
        it_n = CounterMetricFamily(
            "trainscope_iterations", "Iterations completed by the rank", labels=jr
        )
        k_n = CounterMetricFamily(
            "trainscope_kernel_events",
            "GPU activity records (kernels, memcpy, memset) of the rank; per-kernel "
            "summaries go to Kafka, not here",
            labels=jr,
        )
        ph_mean = GaugeMetricFamily(
            "trainscope_phase_seconds", "Mean duration of a phase in the rank's latest window",
            labels=jrp,
        )
        ph_p99 = GaugeMetricFamily(
            "trainscope_phase_p99_seconds", "p99 duration of a phase in the rank's latest window",
            labels=jrp,
        )
        ph_max = GaugeMetricFamily(
            "trainscope_phase_max_seconds", "Longest run of a phase in the rank's latest window",
            labels=jrp,
        )
        ph_total = CounterMetricFamily(
            "trainscope_phase_total_seconds", "Time spent in a phase by the rank", labels=jrp
        )
        ph_n = CounterMetricFamily(
            "trainscope_phase_count", "Runs of a phase by the rank", labels=jrp
        )
        for (job, rank), st in ranks:
            lv = [job, rank]
            info.add_metric(lv, dict(zip(INFO_LABELS, st.info)))
            if st.iter_mean_s is not None:
                it_mean.add_metric(lv, st.iter_mean_s)
                it_p50.add_metric(lv, st.iter_p50_s)
                it_max.add_metric(lv, st.iter_max_s)
            if st.iterations is not None:
                it_n.add_metric(lv, st.iterations)
            if st.kernel_events is not None:
                k_n.add_metric(lv, st.kernel_events)
            for phase, ph in st.phases.items():
                pv = [job, rank, phase]
                ph_mean.add_metric(pv, ph.mean_s)
                ph_p99.add_metric(pv, ph.p99_s)
                ph_max.add_metric(pv, ph.max_s)
                ph_total.add_metric(pv, ph.total_s)
                ph_n.add_metric(pv, ph.count)
        yield from (info, it_mean, it_p50, it_max, it_n, k_n,
                    ph_mean, ph_p99, ph_max, ph_total, ph_n)


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it and frees the port."""

    def __init__(self, httpd, thread: threading.Thread, host: str, tls: bool = False) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_address[1]
        h = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if tls else 'http'}://{h}:{self.port}/metrics"
        self._closed = False

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()  # returns once serve_forever has left its loop
        self._httpd.server_close()
        self._thread.join(timeout_s)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_metrics_server(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
    health: Callable[[], dict] | None = None, *, security=None,
    on_denied: Callable[[], None] | None = None,
) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` and, with ``health``, ``/healthz``.

    ``/healthz`` answers the JSON of ``health()``: 200 when its ``ok`` is
    true, 503 otherwise (a dead thread, a store that cannot write). Other
    paths serve the registry, as prometheus_client's own server does;
    ``port=0`` binds a free port, read back from ``.port``.

    With ``security`` (``proto.security.ServerSecurity``): TLS when it has a
    certificate (the handshake runs in the request's thread, under a 10 s
    socket timeout, so a client that never finishes it cannot stall the
    accept loop), and every path answers 401 unless the request carries
    ``Authorization: Bearer <token>`` (compared in constant time;
    ``on_denied`` counts each refusal).
    """
    import json
    import logging
    from wsgiref.simple_server import make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

    metrics_app = make_wsgi_app(registry)
    token_required = security is not None and security.token is not None

    def app(environ, start_response):
        if token_required and not security.authorized(environ.get("HTTP_AUTHORIZATION")):
            if on_denied is not None:
                on_denied()
            body = b"401 Unauthorized: a bearer token is required\n"
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer"),
                                                ("Content-Length", str(len(body)))])
            return [body]
        if health is not None and environ.get("PATH_INFO") == "/healthz":
            try:
                h = health()
            except Exception as e:  # the health check must answer even when it breaks
                h = {"ok": False, "error": type(e).__name__}
            body = json.dumps(h, sort_keys=True).encode()
            start_response("200 OK" if h.get("ok") else "503 Service Unavailable",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics_app(environ, start_response)

    ctx = security.ssl_context() if security is not None and security.tls else None
    http_log = logging.getLogger(__name__ + ".http")

    class _Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def get_request(self):
            sock, addr = self.socket.accept()
            if ctx is None:
                return sock, addr
            sock.settimeout(10.0)
            # handshake on first read, in the request's own thread
            return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        def handle_error(self, request, client_address):
            # a failed TLS handshake (plain HTTP to an https port, a wrong client certificate) is
            # the client's problem: one DEBUG line, not a traceback on stderr
            import sys
            http_log.debug("metrics request from %s failed: %s", client_address, sys.exc_info()[1])

    httpd = make_server(host, port, app, _Server, handler_class=_SilentHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="trainscope-metrics-http", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, host, tls=ctx is not None)
