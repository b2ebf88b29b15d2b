"""Simulator → real exporters → gRPC → real processor: each fault's signature in the records.

Every test runs a small hybrid-parallel job (32 ranks: TP=2, PP=2, EP=2, DP=4
on four 8-GPU hosts) through a processor on 127.0.0.1, then reads what the
processor published on its embedded bus (KernelWindow / PhaseWindow /
IterationWindow / StackWindow) and checks the fault's documented signature
there (faults.py catalogue, ARGUS Table 6, Mycroft §7.1), and that healthy
ranks show none. The signatures are checked under plain lognormal noise
(``noise=None``), where they are exact to a few percent; detection on the
measured noise (spikes, personality) is judged in test_detection_kafka.py
and tests/benchmarks/bench_detection.py.
"""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from support.pipeline import bus_records, start_processor
from support.sim_homes import sim_home
from trainscope.collector.sim import SimConfig, parse_fault, run_sim
from trainscope.collector.sim import workload as wl
from trainscope.processor.windows import WindowConfig

pytestmark = pytest.mark.integration

BASE = dict(ranks=32, tp=2, pp=2, ep=2, layers=1, micro_batches=2, iterations=10, job_id="simtest", noise=None)
TOPO = SimConfig(**BASE).topology()
COMPUTE = (wl.GEMM_FWD, wl.GEMM_DGRAD, wl.FLASH_FWD, wl.FLASH_BWD, wl.EXPERT_FWD)
TP, EP, DP, PP_NEXT = wl.STREAM["tp"], wl.STREAM["ep"], wl.STREAM["dp"], wl.STREAM["pp_next"]


class Records:
    """What the processor published, indexed for the assertions below."""

    def __init__(self, proc, result):
        self.result = result
        self.raw = {s: bus_records(proc, s) for s in ("kernels", "phases", "iterations", "stacks")}
        self.k = collections.defaultdict(list)   # (rank, kernel, stream) -> [(window, KernelStats)]
        for kw in self.raw["kernels"]:
            for ks in kw.kernels:
                self.k[(kw.resource.rank, ks.kernel, ks.stream)].append((kw.window.index, ks))
        self.p = collections.defaultdict(list)   # (rank, phase) -> [(window, PhaseStats)]
        for pw in self.raw["phases"]:
            for ps in pw.phases:
                self.p[(pw.resource.rank, ps.phase)].append((pw.window.index, ps))
        self.marks = collections.defaultdict(dict)
        for iw in self.raw["iterations"]:
            for m in iw.marks:
                self.marks[iw.resource.rank][m.iteration] = m
        self.stacks = collections.defaultdict(collections.Counter)
        for sw in self.raw["stacks"]:
            for fs in sw.stacks:
                self.stacks[sw.resource.rank][fs.stack] += fs.count
        self.truth = json.load(open(result.ground_truth_path))

    def _sel(self, items, windows):
        return [x for w, x in items if windows is None or w in windows]

    def kmean(self, rank, kernel, stream=7, windows=None):
        ks = self._sel(self.k[(rank, kernel, stream)], windows)
        return sum(k.total_ns for k in ks) / sum(k.count for k in ks)

    def kmax(self, rank, kernel, stream=7):
        return max(c.max_ns for k in self._sel(self.k[(rank, kernel, stream)], None) for c in k.clusters)

    def kp50(self, rank, kernel, stream=7):
        """p50 of the largest cluster (the bulk), count-weighted over windows."""
        vals = []
        for k in self._sel(self.k[(rank, kernel, stream)], None):
            big = max(k.clusters, key=lambda c: c.count)
            vals += [big.p50_ns] * int(big.count)
        return float(np.median(vals))

    def kcount(self, rank, prefix="ncclDevKernel"):
        return sum(ks.count for (r, name, _), items in self.k.items() if r == rank and name.startswith(prefix)
                   for _, ks in items)

    def pmean(self, rank, phase, windows=None):
        ps = self._sel(self.p[(rank, phase)], windows)
        return sum(p.mean_ns * p.count for p in ps) / sum(p.count for p in ps)

    def pmax(self, rank, phase):
        return max(p.max_ns for _, p in self.p[(rank, phase)])

    def iteration_s(self, rank):
        ms = self.marks[rank]
        return np.array([(ms[i].end_ns - ms[i].start_ns) / 1e9 for i in sorted(ms)])


def run(faults=(), window_iterations=5, **kw) -> Records:
    cfg = SimConfig(**{**BASE, **kw}, faults=tuple(parse_fault(f) for f in faults), home=sim_home())
    proc = start_processor(window=WindowConfig(mode="iterations", iterations=window_iterations,
                                               idle_close_s=3600))
    try:
        res = run_sim(cfg, proc.address)
        assert proc.drain(60.0)
        assert res.dropped == 0
        return Records(proc, res)
    finally:
        proc.stop()


def peers(dim, rank):
    return [r for r in TOPO.group_members(dim, rank) if r != rank]


def same_stage(rank, exclude=()):
    s = int(TOPO.coords["pp"][rank])
    return [r for r in range(TOPO.world) if TOPO.coords["pp"][r] == s and r != rank and r not in exclude]


@pytest.fixture(scope="module")
def healthy():
    return run()


# ------------------------------------------------------------------ healthy


def test_everything_arrives(healthy):
    res = healthy.result
    assert {kw.resource.rank for kw in healthy.raw["kernels"]} == set(range(32))
    assert sum(kw.events for kw in healthy.raw["kernels"]) == res.kernel_events
    assert sum(len(ms) for ms in healthy.marks.values()) == res.iteration_events == 320
    assert sum(ps.count for items in healthy.p.values() for _, ps in items) == res.phase_events
    kw = healthy.raw["kernels"][0]
    assert kw.resource.job_id == "simtest" and kw.resource.coords.tp_size == 2 and kw.resource.host
    # a job that ended normally: every rank's last window is marked final (not a stall)
    final = {iw.resource.rank for iw in healthy.raw["iterations"] if iw.window.final}
    assert final == set(range(32))


def test_healthy_run_shows_no_signature(healthy):
    h = healthy
    for stage_rank in (0, 16):
        ranks = [stage_rank] + same_stage(stage_rank)
        for name in COMPUTE + (wl.H2D,):
            means = np.array([h.kmean(r, name) for r in ranks])
            assert means.max() / means.min() < 1.04, name
        for phase in ("forward", "backward", "self_attention", "moe_experts"):
            means = np.array([h.pmean(r, phase) for r in ranks])
            assert means.max() / means.min() < 1.04, phase
    its = np.array([h.iteration_s(r) for r in range(32)])
    assert np.all(its.max(axis=0) / its.min(axis=0) < 1.02)
    assert its.max() / its.min() < 1.05  # no jitter, no regression
    assert not any("<gc>" in s or "jit" in s or "threading.py:wait" in s
                   for c in h.stacks.values() for s in c)


def test_same_seed_reproduces_the_records():
    a, b = run(iterations=4), run(iterations=4)
    for signal in ("kernels", "phases", "iterations", "stacks"):
        sa = sorted(r.SerializeToString(deterministic=True) for r in a.raw[signal])
        sb = sorted(r.SerializeToString(deterministic=True) for r in b.raw[signal])
        assert sa == sb, signal


def test_clock_offsets_differ_per_host(healthy):
    h = healthy
    hosts = h.truth["hosts"]
    first = {hst["host"]: h.marks[hst["ranks"][0]][5].start_ns for hst in hosts}
    raw_spread = max(first.values()) - min(first.values())
    offsets = {hst["host"]: hst["clock_offset_ns"] for hst in hosts}
    assert len(set(offsets.values())) == len(hosts) and raw_spread > 100_000_000
    corrected = [first[k] - offsets[k] for k in first]
    assert max(corrected) - min(corrected) < 0.1 * raw_spread


# ------------------------------------------------------------------ compute faults


def test_gpu_throttle_slows_compute_on_the_culprit_only():
    rec = run(["gpu_throttle:rank=5,factor=1.5"])
    others = same_stage(5)
    for name in COMPUTE:
        ratio = rec.kmean(5, name) / np.median([rec.kmean(r, name) for r in others])
        assert ratio == pytest.approx(1.5, rel=0.05), name
    assert rec.kmean(5, wl.H2D) / np.median([rec.kmean(r, wl.H2D) for r in others]) < 1.1
    # its collectives are the shortest of its groups: the peers wait for it (ARGUS §9.5)
    tp_peer, = peers("tp", 5)
    assert rec.kmean(tp_peer, wl.AR_BF16, TP) > 2 * rec.kmean(5, wl.AR_BF16, TP)
    ep_peer, = peers("ep", 5)
    assert rec.kmean(ep_peer, wl.SENDRECV, EP) > 1.5 * rec.kmean(5, wl.SENDRECV, EP)
    # L2: compute-only phases flag it within its DP group
    dp = TOPO.group_members("dp", 5)
    att = {r: rec.pmean(r, "self_attention") for r in dp}
    assert max(att, key=att.get) == 5 and att[5] > 1.4 * np.median(list(att.values()))
    # L1 is masked: every rank's iteration time is the same
    its = np.array([rec.iteration_s(r) for r in range(32)])
    assert np.all(its.max(axis=0) / its.min(axis=0) < 1.02)


def test_background_load_is_slower_and_noisier():
    rec = run(["background_load:rank=5,factor=1.6"])
    others = same_stage(5, exclude=TOPO.group_members("tp", 5))
    name = wl.FLASH_BWD
    assert rec.kmean(5, name) > 1.3 * np.median([rec.kmean(r, name) for r in others])

    def spread(r):
        return rec.kmax(r, name) / rec.kp50(r, name)
    assert spread(5) > 1.5 * np.median([spread(r) for r in others])


def test_ecc_adds_tail_latency_not_median():
    rec = run(["ecc:rank=5,prob=0.05,factor=10"])
    others = same_stage(5)
    tails = [rec.kmax(5, n) / max(rec.kmax(r, n) for r in others) for n in COMPUTE]
    assert max(tails) > 4 and sum(t > 2 for t in tails) >= 3
    for name in (wl.FLASH_FWD, wl.FLASH_BWD):  # one position each: the bulk is one cluster
        assert rec.kp50(5, name) / np.median([rec.kp50(r, name) for r in others]) < 1.05
    gt = rec.truth["faults"][0]
    assert gt["levels"] == ["L1", "L3"] and gt["fired"]


def test_pcie_degradation_slows_memcpy_only():
    rec = run(["pcie_degrade:rank=5,factor=4"])
    others = same_stage(5)
    for name in (wl.H2D, wl.D2H):
        assert rec.kmean(5, name) / np.median([rec.kmean(r, name) for r in others]) == pytest.approx(4, rel=0.1)
    for name in COMPUTE:
        assert rec.kmean(5, name) / np.median([rec.kmean(r, name) for r in others]) < 1.04


# ------------------------------------------------------------------ communication faults


def test_nvlink_degradation_slows_the_culprits_intra_host_collectives():
    rec = run(["nvlink_degrade:rank=5,factor=4"])
    group = TOPO.group_members("tp", 5)
    other_tp = [r for r in same_stage(5) if r not in group and r not in TOPO.group_members("ep", 5)
                and not set(TOPO.group_members("ep", r)) & set(group)]
    mine = [rec.kmean(r, wl.AR_BF16, TP) for r in group]
    theirs = [rec.kmean(r, wl.AR_BF16, TP) for r in other_tp]
    assert min(mine) > 2 * np.median(theirs)          # every member, no waiting involved
    # the group becomes a straggler of its DP group in forward/backward (L2)
    for phase in ("forward", "backward"):
        dp = TOPO.group_members("dp", 5)
        f = {r: rec.pmean(r, phase) for r in dp}
        assert max(f, key=f.get) == 5 and f[5] > 1.2 * min(f.values())


def test_nic_degradation_slows_every_ring_through_the_nic():
    rec = run(["nic_degrade:nic=0:2,factor=4"])  # host 0, NIC 2: GPUs 4 and 5
    on_nic = rec.truth["faults"][0]["ranks"]
    assert on_nic == [4, 5]
    through = sorted({m for r in on_nic for m in TOPO.group_members("dp", r)})
    clean = [r for r in range(32) if r not in through and TOPO.coords["pp"][r] == 0]

    def transfer(r):  # the member that arrives last waits least: the group's own transfer time
        return min(rec.kmean(m, wl.RS_F32, DP) for m in TOPO.group_members("dp", r))
    assert min(transfer(r) for r in through) > 3 * max(transfer(r) for r in clean)
    # every member of a ring through the NIC sees it, not only the NIC's own ranks
    assert all(rec.kmean(r, wl.RS_F32, DP) > 2 * transfer(clean[0]) for r in through)
    for name in COMPUTE:
        assert rec.kmean(4, name) / np.median([rec.kmean(r, name) for r in clean]) < 1.04


def test_network_congestion_makes_iteration_time_jitter():
    rec = run(["net_congestion:scope=all,every=9s,for=3s,factor=4"], iterations=12)
    its = rec.iteration_s(0)
    assert its.max() / its.min() > 1.1
    active = set(rec.truth["faults"][0]["active_iterations"])
    assert active and len(active) < 12
    on = np.mean([its[i] for i in active])
    off = np.mean([its[i] for i in range(12) if i not in active])
    assert on > 1.1 * off


def test_nccl_delay_late_entry_is_seen_by_peers():
    rec = run(["nccl_delay:rank=5,prob=0.02,delay=1s"])
    tp_peer, = peers("tp", 5)
    assert rec.kmax(tp_peer, wl.AR_BF16, TP) > 0.9e9
    assert rec.kmax(5, wl.AR_BF16, TP) < 0.5 * rec.kmax(tp_peer, wl.AR_BF16, TP)


# ------------------------------------------------------------------ host-side faults


def test_gc_pause_spikes_iterations_with_normal_kernels():
    rec = run(["gc_pause:rank=5,prob=0.4,delay=1s"])
    fired = {f["iteration"] for f in rec.truth["faults"][0]["fired"]}
    assert fired
    its = rec.iteration_s(20)  # any rank: synchronous training spreads the pause
    spikes = {i for i, t in enumerate(its) if t > np.median(its) + 0.7}
    assert spikes == fired
    others = same_stage(5)
    for name in COMPUTE:
        assert rec.kmean(5, name) / np.median([rec.kmean(r, name) for r in others]) < 1.04
    assert any("<gc>" in s for s in rec.stacks[5]) and not any("<gc>" in s for s in rec.stacks[4])


def test_dataloader_stall_shows_a_gap_before_forward():
    rec = run(["dataloader_stall:rank=5,delay=0.8s"])
    others = same_stage(5)
    dl = rec.pmean(5, "dataloader")
    assert dl > 10 * np.median([rec.pmean(r, "dataloader") for r in others]) and dl > 0.8e9
    # the GPU idles: its TP peer waits in its first all-reduce
    tp_peer, = peers("tp", 5)
    assert rec.kmax(tp_peer, wl.AR_BF16, TP) > 0.7e9
    st = rec.stacks[5]
    q = sum(c for s, c in st.items() if "queues.py:get" in s)
    assert q > 5 * sum(c for s, c in rec.stacks[4].items() if "queues.py:get" in s)


def test_cpu_contention_slows_the_hosts_phases():
    rec = run(["cpu_contention:host=0,onset=5it"])
    host0 = list(range(8))
    before, after = {0}, {1}  # windows of 5 iterations
    for r in (0, 5):
        for phase, factor in (("dataloader", 5), ("forward", 1.2), ("optimizer", 1.05)):
            assert rec.pmean(r, phase, after) > factor * rec.pmean(r, phase, before), (r, phase)
        # launch-bound, not slower kernels
        assert rec.kmean(r, wl.GEMM_FWD, windows=after) < 1.04 * rec.kmean(r, wl.GEMM_FWD, windows=before)
    far = [r for r in same_stage(0) if r not in host0]
    assert rec.pmean(far[0], "forward", after) < 1.05 * rec.pmean(far[0], "forward", before)
    its = rec.iteration_s(20)
    assert its[5:].mean() > 1.05 * its[:5].mean()  # sustained regression (L1)


def test_jit_stall_stretches_one_backward():
    rec = run(["jit_stall:rank=5,prob=1,onset=3it,duration=1it,delay=4s"])
    assert rec.truth["faults"][0]["active_iterations"] == [3]
    assert rec.pmax(5, "backward") > 4e9
    assert max(rec.pmax(r, "backward") for r in same_stage(5, exclude=TOPO.group_members("tp", 5)
                                                              + TOPO.group_members("ep", 5))) < 4e9
    its = rec.iteration_s(0)
    assert its[3] > its[2] + 3.5
    assert any("jit_compile" in s for s in rec.stacks[5])
    others = same_stage(5)
    assert rec.kmean(5, wl.FLASH_BWD) / np.median([rec.kmean(r, wl.FLASH_BWD) for r in others]) < 1.04


# ------------------------------------------------------------------ framework faults


def test_moe_imbalance_varies_moe_experts_across_the_ep_group():
    rec = run(["moe_imbalance:rank=5,factor=2"])
    ep = TOPO.group_members("ep", 5)
    moe = {r: rec.pmean(r, "moe_experts") for r in ep}
    assert moe[5] > 1.8 * min(moe.values())
    a2a = {r: rec.pmean(r, "ep-alltoall") for r in ep}
    assert min(a2a, key=a2a.get) == 5 and max(a2a.values()) > 1.5 * a2a[5]


def test_overlap_loss_exposes_the_gradient_reduction():
    rec = run(["overlap_loss:scope=all,onset=5it"], layers=3)
    for r in (0, 20):
        assert rec.pmean(r, "dp-allreduce", {1}) > 1.8 * rec.pmean(r, "dp-allreduce", {0})
    its = rec.iteration_s(0)
    assert its[5:].mean() > its[:5].mean()


def test_hang_stops_collectives_and_iterations():
    rec = run(["hang:rank=5,onset=4it,timeout=30s"])
    assert rec.result.hung and rec.truth["hung"]
    assert max(rec.marks[5]) == 3 and all(max(rec.marks[r]) == 3 for r in range(32))
    for p in peers("tp", 5) + peers("ep", 5):
        assert rec.kcount(p) > rec.kcount(5)
    tp_peer, = peers("tp", 5)
    assert rec.kmax(tp_peer, wl.AR_BF16, TP) == pytest.approx(30e9, rel=0.01)
    assert rec.kmax(5, wl.AR_BF16, TP) < 5e9
    assert any("threading.py:wait" in s for s in rec.stacks[5])
    assert not any(r.window.final for sig in rec.raw.values() for r in sig)  # hung: no end marker
    assert any("distributed_c10d.py:wait" in s for s in rec.stacks[tp_peer])


def test_pipeline_bubbles_move_upstream_through_the_processor():
    kw = dict(ranks=16, tp=1, pp=4, ep=1, micro_batches=4, iterations=6)
    topo = SimConfig(**{**BASE, **kw}).topology()
    mine, other = topo.group_members("pp", 0), topo.group_members("pp", 1)
    rec = run([f"gpu_throttle:rank={mine[-1]},factor=2"], **kw)
    for s in range(3):
        assert rec.pmean(mine[s], "pp-recv") > 1.3 * rec.pmean(other[s], "pp-recv")
    assert rec.pmean(mine[-1], "backward") > 1.8 * rec.pmean(other[-1], "backward")
