"""The collectives level on step records (analyzer/collectives.py steps 6-7): the simulator's
records with steps (``SimConfig(collective_steps=True)``) absorbed by ``CollectiveState`` as the
analyzer does, judged per window; the provenance rating names the degraded NIC's ranks, the
healthy job names nobody, the step columns are released once judged and bounded, and records
without steps still go through the ring-summary waiting graph."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.attribution import evidence_of
from trainscope.analyzer.collectives import CollectivesConfig, CollectiveState, StepColumns
from trainscope.analyzer.model import LINK
from trainscope.collector.sim import SimConfig, parse_fault
from trainscope.collector.sim.simulate import Simulation
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import common_pb2, records_pb2, telemetry_pb2

PROVENANCE = "Vedrfolnir §III-D contributor rating (eqs. 1-3)"


def _windows(fault: str | None, steps: bool = True, ranks: int = 32, iterations: int = 20, seed: int = 3):
    """Each chunk of the simulated job as the processor's CollectiveWindow per rank."""
    cfg = SimConfig(ranks=ranks, tp=2, pp=2, iterations=iterations, seed=seed, collective_steps=steps,
                    stack_every=0, faults=(parse_fault(fault),) if fault else ())
    sim = Simulation(cfg)
    out = []
    for ch in sim.chunks():
        if ch.collectives is None:
            continue
        for r in range(ranks):
            b = ch.collectives.batch(r)
            if b is None:
                continue
            res = common_pb2.Resource(rank=r, host=sim.topo.host_name(int(sim.topo.host[r])),
                                      coords=common_pb2.ParallelCoords(
                                          pp=int(sim.topo.coords["pp"][r]), pp_size=sim.topo.pp))
            out.append((r, records_pb2.CollectiveWindow(resource=res, groups=b.groups, records=b.records,
                                                        now_ns=b.now_ns)))
    return out, sim.topo


def _judge(windows, per: int = 10, iterations: int = 20, **cfg):
    st = CollectiveState(CollectivesConfig(**cfg))
    for r, w in windows:
        st.absorb(r, w)
    found = []
    for i, lo in enumerate(range(0, iterations, per)):
        win = records_pb2.Window(index=i, kind=records_pb2.WINDOW_KIND_ITERATIONS, first_iteration=lo,
                                 last_iteration=lo + per - 1)
        found += st.late_starts("j", win, {r: float(per) for r in range(32)})
    return st, found


def _links(found, rule=None):
    return [f for f in found if f.kind == "slow_link" and (rule is None or f.evidence.get("rule") == rule)]


@pytest.fixture(scope="module")
def nic():
    return _windows("nic_degrade:nic=1:0,onset=10it,factor=2")


def test_provenance_names_the_degraded_nic_from_step_records(nic):
    windows, topo = nic
    st, found = _judge(windows)
    links = _links(found)
    assert links and all(f.evidence["rule"] == PROVENANCE for f in links), [f.evidence for f in links]
    named = {s.rank for f in links for s in f.suspects}
    assert named <= {8, 9} and named, named
    for f in links:
        assert f.window.index == 1                       # the fault starts at iteration 10
        for s in f.suspects:
            assert s.role == LINK and s.evidence["hardware"] == "NIC"
            assert s.evidence["steps"] and s.impact_ns > 0
            assert 0 < s.evidence["impact_s"] < 3.0      # s/iteration, under the 3 s step
        assert all(e.role == LINK for e in evidence_of(f))     # reaches the verdict as a link
    assert st.step_flows == 0                             # judged: the step columns are released


def test_healthy_job_with_step_records_names_nobody():
    windows, _ = _windows(None, seed=11)
    st, found = _judge(windows)
    assert not _links(found), [f.evidence for f in _links(found)]
    assert not [f for f in found if f.suspects and not f.informational]
    assert st.step_flows == 0


def test_without_steps_the_ring_summary_waiting_graph_still_names_the_nic():
    windows, _ = _windows("nic_degrade:nic=1:0,onset=10it,factor=2", steps=False)
    _, found = _judge(windows)
    links = _links(found)
    assert links and not _links(found, PROVENANCE)
    assert {s.rank for f in links for s in f.suspects} == {8, 9}


def test_step_flows_are_bounded_and_counted(nic):
    windows, _ = nic
    st, found = _judge(windows, max_step_flows=1000)
    assert st.steps_dropped > 0 and st.step_flows <= 1000
    # what kept no steps is judged on its ring summary
    assert {s.rank for f in _links(found) for s in f.suspects} == {8, 9}


def test_a_rank_named_from_steps_is_not_named_again_from_the_ring_summary(nic):
    """Half the collectives lose their steps (odd seqs): both paths see the NIC; one names it."""
    windows, _ = nic
    mixed = []
    for r, w in windows:
        w2 = records_pb2.CollectiveWindow()
        w2.CopyFrom(w)
        for x in w2.records:
            if x.seq % 2:
                for f in ("algo", "step_index", "step_dst", "step_bytes", "step_start_ns", "step_end_ns"):
                    x.ClearField(f)
        mixed.append((r, w2))
    _, found = _judge(mixed)
    links = _links(found)
    assert {s.rank for f in links for s in f.suspects} == {8, 9}
    assert all(f.evidence["rule"] == PROVENANCE for f in links), [f.evidence["rule"] for f in links]
    # the ring summary alone (steps stripped everywhere) would have named them: the dedupe did the work
    for r, w in mixed:
        for x in w.records:
            for f in ("algo", "step_index", "step_dst", "step_bytes", "step_start_ns", "step_end_ns"):
                x.ClearField(f)
    _, plain = _judge(mixed)
    assert {s.rank for f in _links(plain) for s in f.suspects} == {8, 9}


def test_a_congested_host_is_named_by_the_ring_summary_when_the_rating_names_nothing():
    """Congestion of a whole host spreads eq. (3)'s rating over its NICs (none reaches
    min_rating alone): the step records' ring summary names the host's ranks instead."""
    windows, topo = _windows("net_congestion:host=1,onset=10it,factor=3")
    _, found = _judge(windows)
    links = _links(found)
    host1 = set((topo.host == 1).nonzero()[0].tolist())
    assert {s.rank for f in links for s in f.suspects} == host1
    assert all(f.window.index == 1 and f.evidence["rule"] != PROVENANCE for f in links)


def test_step_columns_are_one_array_and_refuse_ragged_records():
    r = telemetry_pb2.CollectiveRecord(op="allreduce", algo="ring", iteration=4, step_index=[0, 1],
                                       step_dst=[3, 3], step_bytes=[10, 10], step_start_ns=[0, 5],
                                       step_end_ns=[4, 9])
    c = StepColumns.of(r)
    assert c.cols.shape == (5, 2) and c.cols.dtype == np.int64 and c.flows == 2
    assert c.step_end_ns.tolist() == [4, 9] and (c.op, c.algo, c.iteration) == ("allreduce", "ring", 4)
    del r.step_end_ns[1]
    assert StepColumns.of(r) is None
    assert StepColumns.of(telemetry_pb2.CollectiveRecord(op="allreduce")) is None
    with pytest.raises(ConfigError):
        CollectivesConfig(max_step_flows=0)
