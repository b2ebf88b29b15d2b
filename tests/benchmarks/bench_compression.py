"""Benchmark: size and fidelity of the kernel summary on real traces (ARGUS §5.2, §6.2; issue #15 item 2).

Run: ``python tests/benchmarks/bench_compression.py [--quick]`` (prints figures, asserts nothing).

Windows (one rank each), built from the real Kineto traces' ``ProfilerStep#N``
spans (a kernel belongs to the step whose span holds its start):

* 1 step: every real step alone;
* 10 steps: 10 of the trace's steps drawn with replacement (3 windows per trace);
* 60 s: steps drawn with replacement until their spans add up to 60 s (one
  window per trace, 97 to 800 steps).

Per window and method: bytes per rank per step (the window's bytes over its
steps), and per (kernel, stream) the W1 between its raw durations and what
the method rebuilds, relative to the key's median (ARGUS §6.2 eq. 3, by
trapezoid on a 4,096-point log grid; ``trainscope.analyzer.cdf``). Methods:

* zstd-19 of the per-key sorted durations (u32) and per-key counts: lossless;
* DDSketch at 1 % relative accuracy per key (written here: log-γ bins,
  γ = 1.01/0.99, each bin's value 2γ^i/(γ+1)); bytes: zig-zag varint index
  deltas + varint counts + 12 bytes per key (γ, offset, length);
* the KDE summary as the processor sends it (one ``KernelWindow``):
  before issue #15 (one cluster per key below 8 calls, lognormal rebuild from
  p50/p99); each change alone; and now (small keys split at 1.5x gaps, p10..p90
  in ``KernelCluster.shape``, piecewise rebuild from the knots).

Bytes of the summary are reported *without kernel names*: the record carries
the name's dictionary id (``KernelStats.kernel_id``, 9 B per key; the job's
kernel-name dictionary sends each name once), and also with names inline (no id). The traces tick in whole microseconds;
``--ns`` repeats the run with each duration spread uniformly over its tick
(as CUPTI's ns timestamps would be).
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys
import time

import numpy as np
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kde import DATA, KernelTrace, load_traces  # noqa: E402

from trainscope.analyzer.cdf import empirical_cdf, log_grid, mixture_cdf, support, w1  # noqa: E402
from trainscope.processor.kde import ClusterTable, KdeConfig, cluster_keys  # noqa: E402
from trainscope.processor.kernel_names import kernel_id  # noqa: E402
from trainscope.proto import cluster_shape  # noqa: E402
from trainscope.proto.v1 import common_pb2, records_pb2  # noqa: E402

GRID_POINTS = 4096
WINDOW_S = 60.0
DD_ALPHA = 0.01


# ----------------------------------------------------------------------------- windows


def step_index(path: str, tr: KernelTrace) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel event its step (``ProfilerStep#N`` span holding its start; clipped to the
    first/last), and each step's span in ns."""
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    evs = doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = sorted((float(e["ts"]) * 1e3, float(e["dur"]) * 1e3) for e in evs
                   if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X")
    if not spans:
        return np.zeros(tr.dur_ns.size, np.int64), np.array([float(tr.start_ns.max() - tr.start_ns.min())])
    starts = np.array([s for s, _ in spans])
    idx = np.searchsorted(starts, tr.start_ns.astype(np.float64), side="right") - 1
    return np.clip(idx, 0, len(spans) - 1), np.array([d for _, d in spans])


def windows(tr: KernelTrace, step: np.ndarray, span: np.ndarray, mode: str, rng):
    """(event indices, steps) of every window of ``mode`` for one trace."""
    by_step = [np.flatnonzero(step == s) for s in range(span.size)]
    if mode == "1 step":
        for s in range(span.size):
            if by_step[s].size:
                yield by_step[s], 1
        return
    for _ in range(3 if mode == "10 steps" else 1):
        pick, total = [], 0.0
        while (len(pick) < 10) if mode == "10 steps" else (total < WINDOW_S * 1e9):
            j = int(rng.integers(span.size))
            pick.append(j)
            total += span[j]
        yield np.concatenate([by_step[j] for j in pick]), len(pick)


# ----------------------------------------------------------------------------- methods


def kernel_window(tr: KernelTrace, key, dur, table: ClusterTable, names: bool, shape: bool) -> bytes:
    """The processor's kernel summary of one rank-window: one KernelStats per key present."""
    n_keys = len(tr.keys)
    total = np.bincount(key, dur.astype(np.float64), minlength=n_keys)
    off = table.offsets(n_keys)
    words = cluster_shape.pack(table.min, table.max, table.quantiles) if shape else np.zeros(len(table), np.uint64)
    stats = []
    for k in np.flatnonzero(np.diff(off)).tolist():
        name, stream, kind = tr.keys[k]
        stats.append(records_pb2.KernelStats(
            kernel=name if names else "", kernel_id=0 if names else kernel_id(name), stream=stream, kind=kind,
            clusters=[records_pb2.KernelCluster(count=int(table.count[i]), p50_ns=table.p50[i],
                                                p99_ns=table.p99[i], min_ns=table.min[i],
                                                max_ns=table.max[i], shape=int(words[i]))
                      for i in range(off[k], off[k + 1])],
            count=int(table.count[off[k]:off[k + 1]].sum()), total_ns=float(total[k])))
    return records_pb2.KernelWindow(
        resource=common_pb2.Resource(job_id=tr.name, rank=0, world_size=1),
        window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0,
                                  start_ns=int(tr.start_ns.min()), end_ns=int(tr.start_ns.max()),
                                  first_iteration=0, last_iteration=tr.steps - 1),
        kernels=stats, events=int(dur.size)).SerializeToString()


def _varint_len(v) -> np.ndarray:
    v = np.asarray(v, np.uint64)
    return 1 + sum((v >= np.uint64(1) << np.uint64(7 * i)).astype(np.int64) for i in range(1, 10))


def ddsketch(d: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """DDSketch at ``DD_ALPHA`` of one key's durations: (bytes, bin values, bin counts)."""
    gamma = (1 + DD_ALPHA) / (1 - DD_ALPHA)
    idx, counts = np.unique(np.ceil(np.log(d) / np.log(gamma)).astype(np.int64), return_counts=True)
    values = 2.0 * gamma ** idx / (gamma + 1.0)
    delta = np.diff(idx, prepend=0)
    zigzag = np.where(delta >= 0, 2 * delta, -2 * delta - 1)
    return 12 + int(_varint_len(zigzag).sum() + _varint_len(counts).sum()), values, counts


def weighted_cdf(values, counts, grid) -> np.ndarray:
    c = np.cumsum(counts) / counts.sum()
    i = np.searchsorted(values, grid, side="right")
    return np.where(i > 0, c[np.maximum(i - 1, 0)], 0.0)


@dataclasses.dataclass
class Method:
    label: str
    bytes: int = 0
    bytes_names: int = 0
    w: list = dataclasses.field(default_factory=list)


# Summary variants: (label, split small keys, send shape, rebuild from knots).
KDE_VARIANTS = (
    ("KDE before #15: lognormal(p50, p99)", False, False, False),
    ("  + small keys split at 1.5x gaps", True, False, False),
    ("  + piecewise from min/p50/p99/max", True, False, True),
    ("KDE now: + p10..p90 (shape), piecewise", True, True, True),
)


def bench_window(tr, key, dur, steps, ms: dict) -> None:
    """Add one window's bytes and per-key relative W1 to every method in ``ms``."""
    n_keys = len(tr.keys)
    order = np.lexsort((dur, key))
    lossless = np.bincount(key, minlength=n_keys).astype("<u4").tobytes() + dur[order].astype("<u4").tobytes()
    ms["zstd"].bytes += len(zstandard.ZstdCompressor(level=19).compress(lossless))
    tables = {}
    for label, split, shape, knots in KDE_VARIANTS:
        t = tables.get(split)
        if t is None:
            t = tables[split] = cluster_keys(dur, key, n_keys, KdeConfig(split_small=split))
        m = ms[label]
        m.bytes += len(kernel_window(tr, key, dur, t, False, shape))
        m.bytes_names += len(kernel_window(tr, key, dur, t, True, shape))
    ds, ks = dur[order].astype(np.float64), key[order]
    bounds = np.searchsorted(ks, np.arange(n_keys + 1))
    offs = {s: t.offsets(n_keys) for s, t in tables.items()}
    for k in range(n_keys):
        d = ds[bounds[k]:bounds[k + 1]]
        if not d.size:
            continue
        nb, values, counts = ddsketch(d)
        ms["dd"].bytes += nb
        rebuilt = []
        for label, split, shape, knots in KDE_VARIANTS:
            t, r = tables[split], slice(offs[split][k], offs[split][k + 1])
            extra = (t.min[r], t.max[r], cluster_shape.pack(t.min[r], t.max[r], t.quantiles[r]) if shape else None) \
                if knots else (None, None, None)
            rebuilt.append((label, (t.count[r], t.p50[r], t.p99[r]), extra))
        lo = min(min(support(*c[1:], 4.0, *e)[0] for _, c, e in rebuilt), d[0], values[0])
        hi = max(max(support(*c[1:], 4.0, *e)[1] for _, c, e in rebuilt), d[-1], values[-1])
        grid = log_grid(lo, hi * 1.000001, GRID_POINTS)
        emp = empirical_cdf(d, grid)
        med = float(np.median(d))
        ms["dd"].w.append(w1(emp, weighted_cdf(values, counts, grid), grid) / med)
        ms["zstd"].w.append(0.0)
        for label, c, e in rebuilt:
            ms[label].w.append(w1(emp, mixture_cdf(*c, grid, *e), grid) / med)


def run(traces, paths, mode: str, jitter: bool) -> tuple[dict, int, int]:
    rng = np.random.default_rng(1)
    jit = np.random.default_rng(2)
    ms = {"zstd": Method("per-key durations, zstd-19 (lossless)"), "dd": Method("DDSketch 1% per key")}
    ms.update({label: Method(label) for label, *_ in KDE_VARIANTS})
    steps = n_windows = 0
    for tr, path in zip(traces, paths):
        step, span = step_index(path, tr)
        for idx, s in windows(tr, step, span, mode, rng):
            dur = tr.dur_ns[idx].astype(np.int64)
            if jitter:      # ns resolution: uniform within the trace's 1 µs tick
                dur = np.maximum(dur + jit.integers(-499, 500, dur.size), 1)
            bench_window(tr, tr.key[idx], dur.astype(np.uint64), s, ms)
            steps += s
            n_windows += 1
    return ms, steps, n_windows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", action="store_true", help="also run with durations spread over their 1 µs tick")
    ap.add_argument("--quick", action="store_true", help="1-step and 10-step windows only")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import glob
    paths = sorted(glob.glob(os.path.join(DATA, "*.json.gz")))
    traces = load_traces()
    print(f"loaded {len(traces)} traces ({sum(t.dur_ns.size for t in traces):,} kernel events) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    modes = ("1 step", "10 steps") if args.quick else ("1 step", "10 steps", "60 s")
    for jitter in (False, True) if args.ns else (False,):
        for mode in modes:
            t1 = time.perf_counter()
            ms, steps, nw = run(traces, paths, mode, jitter)
            n_keys = len(ms["dd"].w)
            print(f"\n{mode} windows{' (durations at ns resolution)' if jitter else ' (durations in whole µs, as traced)'}: "
                  f"{nw} windows, {steps} steps, {n_keys} (window, kernel, stream) keys; "
                  f"{time.perf_counter() - t1:.1f} s")
            head = (f"{'method':40s} {'B/rank/step':>11s} {'with names':>10s} {'rel. W1 p50':>11s} "
                    f"{'p90':>7s} {'max':>8s}")
            print(head)
            print("-" * len(head))
            for m in ms.values():
                w = np.asarray(m.w)
                names = f"{m.bytes_names / steps:10.0f}" if m.bytes_names else f"{'-':>10s}"
                print(f"{m.label:40s} {m.bytes / steps:11.0f} {names} {np.median(w) * 100:10.2f}% "
                      f"{np.percentile(w, 90) * 100:6.2f}% {w.max() * 100:7.1f}%", flush=True)
    print(f"\nbytes: per rank per step = the window's bytes / its steps; 'B/rank/step' of the KDE rows is without "
          f"kernel names (ids from the job's dictionary), 'with names' inline. W1 relative to the key's median. "
          f"Whole benchmark {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
