"""PrometheusSink exposition, its cardinality bound and expiry, and the
remote write encoding (no processes, no sockets: transport is injected)."""
from __future__ import annotations

import math
import struct
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainscope.processor.prom_exporter import PrometheusConfig, PrometheusSink
from trainscope.processor.remote_write import (
    HEADERS,
    STALE_NAN_BITS,
    RemoteWriter,
    build_requests,
    decode_request,
    encode_request,
    is_stale_marker,
    series_from_families,
)
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.sink import Sink
from trainscope.proto.errors import ConfigError
from trainscope.proto.prompb import remote_pb2

from support.prometheus_server import Clock, synthetic_output as window_output

def scrape(registry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def setup():
    metrics = SelfMetrics()
    clock = Clock()
    sink = PrometheusSink(PrometheusConfig(port=0, max_series=1000, stale_after_s=60),
                          metrics, clock=clock)
    registry = CollectorRegistry()
    registry.register(metrics)
    registry.register(sink)
    return sink, registry, metrics, clock


def test_is_a_sink():
    assert isinstance(PrometheusSink(), Sink)
    assert PrometheusSink.name == "prometheus"


def test_series_values(setup):
    sink, registry, metrics, _ = setup
    for r in range(4):
        sink.export(window_output(r, iter_ms=100 + 10 * r, phases={"fwd": 30.0 + r, "bwd": 60.0},
                                  kernels={"gemm": 50, "nccl": 10}))
    s = scrape(registry)
    assert value(s, "trainscope_iteration_seconds", job="j", rank="2") == pytest.approx(0.120)
    assert value(s, "trainscope_iteration_p50_seconds", job="j", rank="2") == pytest.approx(0.120)
    assert value(s, "trainscope_iteration_max_seconds", job="j", rank="2") == pytest.approx(0.180)
    assert value(s, "trainscope_iterations_total", job="j", rank="3") == 4
    r1 = dict(job="j", rank="1")
    assert value(s, "trainscope_phase_seconds", **r1, phase="fwd") == pytest.approx(0.031)
    assert value(s, "trainscope_phase_p99_seconds", **r1, phase="bwd") == pytest.approx(0.072)
    assert value(s, "trainscope_phase_max_seconds", **r1, phase="bwd") == pytest.approx(0.078)
    assert value(s, "trainscope_phase_total_seconds_total", job="j", rank="0",
                 phase="bwd") == pytest.approx(0.240)
    assert value(s, "trainscope_phase_count_total", job="j", rank="0", phase="bwd") == 4
    assert value(s, "trainscope_kernel_events_total", job="j", rank="0") == 60
    # rank 3 of world 4 with tp=2: tp=1, dp=1.
    assert value(s, "trainscope_rank_info", job="j", rank="3", host="node1",
                 dp="1", tp="1", pp="0", ep="0", cp="0") == 1
    assert sum(1 for (n, _) in s if n == "trainscope_rank_info") == 4
    # Self-metrics share the registry and count what the sink consumed.
    assert value(s, "trainscope_processor_records_out_total", sink="prometheus",
                 signal="phases") == 4
    assert metrics.get("records_out", sink="prometheus", signal="kernels") == 4
    assert sink.flush() is True


def test_label_sets_are_bounded_and_no_per_kernel_series(setup):
    sink, registry, _, _ = setup
    sink.export(window_output(0, phases={"fwd": 1.0}, kernels={"ampere_sgemm_128x64": 9}))
    text = generate_latest(registry).decode()
    assert "ampere_sgemm" not in text
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("trainscope_") or fam.name.startswith("trainscope_processor"):
            continue
        for s in fam.samples:
            allowed = {"job", "rank", "phase"}
            if s.name == "trainscope_rank_info":
                allowed |= {"host", "dp", "tp", "pp", "ep", "cp"}
            assert set(s.labels) <= allowed, s
            assert "kernel" not in s.name or s.name == "trainscope_kernel_events_total"


def test_gauges_track_the_newest_window_counters_add_all(setup):
    sink, registry, _, _ = setup
    sink.export(window_output(0, window=5, iter_ms=200, phases={"fwd": 20.0}))
    sink.export(window_output(0, window=4, iter_ms=100, phases={"fwd": 10.0}))  # late
    s = scrape(registry)
    assert value(s, "trainscope_iteration_seconds", job="j", rank="0") == pytest.approx(0.2)
    assert value(s, "trainscope_phase_seconds", job="j", rank="0",
                 phase="fwd") == pytest.approx(0.02)
    assert value(s, "trainscope_iterations_total", job="j", rank="0") == 8
    assert value(s, "trainscope_phase_total_seconds_total", job="j", rank="0",
                 phase="fwd") == pytest.approx(4 * 0.03)


def test_max_series_drops_and_counts():
    metrics = SelfMetrics()
    sink = PrometheusSink(PrometheusConfig(max_series=3), metrics)
    sink.export(window_output(0, phases={"fwd": 1.0, "bwd": 2.0}))  # keys: rank 0, fwd, bwd
    assert sink.series_keys() == 3
    sink.export(window_output(1, phases={"fwd": 1.0}))  # new rank: both records dropped
    sink.export(window_output(0, phases={"fwd": 1.0, "opt": 3.0}))  # opt dropped, fwd updated
    assert sink.series_keys() == 3
    assert metrics.get("drops", where="prometheus_series") == 3
    s = scrape(sink)
    assert ("trainscope_iteration_seconds", frozenset({("job", "j"), ("rank", "1")})) not in s
    assert not any(dict(lbl).get("phase") == "opt" for _, lbl in s)
    assert value(s, "trainscope_phase_count_total", job="j", rank="0", phase="fwd") == 8


def test_stale_series_expire_and_free_their_keys():
    clock = Clock()
    sink = PrometheusSink(PrometheusConfig(max_series=4, stale_after_s=60), clock=clock)
    sink.export(window_output(0, phases={"fwd": 1.0, "bwd": 1.0}))
    sink.export(window_output(1, phases=None))
    assert sink.series_keys() == 4
    clock.t += 45
    sink.export(window_output(0, phases={"fwd": 1.0}))  # bwd not seen since t=1000
    clock.t += 30
    s = scrape(sink)  # scrapes always sweep
    ranks = {dict(lbl)["rank"] for n, lbl in s if n == "trainscope_rank_info"}
    assert ranks == {"0"}
    phases = {dict(lbl)["phase"] for n, lbl in s if n == "trainscope_phase_seconds"}
    assert phases == {"fwd"}
    assert sink.series_keys() == 2
    # The freed keys take new series again.
    sink.export(window_output(2, phases={"fwd": 1.0}))
    assert sink.series_keys() == 4


def test_close_stops_exports():
    sink = PrometheusSink()
    sink.close()
    sink.export(window_output(0))
    assert sink.series_keys() == 0


@pytest.mark.parametrize("field, val", [
    ("port", 70000), ("port", -1), ("max_series", 0), ("stale_after_s", 0),
    ("stale_after_s", math.inf), ("remote_write_url", "ftp://x/y"), ("remote_write_url", "nope"),
    ("remote_write_interval_s", -1), ("remote_write_timeout_s", 0),
    ("remote_write_max_samples_per_request", 0), ("host", ""),
    ("remote_write_labels", {"__name__": "x"}), ("remote_write_labels", {"a-b": "x"}),
])
def test_config_validation_names_the_setting(field, val):
    with pytest.raises(ConfigError) as e:
        PrometheusConfig(**{field: val})
    assert e.value.setting == f"prometheus.{field}"


def test_config_is_frozen():
    cfg = PrometheusConfig(remote_write_url="http://127.0.0.1:9090/api/v1/write")
    with pytest.raises(Exception):
        cfg.port = 1  # type: ignore[misc]


# -- remote write encoding ------------------------------------------------------
def test_series_from_families_labels_sorted_named_and_external(setup):
    sink, registry, _, _ = setup
    sink.export(window_output(2, phases={"fwd": 5.0}))
    series = series_from_families(registry.collect(), 1_700_000_000_123,
                                  {"instance": "proc-1", "rank": "ignored"})
    key = (("__name__", "trainscope_phase_seconds"), ("instance", "proc-1"), ("job", "j"),
           ("phase", "fwd"), ("rank", "2"))
    assert series[key] == [(pytest.approx(0.005), 1_700_000_000_123)]
    for labels in series:
        names = [k for k, _ in labels]
        assert names == sorted(names) and len(set(names)) == len(names)
        assert "__name__" in names and all(v != "" for _, v in labels)
    info = [k for k in series if ("__name__", "trainscope_rank_info") in k]
    assert dict(info[0])["host"] == "node1"


def test_build_requests_chunks_by_samples():
    series = {((("__name__", f"m{i}"),)): [(float(i), 1000)] for i in range(7)}
    reqs = list(build_requests(series, 3))
    assert [sum(len(t.samples) for t in r.timeseries) for r in reqs] == [3, 3, 1]
    long = {(("__name__", "long"),): [(float(v), 1000 + v) for v in range(5, 0, -1)]}
    reqs = list(build_requests(long, 2))
    assert [len(r.timeseries[0].samples) for r in reqs] == [2, 2, 1]
    ts = [s.timestamp for r in reqs for s in r.timeseries[0].samples]
    assert ts == sorted(ts)
    assert all(r.timeseries[0].labels[0].value == "long" for r in reqs)
    with pytest.raises(ValueError):
        list(build_requests(long, 0))


def test_encode_round_trip():
    req = remote_pb2.WriteRequest()
    ts = req.timeseries.add()
    ts.labels.add(name="__name__", value="x")
    ts.samples.add(value=1.5, timestamp=42)
    assert decode_request(encode_request(req)) == req


class FakePost:
    """Records calls; answers from a script of statuses (or exceptions)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, bytes, dict, float]] = []

    def __call__(self, url, body, headers, timeout_s):
        self.calls.append((url, body, dict(headers), timeout_s))
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, BaseException):
            raise a
        return a


def writer(source, post, **kw) -> RemoteWriter:
    kw.setdefault("backoff_initial_s", 0.001)
    kw.setdefault("backoff_max_s", 0.002)
    return RemoteWriter("http://rw.test/api/v1/write", source, post=post,
                        clock_ms=lambda: 1_700_000_000_000, **kw)


def test_writer_sends_every_series_in_chunks_with_spec_headers(setup):
    sink, registry, metrics, _ = setup
    for r in range(4):
        sink.export(window_output(r, phases={"fwd": 1.0, "bwd": 2.0}))
    expected = series_from_families(registry.collect(), 0)
    post = FakePost(200)
    w = writer(registry, post, max_samples_per_request=10, metrics=metrics)
    result = w.write_once()
    assert result.errors == 0 and result.samples_dropped == 0
    assert result.requests == len(post.calls) == math.ceil(result.samples_sent / 10)
    got = {}
    for url, body, headers, _ in post.calls:
        assert url == "http://rw.test/api/v1/write"
        assert headers["Content-Encoding"] == "snappy"
        assert headers["Content-Type"] == "application/x-protobuf"
        assert headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
        assert headers == HEADERS
        req = decode_request(body)
        assert sum(len(t.samples) for t in req.timeseries) <= 10
        for t in req.timeseries:
            got[tuple((l.name, l.value) for l in t.labels)] = [
                (s.value, s.timestamp) for s in t.samples]
    # self-metrics samples may move between the two collections; ours may not.
    ours = {k: v for k, v in expected.items()
            if not dict(k)["__name__"].startswith("trainscope_processor")}
    for k, v in ours.items():
        assert got[k] == [(v[0][0], 1_700_000_000_000)]
    assert metrics.get("records_out", sink="remote_write", signal="samples") == result.samples_sent
    assert metrics.get("bytes_out", sink="remote_write", signal="samples") == sum(
        len(c[1]) for c in post.calls)


def test_writer_sends_one_stale_marker_for_vanished_series():
    clock = Clock()
    sink = PrometheusSink(PrometheusConfig(stale_after_s=10), clock=clock)
    sink.export(window_output(0))
    post = FakePost(200)
    w = writer(sink, post)
    w.write_once()
    clock.t += 60  # rank 0 expires
    w.write_once()
    req = decode_request(post.calls[-1][1])
    assert req.timeseries and all(is_stale_marker(t.samples[0].value) for t in req.timeseries)
    bits = struct.unpack("<Q", struct.pack("<d", req.timeseries[0].samples[0].value))[0]
    assert bits == STALE_NAN_BITS
    n_calls = len(post.calls)
    assert w.write_once().requests == 0 and len(post.calls) == n_calls  # only once


def test_writer_retries_5xx_and_connection_errors_then_delivers():
    sink = PrometheusSink()
    sink.export(window_output(0))
    post = FakePost(503, ConnectionRefusedError(), 500, 204)
    metrics = SelfMetrics()
    result = writer(sink, post, metrics=metrics).write_once()
    assert len(post.calls) == 4 and result.errors == 0 and result.samples_dropped == 0
    assert metrics.get("sink_errors", sink="remote_write") == 0


def test_writer_never_retries_4xx_and_counts_the_loss():
    sink = PrometheusSink()
    for r in range(3):
        sink.export(window_output(r))
    post = FakePost(400)
    metrics = SelfMetrics()
    result = writer(sink, post, metrics=metrics, max_samples_per_request=5).write_once()
    # Each request is tried once; a bad request does not stop the others.
    assert len(post.calls) == result.requests == result.errors > 1
    assert metrics.get("sink_errors", sink="remote_write") == result.errors
    assert metrics.get("drops", where="remote_write") == result.samples_dropped > 0
    assert metrics.get("records_out", sink="remote_write", signal="samples") == 0


def test_writer_gives_up_at_the_deadline_and_skips_the_rest_of_the_round():
    sink = PrometheusSink()
    for r in range(3):
        sink.export(window_output(r))
    post = FakePost(503)
    metrics = SelfMetrics()
    t0 = time.monotonic()
    result = writer(sink, post, metrics=metrics, timeout_s=0.2, max_samples_per_request=5,
                    backoff_initial_s=0.01, backoff_max_s=0.05).write_once()
    assert time.monotonic() - t0 < 1.0
    assert result.errors == 1 and result.samples_sent == 0 and len(post.calls) > 2
    assert metrics.get("drops", where="remote_write") == result.samples_dropped
    assert result.samples_dropped == sum(1 for _ in series_from_families(sink.collect(), 0))


def test_close_cuts_backoff_short():
    sink = PrometheusSink()
    sink.export(window_output(0))
    post = FakePost(503)
    w = writer(sink, post, timeout_s=60, backoff_initial_s=30, backoff_max_s=30)
    done = threading.Event()
    t = threading.Thread(target=lambda: (w.write_once(), done.set()))
    t.start()
    deadline = time.monotonic() + 5
    while not post.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    w.close()
    assert done.wait(2.0), "write_once kept backing off after close()"
    assert time.monotonic() - t0 < 2.0 and len(post.calls) == 1
    t.join()


def test_background_thread_pushes_each_interval_and_stops():
    sink = PrometheusSink()
    sink.export(window_output(0))
    post = FakePost(200)
    w = writer(sink, post, interval_s=0.02).start()
    deadline = time.monotonic() + 5
    while len(post.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    w.close()
    n = len(post.calls)
    assert n >= 3
    time.sleep(0.1)
    assert len(post.calls) == n


def test_from_config():
    cfg = PrometheusConfig(remote_write_url="http://127.0.0.1:1/api/v1/write",
                           remote_write_interval_s=3, remote_write_max_samples_per_request=7,
                           remote_write_labels={"instance": "p1"})
    w = RemoteWriter.from_config(cfg, PrometheusSink())
    assert (w.url, w.interval_s, w.max_samples, w.external_labels) == (
        cfg.remote_write_url, 3, 7, {"instance": "p1"})
    with pytest.raises(ValueError):
        RemoteWriter.from_config(PrometheusConfig(), PrometheusSink())
