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
   within 10 %), the deepest queue, the trajectory (t, RSS, queue depth a tenth of the run
   apart), events sent / received / rejected / dropped (target: zero loss).
5. ``--tracemalloc [FRAMES]``: the child traces its allocations and prints its largest sites
   at warm-up end and its top 10 by growth from there to the run's end (slower: not the
   default). ``MALLOC_ARENA_MAX=2 python ...`` reaches the child through its environment.
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
from trainscope.processor.windows import WindowConfig  # noqa: E402

CHILD = r"""
import sys, threading
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.prom_exporter import PrometheusConfig
from trainscope.processor.windows import WindowConfig
# composed as `trainscope processor` composes it (deploy/cli.py): no in-process bus
p = Processor(ProcessorConfig(listen="127.0.0.1:0", prometheus=PrometheusConfig(port=0), embedded_bus=False,
                              window=WindowConfig(mode="iterations", iterations=10))).start()
import os, tracemalloc
frames = int(os.environ.get("SOAK_TRACEMALLOC", "0"))  # --tracemalloc: off by default (overhead)
if frames:
    tracemalloc.start(frames)
print(p.address, p.metrics_server.url, flush=True)
snap = None
for line in sys.stdin:  # until EOF; "snap" / "diff" only with --tracemalloc
    if line.strip() == "snap" and frames:
        snap = tracemalloc.take_snapshot()
        print(f"traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB at warm-up end; largest sites:", flush=True)
        for st in snap.statistics("lineno")[:5]:
            f = st.traceback[-1]
            print(f"  {st.size / 2**20:8.2f} MiB ({st.count:,} blocks)  {f.filename.split('trainscope/')[-1]}:{f.lineno}",
                  flush=True)
        print("end", flush=True)
    elif line.strip() == "diff" and frames and snap is not None:
        now = tracemalloc.take_snapshot()
        print(f"traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB at run end", flush=True)
        for st in now.compare_to(snap, "traceback" if frames > 1 else "lineno")[:10]:
            print(f"  {st.size_diff / 2**20:+8.2f} MiB ({st.size / 2**20:7.2f} MiB, {st.count_diff:+,} blocks)  "
                  + " -> ".join(f"{f.filename.split('trainscope/')[-1]}:{f.lineno}" for f in st.traceback), flush=True)
        print("end", flush=True)
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
    ap.add_argument("--tracemalloc", type=int, nargs="?", const=1, default=0, metavar="FRAMES",
                    help="the child traces allocations (FRAMES deep) and prints its top 10 sites by "
                         "growth between warm-up end and run end (slows it; off by default)")
    a = ap.parse_args(argv)
    warm = a.warmup_s if a.warmup_s is not None else a.seconds / 10

    trace = load_rank_trace(ROOT.parent / "shared/data/kineto/job16-rank0.json.gz", rank=0)
    real = list(trace.kernels.names)
    durs = trace.kernels.duration_ns.astype(np.int64)
    env = dict(os.environ, SOAK_TRACEMALLOC=str(a.tracemalloc))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    snapped = False
    tm_lines: list[str] = []
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
            if a.tracemalloc and not snapped and now - t0 >= warm:
                child.stdin.write("snap\n")
                child.stdin.flush()
                while (line := child.stdout.readline()) and line.strip() != "end":
                    tm_lines.append(line.rstrip())
                snapped = True
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
        if a.tracemalloc and snapped:
            child.stdin.write("diff\n")
            child.stdin.flush()
            while (line := child.stdout.readline()) and line.strip() != "end":
                tm_lines.append(line.rstrip())
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
    cap = WindowConfig().max_names_per_rank  # a rank's name table grows until this, then is compacted
    t_full = (cap - len(real)) / max(1, a.new_names * 10)
    if t_full < a.seconds:
        full = min(samples, key=lambda s: abs(s[0] - t_full))
        print(f"  name tables full ({cap:,} names per rank) at t~{t_full:.0f} s: RSS {full[1]:.0f} MiB, "
              f"end/that {end / full[1]:.2f}x (not the target's warm-up; shown to tell fill from growth)")
    print(f"queue depth: max {max(s[2] for s in samples):.0f} batches")
    print("trajectory (t s, RSS MiB, queue depth), a tenth of the run apart:")
    for k in range(11):
        t, rss, q = min(samples, key=lambda s: abs(s[0] - k * a.seconds / 10))
        print(f"  {t:6.0f} {rss:7.0f} {q:5.0f}")
    print(f"events: sent {sent:,}, received {received - it * a.ranks:,.0f} kernel records "
          f"(+{it * a.ranks:,} iteration marks), batches rejected {rejected:.0f}, "
          f"processor drops {dropped_p:.0f} records, collector drops {dropped_c} batches")
    print(f"names evicted {total(m, 'trainscope_processor_names_evicted'):,.0f}; healthz ok={health['ok']}")
    if tm_lines:
        print(f"tracemalloc ({a.tracemalloc} frame(s)), top 10 sites by growth from warm-up end to run end:")
        print("\n".join(tm_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
