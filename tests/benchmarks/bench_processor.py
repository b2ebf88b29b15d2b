"""Processor throughput on batches shaped like the real traces (prints figures).

    python tests/benchmarks/bench_processor.py [--ranks 64] [--steps 20]

Stages timed on one thread (one core), in the same run:
  1. decode:     TelemetryBatch bytes -> validated KernelColumns (protobuf parse + numpy.frombuffer)
  2. window:     Windower.add_kernels (string-table merge, window routing)
  3. summarise:  window close -> KDE valley clustering of every (kernel, stream) -> KernelWindow protobuf
and end to end over gRPC (exporters -> processor on a unix socket), whose
ingest and processing threads share the interpreter with the exporters.
Baseline in the same run: building one protobuf message per kernel record
(the per-record encoding ARCHITECTURE.md warns tops out near 400k records/s).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trainscope.collector.exporter import BatchExporter
from trainscope.collector.exporter_config import ExporterConfig
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.ingest import Validator
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.processor.summarize import Summarizer
from trainscope.processor.windows import WindowConfig, Windower
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"


def load_real(path: Path) -> tuple[KernelColumns, int]:
    """A real trace's kernel stream (sorted by start) and its number of steps."""
    trace = load_rank_trace(path, rank=0)
    return trace.kernels, max(len(trace.iterations), 1)


def make_batches(base: KernelColumns, ranks: int, reps: int, chunk: int = 16384, seed: int = 0):
    """Per rank: the real stream repeated ``reps`` times with lognormal jitter, cut into batches."""
    rng = np.random.default_rng(seed)
    span = int(base.start_ns[-1] - base.start_ns[0]) + 1
    out = []
    for r in range(ranks):
        res = Resource(job_id="bench", rank=r, world_size=ranks).to_pb()
        seq = 0
        for k in range(reps):
            dur = np.maximum(1, base.duration_ns * np.exp(rng.normal(0, 0.03, len(base)))).astype(np.uint64)
            start = base.start_ns - base.start_ns[0] + np.uint64(k * span)
            cols = KernelColumns(base.names, start, dur, base.name_id, base.stream, base.kind)
            for a in range(0, len(cols), chunk):
                seq += 1
                b = telemetry_pb2.TelemetryBatch(resource=res, seq=seq)
                b.kernels.CopyFrom(cols.take(slice(a, a + chunk)).to_pb())
                out.append(b.SerializeToString())
    return out


def run_stages(batches: list[bytes], window_s: float) -> dict:
    metrics = SelfMetrics()
    v = Validator(metrics)
    summarize = Summarizer()
    closed = []
    w = Windower(WindowConfig(length_s=window_s, lateness_s=0), closed.append, metrics)
    t_decode = t_window = 0.0
    n = 0
    for raw in batches:
        t0 = time.perf_counter()
        d = v.decode(raw)
        t1 = time.perf_counter()
        w.add_kernels(d.resource, d.payload)
        t_window += time.perf_counter() - t1
        t_decode += t1 - t0
        n += d.records
    w.flush()
    t0 = time.perf_counter()
    outs = [summarize(c) for c in closed]
    t_sum = time.perf_counter() - t0
    keys = sum(len(o.kernels.kernels) for o in outs if o.kernels)
    return dict(events=n, decode=t_decode, window=t_window, summarise=t_sum, windows=len(closed), keys=keys)


def per_record_baseline(base: KernelColumns, n: int) -> float:
    """Events/s when every kernel is its own protobuf message (built + serialised + parsed)."""
    from trainscope.proto.v1 import telemetry_pb2 as pb
    k = base.take(slice(0, n))
    names = k.names
    t0 = time.perf_counter()
    msgs = [pb.PhaseTiming(name=names[i], start_ns=s, duration_ns=d, stream=st)
            for i, s, d, st in zip(k.name_id.tolist(), k.start_ns.tolist(), k.duration_ns.tolist(),
                                   k.stream.tolist())]
    blob = [m.SerializeToString() for m in msgs]
    [pb.PhaseTiming.FromString(b) for b in blob]
    return n / (time.perf_counter() - t0)


def end_to_end(base: KernelColumns, ranks: int, reps: int) -> tuple[int, float]:
    sock = os.path.join(tempfile.mkdtemp(), "p.sock")
    cfg = ProcessorConfig(listen=f"unix://{sock}", embedded_bus=False,
                          window=WindowConfig(length_s=1, lateness_s=0))
    with Processor(cfg) as proc:
        t0 = time.perf_counter()
        exps = []
        for r in range(ranks):
            e = BatchExporter(Resource(job_id="e2e", rank=r, world_size=ranks),
                              ExporterConfig(target=proc.address, max_queue_batches=100_000,
                                             max_queue_bytes=1 << 32))
            span = int(base.start_ns[-1] - base.start_ns[0]) + 1
            for k in range(reps):
                start = base.start_ns - base.start_ns[0] + np.uint64(k * span)
                cols = KernelColumns(base.names, start, base.duration_ns, base.name_id, base.stream, base.kind)
                for a in range(0, len(cols), 16384):
                    part = cols.take(slice(a, a + 16384))
                    e.submit(part.to_pb, len(part) * 25)
            exps.append(e)
        for e in exps:
            e.flush(600)
        proc.drain(600)
        dt = time.perf_counter() - t0
        n = int(proc.metrics.get("events_in", signal="kernels"))
        for e in exps:
            e.shutdown(1)
    return n, dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=8, help="repetitions of each trace per rank")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    if not SHARED.is_dir():
        print(f"real traces not found under {SHARED}", file=sys.stderr)
        return 1
    print(f"processor throughput, one thread, {args.ranks} ranks x {args.reps} repetitions per trace")
    print(f"{'trace':32} {'events':>10} {'decode/s':>12} {'window/s':>12} {'summ./s':>12} "
          f"{'total/s':>12} {'keys':>7}")
    totals = []
    for path in sorted(SHARED.glob("*.json.gz")):
        base, steps = load_real(path)
        batches = make_batches(base, args.ranks, args.reps)
        runs = [run_stages(batches, window_s=10.0) for _ in range(args.runs)]
        r = min(runs, key=lambda x: x["decode"] + x["window"] + x["summarise"])
        tot = r["decode"] + r["window"] + r["summarise"]
        totals.append(r["events"] / tot)
        print(f"{path.name:32} {r['events']:>10,} {r['events'] / r['decode']:>12,.0f} "
              f"{r['events'] / r['window']:>12,.0f} {r['events'] / r['summarise']:>12,.0f} "
              f"{r['events'] / tot:>12,.0f} {r['keys']:>7,}")
    print(f"median over traces: {statistics.median(totals):,.0f} events/s per core "
          f"(target >= 1,000,000)")
    base, _ = load_real(SHARED / "job16-rank0.json.gz")
    pr = per_record_baseline(base, min(len(base), 50_000))
    print(f"baseline, one protobuf message per record: {pr:,.0f} events/s "
          f"-> columnar path is {statistics.median(totals) / pr:.1f}x faster")
    n, dt = end_to_end(base, ranks=8, reps=20)
    print(f"end to end over gRPC (8 exporters -> unix socket -> processor, same process): "
          f"{n:,} events in {dt:.2f} s = {n / dt:,.0f} events/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
