"""Short captures (6-12 profiler steps) of jobs built from the real kernel streams, replayed end to end.

    python tests/benchmarks/bench_short_captures.py [--quick] [--seeds 2] [--only compute]

An on-call engineer often has only a short ``torch.profiler`` capture of every
rank. Each job here is built by ``tests/support/realjob.py`` from a real trace
in ``../shared/data/kineto`` (its per-call noise, the measured per-rank
personality, spikes, pipeline stages), 16-256 ranks with tp/pp, 6-12 steps,
with one fault costing >= 3 % of the step, or none (healthy controls). Each is
replayed through the real pipeline (``trainscope.deploy.replay.run_replay``)
and the job's verdict (``merge_windows``) is scored:

- faulty: *right* when the top suspect is a culprit of the fault (a rank of the
  faulty host for a host fault) and no rank outside the fault is named as a
  culprit or link (waiters may be listed as waiters);
- healthy: *clean* when nobody is named and the state is not "degraded".

Prints one row per job (the fault's cost in % of the step against the job's
healthy twin, state, named ranks,
seconds to build and replay) and the totals; faults costing under ``--min-cost``
are shown as ``(n/s)`` and not scored.
Figures are counts; the replay time is wall seconds on this machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from support.realjob import Fault, JobSpec, build_job  # noqa: E402

from trainscope.collector.sources.replay import load_rank_trace  # noqa: E402

from trainscope.analyzer.merge import merge_windows  # noqa: E402
from trainscope.deploy.replay import run_replay  # noqa: E402


def cases(seed: int, quick: bool) -> list[tuple[str, JobSpec, set[int] | None]]:
    """(label, spec, culprit ranks or None for a healthy control)."""
    s = 100 * seed
    shapes = [(16, 2, 1), (32, 2, 2), (64, 4, 2)] + ([] if quick else [(256, 8, 1)])
    out: list[tuple[str, JobSpec, set[int] | None]] = []
    for i, (n, tp, pp) in enumerate(shapes):
        steps = (6, 8, 10, 12)[(i + seed) % 4]
        r = (5 + 7 * i + 3 * seed) % n
        host = (i + seed) % max(1, n // 8)
        base = dict(ranks=n, tp=tp, pp=pp, steps=steps, seed=s + i, noisy=((r + 3) % n,))
        out += [
            (f"{n}r tp{tp} pp{pp} {steps} steps healthy", JobSpec(**base), None),
            (f"{n}r {steps} steps compute 1.15x rank {r}",
             JobSpec(**base, faults=(Fault("compute", ranks=(r,), factor=1.15),)), {r}),
            (f"{n}r {steps} steps compute 1.3x rank {r}, tp partners wait",
             JobSpec(**base, faults=(Fault("compute", ranks=(r,), factor=1.3, waiters=True),)), {r}),
            (f"{n}r {steps} steps dataloader +15 ms rank {r}",
             JobSpec(**base, faults=(Fault("dataloader", ranks=(r,), delay_ms=15.0),)), {r}),
            (f"{n}r {steps} steps compute 1.3x rank {r} from step {steps // 2}",
             JobSpec(**base, faults=(Fault("compute", ranks=(r,), factor=1.3, start=steps // 2),)), {r}),
            (f"{n}r {steps} steps copies 3x rank {r}",
             JobSpec(**base, faults=(Fault("copies", ranks=(r,), factor=3.0),)), {r}),
            (f"{n}r {steps} steps host {host} compute 1.2x",
             JobSpec(**base, faults=(Fault("host", host=host, factor=1.2),)),
             set(range(8 * host, 8 * host + 8))),
        ]
    return out


def cost_pct(job: pathlib.Path, twin: pathlib.Path, culprits: set[int]) -> float:
    """What the fault costs: a culprit's mean step against the same rank of the job's healthy twin (the
    same spec and seed with the fault's factor 1 and delay 0, so the same noise draws), in %."""
    r = min(culprits)

    def mean_step(d: pathlib.Path) -> float:
        marks = load_rank_trace(d / f"rank-{r}.json.gz").iterations
        return sum(m.end_ns - m.start_ns for m in marks) / max(len(marks), 1)
    return 100.0 * (mean_step(job) / mean_step(twin) - 1.0)


def healthy_twin(spec: JobSpec) -> JobSpec:
    return dataclasses.replace(spec, faults=tuple(dataclasses.replace(f, factor=1.0, delay_ms=0.0)
                                                  for f in spec.faults))


def judge(v, culprits: set[int] | None) -> tuple[bool, str]:
    named = [(s.rank, s.role) for s in v.ranks] if v else []
    state = v.state if v else "none"
    if culprits is None:
        return (not named and state != "degraded"), state
    blamed = [r for r, role in named if role in ("culprit", "link")]
    ok = bool(named) and named[0][0] in culprits and all(r in culprits for r in blamed)
    return ok, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1, help="seeds per case (default 1)")
    ap.add_argument("--quick", action="store_true", help="leave out the 256-rank jobs")
    ap.add_argument("--only", default="", help="run only cases whose label contains this")
    ap.add_argument("--min-cost", type=float, default=3.0,
                    help="faults costing less than this %% of the step are shown but not scored (default 3)")
    args = ap.parse_args(argv)
    rows = []
    for seed in range(args.seeds):
        for label, spec, culprits in cases(seed, args.quick):
            if args.only and args.only not in label:
                continue
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                build_job(pathlib.Path(tmp) / "job", spec)
                cost = 0.0
                if culprits:
                    build_job(pathlib.Path(tmp) / "twin", healthy_twin(spec))
                    cost = cost_pct(pathlib.Path(tmp) / "job", pathlib.Path(tmp) / "twin", culprits)
                res = run_replay(str(pathlib.Path(tmp) / "job"), home=str(pathlib.Path(tmp) / "h"))
            v = merge_windows(res.verdicts)
            ok, state = judge(v, culprits)
            sec = time.perf_counter() - t0
            named = ",".join(f"{s.rank}{s.role[0]}" for s in v.ranks[:6]) if v else ""
            scored = culprits is None or cost >= args.min_cost
            if scored:
                rows.append((label, culprits is None, ok))
            mark = ("ok" if ok else "WRONG") if scored else "(n/s)"
            print(f"{mark:>5}  {label:<48} cost {cost:5.1f} %  {state:<10} named [{named}]  {sec:5.1f} s",
                  flush=True)
            if not ok and v is not None:
                print(f"       {v.summary[:220]}", flush=True)
    faulty = [ok for _, h, ok in rows if not h]
    healthy = [ok for _, h, ok in rows if h]
    print(f"faulty costing >= {args.min_cost:g} % of the step named right (top-1, nobody else blamed): "
          f"{sum(faulty)}/{len(faulty)}"
          f" = {100 * sum(faulty) / max(len(faulty), 1):.0f} %")
    print(f"healthy controls clean: {sum(healthy)}/{len(healthy)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
