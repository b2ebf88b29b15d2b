"""Collective records: volume per rank and the analyzer's cost for a large group (prints figures).

    python tests/benchmarks/bench_collectives.py [--ranks 1024] [--per-s 10] [--seconds 60]

1. Volume: one rank issuing ``--per-s`` collectives a second for a minute, as
   the collector ships them (``CollectiveBatch`` every second, serialised) and
   as the processor publishes them (``CollectiveWindow`` every 2 s, raw records
   plus summaries): bytes per rank per minute, and the same with a hang (every
   collective in flight, re-reported as a state record each second).
2. Analyzer: ``--ranks`` members of one group, ``--per-s x --seconds``
   collectives, one straggler late to every one from the middle on: time to
   absorb the records and judge late starts, and the hang check, against the
   baseline of only parsing the same records from bytes (``FromString``), in
   the same run. The straggler must be found (a figure, not a timing assertion).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from trainscope.analyzer.collectives import CollectiveState, CollectivesConfig
from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows, validate
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

MS = 1_000_000
T0 = 1_700_000_000 * 10**9


def batch(rank: int, seqs: range, period_ns: int, ranks: int, *, late_rank: int = -1, late_from: int = 0,
          late_ns: int = 0, inflight: bool = False) -> telemetry_pb2.CollectiveBatch:
    """One rank's records: everyone enters within 0.5 ms, except ``late_rank`` from ``late_from`` on;
    the collective ends 1 ms after the last member entered, on every member."""
    rng = np.random.default_rng(rank)
    b = telemetry_pb2.CollectiveBatch(groups=[telemetry_pb2.CollectiveGroup(id="0", members=range(ranks))])
    for s in seqs:
        t = T0 + s * period_ns
        delay = late_ns if s >= late_from and late_rank >= 0 else 0
        enq = t + int(rng.uniform(0, 0.5) * MS) + (delay if rank == late_rank else 0)
        end = 0 if inflight else t + delay + int(1.5 * MS)
        b.records.add(group=0, seq=s, op="allreduce", bytes=1 << 25, dtype="bfloat16", enqueue_ns=enq,
                      start_ns=enq, end_ns=end, iteration=s // 4)
    b.now_ns = T0 + seqs.stop * period_ns
    return b


def volume(per_s: int, seconds: int) -> None:
    period = int(1e9 / per_s)
    for label, inflight in (("normal", False), ("hang (all in flight)", True)):
        wire = 0
        out = []
        m = SelfMetrics()
        cw = CollectiveWindows(CollectiveWindowConfig(), out.append, m)
        for sec in range(seconds):
            if inflight:   # a hang: the same stuck collective re-reported every second
                b = batch(0, range(1, 2), period, 8, inflight=True)
            else:
                b = batch(0, range(sec * per_s + 1, (sec + 1) * per_s + 1), period, 8)
            wire += len(b.SerializeToString())
            payload, _, _ = validate(b, 8, 2**62, m)
            cw.add(Resource(job_id="j", rank=0, world_size=8), payload)
            if sec % 2 == 1:
                cw.flush()
        cw.flush()
        published = sum(len(o.collectives.SerializeToString()) for o in out)
        print(f"volume, {label}: {per_s} collectives/s -> collector {wire * 60 / seconds / 1024:.1f} KiB "
              f"per rank per minute, processor {published * 60 / seconds / 1024:.1f} KiB per rank per minute "
              f"({len(out)} windows)")


def analyzer(ranks: int, per_s: int, seconds: int) -> None:
    n = per_s * seconds
    period = int(1e9 / per_s)
    culprit = ranks // 3
    windows = []
    for r in range(ranks):
        b = batch(r, range(1, n + 1), period, ranks, late_rank=culprit, late_from=n // 2, late_ns=30 * MS)
        w = records_pb2.CollectiveWindow(resource=Resource(job_id="j", rank=r, world_size=ranks).to_pb(),
                                         window=records_pb2.Window(index=0), groups=b.groups, records=b.records,
                                         now_ns=b.now_ns)
        windows.append(w.SerializeToString())
    nrec = ranks * n
    t0 = time.perf_counter()
    parsed = [records_pb2.CollectiveWindow.FromString(x) for x in windows]
    t_parse = time.perf_counter() - t0
    st = CollectiveState(CollectivesConfig(max_seqs_per_group=n + 1))
    t0 = time.perf_counter()
    for r, w in enumerate(parsed):
        st.absorb(r, w)
    t_absorb = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = st.late_starts("j", records_pb2.Window(index=0))
    t_judge = time.perf_counter() - t0
    t0 = time.perf_counter()
    st.hangs("j", records_pb2.Window(index=0))
    t_hang = time.perf_counter() - t0
    named = [s.rank for f in found if f.kind == "late_start" for s in f.suspects]
    print(f"analyzer, {ranks}-rank group, {n} collectives ({nrec:,} records): parse {t_parse:.2f} s (baseline), "
          f"absorb {t_absorb:.2f} s ({t_absorb / t_parse:.1f}x parse), late-start RCA {t_judge:.2f} s "
          f"({t_judge / t_parse:.1f}x parse, {t_judge / n * 1e3:.2f} ms per collective), hang check "
          f"{t_hang * 1e3:.1f} ms; named {named} (culprit {culprit})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--per-s", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=60)
    a = ap.parse_args()
    volume(a.per_s, a.seconds)
    analyzer(a.ranks, a.per_s, min(a.seconds, 10))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
