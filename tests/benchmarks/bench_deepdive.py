"""L4 deep dive cost (EROICA §4.2-4.3); prints figures.

    python tests/benchmarks/bench_deepdive.py [--ranks 1024] [--functions 60] [--big 16384] [--repeat 3]

One core (BLAS pinned to one thread); times are CPU seconds of this process
(``time.process_time``), robust to other jobs on a shared machine.

1. Localisation at scale: ``--ranks`` ranks of one role, ``--functions``
   functions each (compute kernels, memory copies, collectives, Python
   functions) with synthetic patterns: every function's β, μ, σ has the
   same value on every rank up to lognormal rank-to-rank noise (3 % on μ,
   10 % on σ, β following μ), plus Python functions that reach the path on
   only some ranks. One culprit rank has its largest compute kernel 1.5x
   slower per execution. The run checks that exactly that (rank, function) is named,
   and that the healthy job (no culprit) names nobody. Printed: time (s) and
   peak traced memory (MiB) of ``localize``, and the baseline in the same
   run: Δ over all |W| ranks instead of N = 100 sampled ones (the cost EROICA's
   sampling avoids), at ``--ranks``; ``--big`` repeats the sampled version at
   a larger scale (0 to skip).
2. Per-rank analysis of each real trace in ../shared/data/kineto: read (JSON
   -> columns), critical path, patterns; events per second for the analysis
   with and without the read. In EROICA the per-rank part runs on each
   worker's daemon, in parallel; only the patterns (a few KB) travel.
Reference: EROICA localises 1 M GPUs in about 3 minutes.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from trainscope.analyzer.deepdive.critical_path import critical_path  # noqa: E402
from trainscope.analyzer.deepdive.localize import LocalizeConfig, localize  # noqa: E402
from trainscope.analyzer.deepdive.patterns import Patterns, behaviour_patterns  # noqa: E402
from trainscope.analyzer.deepdive.trace import read_trace  # noqa: E402

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
KINDS = ("compute",) * 6 + ("memory",) * 2 + ("communication",) * 1 + ("python",) * 3


def synthetic_job(ranks: int, functions: int, culprit: int | None, seed: int = 0,
                  slow: float = 1.5) -> tuple[dict[int, Patterns], str]:
    """Patterns of ``ranks`` ranks; ``culprit``'s largest compute kernel ``slow`` times slower per
    execution (a kernel that matters: its slowdown costs more than EROICA's 1 % noise floor)."""
    rng = np.random.default_rng(seed)
    names = tuple(f"{KINDS[j % len(KINDS)]}_fn_{j}" for j in range(functions))
    kinds = tuple(KINDS[j % len(KINDS)] for j in range(functions))
    window = 20.0                                         # s, EROICA's default profiling session
    count = rng.integers(10, 2000, functions).astype(float)
    share = rng.dirichlet(np.ones(functions)) * 0.95      # β of each function, healthy
    mu0 = share * window / count
    sig0 = mu0 * rng.uniform(0.05, 0.5, functions)
    mu = mu0 * rng.lognormal(0, 0.03, (ranks, functions))
    sig = sig0 * rng.lognormal(0, 0.10, (ranks, functions))
    n = np.broadcast_to(count, (ranks, functions)).copy()
    # Python functions that only some ranks' paths reach (a logging call now and then)
    sparse = np.array([k == "python" for k in kinds]) & (np.arange(functions) % 2 == 1)
    n[:, sparse] *= rng.random((ranks, int(sparse.sum()))) > 0.3
    compute = np.flatnonzero(np.array([k == "compute" for k in kinds]))
    culprit_fn = int(compute[np.argmax(share[compute])])
    if culprit is not None:
        mu[culprit, culprit_fn] *= slow
    beta = mu * n / window
    out = {}
    for r in range(ranks):
        on = n[r] > 0
        idx = np.flatnonzero(on)
        out[r] = Patterns(functions=tuple(names[j] for j in idx), kinds=tuple(kinds[j] for j in idx),
                          beta=beta[r, idx], mu=mu[r, idx], sigma=sig[r, idx], count=n[r, idx].astype(np.int64),
                          launched_by=("",) * idx.size, window_s=window, iterations=100)
    return out, names[culprit_fn]


def _timed(fn):
    tracemalloc.start()
    t = time.process_time()
    res = fn()
    dt = time.process_time() - t
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return res, dt, peak


def bench_localize(ranks: int, functions: int, repeat: int, baseline: bool) -> bool:
    culprit = ranks // 3
    bad, fn = synthetic_job(ranks, functions, culprit)
    good, _ = synthetic_job(ranks, functions, None)
    best = min((_timed(lambda: localize(bad)) for _ in range(repeat)), key=lambda x: x[1])
    out, dt, peak = best
    named = {(o.function, r) for o in out for r, s in zip(o.ranks, o.slower) if s}
    want = {(fn, culprit)}
    healthy, dth, _ = _timed(lambda: localize(good))
    ok = named == want and not healthy
    print(f"localize {ranks:>7,} ranks x {functions} functions: {dt:7.3f} s, peak {peak:7.1f} MiB "
          f"(N = 100 sampled); culprit rank {culprit} {'named' if named == want else 'MISSED: ' + str(named)[:120]}; "
          f"healthy job: {'no outlier' if not healthy else str(len(healthy)) + ' outliers'} ({dth:.3f} s)")
    if baseline:
        cfg = LocalizeConfig(n_sample=ranks)
        _, dtb, peakb = _timed(lambda: localize(bad, cfg=cfg))
        print(f"  baseline, Δ over all {ranks:,} ranks: {dtb:7.3f} s, peak {peakb:7.1f} MiB "
              f"-> sampling is {dtb / dt:.1f}x faster (peak memory {peak / peakb:.2f}x the baseline's: "
              "both chunk Δ to ~4 M pairs)")
    return ok


def bench_traces() -> None:
    files = sorted(SHARED.glob("*.json.gz"))
    if not files:
        print("(no ../shared/data/kineto: per-trace figures skipped)")
        return
    print(f"{'trace':32} {'events':>8} {'read s':>7} {'path s':>7} {'pattern s':>9} "
          f"{'events/s (analysis)':>20} {'events/s (with read)':>21}")
    tot_ev = tot_a = tot_r = 0.0
    for f in files:
        t = time.process_time()
        tr = read_trace(f)
        tr_s = time.process_time() - t
        t = time.process_time()
        cp = critical_path(tr)
        cp_s = time.process_time() - t
        t = time.process_time()
        behaviour_patterns(cp)
        pt_s = time.process_time() - t
        a = cp_s + pt_s
        tot_ev += len(tr)
        tot_a += a
        tot_r += tr_s
        print(f"{f.name:32} {len(tr):8,} {tr_s:7.3f} {cp_s:7.3f} {pt_s:9.4f} {len(tr) / a:20,.0f} "
              f"{len(tr) / (a + tr_s):21,.0f}")
    print(f"{'all':32} {int(tot_ev):8,} {tot_r:7.3f} {tot_a:17.3f} {tot_ev / tot_a:20,.0f} "
          f"{tot_ev / (tot_a + tot_r):21,.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--functions", type=int, default=60)
    ap.add_argument("--big", type=int, default=16384, help="a larger scale, sampled only (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    print("1. localisation (EROICA §4.3), one core, CPU s")
    ok = bench_localize(a.ranks, a.functions, a.repeat, baseline=True)
    if a.big:
        ok &= bench_localize(a.big, a.functions, 1, baseline=False)
    print("2. per-rank analysis of the real traces (critical path §4.2 + patterns), one core, CPU s")
    bench_traces()
    print(f"wall-clock total {time.perf_counter() - t:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
