"""Detection accuracy and latency over simulated scenarios (prints tables).

    python tests/benchmarks/bench_detection.py [--ranks 32 64] [--magnitudes 1 2] [--healthy-runs 3]

Every fault type × size × magnitude, plus healthy runs, through the real
path (simulator → exporters → gRPC → processor → embedded bus → analyzer),
scored against the simulator's ground truth (analyzer/evaluate.py):
caught, top-1 culprit rank, phase/kernel right, levels, detection latency in
windows after onset, and false alarms per healthy hour (simulated time).
Also: onset → first diagnosis latency per level on a 1,024-rank job (--big).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

from trainscope.analyzer.evaluate import evaluate, load_truth
from trainscope.collector.sim import sim_config
from trainscope.deploy.embedded import run_sim
from trainscope.deploy.embedded import SimAnalysis

# Faults that L1-L3 are expected to catch (ARGUS Table 6), with a scope and a
# magnitude ladder (mild, strong). Onset 30 s into a 3 s/iteration job.
SCENARIOS = {
    "gpu_throttle": ("rank={r}", ["factor=1.2", "factor=1.5"]),
    "background_load": ("rank={r}", ["factor=1.2", "factor=1.5"]),
    "pcie_degrade": ("rank={r}", ["factor=2", "factor=4"]),
    "ecc": ("rank={r}", ["prob=0.01,factor=8", "prob=0.03,factor=8"]),
    "nvlink_degrade": ("rank={r}", ["factor=2", "factor=3"]),
    "nic_degrade": ("nic=1:0", ["factor=2", "factor=4"]),
    "net_congestion": ("host=1", ["factor=2", "factor=3"]),
    "nccl_delay": ("rank={r}", ["prob=0.01,delay=1", "prob=0.03,delay=1"]),
    "gc_pause": ("rank={r}", ["prob=0.05,delay=0.5", "prob=0.1,delay=1"]),
    "dataloader_stall": ("rank={r}", ["delay=0.3", "delay=1"]),
    "cpu_contention": ("host=1", ["factor=3", "factor=10"]),
    "moe_imbalance": ("rank={r}", ["factor=1.5", "factor=2"]),
    "hang": ("rank={r}", ["timeout=60", "timeout=60"]),
    "jit_stall": ("rank={r}", ["prob=0.05,delay=3", "prob=0.1,delay=5"]),
}


def run_one(ranks: int, fault: str | None, seed: int, iterations: int, home: str):
    ep = 4 if fault and fault.startswith("moe") else 1
    cfg = sim_config(ranks=ranks, tp=2, pp=2, ep=ep, iterations=iterations, seed=seed,
                     faults=[fault] if fault else [], job_id=f"bench{seed}", home=home,
                     window_iterations=10)
    analysis = SimAnalysis()
    res = run_sim(cfg, **analysis.hooks())
    return cfg, res, analysis.verdicts


def latency_at_scale(ranks: int = 1024, iterations: int = 60) -> None:
    """Onset -> first diagnosis per level on a large job, in windows and simulated
    seconds, plus the analyzer's wall time per window (replayed from the store)."""
    from trainscope.analyzer.service import Analyzer, AnalyzerConfig
    from trainscope.analyzer.sources import StoreSource

    culprit = 137
    spec = f"gpu_throttle:rank={culprit},onset=60s,factor=1.4"
    with tempfile.TemporaryDirectory() as home:
        cfg = sim_config(ranks=ranks, tp=8, pp=4, iterations=iterations, faults=[spec], job_id="big",
                         home=home, window_iterations=10)
        t0 = time.perf_counter()
        analysis = SimAnalysis()
        res = run_sim(cfg, **analysis.hooks())
        wall = time.perf_counter() - t0
        truth = load_truth(res.ground_truth_path)
        onset_it = truth["faults"][0]["onset_iteration"]
        iters = truth["iterations"]
        print(f"\n{ranks} ranks (tp=8 pp=4), {iterations} iterations, {res.kernel_events:,} kernel events, "
              f"{spec}: whole run {wall:.0f} s wall")
        for level in ("L1", "L2", "L3"):
            hit = None
            for v in sorted(analysis.verdicts, key=lambda v: v.window.index):
                if any(f.level == level and (f.kind in ("jitter", "regression", "stall")
                                             or any(s.rank == culprit for s in f.suspects)) for f in v.findings):
                    hit = v
                    break
            if hit is None:
                print(f"  {level}: no diagnosis")
                continue
            last_it = min(hit.window.last_iteration, iters["count"] - 1)
            sim_lat = iters["end_s"][last_it] - iters["start_s"][onset_it]
            print(f"  {level}: first diagnosis in window {hit.window.index} (onset window "
                  f"{onset_it // cfg.window_iterations}); fault onset -> window close = {sim_lat:.0f} simulated s")
        src = StoreSource(res.store_path)
        a = Analyzer(AnalyzerConfig(), src, [])
        t1 = time.perf_counter()
        n = len(a.finish())
        dt = time.perf_counter() - t1
        print(f"  analyzer, re-reading the store: {n} windows of {ranks} ranks in {dt:.1f} s = "
              f"{dt / max(n, 1):.2f} s per window (L1+L2+L3, records decoding included)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also the 1,024-rank latency run")
    ap.add_argument("--ranks", type=int, nargs="+", default=[32])
    ap.add_argument("--magnitudes", type=int, nargs="+", default=[0, 1], help="indices into each ladder")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--healthy-runs", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="fault types to run")
    args = ap.parse_args(argv)
    rows = []
    t0 = time.perf_counter()
    print(f"{'fault':<44} {'ranks':>5} {'caught':>6} {'top1':>5} {'phase':>5} {'kernel':>6} "
          f"{'levels':<8} {'latency':>7}  verdict")
    for ftype, (scope, ladder) in SCENARIOS.items():
        if args.only and ftype not in args.only:
            continue
        for ranks in args.ranks:
            culprit = ranks // 2 - 3
            for mi in args.magnitudes:
                if mi >= len(ladder):
                    continue
                params = ladder[mi]
                spec = f"{ftype}:{scope.format(r=culprit)},onset=30s" + (f",{params}" if params else "")
                with tempfile.TemporaryDirectory() as home:
                    cfg, res, verdicts = run_one(ranks, spec, 7, args.iterations, home)
                    ev = evaluate(verdicts, load_truth(res.ground_truth_path), cfg.window_iterations)
                f = ev.faults[0]
                lat = "-" if f.first_window is None else str(f.first_window - (f.onset_window or 0))
                rows.append((ftype, ranks, f))
                print(f"{spec:<44} {ranks:>5} {'yes' if f.caught else 'NO':>6} {'yes' if f.top1 else 'no':>5} "
                      f"{'yes' if f.phase else '-':>5} {'yes' if f.kernel else '-':>6} "
                      f"{'+'.join(f.levels) or '-':<8} {lat:>7}  {f.verdict[:90]}", flush=True)
    healthy_windows = false_windows = 0
    sim_seconds = 0.0
    for ranks in args.ranks:
        for seed in range(args.healthy_runs):
            with tempfile.TemporaryDirectory() as home:
                cfg, res, verdicts = run_one(ranks, None, 100 + seed, args.iterations, home)
            healthy_windows += len(verdicts)
            false_windows += sum(1 for v in verdicts if v.ranks or v.findings)
            sim_seconds += res.sim_seconds
    n = len(rows)
    print(f"\n{n} faulty runs: caught {sum(f.caught for _, _, f in rows)}/{n}, "
          f"top-1 rank right {sum(f.top1 for _, _, f in rows)}/{n}, "
          f"phase right {sum(f.phase for _, _, f in rows)}, kernel right {sum(f.kernel for _, _, f in rows)}")
    hours = sim_seconds / 3600
    print(f"healthy: {false_windows} of {healthy_windows} windows with a finding over {sim_seconds:.0f} "
          f"simulated s = {false_windows / hours if hours else 0:.1f} false alarms per healthy hour")
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    if args.big:
        latency_at_scale()
    return 0


if __name__ == "__main__":
    sys.exit(main())
