"""Collectives of a simulated job joined across ranks, for tests and benchmarks. Step records
(collector/sim/collective_records.py steps 5-6) come with ``SimConfig(collective_steps=True)``
(``trainscope sim --collective-steps``)."""
from __future__ import annotations

import collections

from trainscope.collector.sim.simulate import Simulation


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
