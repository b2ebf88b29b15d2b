"""Benchmark: KDE valley clustering throughput on real kernel traces (ARGUS §5.2).

Run: ``python tests/benchmarks/bench_kde.py`` (one core; prints figures, asserts nothing).

Batches are shaped like the processor's: the real Kineto traces in
``/work/shared/data/kineto`` (one rank-window each, ~100-200 (kernel, stream)
keys), clustered one trace per call, and tiled into one batch of a few million
events (each copy's keys distinct, as many rank-windows clustered at once).
The same run times a naive per-key baseline (scipy ``gaussian_kde`` per key,
ARGUS filters in Python, ``numpy.percentile`` per cluster) on one copy of the
traces and prints the ratio.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import dataclasses
import glob
import gzip
import json
import math
import statistics
import sys
import time

import numpy as np

from trainscope.processor.kde import KdeConfig, cluster_keys

DATA = os.environ.get("TRAINSCOPE_KINETO", "/work/shared/data/kineto")
KERNEL_CATS = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2}  # -> trainscope.v1.KernelKind


@dataclasses.dataclass(frozen=True)
class KernelTrace:
    """Kernel events of one rank's trace, keyed by (name, stream)."""

    name: str
    keys: list[tuple[str, int, int]]  # (kernel name, stream, kind) per key id
    key: np.ndarray  # key id per event
    start_ns: np.ndarray
    dur_ns: np.ndarray  # uint64
    steps: int  # ProfilerStep#N spans
    events: list[dict]  # the raw kernel events, for their JSON size


def load_trace(path: str) -> KernelTrace:
    """Kernel events (cat kernel/gpu_memcpy/gpu_memset) of one Chrome-trace file."""
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    evs = doc["traceEvents"] if isinstance(doc, dict) else doc
    kern = [e for e in evs if e.get("cat") in KERNEL_CATS and e.get("ph") == "X"]
    steps = sum(1 for e in evs if str(e.get("name", "")).startswith("ProfilerStep#"))
    ids: dict[tuple[str, int, int], int] = {}
    key = np.array(
        [ids.setdefault((e["name"], int(e.get("args", {}).get("stream", 0)), KERNEL_CATS[e["cat"]]), len(ids))
         for e in kern], np.int64)
    dur = np.array([max(round(float(e["dur"]) * 1000), 1) for e in kern], np.uint64)
    start = np.array([round(float(e["ts"]) * 1000) for e in kern], np.uint64)
    return KernelTrace(os.path.basename(path).removesuffix(".json.gz"), list(ids), key, start, dur,
                       max(steps, 1), kern)


def load_traces(pattern: str | None = None) -> list[KernelTrace]:
    paths = sorted(glob.glob(pattern or os.path.join(DATA, "*.json.gz")))
    if not paths:
        sys.exit(f"no traces under {DATA}")
    return [load_trace(p) for p in paths]


def timed(fn, runs: int) -> float:
    """Median wall time of ``runs`` calls (after one warm-up)."""
    fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def naive_cluster(d: np.ndarray, cfg: KdeConfig) -> list[tuple[int, float, float]]:
    """The straightforward per-key version: scipy gaussian_kde on a 512-point grid,
    argrelmin valleys, ARGUS's two filters in Python, numpy.percentile per cluster."""
    from scipy.signal import argrelmin
    from scipy.stats import gaussian_kde

    d = np.sort(d.astype(np.float64))
    x = np.log(d)
    n = d.size
    bounds: list[float] = []
    if n >= cfg.exact_below and x[-1] > x[0]:
        sigma = x.std()
        h = 1.06 * sigma * n ** -0.2
        grid = np.linspace(x[0] - 3 * h, x[-1] + 3 * h, 512)
        dens = gaussian_kde(x, bw_method=h / sigma)(grid)
        m = max(cfg.min_cluster_count, math.ceil(cfg.min_cluster_frac * n))
        for b in grid[argrelmin(dens)[0]]:
            left = np.searchsorted(x, b)
            prev = np.searchsorted(x, bounds[-1]) if bounds else 0
            if left - prev >= m and n - left >= m and (not bounds or b - bounds[-1] >= cfg.min_spacing):
                bounds.append(b)
    out = []
    for part in np.split(d, np.searchsorted(x, bounds)):
        p50, p99 = np.percentile(part, [50, 99])
        out.append((part.size, p50, p99))
    return out


def main() -> None:
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    t0 = time.perf_counter()
    traces = load_traces()
    print(f"loaded {len(traces)} traces in {time.perf_counter() - t0:.1f} s (JSON decode not timed below)\n")
    cfg = KdeConfig()

    print("per rank-window (one trace per cluster_keys call, median of 20 runs):")
    print(f"{'trace':32s} {'events':>7s} {'keys':>5s} {'clusters':>8s} {'ms':>7s} {'Mev/s':>7s}")
    tot_ev = tot_t = 0.0
    for tr in traces:
        table = cluster_keys(tr.dur_ns, tr.key, len(tr.keys), cfg)
        t = timed(lambda: cluster_keys(tr.dur_ns, tr.key, len(tr.keys), cfg), 20)
        tot_ev += tr.dur_ns.size
        tot_t += t
        print(f"{tr.name:32s} {tr.dur_ns.size:7d} {len(tr.keys):5d} {len(table):8d} {t * 1e3:7.2f} "
              f"{tr.dur_ns.size / t / 1e6:7.2f}")
    print(f"{'all windows, one call each':32s} {int(tot_ev):7d} {'':5s} {'':8s} {tot_t * 1e3:7.2f} "
          f"{tot_ev / tot_t / 1e6:7.2f}\n")

    # One batch of a few million events: every copy of every trace gets its own keys.
    durs, keys, off = [], [], 0
    for tr in traces:
        durs.append(tr.dur_ns)
        keys.append(tr.key + off)
        off += len(tr.keys)
    one_d, one_k, one_n = np.concatenate(durs), np.concatenate(keys), off
    copies = max(1, 3_000_000 // one_d.size)
    big_d = np.tile(one_d, copies)
    big_k = (np.repeat(np.arange(copies, dtype=np.int64) * one_n, one_d.size) + np.tile(one_k, copies))
    t_big = timed(lambda: cluster_keys(big_d, big_k, copies * one_n, cfg), 5)
    print(f"tiled batch: {copies} copies x {one_d.size} events = {big_d.size:,} events, "
          f"{copies * one_n:,} keys, one call: {t_big * 1e3:.0f} ms (median of 5) = "
          f"{big_d.size / t_big / 1e6:.2f} M events/s\n")

    # Naive baseline on one copy (it is slow): per key, in Python.
    per_key = [one_d[one_k == k] for k in range(one_n)]
    t_naive = timed(lambda: [naive_cluster(d, cfg) for d in per_key], 1)
    t_fast = timed(lambda: cluster_keys(one_d, one_k, one_n, cfg), 10)
    naive = [naive_cluster(d, cfg) for d in per_key]
    table = cluster_keys(one_d, one_k, one_n, cfg)
    same = int(sum(len(nv) == c for nv, c in zip(naive, np.bincount(table.key, minlength=one_n))))
    print(f"naive per-key baseline on one copy ({one_d.size:,} events, {one_n} keys):")
    print(f"  naive  {t_naive * 1e3:9.1f} ms = {one_d.size / t_naive / 1e6:7.3f} M events/s")
    print(f"  cluster_keys {t_fast * 1e3:3.1f} ms = {one_d.size / t_fast / 1e6:7.3f} M events/s")
    print(f"  speed-up {t_naive / t_fast:.0f}x; same number of clusters on {same}/{one_n} keys "
          f"(the naive one is ARGUS as written: no significance filter, no refinement, no tick spreading)")


if __name__ == "__main__":
    main()
