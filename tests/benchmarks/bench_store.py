"""``trainscope query`` on a 10,000-rank job's store (issue #15 item 5); prints figures.

    python tests/benchmarks/bench_store.py [--ranks 10000] [--windows 3] [--kernels 100] [--no-before]

Builds a store in a temporary directory through the processor's and the
analyzer's own stores: per window and rank an iteration record (5 marks), a
phase record (2 phases) and a kernel record (``--kernels`` kernels, one
cluster each); per window a verdict whose L2 and L3 findings name rank 7
(``analyzer.merge``). Kernel windows carry kernel ids and the job's dictionary
names them, as the processor writes them. Then asks ``jobs``, ``verdict``, ``stragglers``,
``kernels --rank 7`` (every window and ``--last 1``), ``ranks`` and
``iterations``, each with a fresh ``Query`` (a new read-only connection, as
the CLI does), and prints wall and CPU seconds. "Before" is
``analyzer/query.py`` at ``BEFORE`` (read with ``git show``: every question
read the job's records whole) on the same file; both must give the same
answer (JSON, ``query_model.as_json``). Both read a file that has the new
indexes (the writer's schema adds them).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from trainscope.analyzer import query as query_now
from trainscope.analyzer.merge import merge
from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.analyzer.query_model import as_json
from trainscope.analyzer.store import DiagnosisStore
from trainscope.processor.kernel_names import KERNEL_NAMES, kernel_id
from trainscope.processor.store import SqliteStore
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2, telemetry_pb2

#: The last commit before issue #15's store and query changes.
BEFORE = "59f535640ea2e772fe71b0ca0393d23e27221ec1"
ROOT = pathlib.Path(__file__).resolve().parents[2]
SLOW = 7
MS = 1_000_000


def load_before():
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:analyzer/query.py"],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:     # removed once the module is loaded
        path = pathlib.Path(tmp) / "query_before.py"
        path.write_bytes(src)
        spec = importlib.util.spec_from_file_location("query_before", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["query_before"] = mod
        spec.loader.exec_module(mod)
    return mod


def window(i: int) -> records_pb2.Window:
    return records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=i, first_iteration=5 * i,
                              last_iteration=5 * i + 4, start_ns=i * 10_000 * MS, end_ns=(i + 1) * 10_000 * MS)


def build(path: str, ranks: int, windows: int, kernels: int) -> float:
    """Write the store; returns the seconds it took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    records, diagnoses = SqliteStore(path, max_rows=10**9), DiagnosisStore(path)
    res = [Resource(job_id="big", rank=r, world_size=ranks, host=f"node{r // 8}", device=f"cuda:{r % 8}",
                    local_rank=r % 8, coords=coords_for_rank(r, ranks, tp=8)) for r in range(ranks)]
    res_pb = [r.to_pb() for r in res]
    names = [f"void at::native::vectorized_elementwise_kernel<4, op_{k}>" for k in range(kernels)]
    base = np.exp(rng.uniform(np.log(5e3), np.log(5e6), kernels))
    # as the processor writes them: kernel windows carry ids, the job's dictionary names them once
    ids = [kernel_id(n) for n in names]
    records.put(KERNEL_NAMES, records_pb2.KernelNames(job_id="big", scheme=1, names=[
        records_pb2.KernelName(id=i, name=n) for i, n in zip(ids, names)]))
    for w in range(windows):
        win = window(w)
        tpl = records_pb2.KernelWindow(window=win, events=kernels * 100)
        for k in range(kernels):
            tpl.kernels.add(kernel_id=ids[k], stream=7, count=100).clusters.add(
                count=100, p50_ns=base[k], p99_ns=base[k] * 1.5)
        noise = np.exp(rng.normal(0, 0.01, (ranks, kernels)))
        noise[SLOW, 3] *= 1.3
        batch = []
        for r in range(ranks):
            kw = records_pb2.KernelWindow()
            kw.CopyFrom(tpl)
            kw.resource.CopyFrom(res_pb[r])
            tot = (base * 100 * noise[r]).tolist()
            for ks, t in zip(kw.kernels, tot):
                ks.total_ns = t
            d = int(100 * MS * (1.1 if r == SLOW else 1.0))
            marks = [telemetry_pb2.IterationMark(iteration=5 * w + i, start_ns=win.start_ns + i * d,
                                                 end_ns=win.start_ns + (i + 1) * d) for i in range(5)]
            batch += [("kernels", kw),
                      ("iterations", records_pb2.IterationWindow(resource=res_pb[r], window=win, marks=marks,
                                                                 mean_ns=d, p50_ns=d, max_ns=d)),
                      ("phases", records_pb2.PhaseWindow(resource=res_pb[r], window=win, phases=[
                          records_pb2.PhaseStats(phase="forward", count=5, mean_ns=30 * MS, total_ns=150 * MS),
                          records_pb2.PhaseStats(phase="backward", count=5, mean_ns=60 * MS, total_ns=300 * MS)]))]
            if len(batch) >= 3000:
                records.put_many(batch)
                batch = []
        records.put_many(batch)
        fs = [Finding(level="L2", kind="straggler", job_id="big", window=win,
                      scope=Scope(phase="backward", group="dp", group_index=SLOW % 8),
                      suspects=(SuspectRank(SLOW, 5.0, {"ratio": 1.1}, impact_ns=10 * MS),), severity=0.1),
              Finding(level="L3", kind="degraded_kernel", job_id="big", window=win,
                      scope=Scope(kernel=names[3], stream=7, group="dp", group_index=SLOW % 8),
                      suspects=(SuspectRank(SLOW, 9.0, {"ratio": 1.3}, impact_ns=2 * MS),), severity=0.3)]
        v = merge("big", win, fs, {SLOW: res[SLOW]})
        diagnoses.put(list(v.findings), v)
        print(f"  window {w + 1}/{windows} written ({time.perf_counter() - t0:.0f} s)", flush=True)
    records.close()
    diagnoses.close()
    return time.perf_counter() - t0


QUESTIONS = [
    ("jobs", lambda q: q.jobs()),
    ("verdict", lambda q: q.verdict("big")),
    ("stragglers", lambda q: q.stragglers("big")),
    ("kernels --rank 7", lambda q: q.kernels("big", SLOW)),
    ("kernels --rank 7 --last 1", lambda q: q.kernels("big", SLOW, last=1)),
    ("ranks", lambda q: q.ranks("big")),
    ("iterations", lambda q: q.iterations("big")),
]


def ask(mod, path: str, fn):
    cfg = mod.QueryConfig(store_path=path)
    t0, c0 = time.perf_counter(), time.process_time()
    with mod.Query(cfg) as q:
        out = fn(q)
    return out, time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=10_000)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--kernels", type=int, default=100)
    ap.add_argument("--no-before", action="store_true")
    a = ap.parse_args(argv)
    before = None if a.no_before else load_before()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        path = os.path.join(tmp, "store.sqlite")
        print(f"store benchmark: {a.ranks:,} ranks x {a.windows} windows x {a.kernels} kernels; before = "
              f"query.py at {BEFORE[:10]}" + ("" if before else " (not available: after only)"), flush=True)
        took = build(path, a.ranks, a.windows, a.kernels)
        print(f"store written in {took:.0f} s: {os.path.getsize(path) / 2**20:.0f} MiB", flush=True)
        for name, fn in QUESTIONS:
            now, wall, cpu = ask(query_now, path, fn)
            line = f"{name:>26}: after {wall:6.3f} s wall ({cpu:6.3f} s CPU)"
            if name.startswith("kernels"):
                # the peers: the rank's dp group, <= 256 evenly spaced (query.MAX_KERNEL_PEERS), against
                # every rank in the same run (the before code cannot read id-only windows)
                every = query_now.Query._kernel_peers
                query_now.Query._kernel_peers = lambda self, job, rank: None
                try:
                    full, wall_f, cpu_f = ask(query_now, path, fn)
                finally:
                    query_now.Query._kernel_peers = every
                by = {y.kernel: y for y in full.rows}
                err = [abs(x.peer_mean_s / by[x.kernel].peer_mean_s - 1) for x in now.rows
                       if x.kernel in by and x.peer_mean_s and by[x.kernel].peer_mean_s]
                line += (f"; every rank as peers {wall_f:6.3f} s wall ({cpu_f:6.3f} s CPU) -> {wall_f / wall:5.1f}x"
                         f" faster; {now.params['peers']} peers against {full.params['peers']}: peer mean per call"
                         f" within {100 * max(err, default=0):.2f} % on {len(err)} kernels, top kernel "
                         f"{'the same' if now.rows[0].kernel == full.rows[0].kernel else 'DIFFERENT'}")
                print(line, flush=True)
                continue
            if before is not None and not (name.endswith("--last 1")):
                old, wall_b, cpu_b = ask(before, path, fn if "--last" not in name else None)
                same = "same answer" if json.dumps(as_json(now), default=str) == json.dumps(as_json(old), default=str) \
                    else "ANSWERS DIFFER"
                line += f"; before {wall_b:7.3f} s wall ({cpu_b:6.3f} s CPU) -> {wall_b / wall:5.1f}x faster; {same}"
            elif name.endswith("--last 1"):
                line += "; (new option: no before)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
