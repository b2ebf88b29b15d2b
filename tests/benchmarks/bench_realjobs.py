"""Verdicts on real PyTorch jobs: plain all-reduce, DDP and FSDP2 on gloo, healthy and with one fault each.

    python tests/benchmarks/bench_realjobs.py [--modes plain ddp fsdp groups] [--seeds 1] [--busy] [--only late hang]
        [--record DIR]
    python tests/benchmarks/bench_realjobs.py --reanalyze DIR

``--record DIR`` keeps each job's bus (every record the live analyzer read, one
``<mode>-<scenario>-<seed>.bus`` file each); ``--reanalyze DIR`` judges those
records again with the analyzer as it is now, in seconds and without timing
(what a rule change does to the same jobs; the live run stays the measure).

Each job is ``tests/support/train_collectives.py`` (4 ranks, CPU, gloo on
127.0.0.1) under ``trainscope run`` against a real processor, with a live
analyzer on its bus (``tests/support/livejob.py``; 10-iteration windows; the
analyzer thread at nice 10, as a service that runs off the training hosts would
not take the job's cores), ``--steps`` steps. Faults on one rank from step 10 on:

- ``slow forward``: ``--slow-ms`` of extra busy work inside the forward;
- ``late start``: a sleep between forward and backward (plain: before the
  all-reduce; DDP: before backward's bucket all-reduces; FSDP2: before its
  backward's all-gathers);
- ``intermittent stall``: a 300 ms sleep there one step in five;
- ``data loader``: a sleep before each batch;
- ``between layers``: a sleep between the first and second layer's forward
  (FSDP2: before the second layer's all-gather);
- ``host contention``: the rank shares one core with three busy processes of its
  own priority (a neighbour's processes on a shared host);
- ``hang``: the rank stops before its gradient collectives at step 40; the job is
  right once a ``stalled`` verdict names it (the row gives the seconds from its
  stop to that verdict), then it is killed;

and a healthy job whose ranks load batches in 2 worker processes each
(``healthy workers``, the common ``DataLoader(num_workers=2)``),

and the two-group job (``tests/support/train_groups.py``: tensor-parallel pairs
all-reducing activations inside the forward, data-parallel pairs all-reducing
gradients after backward) with the same faults on rank 1 (TP partner 0, DP peer
3) but ``between layers`` (its forward has one layer before the TP all-reduce):
a late start and the intermittent stall sleep after backward, before the DP
all-reduce; the hang stops it before backward at step 40.

``--busy`` runs a CPU-hungry process (``nice 10``, one busy core) beside every
job, as on a shared host. The job's verdict (``merge_windows`` over every
window's) is scored: a faulty job is *right* when its top suspect is the faulty
rank and no other rank is a culprit or link; a healthy job is *clean* when
nobody is named and it is not "degraded" (the totals also count the healthy
jobs that named nobody: "degraded, not localized" is what a job slowed as a
whole by its host reads). Prints one row per job (seconds are
wall time here) and the totals. No job is run twice.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from support.livejob import LiveJob, torchrun  # noqa: E402

from trainscope.analyzer.merge import merge_windows  # noqa: E402
from trainscope.analyzer.service import Analyzer, AnalyzerConfig  # noqa: E402
from trainscope.analyzer.sources import BusSource  # noqa: E402
from trainscope.processor.bus import EmbeddedBus  # noqa: E402

RANK = 2
#: The live analyzer's niceness: deployed, it runs off the training hosts; here it shares the job's two cores,
#: and its per-window work (a burst of CPU-seconds at each window close) would slow the job it judges.
ANALYZER_NICE = 10
SCENARIOS = {
    "healthy": [],
    "slow forward": ["--slow-rank", str(RANK), "--slow-ms", "15"],
    "late start": ["--late-rank", str(RANK), "--late-s", "0.03", "--late-from", "10"],
    "intermittent stall": ["--late-rank", str(RANK), "--late-s", "0.3", "--late-from", "10", "--late-every", "5"],
    "data loader": ["--loader-rank", str(RANK), "--loader-ms", "30"],
    "between layers": ["--layer-delay-rank", str(RANK), "--layer-delay-ms", "20"],
    "host contention": ["--contend-rank", str(RANK)],
    "hang": ["--hang-rank", str(RANK), "--hang-from", "40"],
    "healthy workers": ["--loader-workers", "2"],
}
#: Seconds a hung job is watched for its stalled verdict (the analyzer's hang timeout is 15 s).
HANG_WATCH_S = 120


#: The two-group job (``tests/support/train_groups.py``): TP pairs (0, 1), (2, 3) inside the forward,
#: DP pairs (0, 2), (1, 3) after backward; its faults are on rank 1 (TP partner 0, DP peer 3).
GROUPS = pathlib.Path(__file__).resolve().parents[1] / "support" / "train_groups.py"
GROUP_RANK = 1
GROUP_SCENARIOS = {
    "healthy": [],
    "slow forward": ["--slow-rank", str(GROUP_RANK), "--slow-ms", "15"],
    "late start": ["--late-rank", str(GROUP_RANK), "--late-ms", "30"],
    "intermittent stall": ["--late-rank", str(GROUP_RANK), "--late-ms", "300", "--late-every", "5"],
    "data loader": ["--loader-rank", str(GROUP_RANK), "--loader-ms", "30"],
    "host contention": ["--contend-rank", str(GROUP_RANK)],
    "hang": ["--hang-rank", str(GROUP_RANK), "--fault-from", "40"],
    "healthy workers": ["--loader-workers", "2"],
}


def healthy(name: str) -> bool:
    return name.startswith("healthy")


def run_job(tmp: pathlib.Path, mode: str, extra: list[str], steps: int):
    """(the job, its output or None for a hang, seconds from the hang to the stalled verdict naming it)."""
    hang_file = tmp / "hang.txt"
    if "--hang-rank" in extra:
        extra = [*extra, "--hang-file", str(hang_file)]
    if mode == "groups":
        # real torchrun, as a user runs it (the tests fork their ranks after one import torch)
        job = LiveJob(tmp, "bench-groups", command=torchrun("--steps", str(steps), *extra, script=GROUPS,
                                                            fork=False), analyzer_nice=ANALYZER_NICE)
    else:
        job = LiveJob(tmp, f"bench-{mode}", "--mode", mode, "--steps", str(steps), *extra,
                      analyzer_nice=ANALYZER_NICE, fork=False)
    latency = None
    culprit = GROUP_RANK if mode == "groups" else RANK
    try:
        if "--hang-rank" in extra:
            out = None
            named, at = job.wait_for(lambda v: v.state == "stalled" and v.ranks and v.ranks[0].rank == culprit,
                                     HANG_WATCH_S)
            if named is not None and hang_file.exists():
                latency = at - float(hang_file.read_text())
        else:
            out = job.finish(timeout_s=300)
    finally:
        job.close()
    return job, out, latency


def save_bus(bus: EmbeddedBus, path: pathlib.Path) -> None:
    """Every record of every topic on the job's bus (``--record``): JSON, keys and values in base64 (data, never
    code: a recorded file is safe to read back), written 0600 and never over an existing file."""
    topics = {t: [[base64.b64encode(r.key).decode(), base64.b64encode(r.value).decode()]
                  for r in bus.poll(t, 0, max_records=10**9)] for t in list(bus._logs)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(topics, f)


def reanalyze(path: pathlib.Path) -> list:
    """The verdicts of a recorded job's windows with the analyzer as it is now (``--reanalyze``)."""
    bus = EmbeddedBus(max_records=10**9)
    for topic, recs in json.loads(path.read_text()).items():
        for key, value in recs:
            bus.publish(str(topic), base64.b64decode(key), base64.b64decode(value))
    an = Analyzer(AnalyzerConfig(), BusSource(bus), [])
    out = []
    while True:
        got = an.step(0.0)
        if not got:
            break
        out += got
    return out + [v for v in an.finish() if v not in out]


def judge(v, fault: bool, culprit: int) -> bool:
    named = [(s.rank, s.role) for s in v.ranks] if v else []
    if not fault:
        return not named and (v is None or v.state != "degraded")
    blamed = {r for r, role in named if role in ("culprit", "link")}
    return bool(named) and named[0][0] == culprit and blamed == {culprit}


def explain(windows, ranks: set[int], width: int = 220) -> list[str]:
    """A wrong job's evidence, to study without rerunning it: every window's findings that name
    ``ranks`` (level/kind, place, the suspect's evidence: rule, lateness, p-value, ...)."""
    out = []
    for w in windows:
        for f in w.findings:
            if f.informational:
                continue
            for s in f.suspects:
                if s.rank in ranks:
                    ev = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in dict(s.evidence).items()
                          if k not in ("stack_grid", "flight_recorder")}
                    out.append(f"w{w.window.index} rank {s.rank} {s.role} {f.level}/{f.kind} "
                               f"{f.scope.phase or f.scope.kernel or f.scope.group} "
                               f"{s.impact_s * 1e3:.2f} ms: {ev}"[:width])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["plain", "ddp", "fsdp", "groups"],
                    choices=["plain", "ddp", "fsdp", "groups"])
    ap.add_argument("--seeds", type=int, default=1, help="runs of each job (default 1)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--busy", action="store_true", help="a CPU-hungry process beside every job")
    ap.add_argument("--only", nargs="*", default=[], help="scenarios whose name contains one of these")
    ap.add_argument("--record", type=pathlib.Path, help="keep each job's bus records in this folder")
    ap.add_argument("--reanalyze", type=pathlib.Path, help="judge the jobs recorded in this folder again")
    args = ap.parse_args(argv)
    if args.reanalyze:
        return replay_all(args.reanalyze, args.only)
    if args.record:
        args.record.mkdir(parents=True, exist_ok=True)
    busy = None
    if args.busy:
        busy = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while True: pass"])
    rows = []
    try:
        for seed in range(args.seeds):
            for mode in args.modes:
                for name, extra in (GROUP_SCENARIOS if mode == "groups" else SCENARIOS).items():
                    if args.only and not any(o in name for o in args.only):
                        continue
                    t0 = time.perf_counter()
                    with tempfile.TemporaryDirectory() as tmp:
                        job, out, hang_s = run_job(pathlib.Path(tmp), mode, extra, args.steps)
                    if args.record:
                        save_bus(job.proc.bus, args.record / f"{mode}-{name.replace(' ', '_')}-{seed}.bus")
                    v = merge_windows(job.seen())
                    ok = judge(v, not healthy(name), GROUP_RANK if mode == "groups" else RANK)
                    rows.append((mode, name, ok, job.job.returncode, bool(v and v.ranks)))
                    named = ",".join(f"{s.rank}{s.role[0]}" for s in v.ranks[:6]) if v else ""
                    hang = "" if hang_s is None else f"  named {hang_s:.1f} s after it stopped"
                    print(f"{'ok' if ok else 'WRONG':>5}  {mode:<5} {name:<19} seed {seed}  "
                          f"{(v.state if v else 'none'):<10} named [{named}]  exit {job.job.returncode}  "
                          f"{time.perf_counter() - t0:5.1f} s{hang}", flush=True)
                    if not ok and v is not None:
                        report(v, job.seen())
    finally:
        if busy is not None:
            busy.kill()
    totals(rows, 'beside a busy process' if args.busy else 'idle machine')
    return 0


def report(v, windows) -> None:
    print(f"       {v.summary[:240]}", flush=True)
    for line in explain(windows, {s.rank for s in v.ranks}):
        print(f"         {line}", flush=True)


def totals(rows, where: str) -> None:
    faulty = [ok for _, n, ok, _, _ in rows if not healthy(n)]
    clean = [ok for _, n, ok, _, _ in rows if healthy(n)]
    nobody = [not named for _, n, _, _, named in rows if healthy(n)]
    print(f"{where}: faulty right (top-1, nobody else blamed) {sum(faulty)}/{len(faulty)}; healthy: named "
          f"nobody {sum(nobody)}/{len(nobody)}, state healthy {sum(clean)}/{len(clean)}")


def replay_all(folder: pathlib.Path, only: list[str]) -> int:
    files = sorted(folder.glob("*.bus"))
    if not files:
        print(f"bench_realjobs: no recorded jobs (*.bus) in {folder}; record some with --record {folder}",
              file=sys.stderr)
        return 2
    rows = []
    for f in files:
        parts = f.stem.split("-")
        if len(parts) != 3:
            print(f"bench_realjobs: {f.name} is not named <mode>-<scenario>-<seed>.bus; skipped", file=sys.stderr)
            continue
        mode, name, seed = parts
        name = name.replace("_", " ")
        if only and not any(o in name for o in only):
            continue
        if name == "hang":
            print(f"   --  {mode:<5} {name:<19} seed {seed}  judged live only: the hang timeout is wall time",
                  flush=True)
            continue
        try:
            windows = reanalyze(f)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            print(f"bench_realjobs: {f} is not a job this benchmark recorded ({type(e).__name__}: {e}); skipped",
                  file=sys.stderr)
            continue
        v = merge_windows(windows)
        ok = judge(v, not healthy(name), GROUP_RANK if mode == "groups" else RANK)
        rows.append((mode, name, ok, 0, bool(v and v.ranks)))
        named = ",".join(f"{s.rank}{s.role[0]}" for s in v.ranks[:6]) if v else ""
        print(f"{'ok' if ok else 'WRONG':>5}  {mode:<5} {name:<19} seed {seed}  "
              f"{(v.state if v else 'none'):<10} named [{named}]", flush=True)
        if not ok and v is not None:
            report(v, windows)
    totals(rows, f"re-analysed ({folder})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
