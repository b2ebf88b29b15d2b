"""Whole path into a real Prometheus: collector SDK → gRPC → processor →
/metrics scraped by Prometheus (and remote write into it), answered by PromQL."""
import time

import pytest

from support.pipeline import start_processor
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.sdk import Collector, CollectorConfig
from trainscope.processor.prom_exporter import PrometheusConfig
from trainscope.processor.windows import WindowConfig

pytestmark = pytest.mark.integration


def test_phases_from_the_sdk_are_queryable_in_prometheus(prometheus_server):
    prom_probe = prometheus_server([])  # started first so its remote-write URL is known
    proc = start_processor(
        window=WindowConfig(mode="iterations", iterations=2, lateness_s=0),
        prometheus=PrometheusConfig(port=0, remote_write_url=prom_probe.remote_write_url,
                                    remote_write_interval_s=0.5),
    )
    cols = []
    try:
        for rank in range(4):
            c = Collector(CollectorConfig(job_id="pjob", rank=rank, world_size=4,
                                          exporter=ExporterConfig(target=proc.address, confirm_interval_s=0.2)))
            cols.append(c)
            t = 1_000_000_000
            for it in range(6):
                fwd = 30_000_000 * (3 if rank == 2 else 1)
                c.record_phase("forward", t, fwd, iteration=it)
                c.record_phase("backward", t + fwd, 60_000_000, iteration=it)
                c.iteration(it, start_ns=t, end_ns=t + fwd + 60_000_000)
                t += fwd + 70_000_000
            assert c.flush(10)
        assert proc.drain(20)
        prom = prometheus_server([f"127.0.0.1:{proc.metrics_server.port}"])
        assert prom.wait_for('count(trainscope_phase_seconds{job="pjob"})', lambda r: r and float(r[0]["value"][1]) == 8, timeout_s=30)
        top = prom.query('topk(1, trainscope_phase_seconds{job="pjob",phase="forward"})')
        assert top[0]["metric"]["rank"] == "2"
        assert float(top[0]["value"][1]) == pytest.approx(0.09)
        it = prom.query('trainscope_iteration_seconds{job="pjob",rank="0"}')
        assert float(it[0]["value"][1]) == pytest.approx(0.09)
        # remote write landed in the other server too
        assert prom_probe.wait_for('trainscope_phase_seconds{job="pjob",rank="2",phase="forward"}',
                                   lambda r: bool(r), timeout_s=30)
    finally:
        for c in cols:
            c.shutdown(1)
        proc.stop()
