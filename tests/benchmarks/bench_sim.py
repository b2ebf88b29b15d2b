"""Simulator throughput: events generated per second, and a whole run through a real processor.

    python tests/benchmarks/bench_sim.py                       # 1,024 ranks x 100 iterations, TP8 PP4 EP8
    python tests/benchmarks/bench_sim.py --ranks 256 --iterations 20 --layers 8

Measured in one run, on the same job (one fault injected, as a demo would):
  1. generate:  simulate every iteration (numpy engine) and encode every payload the
                exporter would send (KernelBatch columns, phases, marks, stacks,
                collective records: their share printed on its own),
                without sending: the simulator's own rate on one core;
  2. pipeline:  the same run through the real exporters and gRPC to a real processor
                in its own process (unix socket, iteration windows of 10), from the first
                iteration to the processor having drained every window; every kernel event
                is counted back out of the records it published. ``--store`` repeats it
                with the processor's SQLite store on (as ``trainscope processor`` runs);
  3. embedded:  optional (``--embedded``): the default ``trainscope sim`` destination, an
                in-process processor sharing the interpreter (and the GIL) with the simulator.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from trainscope.collector.sim import SimConfig, parse_fault, run_sim
from trainscope.deploy.embedded import run_sim_embedded
from trainscope.collector.sim.emit import MemorySink
from trainscope.collector.sim.simulate import Simulation
from trainscope.proto.v1.telemetry_pb2 import IterationBatch, PhaseBatch


class EncodeOnly(MemorySink):
    """Builds and serialises every payload like ExporterSink would, keeps nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.collective_s = 0.0   # of which building and serialising the collective records

    def write(self, chunk) -> None:
        for r in range(chunk.topo.world):
            self.bytes += len(chunk.kernels(r).to_pb().SerializeToString())
            self.bytes += len(PhaseBatch(phases=chunk.phase_timings(r)).SerializeToString())
            self.bytes += len(IterationBatch(marks=chunk.marks(r)).SerializeToString())
            snap = chunk.stack(r)
            if snap is not None:
                self.bytes += len(snap.SerializeToString())
        t0 = time.perf_counter()
        for r in range(chunk.topo.world):
            coll = chunk.collective_batch(r)
            if coll is not None:
                self.bytes += len(coll.SerializeToString())
        self.collective_s += time.perf_counter() - t0


def config(args, **kw) -> SimConfig:
    return SimConfig(ranks=args.ranks, tp=args.tp, pp=args.pp, ep=args.ep, layers=args.layers,
                     micro_batches=args.micro_batches, iterations=args.iterations, job_id="bench-sim",
                     faults=(parse_fault(f"gpu_throttle:rank={min(137, args.ranks - 1)},onset=60s,factor=1.4"),),
                     **kw)


def generate(args) -> tuple[int, int, float, float]:
    t0 = time.perf_counter()
    sim = Simulation(config(args))
    sink = EncodeOnly()
    events = kernels = 0
    t_engine = 0.0
    it = sim.chunks()
    while True:
        t1 = time.perf_counter()
        try:
            chunk = next(it)
        except StopIteration:
            break
        t_engine += time.perf_counter() - t1
        sink.write(chunk)
        kernels += chunk.kernel_events
        events += chunk.kernel_events + chunk.phase_events + chunk.mark_events
    print(f"   collective records: {sink.collective_s:.2f} s of the run", flush=True)
    return events, kernels, time.perf_counter() - t0, t_engine


PROCESSOR = r"""
import json, signal, sys, threading
from trainscope.proto.contracts import topic_for
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.windows import WindowConfig
from trainscope.proto.v1 import records_pb2
listen, store = sys.argv[1], sys.argv[2] or None
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
proc = Processor(ProcessorConfig(listen=listen, store_path=store, window=WindowConfig(
    mode="iterations", iterations=10, idle_close_s=3600))).start()
print("listening", flush=True)
stop.wait()
drained = proc.drain(900.0)
n, off = 0, 0
while True:
    recs = proc.bus.poll(topic_for("kernels"), off)
    if not recs:
        break
    n += sum(records_pb2.KernelWindow.FromString(r.value).events for r in recs)
    off = recs[-1].offset + 1
proc.stop()
print(json.dumps({"drained": drained, "kernel_events": n}), flush=True)
"""


def through_processor(args, home: str, *, store: bool) -> dict:
    """Step 2: a processor in its own process (its own core and interpreter)."""
    import json

    sock = os.path.join(tempfile.mkdtemp(prefix="ts-bench-"), "processor.sock")
    store_path = os.path.join(home, "store.sqlite") if store else ""
    proc = subprocess.Popen([sys.executable, "-c", PROCESSOR, f"unix://{sock}", store_path],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening" not in line:
        proc.kill()
        raise SystemExit(f"processor did not start: {line!r}")
    t0 = time.perf_counter()
    res = run_sim(config(args, home=home), f"unix://{sock}")
    t_sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)  # drain: close every window, publish, then report
    out = json.loads(proc.stdout.readline())
    t_done = time.perf_counter()
    proc.wait(timeout=60)
    return dict(res=res, wall=t_done - t0, send=t_sent - t0, drain=t_done - t_sent,
                stored=out["kernel_events"], drained=out["drained"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--embedded", action="store_true", help="also run with the in-process processor")
    ap.add_argument("--skip-processor", action="store_true", help="only measure generation")
    ap.add_argument("--store", action="store_true", help="also run with the processor's SQLite store on")
    args = ap.parse_args(argv)

    cfg = config(args)
    kpi = Simulation(cfg).tmpl.kernels_per_iteration()
    print(f"job: {args.ranks} ranks (TP{args.tp} PP{args.pp} EP{args.ep} DP{cfg.topology().dp}), "
          f"{args.iterations} iterations, {min(kpi)}-{max(kpi)} kernels per rank per iteration, "
          f"{cfg.topology().hosts} hosts", flush=True)

    events, kernels, wall, t_engine = generate(args)
    print(f"1. generate (simulate + encode, no sending): {events:,} events ({kernels:,} kernel events) "
          f"in {wall:.2f} s = {events / wall:,.0f} events/s; engine alone {t_engine:.2f} s "
          f"= {events / t_engine:,.0f} events/s", flush=True)
    if args.skip_processor:
        return 0

    for store in (False, True) if args.store else (False,):
        with tempfile.TemporaryDirectory(prefix="bench-sim-") as home:
            r = through_processor(args, home, store=store)
        res = r["res"]
        ok = "all" if r["stored"] == res.kernel_events else f"ONLY {r['stored']:,} of"
        print(f"2{'b' if store else 'a'}. pipeline (exporters -> gRPC -> processor process"
              f"{' + SQLite store' if store else ''}): {res.events:,} events in {r['wall']:.2f} s "
              f"= {res.events / r['wall']:,.0f} events/s (sending {r['send']:.2f} s, final drain "
              f"{r['drain']:.2f} s); {ok} {res.kernel_events:,} kernel events summarised; exporter drops "
              f"{res.dropped}; {res.sim_seconds:.0f} simulated s, {res.sim_seconds / r['wall']:.0f}x real time",
              flush=True)
    if args.embedded:
        with tempfile.TemporaryDirectory(prefix="bench-sim-") as home:
            res = run_sim_embedded(config(args, home=home))
        print(f"3. embedded (in-process processor, shared interpreter): {res.events:,} events in "
              f"{res.wall_s:.2f} s = {res.events_per_s:,.0f} events/s; drops {res.dropped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
