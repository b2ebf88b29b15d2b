"""Measure the noise of real kernel streams (../shared/data/kineto); prints the figures of docs/noise.md.

    python tests/benchmarks/measure_noise.py [--json OUT]

Per trace, through the project's own loader (``collector/sources/replay``):

1. Per (kernel, stream) with at least ``MIN_CALLS`` calls: the robust body
   spread σ = 1.4826·MAD of ln(d / median) (what a lognormal body would
   have), the share of calls more than 1.2× and 1.5× their median (spikes),
   p99/p50 and max/median. Figures are medians and 90th percentiles over the
   keys, by category (compute, memory copy, communication), and pooled over
   every call.
2. Spikes: among calls > 1.2× their key's median, the distribution of
   ln(d / median) (the spike size the simulator draws).
3. Steps: CV of the ProfilerStep durations.
4. Personality: for the two ranks of job128, per key the ratio of the
   medians; the spread of ln(ratio) / √2 is one rank's persistent offset.

Only the traces and numpy are used; nothing here is tuned to a test.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import numpy as np

from trainscope.analyzer.topology import CATEGORIES, RoutingConfig
from trainscope.collector.sources.replay import load_rank_trace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.noise_stats import call_sites, site_stats  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
MIN_CALLS = 5
ROUTING = RoutingConfig()


def per_key(trace) -> dict[tuple[str, int], np.ndarray]:
    k = trace.kernels
    key = k.name_id.astype(np.int64) * 4096 + k.stream.astype(np.int64)
    order = np.argsort(key, kind="stable")
    ks, ds = key[order], k.duration_ns[order].astype(np.float64)
    cut = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1], True])
    out = {}
    for a, b in zip(cut[:-1], cut[1:]):
        d = ds[a:b]
        d = d[d > 0]
        if d.size >= MIN_CALLS:
            out[(k.names[int(ks[a] // 4096)], int(ks[a] % 4096))] = d
    return out


def key_stats(d: np.ndarray) -> dict:
    med = float(np.median(d))
    lr = np.log(d / med)
    return {"n": int(d.size), "sigma": float(1.4826 * np.median(np.abs(lr))),
            "over_1_2": float(np.mean(d > 1.2 * med)), "over_1_5": float(np.mean(d > 1.5 * med)),
            "p99_p50": float(np.percentile(d, 99) / med), "max_med": float(d.max() / med)}


def measure(path: pathlib.Path) -> dict:
    t = load_rank_trace(path)
    keys = per_key(t)
    by_cat: dict[str, list[dict]] = {c: [] for c in CATEGORIES}
    spikes, pooled = [], {"calls": 0, "over_1_2": 0, "over_1_5": 0}
    for (name, _), d in keys.items():
        s = key_stats(d)
        by_cat[CATEGORIES[ROUTING.category(name)]].append(s)
        med = np.median(d)
        pooled["calls"] += d.size
        pooled["over_1_2"] += int(np.sum(d > 1.2 * med))
        pooled["over_1_5"] += int(np.sum(d > 1.5 * med))
        spikes += np.log(d[d > 1.2 * med] / med).tolist()
    steps = np.array([m.end_ns - m.start_ns for m in t.iterations], dtype=np.float64)
    sites, once = call_sites(t)
    out = {"trace": path.name, "keys": len(keys), "calls": pooled["calls"],
           "pooled_over_1_2": pooled["over_1_2"] / max(pooled["calls"], 1),
           "pooled_over_1_5": pooled["over_1_5"] / max(pooled["calls"], 1),
           "step_cv": float(steps.std() / steps.mean()) if steps.size > 1 else None, "steps": int(steps.size),
           "spike_log_size": _q(spikes), "by_category": {}, "call_sites": site_stats(sites, once)}
    for c, rows in by_cat.items():
        if rows:
            out["by_category"][c] = {"keys": len(rows), **{f: _q([r[f] for r in rows])
                                                          for f in ("sigma", "over_1_2", "over_1_5", "p99_p50")}}
    return out, keys


def _q(v) -> dict | None:
    v = np.asarray(v, dtype=np.float64)
    if not v.size:
        return None
    return {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)), "mean": float(v.mean())}


def personality(a: dict, b: dict) -> dict:
    common = [k for k in a if k in b]
    lr = np.array([math.log(np.median(a[k]) / np.median(b[k])) for k in common])
    return {"keys": len(common), "median_abs_log_ratio": float(np.median(np.abs(lr))),
            "p90_abs_log_ratio": float(np.percentile(np.abs(lr), 90)),
            "sigma_per_rank": float(1.4826 * np.median(np.abs(lr - np.median(lr))) / math.sqrt(2))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here as JSON")
    a = ap.parse_args(argv)
    files = sorted(SHARED.glob("*.json.gz"))
    if not files:
        print(f"no traces in {SHARED}", file=sys.stderr)
        return 2
    results, keys = [], {}
    print(f"{'trace':32} {'keys':>5} {'calls':>7} {'>1.2x':>6} {'>1.5x':>6} {'step CV':>8}   "
          "sigma med/p90 (compute | memory | comm)")
    for f in files:
        r, k = measure(f)
        keys[f.name] = k
        results.append(r)
        cats = " | ".join(f"{r['by_category'][c]['sigma']['median']:.3f}/{r['by_category'][c]['sigma']['p90']:.3f}"
                          if c in r["by_category"] else "  -  " for c in CATEGORIES)
        cv = f"{r['step_cv']:.3f}" if r["step_cv"] is not None else "-"
        print(f"{r['trace']:32} {r['keys']:>5} {r['calls']:>7} {r['pooled_over_1_2']:>6.1%} "
              f"{r['pooled_over_1_5']:>6.1%} {cv:>8}   {cats}")
    print("\nthe same call across steps (j-th call of a kernel in each ProfilerStep; >= 3 steps):")
    print(f"{'trace':32} {'sites':>6} {'calls':>6} {'>1.2x':>6} {'>1.5x':>6} {'<0.83x':>7} {'sigma med':>9} "
          f"{'p90':>6}   once-per-step kernels: sites, >1.2x, >1.5x")
    for r in results:
        al, o = r["call_sites"].get("all_sites"), r["call_sites"].get("once_per_step")
        if not al:
            print(f"{r['trace']:32}   fewer than 3 steps")
            continue
        once_txt = (f"{o['sites']}, {o['over_1_2']:.1%}, {o['over_1_5']:.1%}" if o else "-")
        print(f"{r['trace']:32} {al['sites']:>6} {al['calls']:>6} {al['over_1_2']:>6.1%} {al['over_1_5']:>6.1%} "
              f"{al['under_0_8']:>7.1%} {al['sigma']['median']:>9.3f} {al['sigma']['p90']:>6.3f}   {once_txt}")
    site_sizes = [r["call_sites"]["all_sites"]["spike_log_size"]["median"] for r in results
                  if r["call_sites"].get("all_sites") and r["call_sites"]["all_sites"]["spike_log_size"]]
    if site_sizes:
        print("spike size at a call site (calls > 1.2x): median ln(d/median) "
              + ", ".join(f"{x:.2f}" for x in site_sizes) + f"  (= {math.exp(float(np.median(site_sizes))):.2f}x)")
    print("\nper (kernel, stream) over all its calls (call sites mixed: shapes differ, the KDE clusters them):")
    sizes = [r["spike_log_size"]["median"] for r in results if r["spike_log_size"]]
    print(f"\nspike size (calls > 1.2x median): median ln(d/median) per trace "
          + ", ".join(f"{s:.2f}" for s in sizes) + f"  (= {math.exp(float(np.median(sizes))):.2f}x)")
    p = None
    if "job128-rank0.json.gz" in keys and "job128-rank1.json.gz" in keys:
        p = personality(keys["job128-rank0.json.gz"], keys["job128-rank1.json.gz"])
        print(f"personality (job128 rank 0 vs 1, {p['keys']} keys): median |ln ratio| {p['median_abs_log_ratio']:.3f}, "
              f"p90 {p['p90_abs_log_ratio']:.3f}; per-rank sigma {p['sigma_per_rank']:.3f}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"traces": results, "personality": p}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
