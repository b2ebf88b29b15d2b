"""A real Prometheus scrapes the processor's /metrics and receives its remote
writes; PromQL reads back what was exported."""
from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from trainscope.processor.prom_exporter import (
    PrometheusConfig,
    PrometheusSink,
    start_metrics_server,
)
from trainscope.processor.remote_write import RemoteWriter
from trainscope.processor.selfmetrics import SelfMetrics

from support.prometheus_server import Clock, synthetic_output as window_output

pytestmark = pytest.mark.integration

SLOW_RANK = 2


def feed(sink: PrometheusSink, job: str = "j") -> None:
    """4 ranks x 2 phases; rank 2 is slow in bwd (and so in its iterations)."""
    for r in range(4):
        slow = r == SLOW_RANK
        sink.export(window_output(
            r, job=job, iter_ms=150.0 if slow else 100.0,
            phases={"fwd": 30.0, "bwd": 110.0 if slow else 60.0},
            kernels={"gemm": 100 + r},
        ))


def one(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


@pytest.fixture
def served():
    metrics = SelfMetrics()
    sink = PrometheusSink(PrometheusConfig(port=0), metrics)
    registry = CollectorRegistry()
    registry.register(metrics)
    registry.register(sink)
    feed(sink)
    server = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        yield registry, server, metrics
    finally:
        server.close()


def test_metrics_server_serves_and_closes(served):
    _, server, _ = served
    with urllib.request.urlopen(server.url, timeout=5) as r:
        text = r.read().decode()
    assert 'trainscope_iteration_seconds{job="j",rank="2"} 0.15' in text
    assert "trainscope_processor_records_out_total" in text
    server.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=1):
        pass


def test_prometheus_scrapes_and_answers_promql(served, prometheus_server):
    _, server, _ = served
    prom = prometheus_server([f"127.0.0.1:{server.port}"])

    q = f'trainscope_iteration_seconds{{job="j",rank="{SLOW_RANK}"}}'
    assert one(prom.wait_for(q)) == pytest.approx(0.150)
    assert one(prom.query('trainscope_iteration_seconds{job="j",rank="0"}')) == pytest.approx(0.100)

    top = prom.query("topk(1, trainscope_phase_seconds)")
    assert len(top) == 1
    assert top[0]["metric"]["rank"] == str(SLOW_RANK) and top[0]["metric"]["phase"] == "bwd"
    assert float(top[0]["value"][1]) == pytest.approx(0.110)

    # honor_labels keeps our job label; rank_info joins coordinates on demand.
    joined = prom.query(
        'trainscope_phase_seconds{phase="bwd"} * on(job, rank) group_left(host, dp, tp) '
        'trainscope_rank_info'
    )
    by_rank = {m["metric"]["rank"]: m["metric"] for m in joined}
    assert set(by_rank) == {"0", "1", "2", "3"}
    assert (by_rank["2"]["host"], by_rank["2"]["dp"], by_rank["2"]["tp"]) == ("node1", "1", "0")

    assert one(prom.query('sum(trainscope_kernel_events_total{job="j"})')) == 100 + 101 + 102 + 103
    assert one(prom.query(
        'trainscope_processor_records_out_total{sink="prometheus",signal="phases"}')) == 4
    # Bounded cardinality: no trainscope series carries a kernel label.
    assert prom.query('count({__name__=~"trainscope_.*", kernel!=""})') == []


def test_remote_write_lands_and_stale_markers_end_series(served, prometheus_server):
    registry, _, metrics = served
    prom = prometheus_server([])  # receiver only, scrapes nothing

    writer = RemoteWriter(prom.remote_write_url, registry, interval_s=0.2,
                          max_samples_per_request=25, metrics=metrics,
                          external_labels={"source": "rw", "instance": "proc-1"})
    writer.start()
    try:
        q = f'trainscope_iteration_seconds{{source="rw",job="j",rank="{SLOW_RANK}"}}'
        assert one(prom.wait_for(q, timeout_s=15)) == pytest.approx(0.150)
        # requests carry 25 samples each: wait until the phase series have landed too
        top = prom.wait_for('topk(1, trainscope_phase_seconds{source="rw"})', timeout_s=15)
        assert top[0]["metric"]["rank"] == str(SLOW_RANK)
        # The writer's own counters travel too, with the external labels.
        prom.wait_for('trainscope_processor_records_out_total'
                      '{sink="remote_write",instance="proc-1"} > 0', timeout_s=10)
    finally:
        writer.close()
    assert metrics.get("sink_errors", sink="remote_write") == 0
    assert metrics.get("records_out", sink="remote_write", signal="samples") > 25

    # A series that leaves the exposition gets a stale marker: it vanishes
    # from queries at once, not after Prometheus' 5-minute lookback.
    clock = Clock()
    sink = PrometheusSink(PrometheusConfig(stale_after_s=10), clock=clock)
    sink.export(window_output(0, job="ephemeral"))
    rw = RemoteWriter(prom.remote_write_url, sink, external_labels={"source": "rw2"})
    assert rw.write_once().errors == 0
    prom.wait_for('trainscope_iteration_seconds{job="ephemeral"}', timeout_s=10)
    clock.t += 60
    result = rw.write_once()
    assert result.errors == 0 and result.samples_sent > 0
    prom.wait_for('trainscope_iteration_seconds{job="ephemeral"}', lambda r: r == [], timeout_s=10)


def test_remote_write_rejected_request_is_counted_not_retried(prometheus_server):
    """A 4xx from a real receiver (an out-of-order sample) is given up at once."""
    prom = prometheus_server([])
    sink = PrometheusSink()
    sink.export(window_output(0, job="ooo"))
    metrics = SelfMetrics()
    now = [time.time_ns() // 1_000_000]
    w = RemoteWriter(prom.remote_write_url, sink, metrics=metrics, clock_ms=lambda: now[0])
    assert w.write_once().errors == 0
    now[0] -= 3_600_000  # an hour earlier: out of order for the same series
    result = w.write_once()
    assert result.errors >= 1 and 400 <= (result.last_status or 0) < 500
    assert metrics.get("sink_errors", sink="remote_write") == result.errors
