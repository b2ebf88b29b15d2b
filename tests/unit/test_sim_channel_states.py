"""Channel states end to end without processes: the simulator's in-flight records and channel states
(collector/sim/collective_records.py step 7) through the processor's validation and windows into the
analyzer's hang steps (5, 5b, 5c). A failed NIC is named by its rank and the stuck seq; a plain hang
still names the rank that never entered; a healthy job's collectives caught mid-flight name nobody."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from trainscope.analyzer import channel_states as cs
from trainscope.analyzer.collectives import CollectiveState, CollectivesConfig
from trainscope.analyzer.model import CULPRIT, LINK
from trainscope.collector.sim import SimConfig, parse_fault
from trainscope.collector.sim.channel_states import CHANNELS, states_at
from trainscope.collector.sim.simulate import Simulation
from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows, validate
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2
from trainscope.proto.v1.telemetry_pb2 import CollectiveBatch

RANKS = 32


def _run(fault: str | None, iterations: int = 10, seed: int = 3):
    """The job through the processor (a window per chunk, as the embedded simulator's barrier closes
    them) into one CollectiveState; the in-flight records per rank; the processor's metrics."""
    cfg = SimConfig(ranks=RANKS, tp=2, pp=2, iterations=iterations, seed=seed, stack_every=0,
                    faults=(parse_fault(fault),) if fault else ())
    sim = Simulation(cfg)
    m, out = SelfMetrics(), []
    cw = CollectiveWindows(CollectiveWindowConfig(), out.append, m)
    flying: dict[int, list] = collections.defaultdict(list)
    for ch in sim.chunks():
        if ch.collectives is None:
            continue
        for r in range(RANKS):
            data = ch.collectives.payload(r)
            if data is None:
                continue
            b = CollectiveBatch.FromString(data)
            flying[r] += [(b.groups[x.group].id, x.seq) for x in b.records if not x.end_ns]
            payload, _, _ = validate(b, RANKS, 2**62, m)
            cw.add(Resource(job_id="j", rank=r, world_size=RANKS), payload)
        cw.flush()
    st = CollectiveState(CollectivesConfig(hang_settle_s=0.0))   # settling: two calls, no wall-clock wait
    for o in out:
        st.absorb(o.collectives.resource.rank, o.collectives)
    st.late_starts("j", records_pb2.Window(index=0))
    return sim, st, flying, m


@pytest.fixture(scope="module")
def nic_fail():
    return _run("nic_fail:rank=5,onset=5it")


def test_a_failed_nic_is_named_with_the_seq_every_member_is_stuck_in(nic_fail):
    sim, st, flying, m = nic_fail
    assert sim.hung and m.get("records_rejected", reason="channel_state") == 0
    on_nic = set(np.flatnonzero(sim.topo.nic == sim.topo.nic[5]).tolist())     # rank 5 and its NIC's other GPU
    (f,) = st.hangs("j", records_pb2.Window(index=1))
    (s,) = f.suspects
    assert f.kind == "stall" and s.rank in on_nic and s.role == LINK
    assert f.evidence["link"] == f"NIC of rank {s.rank}" and f.evidence["absent_ranks"] == []
    gid, seq = f.evidence["group"], f.evidence["seq"]
    assert (gid, seq) in flying[s.rank] and gid.startswith("dp:")
    members = st.groups[gid].members
    assert sorted(f.evidence["waiting_ranks"]) == sorted(x for x in members if x != s.rank)
    assert all((gid, seq) in flying[x] for x in members)        # every member entered and stays in flight
    assert s.evidence["state"] == "not delivered" and s.evidence["stuck_s"] > 30
    assert f"NIC of rank {s.rank}" in s.evidence["function"] and len(s.evidence["function"]) <= 48
    assert st.hangs("j", records_pb2.Window(index=2)) == []     # once; the collectives it held up are not named


def test_a_plain_hang_still_names_the_rank_that_never_entered():
    sim, st, flying, m = _run("hang:rank=13,onset=5it")
    assert sim.hung and not flying[13] and flying[12]          # its TP partner waits in their all-reduce
    assert st.hangs("j", records_pb2.Window(index=1)) == []     # with states: named once nothing changed
    found = st.hangs("j", records_pb2.Window(index=1))
    assert [(f.kind, f.suspects[0].rank, f.suspects[0].role) for f in found] == [("stall", 13, CULPRIT)]
    (f,) = found
    assert 13 in f.evidence["absent_ranks"] and f.evidence["waiting_ranks"]
    assert "not transmitted" in f.evidence.get("channel_states", "")      # its upstream: receiver not ready


def test_a_healthy_job_sends_no_states_and_names_nobody():
    sim, st, flying, m = _run(None)
    assert not sim.hung and not any(flying.values()) and m.get("channel_states", fate="kept") == 0
    assert st.hangs("j", records_pb2.Window(index=1)) == []


def test_healthy_collectives_caught_mid_flight_name_nobody():
    """Snapshots of a healthy job's collectives in flight at 100 ms ticks (``states_at`` with their end):
    counters move, Table 4 shows network states at those instants, yet no flow is stuck."""
    cfg = SimConfig(ranks=RANKS, tp=2, pp=2, iterations=3, seed=5, stack_every=0, clock_offset_s=0.0,
                    clock_drift_ppm=0.0)
    sim = Simulation(cfg)
    chunk = next(c for c in sim.chunks() if c.collectives is not None)
    c = chunk.collectives
    p = c.plan
    start = np.where(c.valid, c.enqueue, np.nan).astype(float)
    end = np.where(c.valid, c.end, np.nan).astype(float)
    dead = np.full(RANKS, np.inf)
    lo, hi = np.nanmin(start), np.nanmax(end)
    snapshots = seen = 0
    states = collections.Counter()
    for t in np.arange(lo, hi, 100_000_000.0)[::3]:
        with np.errstate(invalid="ignore"):
            flying = (start <= t) & (end > t)
        if not flying.any():
            continue
        snap = states_at(p, c.iterations, start, flying, np.full(start.shape, t), dead, end)
        by = collections.defaultdict(list)
        Kc = len(p.slots)
        for i in range(len(snap.rank)):
            r, k = int(snap.rank[i]), int(snap.v[i]) % Kc
            key = (p.groups[r][p.group_of[r, k]].id, int(snap.v[i]))
            for ch in range(CHANNELS):
                by[key].append((r, ch, int(snap.at[i]), int(snap.total[i]), int(snap.ready[i]),
                                int(snap.transmitted[i]), int(snap.done[i]), int(snap.stuck[i]), int(snap.peer[i])))
        for (gid, _), rows in by.items():
            if len({x[0] for x in rows}) < len(sim.topo.group_members(gid.split(":")[0], int(gid.split(":")[1]))):
                continue      # a member not there yet: step 5's case, not 5b's
            s = cs.Snapshot.of(rows)
            states.update(s.state.tolist())
            seen += len(rows)
            snapshots += 1
            assert cs.localise(s) is None
    assert snapshots >= 20 and seen >= 200
    assert states[cs.NOT_TRANSMITTED] + states[cs.NOT_DELIVERED] > 0     # network states, moving


def test_nic_fail_parses_and_resolves_to_the_nic_of_the_rank():
    from trainscope.collector.sim.faults import resolve_ranks

    f = parse_fault("nic_fail:rank=5,onset=30s")
    assert f.type == "nic_fail" and f.onset.value == 30.0 and f.params["timeout"] == 60.0
    sim = Simulation(SimConfig(ranks=RANKS, tp=2, pp=2, iterations=1, faults=(f,)))
    got = resolve_ranks(f, sim.topo, "f").tolist()
    assert 5 in got and got == np.flatnonzero(sim.topo.nic == sim.topo.nic[5]).tolist()
