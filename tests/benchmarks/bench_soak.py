"""Soak: a processor fed at a steady rate with a realistic name mix; memory, queue and loss.

    python tests/benchmarks/bench_soak.py                # 10 minutes (the issue #11 target)
    python tests/benchmarks/bench_soak.py --seconds 60   # shorter

1. Start the processor in a child process (its RSS is measured alone) on 127.0.0.1, with
   the /metrics and /healthz endpoint.
2. Feed ``--ranks`` real exporters, each ``--rate`` kernel records per second in batches,
   with the kernel names of a real trace (``../shared/data/kineto/job16-rank0.json.gz``)
   plus a trickle of never-seen names (``--new-names`` per batch: JIT'd or templated
   kernels), and iteration marks so windows close.
3. Every second: the child's RSS (``/proc/PID/status``) and the queue depth (/metrics).
4. Print RSS at start (after warm-up), peak and end (MiB), the end/warm-up ratio (target:
   within 10 %), the deepest queue, events sent / received / rejected / dropped (target:
   zero loss).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from trainscope.collector.exporter import BatchExporter  # noqa: E402
from trainscope.collector.exporter_config import ExporterConfig  # noqa: E402
from trainscope.collector.sources.replay import load_rank_trace  # noqa: E402
from trainscope.proto.columnar import KernelColumns  # noqa: E402
from trainscope.proto.model import Resource  # noqa: E402
from trainscope.proto.v1 import telemetry_pb2  # noqa: E402

CHILD = r"""
import sys, threading
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.prom_exporter import PrometheusConfig
from trainscope.processor.windows import WindowConfig
# composed as `trainscope processor` composes it (deploy/cli.py): no in-process bus
p = Processor(ProcessorConfig(listen="127.0.0.1:0", prometheus=PrometheusConfig(port=0), embedded_bus=False,
                              window=WindowConfig(mode="iterations", iterations=10))).start()
print(p.address, p.metrics_server.url, flush=True)
sys.stdin.read()
p.stop()
"""


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def total(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--warmup-s", type=float, default=None, help="default: a tenth of the run")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rate", type=int, default=20_000, help="kernel records per second per rank")
    ap.add_argument("--new-names", type=int, default=20, help="never-seen kernel names per batch")
    a = ap.parse_args(argv)
    warm = a.warmup_s if a.warmup_s is not None else a.seconds / 10

    trace = load_rank_trace(ROOT.parent / "shared/data/kineto/job16-rank0.json.gz", rank=0)
    real = list(trace.kernels.names)
    durs = trace.kernels.duration_ns.astype(np.int64)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address, metrics_url = child.stdout.readline().split()
    exporters = [BatchExporter(Resource(job_id="soak", rank=r, world_size=a.ranks, pid=1000 + r),
                               ExporterConfig(target=address)) for r in range(a.ranks)]
    rng = np.random.default_rng(0)
    per_batch = max(1, a.rate // 10)  # ten batches per second per rank
    sent = batches = 0
    samples: list[tuple[float, float, float]] = []  # (t, rss MiB, queue depth)
    t0 = time.monotonic()
    clock_ns = 10**9
    it = 0
    next_sample = t0
    try:
        while (now := time.monotonic()) - t0 < a.seconds:
            for r, exp in enumerate(exporters):
                fresh = [f"jit_kernel_{batches}_{r}_{j}" for j in range(a.new_names)]
                names = real + fresh
                ids = rng.integers(0, len(real), per_batch)
                ids[: len(fresh)] = len(real) + np.arange(len(fresh))
                k = KernelColumns.build(names, clock_ns + np.arange(per_batch) * 1000,
                                        durs[rng.integers(0, len(durs), per_batch)], ids, [7] * per_batch)
                exp.submit(k.to_pb(), per_batch * 25)
                marks = telemetry_pb2.IterationBatch(marks=[telemetry_pb2.IterationMark(
                    iteration=it, start_ns=clock_ns, end_ns=clock_ns + per_batch * 1000)])
                exp.submit(marks, 32)
                sent += per_batch
            batches += 1
            it += 1
            clock_ns += per_batch * 1000 + 1000
            if now >= next_sample:
                m = scrape(metrics_url)
                samples.append((now - t0, rss_mib(child.pid), total(m, "trainscope_processor_queue_depth")))
                next_sample = now + 1.0
            time.sleep(max(0.0, t0 + batches * 0.1 - time.monotonic()))
        for exp in exporters:
            exp.flush(60)
        time.sleep(2)
        m = scrape(metrics_url)
        health = json.loads(urllib.request.urlopen(metrics_url.replace("/metrics", "/healthz"), timeout=5).read())
        samples.append((time.monotonic() - t0, rss_mib(child.pid), total(m, "trainscope_processor_queue_depth")))
    finally:
        for exp in exporters:
            exp.shutdown(5)
        child.stdin.close()
        child.wait(60)
    after = [s for s in samples if s[0] >= warm] or samples
    start, peak, end = after[0][1], max(s[1] for s in samples), samples[-1][1]
    received = total(m, "trainscope_processor_events_in")
    rejected = total(m, "trainscope_processor_batches_rejected")
    dropped_p = total(m, "trainscope_processor_drops")
    dropped_c = sum(e.stats.dropped_total for e in exporters)
    print(f"soak: {a.seconds:.0f} s, {a.ranks} ranks x {a.rate:,} kernel records/s, "
          f"{len(real)} real names + {a.new_names} new names per batch")
    print(f"processor RSS: {samples[0][1]:.0f} MiB at start, {start:.0f} MiB after {warm:.0f} s warm-up, "
          f"peak {peak:.0f} MiB, end {end:.0f} MiB (end/warm-up {end / start:.2f}x; target within 1.10x)")
    print(f"queue depth: max {max(s[2] for s in samples):.0f} batches")
    print(f"events: sent {sent:,}, received {received - it * a.ranks:,.0f} kernel records "
          f"(+{it * a.ranks:,} iteration marks), batches rejected {rejected:.0f}, "
          f"processor drops {dropped_p:.0f} records, collector drops {dropped_c} batches")
    print(f"names evicted {total(m, 'trainscope_processor_names_evicted'):,.0f}; healthz ok={health['ok']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
