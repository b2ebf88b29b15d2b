"""A processing thread that fails is restarted (counted) or, failing again and again, marked dead:
/healthz says so, batches are refused (the collector keeps them), the daemon exits non-zero, and
stop() ends in bounded time (issue #11 item 3). Real processor and /metrics server on 127.0.0.1:0."""
import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from support.pipeline import batch, raw_stream, start_processor, wait_for
from trainscope.processor.prom_exporter import PrometheusConfig
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource

RES = Resource(job_id="job", rank=0, world_size=1)
S = 10**9


def cols(n, start):
    return KernelColumns.build(["gemm"], np.arange(n) * 1000 + start, [500] * n, [0] * n, [7] * n)


def healthz(proc):
    url = proc.metrics_server.url.replace("/metrics", "/healthz")
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_healthz_ok_then_a_failing_thread_is_restarted_then_declared_dead():
    proc = start_processor(prometheus=PrometheusConfig(port=0))
    proc.pipeline._idle_check = 0.05
    try:
        status, h = healthz(proc)
        assert status == 200 and h["ok"] and h["pipeline"]["alive"]
        calls = {"n": 0}

        def broken():  # a failure outside any one batch: the loop itself raises
            calls["n"] += 1
            raise RuntimeError("boom")
        proc.pipeline.windower.close_idle = broken
        assert wait_for(lambda: proc.pipeline.dead, 20)
        assert proc.pipeline.restarts == proc.pipeline.max_restarts
        assert proc.metrics.get("thread_restarts", thread="pipeline") == proc.pipeline.max_restarts
        status, h = healthz(proc)
        assert status == 503 and not h["ok"] and not h["pipeline"]["alive"]
        with pytest.raises(grpc.RpcError) as e:  # refused, not swallowed: the collector keeps it
            raw_stream(proc.address, [batch(RES, 1, cols(10, S))])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert proc.metrics.get("batches_rejected", reason="overloaded") >= 1
        assert proc.serve(threading.Event(), poll_s=0.01) == 1
    finally:
        t0 = time.monotonic()
        proc.stop()
        assert time.monotonic() - t0 < 40


def test_one_failure_is_restarted_and_the_pipeline_goes_on():
    proc = start_processor()
    proc.pipeline._idle_check = 0.05
    try:
        orig = proc.pipeline.windower.close_idle
        fails = {"left": 1}

        def once():
            if fails["left"]:
                fails["left"] -= 1
                raise RuntimeError("boom once")
            orig()
        proc.pipeline.windower.close_idle = once
        assert wait_for(lambda: proc.pipeline.restarts == 1, 10)
        s = raw_stream(proc.address, [batch(RES, 1, cols(10, S))])
        assert s.batches_accepted == 1
        assert proc.drain(10) and proc.pipeline.alive() and not proc.pipeline.dead
    finally:
        proc.stop()


def test_stop_is_bounded_when_the_queue_is_full_and_the_thread_is_stuck():
    proc = start_processor(queue_max_batches=2)
    release = threading.Event()
    proc.pipeline.windower.add_kernels = lambda *a: release.wait(60)
    try:
        with pytest.raises(grpc.RpcError):  # the queue fills: the stream is refused (back-pressure)
            raw_stream(proc.address, [batch(RES, i, cols(5, i * S)) for i in range(1, 5)], timeout=20)
    finally:
        t0 = time.monotonic()
        proc.pipeline.stop(timeout_s=2)
        took = time.monotonic() - t0
        release.set()
        proc.stop()
    assert took < 10
