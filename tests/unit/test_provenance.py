"""Step decomposition (collector/sim/collective_records.py), the step waiting graph
(analyzer/waiting_graph.py) and the contributor rating (analyzer/provenance.py).

Decompositions are checked against the textbook step counts and bytes. The root
cause is checked on windows built from the same step timing the simulator uses
(``time_steps``) with healthy noise (per-rank link personality, per-step jitter,
arrival skew): a degraded NIC names its rank, a degraded link names src -> dst,
at 64 and 1,024 ranks, and a healthy window names nobody. Through the simulator
and protobuf records: a NIC names its ranks, a degraded NVLink of a 2-GPU TP ring
names the pair (a <-> b), and a healthy job nobody.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from trainscope.analyzer.provenance import ProvenanceConfig, rate, root_cause
from trainscope.analyzer.waiting_graph import StepBlock, critical_path, incoming, step_blocks, waits
from trainscope.collector.sim import SimConfig, parse_fault
from trainscope.collector.sim.collective_records import decompose, time_steps
from trainscope.collector.sim.simulate import Simulation
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2
from support.step_records import joined

WINDOW = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=1, first_iteration=0, last_iteration=9)


# ------------------------------------------------------------------ decomposition against the textbook


@pytest.mark.parametrize("n", [2, 3, 8, 13, 64])
def test_ring_decompositions_match_the_textbook(n):
    B = 64 * 13 * 1000            # divisible by every n here but 3: bytes per chunk floor(B/n)
    for op, steps, per_member in (("allreduce", 2 * (n - 1), 2 * (n - 1) * (B // n)),
                                  ("reducescatter", n - 1, (n - 1) * (B // n)),
                                  ("allgather", n - 1, (n - 1) * B)):
        sp = decompose(op, n, B)
        assert sp.algo == "ring" and sp.steps == steps
        assert (sp.dst[:, :, 0] == (np.arange(n) + 1) % n).all()          # always to the next member
        assert (sp.nbytes.sum(axis=(0, 2)) == per_member).all()
        # every step, every member receives exactly one flow: from the previous member
        assert (sp.inc[:, :, 0] == (np.arange(n) - 1) % n).all()


@pytest.mark.parametrize("n", [2, 3, 7, 8, 13, 64])
def test_tree_allreduce_decomposition(n):
    B = 1 << 20
    sp = decompose("allreduce", n, B, "tree")
    D = int(np.floor(np.log2(n)))
    assert sp.steps == 2 * D
    src = np.broadcast_to(np.arange(n)[None, :, None], sp.dst.shape)
    edges = collections.Counter(zip(src[sp.dst >= 0].tolist(), sp.dst[sp.dst >= 0].tolist()))
    # each of the n-1 tree edges carries B up (reduce) and B down (broadcast), once each
    assert len(edges) == 2 * (n - 1) and set(edges.values()) == {1}
    for i in range(1, n):
        assert edges[(i, (i - 1) // 2)] == 1 and edges[((i - 1) // 2, i)] == 1
    assert sp.nbytes.sum() == 2 * (n - 1) * B
    # reduce phase: a parent sends up only after its children did
    up = {i: s for s in range(D) for i in np.flatnonzero(sp.dst[s, :, 0] >= 0).tolist()}
    for i in range(1, n):
        for ch in (2 * i + 1, 2 * i + 2):
            if ch < n:
                assert up[ch] < up[i]


@pytest.mark.parametrize("n", [2, 5, 16])
def test_pairwise_alltoall_decomposition(n):
    B = 16 * 5 * 100
    sp = decompose("alltoall", n, B)
    assert sp.algo == "pairwise" and sp.steps == n - 1
    for i in range(n):
        assert sorted(sp.dst[:, i, 0].tolist()) == [j for j in range(n) if j != i]   # everyone once
    assert (sp.nbytes.sum(axis=(0, 2)) == (n - 1) * (B // n)).all()


def test_decompose_rejects_unknown_algorithms():
    with pytest.raises(ValueError):
        decompose("allgather", 8, 100, "tree")


def test_time_steps_runs_at_the_slowest_link():
    sp = decompose("allreduce", 8, 8000)
    mult = np.ones((2, 8))
    mult[1, 3] = 3.0
    start, end = time_steps(sp, np.zeros((2, 8)), mult, np.ones(2))
    S = sp.steps
    assert np.nanmax(end[0]) == pytest.approx(S * 1000)
    assert np.nanmax(end[1]) == pytest.approx(S * 3000)    # every step waits for the slow link's chunk
    assert (start[:, 1:] >= start[:, :-1]).all()


# ------------------------------------------------------------------ synthetic windows (healthy noise)


def _blocks(world: int, gsize: int, *, nic: int = -1, link: tuple[int, int] | None = None, factor: float = 3.0,
            iterations: int = 10, seed: int = 0, op: str = "allreduce", algo: str | None = None) -> list[StepBlock]:
    """A window of ring all-reduces over groups of ``gsize`` consecutive... members strided so
    that each group spans hosts (8 GPUs a host): group g holds ranks g, g + G, g + 2G, ...
    Healthy noise: a per-rank link personality (2 %), per-step jitter (5 %), arrival skew."""
    rng = np.random.default_rng(seed)
    G = world // gsize
    members = np.arange(world).reshape(gsize, G).T               # (G, n)
    sp = decompose(op, gsize, 1 << 22, algo)
    person = rng.lognormal(0, 0.02, world)
    if nic >= 0:
        person[nic] *= factor
    C = iterations * G
    mem = np.tile(members, (iterations, 1))
    noise = rng.lognormal(0, 0.05, (C,) + sp.dst.shape)
    if link is not None:
        a, b = link
        pos = np.argwhere(mem == a)
        for c, i in pos:
            hit = sp.dst[:, i, :] >= 0
            to_b = np.zeros_like(hit)
            to_b[hit] = mem[c, sp.dst[:, i, :][hit]] == b
            noise[c][:, i, :] *= np.where(to_b, factor, 1.0)
    arrive = rng.uniform(0, 2e6, (C, gsize))
    t0 = np.full((C, gsize), arrive.max(axis=1, keepdims=True))
    st, en = time_steps(sp, t0, person[mem], np.full(C, 1.0), noise)
    dst = np.where(sp.dst[None] >= 0, np.take_along_axis(
        np.repeat(mem[:, None, :, None], sp.steps, 1), np.maximum(sp.dst, 0)[None].repeat(C, 0), axis=2), -1)
    off = arrive[:, None, :, None]
    return [StepBlock(op=op, algo=sp.algo, spans=True, gid=[f"dp:{int(m)}" for m in mem[:, 0]],
                      seq=np.repeat(np.arange(iterations) + 1, G), iteration=np.repeat(np.arange(iterations), G),
                      members=mem, dst=dst, nbytes=np.broadcast_to(sp.nbytes, dst.shape).copy(),
                      start=st - off, end=en - off, inc=incoming(sp.dst))]


@pytest.mark.parametrize("world,gsize,culprit", [(64, 8, 21), (1024, 32, 613)])
def test_culprit_rank_named_for_its_nic(world, gsize, culprit):
    blocks = _blocks(world, gsize, nic=culprit)
    out = rate(blocks, iterations=10)
    assert out and out[0].element == "rank" and out[0].ranks == (culprit,) and out[0].hardware == "NIC"
    assert len(out) == 1
    top = out[0]
    assert top.impact_s > 0 and top.rating > 0.2   # a third of each slow step: its tx or rx port
    n = blocks[0].members.shape[1]
    assert set(top.step_positions) == set(range(2 * (n - 1)))        # every step of the ring slowed
    assert top.slow_collectives == top.judged == 10


@pytest.mark.parametrize("world,gsize,link", [(64, 8, (29, 37)), (1024, 32, (100, 132))])
def test_culprit_link_named_src_to_dst(world, gsize, link):
    blocks = _blocks(world, gsize, link=link)
    G = world // gsize
    assert link[1] == link[0] + G                                    # the next member of its ring
    out = rate(blocks, iterations=10)
    assert [(o.element, o.ranks, o.both_ways) for o in out] == [("link", link, False)]
    assert out[0].impact_s > 0


@pytest.mark.parametrize("world,gsize", [(64, 8), (1024, 32)])
def test_healthy_window_names_nobody(world, gsize):
    for seed in range(3):
        assert rate(_blocks(world, gsize, seed=seed), iterations=10) == []


@pytest.mark.parametrize("op,algo", [("allreduce", "tree"), ("alltoall", "pairwise")])
def test_culprit_rank_named_in_tree_and_all_to_all(op, algo):
    blocks = _blocks(64, 8, nic=21, op=op, algo=algo)     # 21: position 2 of its group, an inner tree node
    out = rate(blocks, iterations=10)
    assert [(o.element, o.ranks) for o in out] == [("rank", (21,))]
    assert rate(_blocks(64, 8, op=op, algo=algo), iterations=10) == []
    L, crit = critical_path(blocks[0])
    per_step = crit.sum(axis=(2, 3))
    S = per_step.shape[1]
    assert (per_step <= 1).all() and (per_step.sum(axis=1) > S // 2).all()   # a chain: up the tree, then down
    if algo == "pairwise":
        assert (per_step == 1).all()


def test_critical_path_and_waits_follow_the_slow_rank():
    blocks = _blocks(64, 8, nic=21)
    b = blocks[0]
    L, crit = critical_path(b)
    S = b.dst.shape[1]
    assert (crit.sum(axis=(1, 2, 3)) == S).all()                    # one flow step per step
    c = int(np.flatnonzero((b.members == 21).any(axis=1))[0])
    i = int(np.flatnonzero(b.members[c] == 21)[0])
    on = np.flatnonzero(crit[c].any(axis=(0, 2)))
    prev = (i - 1) % b.members.shape[1]
    assert set(on.tolist()) <= {i, prev}                            # along a flow through the slow NIC
    w = waits(b, L, tol_ns=1e5)
    mine = [x for x in w if x[0] == b.gid[c]]
    assert mine and all(x[2] >= 1 and x[4] == int(b.members[c, (list(b.members[c]).index(x[3]) - 1) % 8])
                        for x in mine)                              # a ring member waits for its predecessor
    total = collections.Counter()
    for x in mine:
        total[x[3]] += x[5]
    # Table I: the two flows through the slow NIC (13 -> 21 -> 29) never wait; their senders wait least
    least = sorted(b.members[c].tolist(), key=lambda r: total.get(r, 0.0))[:2]
    assert set(least) == {21, int(b.members[c, prev])}


def test_config_is_validated():
    with pytest.raises(ConfigError):
        ProvenanceConfig(slow_factor=1.0)
    with pytest.raises(ConfigError):
        ProvenanceConfig(triggers_per_step=0)
    with pytest.raises(ConfigError):
        ProvenanceConfig(min_share=0)


# ------------------------------------------------------------------ through the simulator's records


def _sim(fault: str | None, ranks: int = 32, iterations: int = 10):
    cfg = SimConfig(ranks=ranks, tp=2, pp=2, iterations=iterations, seed=3, collective_steps=True,
                    faults=(parse_fault(fault),) if fault else ())
    sim = Simulation(cfg)
    colls, _ = joined(sim)
    hosts = {r: f"host{int(sim.topo.host[r])}" for r in range(ranks)}
    return step_blocks(colls, hosts), hosts, sim.topo


def test_simulator_step_records_fill_the_transfer():
    blocks, _, topo = _sim(None, iterations=2)
    assert {(b.op, b.algo) for b in blocks} == {("allreduce", "ring"), ("reducescatter", "ring"),
                                                ("allgather", "ring")}
    for b in blocks:
        n = b.members.shape[1]
        want = 2 * (n - 1) if b.op == "allreduce" else n - 1
        assert b.dst.shape[1] == want
        assert (b.dur[b.dst >= 0] > 0).all()


def test_simulator_nic_named_through_records():
    blocks, hosts, topo = _sim("nic_degrade:nic=2:1,factor=3")
    out = root_cause("j", WINDOW, blocks, hosts, iterations=10)
    nic_ranks = set(np.flatnonzero(topo.nic == 2 * topo.nics_per_host + 1).tolist())
    named = {s.rank for f in out for s in f.suspects}
    assert named == nic_ranks
    assert all(f.kind == "slow_link" and f.suspects[0].role == "link" for f in out)
    assert all(f.suspects[0].evidence["element"] == "rank" and f.suspects[0].impact_ns > 0 for f in out)


def test_simulator_nvlink_names_the_pair_not_one_gpu():
    blocks, hosts, _ = _sim("nvlink_degrade:rank=5,factor=3")
    out = rate(blocks, iterations=10)
    assert [(o.element, o.ranks, o.both_ways, o.hardware) for o in out] == [("link", (4, 5), True, "NVLink")]


def test_simulator_nvlink_records_are_the_same_whichever_gpu_is_degraded():
    """The physics behind naming the pair: both flows of a 2-GPU ring cross the degraded GPU's
    NVLink, so with the same seed the pair's step records do not depend on which GPU it is."""
    durs = []
    for culprit in (4, 5):
        blocks, _, _ = _sim(f"nvlink_degrade:rank={culprit},factor=3", iterations=4)
        b = next(b for b in blocks if not b.spans and b.members.shape[1] == 2)
        mine = [c for c, g in enumerate(b.gid) if g == "tp:4"]
        durs.append(b.dur[mine])
    np.testing.assert_array_equal(durs[0], durs[1])
    siblings = np.nanmedian(b.dur[[c for c, g in enumerate(b.gid) if g != "tp:4"]])
    assert np.nanmedian(durs[0]) > 2.5 * siblings                  # and the pair is slow


def test_simulator_healthy_names_nobody():
    blocks, hosts, _ = _sim(None)
    assert root_cause("j", WINDOW, blocks, hosts, iterations=10) == []
