"""Benchmark: kernel-stat compression ratio and fidelity on real traces (ARGUS §5.2, §6.2).

Run: ``python tests/benchmarks/bench_compression.py`` (prints figures, asserts nothing).

Per trace (one rank), per training step (``ProfilerStep#N`` spans):

* bytes in: kernel events as 16-byte binary records (start u64, duration u32,
  name id u16, stream u16) and as the trace's JSON text of those events;
* bytes out: one ``trainscope.v1.KernelWindow`` holding one ``KernelStats``
  per (kernel, stream) with its KDE clusters (with kernel names, and with the
  names interned, i.e. sent once per job in a string table);
* fidelity: W1 between each key's raw durations and the lognormal mixture
  rebuilt from its clusters (ARGUS §6.2), relative to the key's median;
* alternatives in the same run: the per-key durations losslessly compressed
  with zstd and gzip (W1 = 0; also with the durations at ns resolution, as
  CUPTI reports them, since these traces tick in whole µs), and one DDSketch
  per key at 1% relative accuracy (its protobuf, and a sparse byte estimate;
  W1 of its bins).

ARGUS reports ~3,700x (10 MB of raw trace -> 2.7 KB of statistics per rank per step).
"""
from __future__ import annotations

import gzip
import json
import os
import sys
import time

import numpy as np
import zstandard
from ddsketch import DDSketch
from ddsketch.pb.proto import DDSketchProto

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kde import KernelTrace, load_traces  # noqa: E402

from trainscope.analyzer.cdf import empirical_cdf, log_grid, mixture_cdf, support, w1  # noqa: E402
from trainscope.processor.kde import ClusterTable, cluster_keys  # noqa: E402
from trainscope.proto.v1 import common_pb2, records_pb2  # noqa: E402

ARGUS_RATIO = 10e6 / 2.7e3
GRID_POINTS = 4096


def kernel_window(tr: KernelTrace, table: ClusterTable, names: bool) -> records_pb2.KernelWindow:
    """The processor's kernel summary of one rank-window: one KernelStats per key."""
    total = np.bincount(tr.key, tr.dur_ns.astype(np.float64), minlength=len(tr.keys))
    off = table.offsets(len(tr.keys))
    stats = []
    for k, (name, stream, kind) in enumerate(tr.keys):
        rows = range(off[k], off[k + 1])
        stats.append(records_pb2.KernelStats(
            kernel=name if names else "", stream=stream, kind=kind,
            clusters=[records_pb2.KernelCluster(count=int(table.count[i]), p50_ns=table.p50[i],
                                                p99_ns=table.p99[i], min_ns=table.min[i],
                                                max_ns=table.max[i]) for i in rows],
            count=int(table.count[off[k]:off[k + 1]].sum()), total_ns=float(total[k])))
    return records_pb2.KernelWindow(
        resource=common_pb2.Resource(job_id=tr.name, rank=0, world_size=1),
        window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0,
                                  start_ns=int(tr.start_ns.min()), end_ns=int(tr.start_ns.max()),
                                  first_iteration=0, last_iteration=tr.steps - 1),
        kernels=stats, events=int(tr.dur_ns.size))


def _varint_len(v: np.ndarray) -> np.ndarray:
    return 1 + (np.asarray(v, np.uint64) >= 128) + (np.asarray(v, np.uint64) >= 1 << 14) + \
        (np.asarray(v, np.uint64) >= 1 << 21) + (np.asarray(v, np.uint64) >= 1 << 28)


def sketch(d: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
    """DDSketch at 1%: (protobuf bytes, sparse estimate bytes, bin values, bin counts)."""
    s = DDSketch(relative_accuracy=0.01)
    for v in d.tolist():
        s.add(v)
    pb = len(DDSketchProto.to_proto(s).SerializeToString())
    bins = np.asarray(s._store.bins, np.float64)
    idx = np.flatnonzero(bins) + s._store.offset
    values = np.array([s._mapping.value(int(i)) for i in idx])
    counts = bins[bins > 0]
    # Sparse store: zig-zag varint index deltas + varint counts, + gamma/offset (~12 B).
    sparse = 12 + int(_varint_len(np.diff(idx, prepend=idx[0]) * 2).sum() + _varint_len(counts).sum())
    return pb, sparse, values, counts


def weighted_cdf(values, counts, grid) -> np.ndarray:
    order = np.argsort(values)
    c = np.cumsum(counts[order]) / counts.sum()
    i = np.searchsorted(values[order], grid, side="right")
    return np.where(i > 0, c[np.maximum(i - 1, 0)], 0.0)


def bench_trace(tr: KernelTrace) -> dict:
    n_keys = len(tr.keys)
    t0 = time.perf_counter()
    table = cluster_keys(tr.dur_ns, tr.key, n_keys)
    t_kde = time.perf_counter() - t0
    out = {"name": tr.name, "events": tr.dur_ns.size, "keys": n_keys, "steps": tr.steps,
           "clusters": len(table), "kde_ms": t_kde * 1e3}
    out["bin"] = tr.dur_ns.size * 16
    out["json"] = len(",\n".join(json.dumps(e) for e in tr.events).encode())
    out["stats"] = len(kernel_window(tr, table, names=True).SerializeToString())
    out["stats_interned"] = len(kernel_window(tr, table, names=False).SerializeToString())

    # Lossless: per-key sorted durations (u32 ns) and per-key counts.
    order = np.lexsort((tr.dur_ns, tr.key))
    lossless = np.bincount(tr.key, minlength=n_keys).astype("<u4").tobytes() + \
        tr.dur_ns[order].astype("<u4").tobytes()
    out["zstd"] = len(zstandard.ZstdCompressor(level=19).compress(lossless))
    out["gzip"] = len(gzip.compress(lossless, compresslevel=9))
    # The same durations at ns resolution (uniform within their µs tick), as
    # CUPTI reports them: lossless compression depends on that resolution.
    rng = np.random.default_rng(0)
    fine = np.maximum(tr.dur_ns.astype(np.int64) + rng.integers(-499, 500, tr.dur_ns.size), 1)
    order_f = np.lexsort((fine, tr.key))
    out["zstd_ns"] = len(zstandard.ZstdCompressor(level=19).compress(
        np.bincount(tr.key, minlength=n_keys).astype("<u4").tobytes() + fine[order_f].astype("<u4").tobytes()))
    records = np.zeros(tr.dur_ns.size, [("s", "<u8"), ("d", "<u4"), ("n", "<u2"), ("t", "<u2")])
    records["s"], records["d"] = tr.start_ns, tr.dur_ns
    records["n"] = tr.key
    out["zstd_records"] = len(zstandard.ZstdCompressor(level=19).compress(records.tobytes()))

    off = table.offsets(n_keys)
    w_kde, w_dd, dd_pb, dd_sparse, n_per_key, means = [], [], 0, 0, [], []
    for k in range(n_keys):
        d = tr.dur_ns[tr.key == k].astype(np.float64)
        r = slice(off[k], off[k + 1])
        pb, sp, values, counts = sketch(d)
        dd_pb += pb
        dd_sparse += sp
        lo, hi = support(table.p50[r], table.p99[r])
        grid = log_grid(min(lo, d.min(), values.min()), max(hi, d.max(), values.max()) * 1.000001, GRID_POINTS)
        emp = empirical_cdf(d, grid)
        med = float(np.median(d))
        w_kde.append(w1(emp, mixture_cdf(table.count[r], table.p50[r], table.p99[r], grid), grid) / med)
        w_dd.append(w1(emp, weighted_cdf(values, counts, grid), grid) / med)
        n_per_key.append(d.size)
        means.append(d.mean() / med)
    out.update(dd_pb=dd_pb, dd_sparse=dd_sparse, w_kde=np.array(w_kde), w_dd=np.array(w_dd),
               n_per_key=np.array(n_per_key), mean_over_median=np.array(means))
    return out


def main() -> None:
    t_start = time.perf_counter()
    traces = load_traces()
    results = [bench_trace(tr) for tr in traces]

    print("per trace (one rank, one window; bytes per rank per step):")
    print(f"{'trace':24s} {'events':>6s} {'keys':>4s} {'clus':>4s} {'steps':>5s} {'JSON/step':>10s} "
          f"{'16B/step':>9s} {'stats/step':>10s} {'interned':>9s} {'JSON÷stats':>10s} {'÷interned':>9s} "
          f"{'W1/med p50':>10s} {'p90':>7s}")
    for r in results:
        s = r["steps"]
        print(f"{r['name'][:24]:24s} {r['events']:6d} {r['keys']:4d} {r['clusters']:4d} {s:5d} "
              f"{r['json'] / s:10.0f} {r['bin'] / s:9.0f} {r['stats'] / s:10.0f} {r['stats_interned'] / s:9.0f} "
              f"{r['json'] / r['stats']:9.0f}x {r['json'] / r['stats_interned']:8.0f}x "
              f"{np.median(r['w_kde']):10.4f} {np.percentile(r['w_kde'], 90):7.4f}")

    steps = sum(r["steps"] for r in results)
    js, bn = sum(r["json"] for r in results), sum(r["bin"] for r in results)
    w_kde = np.concatenate([r["w_kde"] for r in results])
    w_dd = np.concatenate([r["w_dd"] for r in results])
    n_key = np.concatenate([r["n_per_key"] for r in results])
    mom = np.concatenate([r["mean_over_median"] for r in results])  # W1/median ÷ this = W1/mean
    big = n_key >= 8
    print(f"\nall {len(results)} traces, {steps} steps; raw in per rank per step: JSON {js / steps / 1e3:.1f} KB, "
          f"16-byte records {bn / steps / 1e3:.1f} KB. ARGUS: 10 MB -> 2.7 KB = {ARGUS_RATIO:,.0f}x.")
    print(f"W1 relative to the key's median over {w_kde.size} keys ({int(big.sum())} with >= 8 events); "
          "lossless methods have W1 = 0.\n")
    head = f"{'method':38s} {'B/rank/step':>11s} {'JSON÷':>8s} {'16B÷':>7s} {'W1/med p50':>10s} {'p90':>7s} " \
           f"{'p90 n>=8':>8s} {'max':>7s} {'W1/mean p50':>11s} {'p90':>6s}"
    print(head)
    print("-" * len(head))

    def row(label, total, w):
        if w is None:
            w = np.zeros(w_kde.shape)
        wm = w / mom
        wcols = (f"{np.median(w):10.4f} {np.percentile(w, 90):7.4f} {np.percentile(w[big], 90):8.4f} "
                 f"{w.max():7.4f} {np.median(wm):11.4f} {np.percentile(wm, 90):6.3f}")
        print(f"{label:38s} {total / steps:11.0f} {js / total:7.0f}x {bn / total:6.1f}x {wcols}")

    row("raw JSON kernel events", js, None)
    row("raw 16-byte records", bn, None)
    row("16-byte records, zstd-19", sum(r["zstd_records"] for r in results), None)
    row("per-key durations, gzip-9 (lossless)", sum(r["gzip"] for r in results), None)
    row("per-key durations, zstd-19 (lossless)", sum(r["zstd"] for r in results), None)
    row("  same, durations at ns resolution", sum(r["zstd_ns"] for r in results), None)
    row("DDSketch 1% per key, protobuf", sum(r["dd_pb"] for r in results), w_dd)
    row("DDSketch 1% per key, sparse estimate", sum(r["dd_sparse"] for r in results), w_dd)
    row("KDE clusters, KernelWindow", sum(r["stats"] for r in results), w_kde)
    row("KDE clusters, KernelWindow, interned", sum(r["stats_interned"] for r in results), w_kde)
    print(f"\nclustering time: {sum(r['kde_ms'] for r in results):.1f} ms for {n_key.sum():,} events "
          f"(first calls, cold); whole benchmark {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
