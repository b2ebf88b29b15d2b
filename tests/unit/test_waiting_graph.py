"""Ring decomposition of the simulator's collectives and the waiting graph's slow-link rule.

The ring (collector/sim/engine.py step 4, collective_records.py): every member
sends to the next one in 2(n-1) steps; a degraded NIC slows every flow its
rank sends or receives in groups spanning hosts, a degraded NVLink those of
intra-host groups. The rule (analyzer/waiting_graph.py): a link slow in
enough of its collectives against its class's median is named; a rank every
link of which is slow is named for its NIC/NVLink; healthy records name nobody.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from support.sim_homes import sim_home
from trainscope.analyzer.model import LINK
from trainscope.analyzer.waiting_graph import WaitingGraphConfig, slow_links
from trainscope.collector.sim import MemorySink, SimConfig, parse_fault, run_sim
from trainscope.collector.sim.collective_records import CollectivePlan
from trainscope.collector.sim.engine import ring_successor
from trainscope.collector.sim.topology import Topology
from trainscope.collector.sim.workload import build_template
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2

WINDOW = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=1, first_iteration=10, last_iteration=19)


# ------------------------------------------------------------------ ring decomposition (simulator)


def test_ring_successor_is_the_next_member_of_each_group():
    topo = Topology.build(32, tp=2, pp=2)
    for dim in ("tp", "dp", "mp"):
        nxt = topo.rank_of[ring_successor(topo, dim)][topo.canon_of]   # rank -> next rank
        for r in range(32):
            members = topo.group_members(dim, r)
            assert nxt[r] in members
            # following next from r visits the whole group once: one ring
            seen, x = [], r
            for _ in members:
                seen.append(x)
                x = int(nxt[x])
            assert x == r and sorted(seen) == members


def test_plan_counts_steps_and_numbers_each_group_alike():
    topo = Topology.build(32, tp=2, pp=2)
    tmpl = build_template(topo, layers=2, micro_batches=4)
    plan = CollectivePlan.build(topo, tmpl)
    ops = dict(zip(plan.slots.tolist(), plan.ops))
    assert set(plan.ops) == {"allreduce", "reducescatter", "allgather"}     # PP send/recv excluded
    for i, k in enumerate(plan.slots.tolist()):
        n = topo.size(tmpl.dim[k])
        want = 2 * (n - 1) if ops[k] == "allreduce" else n - 1
        assert (plan.ring_steps[:, i] == want).all()
    # every member of a group numbers that group's collectives the same way
    for i, k in enumerate(plan.slots.tolist()):
        for r in (0, 13, 29):
            for m in topo.group_members(tmpl.dim[k], r):
                assert plan.seq_index[m, i] == plan.seq_index[r, i]
                assert plan.per_iteration[m, i] == plan.per_iteration[r, i]


def _flows(fault: str | None, ranks: int = 32):
    cfg = SimConfig(ranks=ranks, tp=2, pp=2, iterations=4, seed=3, noise=None,
                    faults=(parse_fault(fault),) if fault else (), home=sim_home())
    sink = MemorySink()
    run_sim(cfg, sinks=[sink])
    busy = collections.defaultdict(list)    # (group dim, src, dst) -> busy / transfer
    for r in range(ranks):
        for b in sink.collectives(r):
            ids = [g.id for g in b.groups]
            for x in b.records:
                assert x.end_ns > x.enqueue_ns and x.seq >= 1
                if x.ring_steps:
                    busy[(ids[x.group].split(":")[0], r, x.ring_next)].append(
                        x.send_busy_ns / (x.send_busy_ns + x.recv_wait_ns))
    return {k: float(np.median(v)) for k, v in busy.items()}, cfg.topology()


def test_degraded_nic_slows_every_flow_its_ranks_send_or_receive_across_hosts():
    flows, topo = _flows("nic_degrade:nic=1:0,factor=3")
    on_nic = set(np.flatnonzero(topo.nic == 1 * topo.nics_per_host + 0).tolist())   # ranks 8, 9
    assert on_nic == {8, 9}
    for (dim, src, dst), share in flows.items():
        crosses = dim in ("dp", "mp") and (src in on_nic or dst in on_nic)
        same_group_slow = dim in ("dp", "mp") and any(m in on_nic for m in topo.group_members(dim, src))
        if crosses:
            assert share > 0.95, (dim, src, dst, share)         # the critical flows: busy the whole transfer
        elif same_group_slow:
            assert share < 0.5, (dim, src, dst, share)          # healthy links of a slowed ring wait
        else:
            assert share > 0.9, (dim, src, dst, share)          # plain lognormal noise: all alike


def test_degraded_nvlink_slows_its_intra_host_flows_only():
    flows, _ = _flows("nvlink_degrade:rank=13,factor=3")
    assert flows[("tp", 13, 12)] > 0.95 and flows[("tp", 12, 13)] > 0.95
    healthy, _ = _flows(None)
    for key in (("dp", 11, 13), ("dp", 13, 15), ("mp", 13, 28)):     # inter-host groups: untouched
        assert flows[key] == pytest.approx(healthy[key], rel=0.05)


# ------------------------------------------------------------------ the waiting-graph rule


def _ring(gid, members, seq, busy_of, *, op="allreduce", nbytes=1 << 20, transfer=100e6, start=0, iteration=0):
    n = len(members)
    row = {}
    for i, m in enumerate(members):
        b = busy_of(m)
        row[m] = (op, nbytes, start, start + transfer, iteration, 2 * (n - 1), members[(i + 1) % n], int(b),
                  int(max(transfer - b, 0)))
    return (gid, tuple(members), seq, row)


def _hosts(ranks, per_host=8):
    return {r: f"h{r // per_host}" for r in ranks}


def _noise(rng):
    return lambda m: 60e6 * float(np.exp(0.08 * rng.standard_normal()))


def test_one_slow_link_is_named_src_to_dst():
    rng = np.random.default_rng(0)
    members = list(range(0, 32, 4))          # 8 members on 4 hosts
    colls = []
    for seq in range(1, 21):
        base = _noise(rng)
        colls.append(_ring("dp:0", members, seq, lambda m, base=base: 180e6 if m == 12 else base(m)))
        colls.append(_ring("dp:1", [m + 1 for m in members], seq, base))
    found = slow_links("job", WINDOW, colls, _hosts(range(32)), {r: 10.0 for r in range(32)})
    assert len(found) == 1
    f = found[0]
    assert f.level == "collectives" and f.kind == "slow_link"
    assert [s.rank for s in f.suspects] == [12, 16] and {s.role for s in f.suspects} == {LINK}
    assert f.evidence["links"] == "12->16" and (f.evidence["src_host"], f.evidence["dst_host"]) == ("h1", "h2")
    # 20 collectives, each (180 - ~60) ms over the usual flow, over 10 iterations
    assert f.suspects[0].impact_ns == pytest.approx(20 * 120e6 / 10, rel=0.15)


def test_a_rank_whose_every_link_is_slow_is_named_for_its_nic():
    rng = np.random.default_rng(1)
    members = list(range(0, 32, 4))
    colls = []
    for seq in range(1, 21):
        base = _noise(rng)
        # rank 8's NIC: the flow into it (4 -> 8) and out of it (8 -> 12)
        colls.append(_ring("dp:0", members, seq, lambda m, base=base: 150e6 if m in (4, 8) else base(m)))
        colls.append(_ring("dp:1", [m + 1 for m in members], seq, base))
    found = slow_links("job", WINDOW, colls, _hosts(range(32)))
    assert [s.rank for f in found for s in f.suspects] == [8]
    ev = found[0].suspects[0].evidence
    assert ev["hardware"] == "NIC" and ev["links"] == "4->8, 8->12" and ev["host"] == "h1"


def test_a_slow_pair_inside_a_host_is_compared_with_its_sibling_pairs():
    rng = np.random.default_rng(2)
    colls = []
    for seq in range(1, 41):
        for pair in range(8):
            a, b = 2 * pair, 2 * pair + 1
            base = _noise(rng)
            colls.append(_ring(f"tp:{a}", [a, b], seq, lambda m, base=base, p=pair: 150e6 if p == 6 else base(m),
                               nbytes=1 << 16))
    found = slow_links("job", WINDOW, colls, _hosts(range(16)))
    named = sorted(s.rank for f in found for s in f.suspects)
    assert named == [12, 13]            # both ends: nothing in a 2-GPU ring tells them apart
    assert {s.evidence["hardware"] for f in found for s in f.suspects} == {"NVLink"}


def test_healthy_rings_and_rare_spikes_name_nobody():
    rng = np.random.default_rng(3)
    members = list(range(0, 32, 4))
    colls = []
    for seq in range(1, 31):
        base = _noise(rng)
        spike = int(rng.integers(0, 32))     # one random flow three times slower now and then
        colls.append(_ring("dp:0", members, seq, lambda m, base=base, s=spike: 3 * base(m) if m == s else base(m)))
        colls.append(_ring("dp:1", [m + 1 for m in members], seq, base))
    assert slow_links("job", WINDOW, colls, _hosts(range(32))) == []


def _burst_job(burst_iterations, seed=4):
    """Two DP rings of 8 members over 4 hosts (8 ranks a host), 4 collectives per iteration over
    iterations 10-19; in ``burst_iterations`` every flow touching host h1 (ranks 8-15) is 2x slow."""
    rng = np.random.default_rng(seed)
    colls, seq = [], 0
    for it in range(10, 20):
        for _ in range(4):
            seq += 1
            base = _noise(rng)
            slow = it in burst_iterations
            for g, members in (("dp:0", list(range(0, 32, 4))), ("dp:1", list(range(2, 32, 4)))):
                # a flow m -> next is slow when either end is on h1 (its NIC is congested)
                nxt = {m: members[(i + 1) % len(members)] for i, m in enumerate(members)}
                colls.append(_ring(g, members, seq, lambda m, base=base, nxt=nxt, slow=slow:
                                   2 * base(m) if slow and (8 <= m < 16 or 8 <= nxt[m] < 16) else base(m),
                                   iteration=it))
    return colls


def test_a_congested_host_is_priced_by_its_slow_iterations():
    """Step 8 (analyzer/collectives.py): bursts on host h1 in 2 of 10 iterations leave each of its
    ranks' findings small; the host's network, judged as one element, costs what those two
    iterations cost the job over the eight clean ones."""
    from trainscope.analyzer.collectives import host_network
    colls = _burst_job({12, 13})
    hosts = _hosts(range(32))
    found = slow_links("job", WINDOW, colls, hosts, {r: 10.0 for r in range(32)},
                       WaitingGraphConfig(min_slow=2))
    named = sorted({s.rank for f in found for s in f.suspects})
    assert named and all(hosts[r] == "h1" for r in named)
    assert all(f.suspects[0].evidence["slow_iterations"] == [12, 13] for f in found)
    its = np.arange(10, 20)
    steps = np.full(10, 3.0e9)
    steps[[2, 3]] = 3.45e9                       # iterations 12, 13: 15 % slower
    floor = 1.01 * max(f.impact_ns for f in found)    # each rank's finding under the floor
    [host] = host_network(found, hosts, its, steps, floor)
    assert host.evidence["host"] == "h1" and [s.rank for s in host.suspects] == named
    assert {s.role for s in host.suspects} == {LINK}
    assert host.impact_ns == pytest.approx(2 * 0.45e9 / 10)
    assert host.evidence["clean_iterations"] == 8
    # a finding that stands on its own (over the floor): the ranks speak, no host element
    assert host_network(found, hosts, its, steps, 0.5 * floor) == []
    # healthy rings: no slow link, no host
    assert host_network(slow_links("job", WINDOW, _burst_job(set()), hosts, config=WaitingGraphConfig(min_slow=2)),
                        hosts, its, np.full(10, 3.0e9), floor) == []


def test_hosts_downstream_of_the_congested_one_are_not_named():
    """Step 8 in a large job: every DP ring crosses the congested host h1, so the bursts also name a
    few links of other hosts in the same iterations; priced by those iterations they would all cost
    the same. Only hosts with at least half the strongest host's evidence are named: h1 (all its
    named ranks) and not h2 (two ranks at a quarter of the impact each); two hosts equally strong are
    both named."""
    import dataclasses as dc
    from trainscope.analyzer.collectives import host_network
    colls = _burst_job({12, 13})
    hosts = _hosts(range(32))
    found = slow_links("job", WINDOW, colls, hosts, {r: 10.0 for r in range(32)}, WaitingGraphConfig(min_slow=2))
    h1 = sorted({s.rank for f in found for s in f.suspects})
    assert len(h1) >= 2 and {hosts[r] for r in h1} == {"h1"}

    def moved(f, rank, scale):
        return dc.replace(f, suspects=tuple(dc.replace(x, rank=rank, impact_ns=x.impact_ns * scale)
                                            for x in f.suspects[:1]))
    h2 = [r for r in range(32) if hosts[r] == "h2"][:2]
    downstream = [moved(found[0], h2[0], 0.25), moved(found[0], h2[1], 0.25)]
    its, steps = np.arange(10, 20), np.full(10, 3.0e9)
    steps[[2, 3]] = 3.45e9
    floor = 1.01 * max(f.impact_ns for f in found)
    named = host_network([*found, *downstream], hosts, its, steps, floor)
    assert [f.evidence["host"] for f in named] == ["h1"]
    twin = [moved(f, [r for r in range(32) if hosts[r] == "h2"][i], 1.0) for i, f in enumerate(found)]
    both = host_network([*found, *twin], hosts, its, steps, floor)
    assert sorted(f.evidence["host"] for f in both) == ["h1", "h2"]


def test_a_host_slow_in_every_iteration_is_left_to_its_ranks():
    """Step 8 needs clean iterations to price against: a persistent fault (a degraded NIC) has none."""
    from trainscope.analyzer.collectives import host_network
    hosts = _hosts(range(32))
    found = slow_links("job", WINDOW, _burst_job(set(range(10, 20))), hosts)
    assert found
    its, steps = np.arange(10, 20), np.full(10, 3.5e9)
    assert host_network(found, hosts, its, steps, 1.01 * max(f.impact_ns for f in found)) == []


def test_records_without_a_ring_decomposition_are_left_to_the_late_start_rule():
    members = (0, 1, 2, 3)
    row = {m: ("allreduce", 1024, 0, 100, 0) for m in members}      # the torch collector's records
    assert slow_links("job", WINDOW, [("0", members, 1, row)], _hosts(range(4))) == []


def test_config_is_checked():
    with pytest.raises(ConfigError, match="slow_factor"):
        WaitingGraphConfig(slow_factor=1.0)
    with pytest.raises(ConfigError, match="min_share"):
        WaitingGraphConfig(min_share=0)
