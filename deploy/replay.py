"""``trainscope replay DIR``: real traces through the real pipeline.

replay source → collector exporter → gRPC → processor (windows, KDE
summaries) → bus/store (→ Kafka, Perfetto, Prometheus when configured).
Nothing is short-circuited: each rank gets its own exporter and stream, as a
training process would.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from typing import Any

from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.sources.replay_dir import resource_for, scan_replay_dir
from trainscope.deploy.embedded import EmbeddedAnalysis, embedded_processor_config, final_drain, remove_socket_dir
from trainscope.processor.daemon import Processor
from trainscope.processor.limits import IngestLimits
from trainscope.processor.store import SqliteStore
from trainscope.processor.windows import WindowConfig
from trainscope.proto.contracts import Signal, WindowMode
from trainscope.proto.securefs import write_private
from trainscope.proto.v1 import telemetry_pb2

log = logging.getLogger(__name__)

KIND_NAMES = {0: "kernel", 1: "memcpy", 2: "memset"}
CHUNK = 32_768
#: Iterations per window of a replay, unless told (``capture_window``).
DEFAULT_WINDOW_ITERATIONS = 5
#: A capture of fewer than this many default windows is judged as one window.
SHORT_CAPTURE_WINDOWS = 3


def capture_window(iterations, default: int = DEFAULT_WINDOW_ITERATIONS,
                   short_windows: int = SHORT_CAPTURE_WINDOWS) -> int:
    """Iterations per window for a capture holding these iteration numbers.

    A long capture is cut into windows of ``default`` iterations, so a late onset is not averaged
    away and the verdict can say since when. A short one (5-12 profiler steps: fewer than
    ``short_windows`` windows) cut the same way leaves one or two windows and a stub (6 steps:
    5 + 1), each too short to compare ranks on and too few for persistence: it is judged as one
    sample, one window holding every step. Windows are cut at multiples of their length
    (``iteration // W``), so W is the smallest length >= the step count that puts the first and
    the last step in the same window.
    """
    its = sorted({int(i) for i in iterations})
    if len(its) >= default * short_windows or not its:
        return default
    lo, hi = its[0], its[-1]
    w = max(len(its), 1)
    while lo // w != hi // w:
        w += 1
    return w


@dataclasses.dataclass(slots=True)
class ReplayResult:
    job_id: str
    ranks: list[int]
    kernel_events_sent: dict[int, int]
    skipped: dict[int, dict[str, int]]
    exporter_drops: dict[int, int]
    processor: dict[str, float]
    store_path: str
    seconds: float
    verdicts: list = dataclasses.field(default_factory=list)
    window_iterations: int = DEFAULT_WINDOW_ITERATIONS


def feed_rank(trace, resource, target: str) -> tuple[int, int]:
    """Stream one rank's trace in time order; returns (kernel events sent, drops)."""
    exp = BatchExporter(resource, ExporterConfig(target=target, max_queue_batches=256,
                                                 drop_policy="newest", confirm_interval_s=0.5))
    k = trace.kernels
    marks = sorted(trace.iterations, key=lambda m: m.end_ns)
    phases = sorted(trace.phases, key=lambda p: p.start_ns + p.duration_ns)
    mi = pi = 0
    sent = 0
    for a in range(0, len(k), CHUNK):
        chunk = k.take(slice(a, a + CHUNK))
        exp.submit(chunk.to_pb(), len(chunk) * 25)
        sent += len(chunk)
        horizon = int(chunk.start_ns[-1])
        mj = mi
        while mj < len(marks) and marks[mj].end_ns <= horizon:
            mj += 1
        if mj > mi:
            exp.submit(telemetry_pb2.IterationBatch(marks=marks[mi:mj]), 24 * (mj - mi))
            mi = mj
        pj = pi
        while pj < len(phases) and phases[pj].start_ns + phases[pj].duration_ns <= horizon:
            pj += 1
        if pj > pi:
            exp.submit(telemetry_pb2.PhaseBatch(phases=phases[pi:pj]), 48 * (pj - pi))
            pi = pj
        if exp.pending > 64:
            exp.flush(60.0)
    if mi < len(marks):
        exp.submit(telemetry_pb2.IterationBatch(marks=marks[mi:]), 24 * (len(marks) - mi))
    if pi < len(phases):
        exp.submit(telemetry_pb2.PhaseBatch(phases=phases[pi:]), 48 * (len(phases) - pi))
    exp.submit_final()
    exp.shutdown(120.0)
    return sent, exp.stats.dropped_total


def run_replay(
    directory: str,
    *,
    home: str | None = None,
    window_iterations: int | None = None,
    kafka: Any = None,
    perfetto: Any = None,
    prometheus: Any = None,
    analyze: bool = True,
    analyzer_config: Any = None,
    replace_store: bool = False,
    progress: Any = None,
) -> ReplayResult:
    """Replay every rank of ``directory`` and close all windows.

    Windows are cut by iterations (the traces' clocks are unrelated, so only
    iteration numbers line ranks up); ``window_iterations`` None picks them from
    the capture (``capture_window``: 5, or the whole capture when it is short).
    ``progress`` (a ``deploy.render.Progress``) is told the ranks fed.
    """
    t0 = time.perf_counter()
    job = scan_replay_dir(directory)
    first = job.load(min(job.files)) if window_iterations is None else None
    if window_iterations is None:
        window_iterations = capture_window(m.iteration for m in first.iterations)
    home = home or tempfile.mkdtemp(prefix="trainscope-replay-")
    os.makedirs(home, exist_ok=True)
    cfg = embedded_processor_config(
        home, WindowConfig(mode=WindowMode.ITERATIONS, iterations=window_iterations, idle_close_s=3600),
        kafka=kafka, perfetto=perfetto, prometheus=prometheus, replace_store=replace_store,
        limits=IngestLimits(live_clock=False))  # trace time, not this host's clock
    store_path = cfg.store_path
    sent: dict[int, int] = {}
    skipped: dict[int, dict[str, int]] = {}
    drops: dict[int, int] = {}
    verdicts: list = []
    try:
        with Processor(cfg) as proc:
            if progress is not None:
                progress.total = len(job.files)
            for i, rank in enumerate(sorted(job.files)):
                if progress is not None:
                    progress.update(i, note=f"rank {rank}")
                trace = first if first is not None and rank == min(job.files) else job.load(rank)
                first = None      # the first rank's columns are not held past its feed
                skipped[rank] = dict(trace.skipped)
                sent[rank], drops[rank] = feed_rank(trace, resource_for(trace, job), proc.address)
            if progress is not None:
                progress.interval_s = 0.0  # the last step's line is always shown
                progress.update(len(job.files), note="draining the processor and analysing")
            final_drain(proc, 300.0)
            metrics = proc.metrics.snapshot()
            if analyze:
                # ranks are fed one after the other: analysed while feeding, a window would be judged on
                # the ranks fed so far. A recorded job is analysed once all of it is in (from offset 0).
                verdicts = EmbeddedAnalysis(proc, store_path, analyzer_config).finish()
    finally:
        remove_socket_dir(cfg)  # the private socket directory is this run's: leave nothing behind
    return ReplayResult(job.job_id, sorted(job.files), sent, skipped, drops, metrics,
                        store_path, time.perf_counter() - t0, verdicts, window_iterations)


def kernel_stats_json(store_path: str, job_id: str | None = None) -> dict:
    """The kernel cluster stats in the store as a JSON-ready dict (``--stats-out``)."""
    store = SqliteStore(store_path)
    try:
        rows = []
        for kw in store.records(Signal.KERNELS, job_id):
            w = kw.window
            for ks in kw.kernels:
                rows.append({
                    "rank": kw.resource.rank,
                    "window": {"index": w.index, "start_ns": w.start_ns, "end_ns": w.end_ns,
                               "first_iteration": w.first_iteration, "last_iteration": w.last_iteration},
                    "kernel": ks.kernel, "stream": ks.stream, "kind": KIND_NAMES.get(ks.kind, str(ks.kind)),
                    "count": ks.count, "total_ns": ks.total_ns,
                    "clusters": [{"count": c.count, "p50_ns": c.p50_ns, "p99_ns": c.p99_ns,
                                  "min_ns": c.min_ns, "max_ns": c.max_ns} for c in ks.clusters],
                })
        return {"job": job_id or (store.jobs() or [""])[0], "kernel_stats": rows}
    finally:
        store.close()


def write_json(obj: dict, path: str) -> None:
    write_private(path, json.dumps(obj, indent=1))  # 0600, mkstemp + rename: no predictable .tmp to plant
