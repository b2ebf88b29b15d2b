"""Deep dives on real PyTorch jobs: a healthy job and one fault each; is only the faulty rank's function named?

    python tests/benchmarks/bench_realdives.py [--seeds 3] [--busy] [--only hot_loop gc] [--keep DIR [--keep-all]]
    python tests/benchmarks/bench_realdives.py --rejudge DIR [DIR ...]

Each job is ``tests/support/deepdive_job.py``'s small gloo job (4 ranks, CPU)
under ``trainscope run`` with a real processor; ``trainscope profile`` asks
for a 4-iteration dive once the processor has seen 12 iterations, and the
analyzer's deep-dive follower (``analyzer/deepdive/results.py``, EROICA §4.3)
analyses it. Scenarios, the fault on rank 2:

- ``healthy``: no fault; right when no rank is named (a function marked
  ``common``, slower on most ranks, is the whole job's and names nobody);
- ``hot_loop``: a Python loop in the step; right when rank 2 alone is named and
  ``hot_loop`` among its functions;
- ``matmul``: the first layer's matmul done four times (a throttled device);
  right when rank 2 alone is named and a matmul operator (``aten::linear``,
  ``aten::addmm``, ``aten::mm``, ``aten::matmul``) or the layer's ``forward``
  among its functions;
- ``gc``: ``gc.collect()`` every step (200k tracked objects); right when rank 2
  alone is named and ``gc.collect``'s built-in among its functions.

``--busy`` runs a CPU-hungry process (``nice 10``, one busy core) beside every
job. ``--keep DIR`` keeps a wrong dive's traces (``DIR/<scenario>-<seed>``, to
analyse again); ``--keep-all`` keeps every dive's (``DIR/<scenario>-<seed>-ok``
for the right ones): a corpus to judge a change of rule on without rerunning jobs;
``--rejudge DIR...`` judges every kept dive there again with the rules as they
are now, in seconds (the folder's name says the scenario, not the verdict). Prints one row per dive (seconds are wall time here) and the totals. No
job is run twice.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from support.deepdive_job import run_once  # noqa: E402

from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig  # noqa: E402
from trainscope.analyzer.store import DiagnosisStore  # noqa: E402

WORLD, RANK = 4, 2
#: What each scenario's rank must be named for (a function name's test).
EXPECT = {
    "healthy": None,
    "hot_loop": lambda f: f.endswith(": hot_loop"),
    "matmul": lambda f: f in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul") or f.endswith(": forward"),
    "gc": lambda f: f == "<built-in function collect>",
}


def named_functions(deep: pathlib.Path, tmp: pathlib.Path) -> tuple[dict[int, list[str]], list[int], list[dict]]:
    """{rank: functions it is named for (slower, not common)}, the dive's suspects, its outliers."""
    store = DiagnosisStore(str(tmp / "store.sqlite"))
    try:
        docs = DeepDiveFollower(str(deep), store, FollowerConfig(verdict_wait_s=0)).scan()
    finally:
        store.close()
    if len(docs) != 1:
        raise RuntimeError(f"{len(docs)} analysed dives, expected 1")
    doc = docs[0]
    return named_of(doc["outliers"]), list(doc["suspects"]), doc["outliers"]


def named_of(outliers: list[dict]) -> dict[int, list[str]]:
    """{rank: functions it is named for}: slower, on an outlier neither the job's (``common``) nor naming
    no cause (``not_cause``: ranks that waited or were absorbed, localize steps 7-8)."""
    named: dict[int, list[str]] = {}
    for o in outliers:
        if o["common"] or o.get("not_cause"):
            continue
        for r, slower in zip(o["ranks"], o["slower"]):
            if slower:
                named.setdefault(int(r), []).append(o["function"])
    return named


def totals(rows: list[tuple[str, bool]]) -> str:
    """The faulty and healthy counts of (scenario, right) rows."""
    faulty = [ok for n, ok in rows if n != "healthy"]
    clean = [ok for n, ok in rows if n == "healthy"]
    return (f"faulty dives right (the rank's function, nobody else named) {sum(faulty)}/{len(faulty)}; "
            f"healthy dives naming nobody {sum(clean)}/{len(clean)}")


def judge(name: str, named: dict[int, list[str]]) -> bool:
    want = EXPECT[name]
    if want is None:
        return not named
    return set(named) == {RANK} and any(want(f) for f in named[RANK])


def rejudge(roots: list[pathlib.Path]) -> int:
    """``--rejudge``: the kept dives (``<scenario>-<seed>[-ok]/dive/<id>/rank-<N>.json``) judged again."""
    from trainscope.analyzer.deepdive import localize_traces, trace_paths
    from trainscope.analyzer.deepdive.trace import TraceError
    rows = []
    for root in roots:
        if not root.is_dir():
            print(f"bench_realdives.py: {root} is not a folder: pass a --keep folder", file=sys.stderr)
            return 2
        for d in sorted(root.iterdir()):
            name = next((n for n in EXPECT if d.name.startswith(n + "-")), None)
            dives = sorted((d / "dive").glob("*/")) if name else []
            if len(dives) != 1:
                continue
            try:
                res = localize_traces(trace_paths(dives[0]))
            except TraceError as e:
                print(f"WRONG  {d}: {e}"[:300], flush=True)
                rows.append((name, False))
                continue
            named = named_of([dataclasses.asdict(o) for o in res.outliers])
            ok = judge(name, named)
            rows.append((name, ok))
            shown = "; ".join(f"rank {r}: {', '.join(sorted(set(fs)))[:100]}" for r, fs in sorted(named.items()))
            print(f"{'ok' if ok else 'WRONG':>5}  {root.name}/{d.name:<18} named [{shown or 'nobody'}]", flush=True)
    if not rows:
        print("bench_realdives.py: no kept dive in those folders (made by --keep DIR --keep-all)", file=sys.stderr)
        return 2
    print("re-judged: " + totals(rows))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1, help="runs of each job (default 1)")
    ap.add_argument("--busy", action="store_true", help="a CPU-hungry process beside every job")
    ap.add_argument("--keep", type=pathlib.Path, help="keep the traces of wrong dives in this folder")
    ap.add_argument("--keep-all", action="store_true", help="with --keep: keep the right dives' traces too")
    ap.add_argument("--only", nargs="*", default=[], choices=list(EXPECT), help="scenarios to run")
    ap.add_argument("--rejudge", nargs="+", type=pathlib.Path, metavar="DIR",
                    help="judge the dives kept in these folders again with the current rules (runs no job)")
    args = ap.parse_args(argv)
    if args.rejudge:
        return rejudge(args.rejudge)
    if args.keep_all and not args.keep:
        ap.error("--keep-all needs --keep DIR")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        ap.error(f"{args.keep} is not empty: name a new folder (nothing is overwritten)")
    busy = None
    if args.busy:
        busy = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while True: pass"])
    rows = []
    try:
        for seed in range(args.seeds):
            for name in EXPECT:
                if args.only and name not in args.only:
                    continue
                t0 = time.perf_counter()
                with tempfile.TemporaryDirectory() as tmp:
                    tmp = pathlib.Path(tmp)
                    faults = {} if name == "healthy" else {RANK: name}
                    try:
                        rc, out, p, deep = run_once(tmp / "job", faults, WORLD, job_id="dive")
                        if p.returncode != 0:
                            raise RuntimeError(f"trainscope profile exited {p.returncode}: {p.stderr.strip()[-300:]}")
                        complete = json.loads(p.stdout).get("complete")
                        named, suspects, outliers = named_functions(deep, tmp)
                        ok = judge(name, named)
                        if args.keep and (not ok or args.keep_all):
                            shutil.copytree(deep, args.keep / f"{name}-{seed}{'-ok' if ok else ''}")
                    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
                        rows.append((name, False))
                        print(f"WRONG  {name:<9} seed {seed}  no dive: {e}"[:400], flush=True)
                        continue
                rows.append((name, ok))
                shown = "; ".join(f"rank {r}: {', '.join(sorted(set(fs)))[:120]}" for r, fs in sorted(named.items()))
                print(f"{'ok' if ok else 'WRONG':>5}  {name:<9} seed {seed}  complete {complete}  suspects {suspects}  "
                      f"named [{shown or 'nobody'}]  exit {rc}  {time.perf_counter() - t0:5.1f} s", flush=True)
                if not ok:      # the evidence of each outlier, to study without rerunning the job
                    for o in outliers:
                        print("         " + json.dumps({k: o[k] for k in sorted(o) if k not in ("why",)})[:600],
                              flush=True)
    finally:
        if busy is not None:
            busy.kill()
    print(f"{'beside a busy process' if args.busy else 'idle machine'}: " + totals(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
