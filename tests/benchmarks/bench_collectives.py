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
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

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


def step_volume(ranks: int, seconds: float) -> None:
    from step_records import joined

    from trainscope.collector.sim import SimConfig
    from trainscope.collector.sim.simulate import Simulation

    out = {}
    for steps in (False, True):
        sim = Simulation(SimConfig(ranks=ranks, tp=2, pp=2, duration_s=seconds, seed=1, collective_steps=steps))
        t0 = time.perf_counter()
        colls, wire = joined(sim)
        out[steps] = (wire, len(colls), time.perf_counter() - t0)
    per = {k: v[0] * 60 / seconds / ranks / 1024 for k, v in out.items()}
    print(f"step records, {ranks}-rank job (tp=2 pp=2), {seconds:g} simulated s, {out[True][1]:,} collectives: "
          f"collector {per[False]:.1f} KiB per rank per minute without steps (baseline), {per[True]:.1f} KiB "
          f"with ({per[True] / per[False]:.1f}x); simulation + encoding {out[False][2]:.1f} s -> {out[True][2]:.1f} s")


def step_rca(ranks: int, collectives: int, per_s: int = 10) -> None:
    from trainscope.analyzer.provenance import rate
    from trainscope.analyzer.waiting_graph import step_blocks
    from trainscope.collector.sim.collective_records import decompose, time_steps

    rng = np.random.default_rng(7)
    culprit = ranks // 3
    sp = decompose("allreduce", ranks, 1 << 26)
    mult = rng.lognormal(0, 0.02, (collectives, ranks))
    mult[:, culprit] *= 3.0
    arrive = rng.uniform(0, 2e6, (collectives, ranks))
    st, en = time_steps(sp, np.repeat(arrive.max(axis=1, keepdims=True), ranks, 1), mult,
                        np.full(collectives, 1.0), rng.lognormal(0, 0.05, (collectives,) + sp.dst.shape))
    st, en = st - arrive[:, None, :, None], en - arrive[:, None, :, None]
    t0 = time.perf_counter()
    wires = []
    for r in range(ranks):
        b = telemetry_pb2.CollectiveBatch(groups=[telemetry_pb2.CollectiveGroup(id="dp:0", members=range(ranks))])
        for c in range(collectives):
            b.records.add(group=0, seq=c + 1, op="allreduce", bytes=1 << 26, dtype="bf16", enqueue_ns=T0,
                          start_ns=T0, end_ns=T0 + int(np.nanmax(en[c, :, r])), iteration=c, algo="ring",
                          step_index=range(sp.steps), step_dst=[(r + 1) % ranks] * sp.steps,
                          step_bytes=sp.nbytes[:, r, 0].tolist(), step_start_ns=np.rint(st[c, :, r, 0]).astype(
                              np.int64).tolist(), step_end_ns=np.rint(en[c, :, r, 0]).astype(np.int64).tolist())
        wires.append(b.SerializeToString())
    t_build = time.perf_counter() - t0
    size = sum(map(len, wires))
    t0 = time.perf_counter()
    parsed = [telemetry_pb2.CollectiveBatch.FromString(w) for w in wires]
    t_parse = time.perf_counter() - t0
    recs: dict = collections.defaultdict(dict)
    t0 = time.perf_counter()
    for r, b in enumerate(parsed):
        for x in b.records:
            recs[x.seq][r] = x
    blocks = step_blocks([("dp:0", tuple(range(ranks)), s, rr) for s, rr in recs.items()],
                         {r: f"host{r // 8}" for r in range(ranks)})
    t_stack = time.perf_counter() - t0
    t0 = time.perf_counter()
    named = rate(blocks, iterations=collectives)
    t_rate = time.perf_counter() - t0
    print(f"step RCA, {ranks}-rank group, {collectives} ring all-reduces x {sp.steps} steps "
          f"({ranks * collectives:,} records, {size / ranks / collectives / 1024:.1f} KiB per record; built in "
          f"{t_build:.1f} s): parse {t_parse:.2f} s (baseline), stack {t_stack:.2f} s ({t_stack / t_parse:.1f}x parse), "
          f"rate {t_rate:.2f} s ({t_rate / t_parse:.1f}x parse, {t_rate / collectives * 1e3:.0f} ms per collective); "
          f"named {[o.name for o in named]} (culprit {culprit}), impact "
          f"{[round(o.impact_s * 1e3, 2) for o in named]} ms per iteration")
    print(f"  at {per_s} such collectives/s a rank would send {size / ranks / collectives * per_s * 60 / 2**20:.1f} MiB "
          f"per minute of step records (one record: {size / ranks / collectives / sp.steps:.1f} bytes per step)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--per-s", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--step-ranks", type=int, default=64)
    ap.add_argument("--step-seconds", type=float, default=60.0)
    ap.add_argument("--rca-ranks", type=int, default=1024)
    ap.add_argument("--rca-collectives", type=int, default=5)
    ap.add_argument("--only-steps", action="store_true", help="only parts 3-4 (step records)")
    a = ap.parse_args()
    if not a.only_steps:
        volume(a.per_s, a.seconds)
        analyzer(a.ranks, a.per_s, min(a.seconds, 10))
    step_volume(a.step_ranks, a.step_seconds)
    step_rca(a.rca_ranks, a.rca_collectives, a.per_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
