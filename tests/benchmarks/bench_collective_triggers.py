"""Mycroft triggers in the processor (processor/collectives.py steps 4-6): cost and published volume.

    python tests/benchmarks/bench_collective_triggers.py [--ranks 64] [--per-s 20] [--seconds 120]

A healthy job of ``--ranks`` members in one group, each rank completing ``--per-s`` collectives a second
(1 MiB, noisy steps), shipped every second, through ``validate`` + ``CollectiveWindows.add``/``tick`` on a fake
processor clock; then the same job with one rank hanging at the middle. Printed, measured in the same run:

* processing time per record with the triggers (baseline: the same windows with the triggers switched off);
* bytes the processor publishes per rank and minute, ``raw_records="always"`` against ``"triggered"``;
* for the hang: how many processor seconds after it the trigger fired, and the bytes published then.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows, TriggerConfig, validate
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

MS = 1_000_000
S = 10**9
T0 = 1_700_000_000 * S


def batches(ranks: int, per_s: int, seconds: int, hang_at: int | None, seed: int = 0):
    """Per second: each rank's CollectiveBatch (pre-serialised-size-free protobufs)."""
    rng = np.random.default_rng(seed)
    seq, t = 0, T0
    out = []
    period = S / per_s
    hang_seq = None
    for sec in range(seconds):
        recs = {r: [] for r in range(ranks)}
        if hang_at is not None and sec >= hang_at:
            if hang_seq is None:
                hang_seq, hang_t = seq + 1, t
            for r in range(1, ranks):   # rank 0 never enters; the others report it in flight
                recs[r].append(telemetry_pb2.CollectiveRecord(group=0, seq=hang_seq, op="allreduce", bytes=1 << 20,
                                                              dtype="float32", enqueue_ns=hang_t,
                                                              start_ns=hang_t, end_ns=0))
            t = T0 + (sec + 1) * S
        else:
            while t < T0 + (sec + 1) * S:
                seq += 1
                enter = t + int(period * rng.lognormal(0, 0.3))
                end = enter + 2 * MS
                for r in range(ranks):
                    e = enter - int(rng.uniform(0, 1) * MS)
                    recs[r].append(telemetry_pb2.CollectiveRecord(group=0, seq=seq, op="allreduce", bytes=1 << 20,
                                                                  dtype="float32", enqueue_ns=e, start_ns=e,
                                                                  end_ns=end))
                t = end
        out.append({r: telemetry_pb2.CollectiveBatch(
            groups=[telemetry_pb2.CollectiveGroup(id="0", members=range(ranks))], records=recs[r], now_ns=t)
            for r in range(ranks) if recs[r]})
    return out


def run(seconds_of, ranks: int, mode: str, triggers: bool):
    clock = [0.0]
    out: list = []
    m = SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(trigger=TriggerConfig(raw_records=mode, hang_s=10.0)),
                           out.append, m, clock=lambda: clock[0])
    if not triggers:
        cw.triggers.sampled = lambda *a: False
        cw.triggers.evaluate = lambda *a: []
    payloads = [[(r, validate(b, ranks, 2**63, m)[0]) for r, b in sec.items()] for sec in seconds_of]
    n = sum(len(p[1]) for sec in payloads for _, p in sec)
    fired_at = None
    t0 = time.process_time()
    for sec in payloads:
        for r, p in sec:
            cw.add(Resource(job_id="j", rank=r, world_size=ranks), p)
        clock[0] += 1.0
        cw.tick()
        if fired_at is None and cw.triggers.recent:
            fired_at = clock[0]
    cw.flush()
    cpu = time.process_time() - t0
    published = sum(len(o.collectives.SerializeToString()) for o in out)
    run.kinds = [(t.kind, round((t.at_ns - T0) / S, 1)) for t in cw.triggers.recent]
    return cpu, n, published, fired_at, m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--per-s", type=int, default=20)
    ap.add_argument("--seconds", type=int, default=120)
    a = ap.parse_args()
    print(f"generating {a.ranks} ranks x {a.per_s} collectives/s x {a.seconds} s ...", flush=True)
    healthy = batches(a.ranks, a.per_s, a.seconds, None)
    hung = batches(a.ranks, a.per_s, a.seconds, a.seconds // 2)
    per_min = 60 / a.seconds / a.ranks / 1024
    base, n, pub_always, _, _ = run(healthy, a.ranks, "always", triggers=False)
    cpu_a, _, pub_a, fired_a, _ = run(healthy, a.ranks, "always", triggers=True)
    cpu_t, _, pub_t, fired_t, m_t = run(healthy, a.ranks, "triggered", triggers=True)
    print(f"healthy: {n:,} records; processing {base / n * 1e6:.2f} us/record without triggers (baseline), "
          f"{cpu_a / n * 1e6:.2f} us/record with ({cpu_a / base:.2f}x), triggered mode {cpu_t / n * 1e6:.2f} us/record "
          f"({cpu_t / base:.2f}x); triggers fired: {len([x for x in (fired_a, fired_t) if x])} (expected 0)")
    print(f"published: always {pub_a * per_min:.1f} KiB per rank per minute, triggered {pub_t * per_min:.1f} KiB "
          f"({pub_t / pub_a:.3f}x; summaries only), raw records summarised "
          f"{m_t.get('collective_raw_records', fate='summarised'):,.0f}")
    cpu_h, nh, pub_h, fired_h, m_h = run(hung, a.ranks, "triggered", triggers=True)
    hang_s = a.seconds // 2
    print(f"hang of rank 0 at {hang_s} s: first trigger at processor second "
          f"{fired_h:.0f} ({fired_h - hang_s:.0f} s after), pulled {m_h.get('collective_raw_records', fate='pulled'):,.0f} "
          f"records, kept {m_h.get('collective_raw_records', fate='kept'):,.0f} after; published "
          f"{pub_h * per_min:.1f} KiB per rank per minute (healthy triggered {pub_t * per_min:.1f}); "
          f"triggers (kind, ranks' clock s): {run.kinds}")


if __name__ == "__main__":
    main()
