"""Prometheus remote write 1.0 client: push the scrape endpoint's series.

Where no Prometheus can reach the processor (scrape), the same metric
families are pushed to a remote write receiver (Prometheus with
``--web.enable-remote-write-receiver``, Mimir, Thanos, VictoriaMetrics...).

Spec: Prometheus Remote-Write 1.0, https://prometheus.io/docs/specs/remote_write_spec/
What this client does about each of its rules:

1. Body: a ``prometheus.WriteRequest`` protobuf (``proto/prompb/remote.proto``),
   compressed with snappy's *block* format (not the framed/stream format):
   ``cramjam.snappy.compress_raw``.
2. Headers: ``Content-Encoding: snappy``, ``Content-Type: application/x-protobuf``,
   ``X-Prometheus-Remote-Write-Version: 0.1.0`` and a ``User-Agent``.
3. Labels: ``__name__`` carries the metric name; labels are sorted by name,
   unique, and labels with empty values are left out (an empty value is the
   same as no label to Prometheus).
4. Samples: float64 values, int64 timestamps in milliseconds since the Unix
   epoch, in order within a series. A series that was sent and is gone in a
   later round gets one *stale marker* (the NaN with bits 0x7ff0000000000002),
   so queries stop returning it at once instead of after 5 minutes.
5. Retries: 5xx and connection errors are retried with exponential backoff
   and jitter until the request's deadline; 2xx and 4xx are never retried
   (a 4xx means the data is bad, and sending it again cannot help). 429
   (which 1.0 allows retrying) is treated as any 4xx.

Encoding (families -> series -> requests -> bytes) is separate from transport
(a ``post`` callable), so tests check the bytes without a server and inject
failures without sockets. The writer never blocks the processor: it runs on
its own thread, and ``close()`` cuts a running backoff short.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import cramjam

from trainscope.processor.prom_exporter import PrometheusConfig
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import redact_url
from trainscope.proto.prompb import remote_pb2

log = logging.getLogger(__name__)

SINK = "remote_write"
SIGNAL = "samples"
HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": "trainscope-remote-write/0.1",
}
#: Prometheus' staleness marker (value.StaleNaN): a NaN with this exact payload.
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]

LabelSet = tuple[tuple[str, str], ...]  # sorted by name, __name__ included
#: Posts one body; returns the HTTP status, raises OSError when no answer came.
Post = Callable[[str, bytes, Mapping[str, str], float], int]


class MetricSource(Protocol):
    """Anything with prometheus_client's ``collect()`` (a registry or a custom collector)."""

    def collect(self) -> Iterable: ...


def is_stale_marker(value: float) -> bool:
    return struct.pack("<d", value) == struct.pack("<Q", STALE_NAN_BITS)


# -- encoding -----------------------------------------------------------------
def series_from_families(
    families: Iterable,
    timestamp_ms: int,
    external_labels: Mapping[str, str] | None = None,
) -> dict[LabelSet, list[tuple[float, int]]]:
    """Flatten prometheus_client metric families into ``labels -> [(value, ms)]``.

    Every sample of a family (``_total``, ``_info``, ``_bucket``...) becomes
    its own series, as in the text exposition. A sample's own timestamp wins
    over ``timestamp_ms``; a series' own label wins over an external one
    (Prometheus' ``external_labels`` rule). Native-histogram samples are
    skipped: remote write 1.0 has no field for them.
    """
    ext = dict(external_labels or {})
    out: dict[LabelSet, list[tuple[float, int]]] = {}
    for fam in families:
        for s in fam.samples:
            if s.value is None or getattr(s, "native_histogram", None) is not None:
                continue
            labels = {**ext, **s.labels, "__name__": s.name}
            key = tuple(sorted((k, str(v)) for k, v in labels.items() if v != ""))
            ts = timestamp_ms if s.timestamp is None else int(round(float(s.timestamp) * 1000))
            out[key] = [(float(s.value), ts)]  # a duplicate series: the last one wins
    return out


def build_requests(
    series: Mapping[LabelSet, Sequence[tuple[float, int]]],
    max_samples: int,
) -> Iterator[remote_pb2.WriteRequest]:
    """Pack series into requests of at most ``max_samples`` samples each.

    A series with more samples than fit is split across requests; each piece
    keeps the full label set and its samples stay in timestamp order.
    """
    if max_samples < 1:
        raise ValueError("max_samples must be >= 1")
    req = remote_pb2.WriteRequest()
    n = 0
    for labels, samples in series.items():
        samples = sorted(samples, key=lambda vt: vt[1])
        i = 0
        while i < len(samples):
            if n == max_samples:
                yield req
                req, n = remote_pb2.WriteRequest(), 0
            take = samples[i:i + max_samples - n]
            ts = req.timeseries.add()
            ts.labels.extend(remote_pb2.Label(name=k, value=v) for k, v in labels)
            ts.samples.extend(remote_pb2.Sample(value=v, timestamp=t) for v, t in take)
            n += len(take)
            i += len(take)
    if n:
        yield req


def encode_request(req: remote_pb2.WriteRequest) -> bytes:
    """Serialize and snappy-compress (block format), as the spec requires."""
    return bytes(cramjam.snappy.compress_raw(req.SerializeToString()))


def decode_request(body: bytes) -> remote_pb2.WriteRequest:
    """The inverse of :func:`encode_request` (tests, debugging receivers)."""
    req = remote_pb2.WriteRequest()
    req.ParseFromString(bytes(cramjam.snappy.decompress_raw(body)))
    return req


def sample_count(req: remote_pb2.WriteRequest) -> int:
    return sum(len(ts.samples) for ts in req.timeseries)


# -- transport ----------------------------------------------------------------
def urllib_post(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> int:
    """POST with urllib; any HTTP answer is a status, no answer raises OSError."""
    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:  # an answer, not a transport failure
        try:
            e.read()
        finally:
            e.close()
        return e.code


@dataclasses.dataclass(frozen=True, slots=True)
class WriteResult:
    """What one round delivered; failures are also counted in the self-metrics."""

    requests: int = 0
    samples_sent: int = 0
    samples_dropped: int = 0
    errors: int = 0
    last_status: int | None = None


class RemoteWriter:
    """Pushes every series of ``source`` to a remote write endpoint each interval.

    ``source`` is a ``CollectorRegistry`` (the one ``/metrics`` serves, so
    both paths carry the same families) or any object with ``collect()``, or
    a sequence of them. Self-metrics: ``records_out`` and ``bytes_out``
    {sink="remote_write", signal="samples"} for delivered samples and
    compressed bytes, ``sink_errors{sink="remote_write"}`` per request given
    up on, ``drops{where="remote_write"}`` for the samples it carried.
    """

    def __init__(
        self,
        url: str,
        source: MetricSource | Sequence[MetricSource],
        *,
        interval_s: float = 15.0,
        timeout_s: float = 10.0,
        max_samples_per_request: int = 2000,
        external_labels: Mapping[str, str] | None = None,
        metrics: SelfMetrics | None = None,
        post: Post = urllib_post,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        self.url = url
        self._sources = list(source) if isinstance(source, (list, tuple)) else [source]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_samples = max_samples_per_request
        self.external_labels = dict(external_labels or {})
        self.metrics = metrics if metrics is not None else SelfMetrics()
        self._post = post
        self._clock_ms = clock_ms
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._round_lock = threading.Lock()
        self._sent: set[LabelSet] = set()  # series of the last round, for stale markers
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(
        cls,
        config: PrometheusConfig,
        source: MetricSource | Sequence[MetricSource],
        *,
        metrics: SelfMetrics | None = None,
        **kwargs,
    ) -> "RemoteWriter":
        if config.remote_write_url is None:
            raise ValueError("PrometheusConfig.remote_write_url is not set")
        return cls(
            config.remote_write_url, source,
            interval_s=config.remote_write_interval_s,
            timeout_s=config.remote_write_timeout_s,
            max_samples_per_request=config.remote_write_max_samples_per_request,
            external_labels=config.remote_write_labels,
            metrics=metrics, **kwargs,
        )

    # -- lifecycle --------------------------------------------------------
    def start(self) -> "RemoteWriter":
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="trainscope-remote-write", daemon=True
            )
            self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop now: a backoff in progress ends at once, no new round starts.

        A request already on the wire finishes or times out (at most
        ``timeout_s`` of the writer). Call :meth:`write_once` first to push
        the final values.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write_once()
            except Exception:  # a bug in one round must not end the writer
                log.exception("remote write round failed")
                self.metrics.inc("sink_errors", sink=SINK)

    # -- one round --------------------------------------------------------
    def _collect_series(self, now_ms: int) -> dict[LabelSet, list[tuple[float, int]]]:
        """The round's series, plus a stale marker for each one that disappeared."""
        families = [fam for src in self._sources for fam in src.collect()]
        series = series_from_families(families, now_ms, self.external_labels)
        for gone in self._sent - series.keys():
            series[gone] = [(STALE_NAN, now_ms)]
        self._sent = {k for k, v in series.items() if not is_stale_marker(v[-1][0])}
        return series

    def write_once(self) -> WriteResult:
        """Collect, encode and send one round now (the thread calls this)."""
        with self._round_lock:
            series = self._collect_series(self._clock_ms())
            requests = list(build_requests(series, self.max_samples))
            sent = dropped = errors = 0
            status = None
            for i, req in enumerate(requests):
                n = sample_count(req)
                body = encode_request(req)
                ok, status, retryable = self._deliver(body)
                if ok:
                    sent += n
                    self.metrics.inc("records_out", n, sink=SINK, signal=SIGNAL)
                    self.metrics.inc("bytes_out", len(body), sink=SINK, signal=SIGNAL)
                    continue
                errors += 1
                self.metrics.inc("sink_errors", sink=SINK)
                if retryable:
                    # The receiver is down or failing: the rest of this round
                    # would only wait out the same deadline, one by one.
                    rest = sum(sample_count(r) for r in requests[i:])
                    dropped += rest
                    self.metrics.inc("drops", rest, where=SINK)
                    break
                dropped += n
                self.metrics.inc("drops", n, where=SINK)
            return WriteResult(len(requests), sent, dropped, errors, status)

    def _deliver(self, body: bytes) -> tuple[bool, int | None, bool]:
        """Send one body; (delivered, last status, failed for a retryable reason)."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            status = None
            try:
                status = self._post(self.url, body, HEADERS, max(remaining, 0.001))
            except OSError as e:  # refused, reset, timed out: no answer
                log.debug("remote write to %s failed: %s", redact_url(self.url), e)
            if status is not None and 200 <= status < 300:
                return True, status, False
            if status is not None and status < 500:
                log.warning("remote write to %s rejected with HTTP %d; not retried",
                            redact_url(self.url), status)
                return False, status, False
            # 5xx or no answer: back off (an exponential step, jittered by
            # ±50% so that processors restarted together do not retry in
            # lockstep) while the deadline allows; close() cuts it short.
            step = min(self._backoff[1], self._backoff[0] * 2 ** attempt)
            delay = step * (0.5 + self._rng.random())
            attempt += 1
            if time.monotonic() + delay >= deadline or self._stop.wait(delay):
                log.warning("remote write to %s gave up after %d attempts (last status %s)",
                            redact_url(self.url), attempt, status)
                return False, status, True
