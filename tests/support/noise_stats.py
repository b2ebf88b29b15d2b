"""Noise statistics of kernel streams at their call sites (the same call across steps).

Used by ``tests/benchmarks/measure_noise.py`` on the real traces and by the
simulator's tests to check that its noise model reproduces them.
"""
from __future__ import annotations

import numpy as np

from trainscope.analyzer.topology import CATEGORIES, RoutingConfig

ROUTING = RoutingConfig()


def _q(v) -> dict | None:
    v = np.asarray(v, dtype=np.float64)
    if not v.size:
        return None
    return {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)), "mean": float(v.mean())}


def call_sites(trace) -> tuple[dict[tuple[str, int, int], np.ndarray], set]:
    """The same call across steps: the j-th call of (kernel, stream) in each ProfilerStep.

    Returns {(kernel, stream, j): durations, one per step that has it} and the
    keys called exactly once per step."""
    k = trace.kernels
    marks = sorted(trace.iterations, key=lambda m: m.start_ns)
    sites: dict[tuple[str, int, int], list[float]] = {}
    per_step_counts: dict[tuple[str, int], set] = {}
    for m in marks:
        sel = np.flatnonzero((k.start_ns >= m.start_ns) & (k.start_ns < m.end_ns))
        seen: dict[tuple[str, int], int] = {}
        for i in sel[np.argsort(k.start_ns[sel], kind="stable")].tolist():
            key = (k.names[int(k.name_id[i])], int(k.stream[i]))
            j = seen.get(key, 0)
            seen[key] = j + 1
            sites.setdefault((*key, j), []).append(float(k.duration_ns[i]))
        for key, n in seen.items():
            per_step_counts.setdefault(key, set()).add(n)
    once = {key for key, ns in per_step_counts.items() if ns == {1}}
    return {s: np.asarray(v) for s, v in sites.items() if len(v) >= 3}, once


def site_stats(sites: dict, once: set) -> dict:
    """Deviation of each call from its call site's median across steps (step 1 on call sites)."""
    out = {}
    for label, pick in (("once_per_step", lambda s: s[:2] in once), ("all_sites", lambda s: True)):
        ratios, sig = [], []
        cat_ratio: dict[str, list] = {c: [] for c in CATEGORIES}
        for site, d in sites.items():
            if not pick(site) or np.any(d <= 0):
                continue
            r = d / np.median(d)
            ratios.append(r)
            cat_ratio[CATEGORIES[ROUTING.category(site[0])]].append(r)
            sig.append(1.4826 * np.median(np.abs(np.log(r))))
        if not ratios:
            out[label] = None
            continue
        allr = np.concatenate(ratios)
        out[label] = {"sites": len(ratios), "calls": int(allr.size),
                      "over_1_2": float(np.mean(allr > 1.2)), "over_1_5": float(np.mean(allr > 1.5)),
                      "under_0_8": float(np.mean(allr < 1 / 1.2)),
                      "sigma": _q(sig), "spike_log_size": _q(np.log(allr[allr > 1.2])),
                      "by_category": {c: {"calls": int(np.concatenate(v).size),
                                          "over_1_2": float(np.mean(np.concatenate(v) > 1.2)),
                                          "over_1_5": float(np.mean(np.concatenate(v) > 1.5))}
                                      for c, v in cat_ratio.items() if v}}
    return out
