"""Simulated jobs whose collective records carry step records (collector/sim/collective_records.py
steps 5-6), for tests and benchmarks: the simulator's own switch for them is not wired to its
config yet, so this replaces the job's plan in ``emit``'s per-job plan cache."""
from __future__ import annotations

import collections

from trainscope.collector.sim import emit
from trainscope.collector.sim.collective_records import CollectivePlan
from trainscope.collector.sim.simulate import Simulation


def use_step_records(sim: Simulation, algos: dict[str, str] | None = None) -> CollectivePlan:
    """From now on the chunks of ``sim`` carry step records (fields 14-19)."""
    topo, tmpl = sim.topo, sim.tmpl
    plan = CollectivePlan.build(topo, tmpl, steps=True, algos=algos)
    emit._PLANS[:] = [(topo, tmpl, plan)] + [x for x in emit._PLANS if not (x[0] is topo and x[1] is tmpl)][:3]
    return plan


def joined(sim: Simulation):
    """Run ``sim``; its collectives joined by (group, seq) as (group id, members, seq, {rank: record}),
    and every rank's ``CollectiveBatch`` payload size in bytes, summed."""
    recs: dict = collections.defaultdict(dict)
    members = {}
    wire = 0
    for ch in sim.chunks():
        for r in range(sim.topo.world):
            data = ch.collectives.payload(r) if ch.collectives is not None else None
            if data is None:
                continue
            wire += len(data)
            b = ch.collectives.batch(r)
            for x in b.records:
                g = b.groups[x.group]
                recs[(g.id, x.seq)][r] = x
                members[(g.id, x.seq)] = tuple(g.members)
    return [(gid, members[(gid, seq)], seq, rr) for (gid, seq), rr in recs.items()], wire
