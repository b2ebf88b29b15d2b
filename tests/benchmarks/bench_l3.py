"""L3 analyzer latency at scale (ARCHITECTURE.md "Performance budgets"); prints figures.

    python tests/benchmarks/bench_l3.py [--keys 100] [--keys-100k-before 25] [--brute-keys 20] [--no-before]

Before/after (issue #15): "before" is ``analyzer/l3_kernels.py`` as of commit
``BEFORE`` (read with ``git show``, run beside today's modules: message-by-message
flatten, CDFs and W1 for every segment); "after" is the module in the tree
(flatten from the wire format, W1 only where a rank is flagged). Both run on the
same inputs in one run and must give the same findings. Per path: CPU seconds
and peak MiB (tracemalloc, measured in a second, untimed call: allocations above
the inputs). At 100,000 ranks the "before" scoring is timed on
``--keys-100k-before`` keys and extrapolated per key (it takes minutes); its
peak is not measured.

One core (BLAS pinned to one thread). Times are CPU seconds of this process
(``time.process_time``), robust to other jobs on a shared machine; the
wall-clock total is printed at the end. Per scale: time to
flatten the window's ``KernelWindow`` protobufs into flat arrays, to route
ranks into groups, and to score (CDFs, sorted prefix-sum mean W1, IQR
significance test). Rank-to-rank noise is lognormal (1 %); one rank gets one kernel 30 %
slower, and the run checks that exactly that is found.

* 1,000 ranks (one DP group of 1,000) and 10,000 ranks (tp=8: groups of
  1,250) go through the protobuf path, ``analyze_kernels``'s steps.
* 100,000 ranks (tp=8, pp=5: groups of 2,500) go through the protobuf path
  too: the 100,000 messages are made by writing the doubles of one rank's
  serialised message into a copy per rank (building 10 M messages in Python
  would take minutes) and parsed with ``FromString`` (not counted).
* Baseline: the brute-force all-pairs W1 matrix on the same CDFs at 1,000
  ranks (what ARGUS Fig. 7c draws), timed on ``--brute-keys`` keys.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")          # one core, also for the brute force's matrix products

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402

from trainscope.analyzer.l3_kernels import (
    KernelTable, L3Config, _cdf_block, _key_grids, flatten_kernels, kernel_findings, mean_w1_to_peers,
    score_kernels,
)
from trainscope.analyzer.topology import group_of, rank_to_group
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

BAD_RANK, BAD_KEY = 7, 3
#: The last commit before issue #15's L3 changes: the "before" of every figure.
BEFORE = "59f535640ea2e772fe71b0ca0393d23e27221ec1"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_before():
    """``analyzer/l3_kernels.py`` at ``BEFORE`` as a module (None when git or the commit is not there)."""
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:analyzer/l3_kernels.py"],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:     # removed once the module is loaded
        path = pathlib.Path(tmp) / "l3_before.py"
        path.write_bytes(src)
        spec = importlib.util.spec_from_file_location("l3_before", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["l3_before"] = mod
        spec.loader.exec_module(mod)
    return mod


def peak_mib(fn, *a, **kw) -> float:
    """Peak of what ``fn`` allocates above what was allocated before it (tracemalloc), MiB."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn(*a, **kw)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / 2**20


def synth(ranks: int, keys: int, seed: int = 0) -> KernelTable:
    """Flat cluster arrays: per key a median and a spread, 30 % of keys bimodal.

    Rank-to-rank noise is lognormal, 1 % on p50 and 3 % on p99/p50; rank
    ``BAD_RANK`` runs key ``BAD_KEY`` 30 % slower.
    """
    rng = np.random.default_rng(seed)
    base = np.exp(rng.uniform(np.log(5e3), np.log(5e6), keys))
    spread = rng.uniform(1.1, 2.0, keys)
    ncl = np.where(rng.random(keys) < 0.3, 2, 1)
    dist_rank, dist_key = np.repeat(np.arange(ranks), keys), np.tile(np.arange(keys), ranks)
    lens = np.tile(ncl, ranks)
    cl_start = np.r_[0, np.cumsum(lens)]
    key_c = np.repeat(dist_key, lens)
    second = (np.arange(cl_start[-1]) - np.repeat(cl_start[:-1], lens)) == 1
    p50 = base[key_c] * np.where(second, 8.0, 1.0) * np.exp(rng.normal(0, 0.01, key_c.size))
    p99 = p50 * spread[key_c] * np.exp(rng.normal(0, 0.03, key_c.size))
    bad = np.repeat((dist_rank == BAD_RANK) & (dist_key == BAD_KEY), lens)
    p50[bad] *= 1.3
    p99[bad] *= 1.3
    cnt = np.where(second, 20, 200)        # identical kernel sequences: equal counts per window
    return KernelTable.from_arrays([(f"kernel_{k}", 7) for k in range(keys)], np.arange(ranks),
                                   dist_rank, dist_key, cl_start, cnt, p50, p99)


def to_protos(t: KernelTable) -> dict[int, records_pb2.KernelWindow]:
    out = {}
    d = 0
    cnt, p50, p99, cs = t.cl_count.tolist(), t.cl_p50.tolist(), t.cl_p99.tolist(), t.cl_start.tolist()
    for r in t.ranks.tolist():
        kw = records_pb2.KernelWindow()
        while d < t.dist_rank.size and t.dist_rank[d] == r:
            name, stream = t.keys[t.dist_key[d]]
            ks = kw.kernels.add(kernel=name, stream=stream)
            for c in range(cs[d], cs[d + 1]):
                ks.clusters.add(count=int(cnt[c]), p50_ns=p50[c], p99_ns=p99[c])
            d += 1
        out[r] = kw
    return out


def fast_protos(t: KernelTable) -> dict[int, records_pb2.KernelWindow]:
    """``to_protos`` for tables whose ranks all hold the same keys and cluster counts (``synth``):
    one rank is serialised with distinct marker doubles, every rank's doubles are written at the
    markers' offsets of a copy of those bytes, and each copy is parsed."""
    d_per = int(np.sum(t.dist_rank == t.ranks[0]))
    c_per = int(t.cl_start[d_per])
    first = KernelTable.from_arrays(t.keys, t.ranks[:1], t.dist_rank[:d_per], t.dist_key[:d_per],
                                    t.cl_start[:d_per + 1], t.cl_count[:c_per],
                                    12345.678 + np.arange(c_per), 98765.4321 + np.arange(c_per))
    one = np.frombuffer(to_protos(first)[int(t.ranks[0])].SerializeToString(), dtype=np.uint8)
    words = np.lib.stride_tricks.sliding_window_view(one, 8).copy().view("<f8").ravel()
    at50 = np.searchsorted(words, first.cl_p50, sorter=np.argsort(words))
    at50 = np.argsort(words)[at50]
    at99 = np.argsort(words)[np.searchsorted(words, first.cl_p99, sorter=np.argsort(words))]
    assert np.array_equal(words[at50], first.cl_p50) and np.array_equal(words[at99], first.cl_p99)
    R, L = t.ranks.size, one.size
    buf = np.tile(one, R)
    base = (np.arange(R) * L)[:, None]
    for at, vals in ((at50, t.cl_p50), (at99, t.cl_p99)):
        pos = (base + at[None, :]).ravel()
        b = vals.astype("<f8").view(np.uint8).reshape(-1, 8)
        buf[pos[:, None] + np.arange(8)] = b
    raw = buf.tobytes()
    return {int(r): records_pb2.KernelWindow.FromString(raw[i * L:(i + 1) * L]) for i, r in enumerate(t.ranks)}


def resources(world: int, **degrees) -> dict[int, Resource]:
    return {r: Resource(job_id="bench", rank=r, world_size=world,
                        coords=coords_for_rank(r, world, **degrees)) for r in range(world)}


def found_ok(flagged: list[tuple[str, int, float]]) -> str:
    """``flagged``: (kernel, rank, time ratio to the group median - 1) of every flagged rank."""
    hit = any(k == f"kernel_{BAD_KEY}" and r == BAD_RANK for k, r, _ in flagged)
    other = [e for k, r, e in flagged if not (k == f"kernel_{BAD_KEY}" and r == BAD_RANK)]
    extra = (f", {len(other)} other flag(s) from noise (largest effect {max(other):.1%})"
             if other else ", no other flag")
    return ("degraded rank found" if hit else "degraded rank MISSED") + extra


def timed(fn, *a, **kw):
    t0 = time.process_time()
    out = fn(*a, **kw)
    return out, time.process_time() - t0


def flags_of(findings) -> list[tuple[str, int, float]]:
    return [(f.scope.kernel, s.rank, s.evidence["ratio"] - 1.0)
            for f in findings if f.kind == "degraded_kernel" for s in f.suspects]


def digest(findings) -> list:
    """What a finding says, to compare the two paths: kind, place, suspects, z and W1 evidence."""
    return [(f.kind, f.scope.kernel, f.scope.group_index, [(s.rank, round(s.score, 9),
             round(s.evidence.get("w1_ns", 0.0), 6)) for s in f.suspects]) for f in findings]


def proto_scale(ranks: int, keys: int, degrees: dict, cfg: L3Config, before, before_keys: int | None = None) -> dict:
    """One scale through ``flatten_kernels`` and ``kernel_findings``, after and (``before``) before."""
    flat = synth(ranks, keys, seed=ranks)
    protos, t_build = timed(fast_protos if ranks > 10_000 else to_protos, flat)
    res = resources(ranks, **degrees)
    groups, t_group = timed(group_of, res, "dp")
    size = len(next(iter(groups.values())))
    out = {}
    for name, mod in (("after", sys.modules["trainscope.analyzer.l3_kernels"]), ("before", before)):
        if mod is None:
            continue
        t, t_flat = timed(mod.flatten_kernels, protos)
        part = before_keys if (name == "before" and before_keys) else None
        if part:   # time a subset of keys, extrapolate per key (minutes otherwise)
            keep = t.dist_key < part
            sub = mod.KernelTable.from_arrays(t.keys[:part], t.ranks, t.dist_rank[keep], t.dist_key[keep],
                                              np.r_[0, np.cumsum(np.diff(t.cl_start)[keep])],
                                              *(x[np.repeat(keep, np.diff(t.cl_start))]
                                                for x in (t.cl_count, t.cl_p50, t.cl_p99)))
            findings, t_score = timed(mod.kernel_findings, "bench", records_pb2.Window(), sub, groups, cfg)
            t_score *= keys / part
        else:
            findings, t_score = timed(mod.kernel_findings, "bench", records_pb2.Window(), t, groups, cfg)
        mib = None
        if not (name == "before" and ranks > 10_000):
            mib = max(peak_mib(mod.flatten_kernels, protos),
                      peak_mib(mod.kernel_findings, "bench", records_pb2.Window(), t, groups, cfg))
        out[name] = (t_flat, t_score, mib, findings)
        est = f" (score extrapolated from {part} keys)" if part else ""
        print(f"{ranks:>7} ranks x {keys} keys, groups of {size}, {name:>6}: flatten {t_flat:6.2f} s  "
              f"score {t_score:6.2f} s  total {t_flat + t_score + t_group:6.2f} s  "
              f"peak {'%.0f MiB' % mib if mib is not None else 'not measured'}{est}; "
              f"detection: {found_ok(flags_of(findings))}", flush=True)
    if "before" in out:
        b, a = out["before"], out["after"]
        same = "n/a (subset of keys before)" if before_keys else (
            "same findings" if digest(a[3]) == digest(b[3]) else "FINDINGS DIFFER")
        print(f"{ranks:>7} ranks: after/before total {(a[0] + a[1]) / (b[0] + b[1]):.3f}x "
              f"({b[0] + b[1]:.1f} s -> {a[0] + a[1]:.2f} s); {same}  "
              f"[groups {t_group:.2f} s, protobuf build not counted: {t_build:.1f} s]", flush=True)
    return out


def brute_force(ranks: int, keys: int, brute_keys: int, cfg: L3Config) -> None:
    t = synth(ranks, keys, seed=ranks)
    _, t_fast = timed(score_kernels, t, np.zeros(ranks, dtype=np.int64), cfg, w1_everywhere=True)
    order = np.lexsort((t.dist_rank, t.dist_key))
    key_first = np.flatnonzero(np.r_[True, np.diff(t.dist_key[order]) != 0])
    lgrid, wgrid, mu, sigma = _key_grids(t, order, key_first, cfg)
    worst, t_brute = 0.0, 0.0
    for k in range(min(brute_keys, keys)):
        t0 = time.process_time()
        d = order[key_first[k]:key_first[k] + ranks]
        f = _cdf_block(t, d, np.full(d.size, k), lgrid, mu, sigma, 0, cfg.grid_points)
        total = np.empty(ranks)
        for a in range(0, ranks, 32):                       # the W1 matrix, 32 rows at a time
            total[a:a + 32] = (np.abs(f[a:a + 32, None, :] - f[None, :, :]) @ wgrid[k]).sum(axis=1)
        brute = total / (ranks - 1)
        t_brute += time.process_time() - t0
        worst = max(worst, float(np.max(np.abs(mean_w1_to_peers(f, wgrid[k]) - brute)) / brute.max()))
    measured = min(brute_keys, keys)
    t_brute_all = t_brute * keys / measured
    print(f"brute-force all-pairs W1 matrix at {ranks} ranks: {t_brute / measured:.3f} s/key "
          f"({measured} keys measured) -> {t_brute_all:6.1f} s for {keys} keys; "
          f"prefix-sum W1 scoring of every segment of the "
          f"same {keys} keys {t_fast:5.2f} s -> {t_brute_all / t_fast:4.1f}x faster; "
          f"max relative difference of the scores {worst:.1e}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--keys-100k-before", type=int, default=25)
    ap.add_argument("--brute-keys", type=int, default=20)
    ap.add_argument("--grid", type=int, default=256)
    ap.add_argument("--no-before", action="store_true", help="skip the before-#15 path")
    ap.add_argument("--scales", default="1000,10000,100000")
    a = ap.parse_args(argv)
    cfg = L3Config(grid_points=a.grid)
    before = None if a.no_before else load_before()
    print(f"L3 benchmark: CPU seconds on one core, {a.grid} grid points, 1 % lognormal rank noise, "
          f"one degraded (rank, kernel); before = l3_kernels.py at {BEFORE[:10]}"
          + ("" if before is not None else " (not available: after only)"), flush=True)
    t_all = time.perf_counter()
    scales = [int(x) for x in a.scales.split(",")]
    for ranks in scales:
        degrees = {} if ranks <= 1000 else {"tp": 8} if ranks <= 10_000 else {"tp": 8, "pp": 5}
        proto_scale(ranks, a.keys, degrees, cfg, before, a.keys_100k_before if ranks > 10_000 else None)
        if ranks == 1000 and a.brute_keys:
            brute_force(1_000, a.keys, a.brute_keys, cfg)
    print(f"benchmark wall time {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
