"""L3 analyzer latency at scale (ARCHITECTURE.md "Performance budgets"); prints figures.

    python tests/benchmarks/bench_l3.py [--keys 100] [--keys-100k 25] [--brute-keys 20]

One core (BLAS pinned to one thread). Times are CPU seconds of this process
(``time.process_time``), robust to other jobs on a shared machine; the
wall-clock total is printed at the end. Per scale: time to
flatten the window's ``KernelWindow`` protobufs into flat arrays, to route
ranks into groups, and to score (CDFs, sorted prefix-sum mean W1, IQR
significance test). Rank-to-rank noise is lognormal (1 %); one rank gets one kernel 30 %
slower, and the run checks that exactly that is found.

* 1,000 ranks (one DP group of 1,000) and 10,000 ranks (tp=8: groups of
  1,250) go through the protobuf path, ``analyze_kernels``'s steps.
* 100,000 ranks (tp=8, pp=5: groups of 2,500) are scored from flat arrays
  (10 M protobuf messages would take minutes and gigabytes just to build in
  Python); a subset of keys is timed and extrapolated per key, and the
  flatten figure is extrapolated per distribution from the 10,000-rank run.
* Baseline: the brute-force all-pairs W1 matrix on the same CDFs at 1,000
  ranks (what ARGUS Fig. 7c draws), timed on ``--brute-keys`` keys.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")          # one core, also for the brute force's matrix products

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from trainscope.analyzer.l3_kernels import (
    KernelTable, L3Config, _cdf_block, _key_grids, flatten_kernels, kernel_findings, mean_w1_to_peers,
    score_kernels,
)
from trainscope.analyzer.topology import group_of, rank_to_group
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

BAD_RANK, BAD_KEY = 7, 3


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


def proto_scale(ranks: int, keys: int, degrees: dict, cfg: L3Config) -> tuple[float, float]:
    flat = synth(ranks, keys, seed=ranks)
    protos, t_build = timed(to_protos, flat)
    t, t_flat = timed(flatten_kernels, protos)
    res = resources(ranks, **degrees)
    groups, t_group = timed(group_of, res, "dp")
    findings, t_score = timed(kernel_findings, "bench", records_pb2.Window(), t, groups, cfg)
    d = t.dist_rank.size
    flags = [(f.scope.kernel, s.rank, s.evidence["ratio"] - 1.0)
             for f in findings if f.kind == "degraded_kernel" for s in f.suspects]
    print(f"{ranks:>7} ranks x {keys} keys, groups of {len(next(iter(groups.values())))}: "
          f"flatten {t_flat:6.2f} s ({t_flat / d * 1e6:.2f} us/dist)  groups {t_group:5.2f} s  "
          f"score {t_score:6.2f} s ({t_score / d * 1e6:.1f} us/dist)  "
          f"total {t_flat + t_group + t_score:6.2f} s"
          f"  [protobuf build, not counted: {t_build:.1f} s]  detection: {found_ok(flags)}")
    return t_flat / d, t_score / d


def brute_force(ranks: int, keys: int, brute_keys: int, cfg: L3Config) -> None:
    t = synth(ranks, keys, seed=ranks)
    _, t_fast = timed(score_kernels, t, np.zeros(ranks, dtype=np.int64), cfg)
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
          f"prefix-sum scoring of the "
          f"same {keys} keys {t_fast:5.2f} s -> {t_brute_all / t_fast:4.1f}x faster; "
          f"max relative difference of the scores {worst:.1e}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--keys-100k", type=int, default=25)
    ap.add_argument("--brute-keys", type=int, default=20)
    ap.add_argument("--grid", type=int, default=256)
    a = ap.parse_args(argv)
    cfg = L3Config(grid_points=a.grid)
    print(f"L3 benchmark: CPU seconds on one core, {a.grid} grid points, 1 % lognormal rank noise, "
          f"one degraded (rank, kernel)")
    t_all = time.perf_counter()
    proto_scale(1_000, a.keys, {}, cfg)
    brute_force(1_000, a.keys, a.brute_keys, cfg)
    flat_per_dist, _ = proto_scale(10_000, a.keys, {"tp": 8}, cfg)
    ranks, k = 100_000, a.keys_100k
    t = synth(ranks, k, seed=ranks)
    groups, t_group = timed(group_of, resources(ranks, tp=8, pp=5), "dp")
    rgm = rank_to_group(groups)
    rg = np.array([rgm[r] for r in range(ranks)], dtype=np.int64)
    res, t_score = timed(score_kernels, t, rg, cfg)
    per_key = t_score / k
    flags = [(t.keys[o.key][0], int(r), float(x / o.median_ns - 1.0))
             for o in res.outliers if o.key >= 0 for r, x in zip(o.ranks, o.x_ns)]
    flat_est = flat_per_dist * ranks * a.keys
    print(f"{ranks:>7} ranks x {k} keys (flat arrays), groups of 2500: score {t_score:6.2f} s = "
          f"{per_key:.2f} s/key -> {a.keys} keys ~{per_key * a.keys:.0f} s; groups {t_group:.2f} s; "
          f"flatten (extrapolated from 10k) ~{flat_est:.0f} s; detection: {found_ok(flags)}")
    print(f"benchmark wall time {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
