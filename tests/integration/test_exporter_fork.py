"""The exporter in a forked child (a data-loader worker forked from a rank): starts a process, so integration tier."""
import multiprocessing

import numpy as np

from support.pipeline import kernel_count, start_processor
from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource

RES = Resource(job_id="job", rank=0, world_size=2)
S = 10**9


def kb(i, n=100):
    return KernelColumns.build(["gemm"], np.arange(n) * 1000 + i * S // 100, [500] * n, [0] * n, [7] * n).to_pb()


def fast_config(target, **kw):
    kw.setdefault("confirm_interval_s", 0.2)
    kw.setdefault("backoff_initial_s", 0.01)
    kw.setdefault("backoff_max_s", 0.1)
    return ExporterConfig(target=target, **kw)


def _child(exp, q):
    # the parent's exporter, inherited by fork: must neither hang nor raise
    ok = exp.submit(kb(1, 7), 200)
    q.put((ok, exp.stats.dropped["forked"], exp.pending, exp.flush(1)))


def _scenario(out):
    """The whole scenario in a fresh process: a process that holds one exporter forks a child. Run in
    the suite's own process, gRPC threads left by earlier tests (their channels, servers) make gRPC skip
    its fork handlers and the child crash: that is the suite's state, not a training process's."""
    proc = start_processor()
    exp = BatchExporter(RES, fast_config(proc.address))
    try:
        exp.submit(kb(0, 5), 200)
        first = exp.flush(10)
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        child = ctx.Process(target=_child, args=(exp, q))
        child.start()
        seen = q.get(timeout=30)
        child.join(10)
        exp.submit(kb(2, 3), 100)          # the parent's exporter still works after the fork
        after = exp.flush(10)
        proc.drain(10)
        out.put((first, seen, child.exitcode, after, kernel_count(proc)))
    finally:
        exp.shutdown(1)
        proc.stop()


def test_exporter_survives_fork():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    scenario = ctx.Process(target=_scenario, args=(out,))
    scenario.start()
    try:
        first, seen, exitcode, after, kernels = out.get(timeout=120)
    finally:
        scenario.join(30)
    assert first
    # in the child: the submit is refused and counted, nothing is pending, flush returns
    assert seen == (False, 1, 0, True)
    assert exitcode == 0
    assert after and kernels == 5 + 3
    assert scenario.exitcode == 0
