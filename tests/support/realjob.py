"""Multi-rank replay jobs built from a real kernel stream, with the measured noise and injected faults.

    python -m support.realjob OUT_DIR [--source job16-rank0] [--ranks 16] [--tp 2] [--pp 2] [--steps 30]
                                      [--fault compute:rank=5,factor=1.3,from=20] ...   (run from tests/)

One real rank's trace (``../shared/data/kineto``) becomes ``--ranks`` rank
files plus ``topology.json`` (the replay contract), written fast (columns,
no per-event objects beyond the JSON writer):

1. Steps: each output step is one of the real trace's steps, drawn at random
   per step and shared by every rank (a bootstrap of whole real steps: the
   real per-call durations, spikes included, stay as recorded).
2. Ranks: every rank runs that step's kernels with its own noise drawn from
   ``docs/noise.md``'s model on top of the real durations: a persistent
   per-(rank, kernel) personality (σ ``personality``), and resampled spikes
   (each call, with probability ``spike_prob``, × e^(0.5 + 0.5·N) ≥ 1.2).
   ``noisy`` ranks get a wider symmetric spread per call (σ 0.09): noisier, not slower.
3. Roles: pipeline stages are heterogeneous (stage s scales every compute
   kernel by ``1 + 0.15·s`` and the last stage runs 20 % more), so ranks are
   comparable only within a stage; hosts hold ``ranks_per_host`` consecutive
   ranks (``topology.json``), tensor-parallel groups inside one host.
4. Faults (``Fault``), each from step ``start`` on (``every``: active in
   alternate windows of that many steps):
   - ``compute``: the ranks' compute kernels × factor; with ``waiters`` the
     tensor-parallel partners' collective kernels absorb the delay (a
     collective ends when its last member arrives: the culprit's are the
     shortest, ARGUS §9.5);
   - ``copies``: memcpy/memset × factor (PCIe);
   - ``host``: every rank of one host, compute × factor;
   - ``comm``: the ranks' collective kernels × factor (a slow link);
   - ``dataloader``: the ranks wait ``delay_ms`` more in a ``dataloader``
     phase at the start of each step, before any kernel (a data-loader
     stall). Only jobs with this fault carry the phase: every rank gets it
     (0.3 ms, lognormal σ 0.2) so the ranks can be compared;
   - ``spike``: one kernel occurrence × factor on the ranks, in step ``start``
     only: the step's longest compute-kernel call (after the noise), the
     largest single-call time a spike can add (a transient, not a fault a
     verdict should name).
5. ``truth.json``: the faults, their ranks, hosts and first step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys

import numpy as np

from trainscope.analyzer.topology import RoutingConfig
from trainscope.collector.sources.kineto_writer import write_kineto_trace
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.proto.columnar import KIND_KERNEL
from trainscope.proto.model import coords_for_rank
from trainscope.proto.v1 import telemetry_pb2

SHARED = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
ROUTING = RoutingConfig()
KINDS = ("compute", "copies", "host", "comm", "dataloader", "spike")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str                     # compute | copies | host | comm | dataloader | spike
    ranks: tuple[int, ...] = ()
    host: int | None = None
    factor: float = 1.3
    start: int = 0                # first faulty step (index into the output steps)
    every: int = 0                # intermittent: on for `every` steps, off for `every`
    waiters: bool = False         # compute: TP partners wait for it in their collectives
    delay_ms: float = 0.0         # dataloader: extra wait per step

    def active(self, step: int) -> bool:
        if step < self.start or (self.kind == "spike" and step != self.start):
            return False
        return not self.every or ((step - self.start) // self.every) % 2 == 0


def parse_fault(text: str) -> Fault:
    """``compute:rank=5,factor=1.3,from=20[,every=5][,waiters]`` / ``host:host=1,factor=1.2`` /
    ``dataloader:rank=3,delay_ms=15,from=10`` / ``spike:rank=2,factor=3,from=7``."""
    kind, _, rest = text.partition(":")
    kw: dict = {}
    for part in filter(None, rest.split(",")):
        k, _, v = part.partition("=")
        if k == "rank":
            kw["ranks"] = tuple(int(x) for x in v.split("+"))
        elif k == "host":
            kw["host"] = int(v)
        elif k == "factor":
            kw["factor"] = float(v)
        elif k == "from":
            kw["start"] = int(v)
        elif k == "every":
            kw["every"] = int(v)
        elif k == "waiters":
            kw["waiters"] = True
        elif k == "delay_ms":
            kw["delay_ms"] = float(v)
        else:
            raise ValueError(f"unknown fault field {k!r} in {text!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r} (one of {', '.join(KINDS)})")
    return Fault(kind, **kw)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    ranks: int = 16
    tp: int = 2
    pp: int = 1
    steps: int = 30
    ranks_per_host: int = 8
    seed: int = 0
    personality: float = 0.03
    spike_prob: float = 0.04
    noisy: tuple[int, ...] = ()
    faults: tuple[Fault, ...] = ()
    source: str = "job16-rank0"


def build_job(directory: str | pathlib.Path, spec: JobSpec) -> dict:
    """Write the job (module steps 1-5); returns its truth."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=False)
    base = load_rank_trace(SHARED / f"{spec.source}.json.gz")
    k = base.kernels
    marks = sorted(base.iterations, key=lambda m: m.start_ns)
    names = k.names
    cat = np.array([ROUTING.category(n) for n in names], dtype=np.int64)[k.name_id]
    compute = (cat == 0) & (k.kind == KIND_KERNEL)
    comm = cat == 2
    copies = cat == 1
    # step 1: the real steps, as index ranges into the kernel columns, and the draw shared by all ranks
    order = np.argsort(k.start_ns, kind="stable")
    real = []
    for m in marks:
        sel = order[(k.start_ns[order] >= m.start_ns) & (k.start_ns[order] < m.end_ns)]
        real.append((sel, int(m.start_ns), int(m.end_ns - m.start_ns)))
    rng = np.random.default_rng([spec.seed, 0])
    pick = rng.integers(0, len(real), spec.steps)
    dp = spec.ranks // (spec.tp * spec.pp)
    loader = any(f.kind == "dataloader" for f in spec.faults)
    topo = {"world_size": spec.ranks, "tp": spec.tp, "pp": spec.pp, "ep": 1, "cp": 1,
            "order": "tp-cp-ep-dp-pp", "ranks_per_host": spec.ranks_per_host}
    (out / "topology.json").write_text(json.dumps(topo))
    # the delay each TP group's culprit adds per step (waiters absorb it in their collectives)
    for r in range(spec.ranks):
        c = coords_for_rank(r, spec.ranks, tp=spec.tp, pp=spec.pp)
        rr = np.random.default_rng([spec.seed, 1, r])
        noisy = 3.0 if r in spec.noisy else 1.0
        pers = np.exp(spec.personality * rr.standard_normal(len(names)))
        stage = 1.0 + 0.15 * c.pp
        extra = 1.2 if c.pp == spec.pp - 1 and spec.pp > 1 else 1.0
        starts, durs, nids, streams, kinds, its, phases = [], [], [], [], [], [], []
        t = 10**12
        for s, p in enumerate(pick):
            sel, s0, length = real[p]
            d = k.duration_ns[sel].astype(np.float64) * pers[k.name_id[sel]]
            d = np.where(compute[sel], d * stage * extra, d)
            spike = rr.random(sel.size) < spec.spike_prob
            d = np.where(spike, d * np.maximum(np.exp(0.5 + 0.5 * rr.standard_normal(sel.size)), 1.2), d)
            if noisy > 1:     # noisier, not slower: a wider symmetric spread around the real durations
                d = d * np.exp(0.03 * noisy * rr.standard_normal(sel.size))
            d = _faults(spec, r, c, s, sel, d, compute, comm, copies, k)
            off = k.start_ns[sel].astype(np.int64) - s0
            stretch = max(1.0, float(d.sum() / max(k.duration_ns[sel].sum(), 1)))
            wait = 0
            if loader:   # the step's kernels start after the data loader returns
                wait = int(3e5 * np.exp(0.2 * rr.standard_normal()) + 1e6 * sum(
                    f.delay_ms for f in spec.faults if f.kind == "dataloader" and r in f.ranks and f.active(s)))
                phases.append(telemetry_pb2.PhaseTiming(name="dataloader", start_ns=t, duration_ns=wait,
                                                        iteration=s))
            starts.append(t + wait + (off * stretch).astype(np.int64))
            durs.append(np.maximum(1, d).astype(np.uint64))
            nids.append(k.name_id[sel])
            streams.append(k.stream[sel])
            kinds.append(k.kind[sel])
            step_len = int(length * stretch) + wait
            its.append(telemetry_pb2.IterationMark(iteration=s, start_ns=t, end_ns=t + step_len))
            t += step_len + 1000
        cols = type(k)(names, np.concatenate(starts).astype(np.uint64), np.concatenate(durs),
                       np.concatenate(nids), np.concatenate(streams), np.concatenate(kinds), device=r % 8)
        write_kineto_trace(str(out / f"rank-{r}.json.gz"), rank=r, world_size=spec.ranks, kernels=cols,
                           iterations=its, phases=phases, compresslevel=1)   # a fixture: written once, read once
    truth = {"spec": {**dataclasses.asdict(spec), "faults": [dataclasses.asdict(f) for f in spec.faults]},
             "dp": dp, "faults": []}
    for f in spec.faults:
        ranks = list(f.ranks) if f.host is None else list(range(f.host * spec.ranks_per_host,
                                                                 (f.host + 1) * spec.ranks_per_host))
        truth["faults"].append({"kind": f.kind, "ranks": ranks, "first_step": f.start,
                                "hosts": sorted({f"host{x // spec.ranks_per_host}" for x in ranks}),
                                **({"phase": "dataloader"} if f.kind == "dataloader" else {})})
    (out / "truth.json").write_text(json.dumps(truth, indent=1))
    return truth


def _faults(spec: JobSpec, r, c, step, sel, d, compute, comm, copies, k) -> np.ndarray:
    for f in spec.faults:
        if not f.active(step):
            continue
        on = r in f.ranks or (f.host is not None and r // spec.ranks_per_host == f.host)
        if f.kind in ("compute", "host") and on:
            d = np.where(compute[sel], d * f.factor, d)
        elif f.kind == "copies" and on:
            d = np.where(copies[sel], d * f.factor, d)
        elif f.kind == "comm" and on:
            d = np.where(comm[sel], d * f.factor, d)
        elif f.kind == "spike" and on and compute[sel].any():
            i = int(np.argmax(np.where(compute[sel], d, -1.0)))   # the step's longest compute call
            d = d.copy()
            d[i] *= f.factor
        elif f.kind == "compute" and f.waiters and any(_tp_partner(x, r, spec) for x in f.ranks):
            # a TP partner waits for the culprit in every collective: the culprit's extra compute time
            # of the step is spread over the partner's collective calls
            extra = (f.factor - 1) * float(k.duration_ns[sel][compute[sel]].sum())
            n = int(comm[sel].sum())
            if n:
                d = np.where(comm[sel], d + extra / n, d)
    return d


def _tp_partner(a: int, b: int, spec: JobSpec) -> bool:
    return a != b and a // spec.tp == b // spec.tp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--source", default="job16-rank0")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", action="append", default=[])
    a = ap.parse_args(argv)
    try:
        spec = JobSpec(ranks=a.ranks, tp=a.tp, pp=a.pp, steps=a.steps, seed=a.seed, source=a.source,
                       faults=tuple(parse_fault(f) for f in a.fault))
        truth = build_job(a.out, spec)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"realjob: {e}", file=sys.stderr)
        return 2
    print(json.dumps(truth["faults"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
