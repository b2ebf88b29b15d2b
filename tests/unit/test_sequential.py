"""Evidence that accumulates per iteration (analyzer/sequential.py, issue #22 item 1): the CUSUM's
threshold from a false-alarm target, its update and reset, and what it changes in the verdict."""
import dataclasses
import math

import numpy as np
import pytest

from trainscope.analyzer.merge import merge
from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.analyzer.sequential import Cusum, SequentialConfig, arl0, threshold, window_sum
from trainscope.analyzer.significance import Persistence
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

MS = 1e6


def win(i):
    return records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=i, first_iteration=10 * i,
                              last_iteration=10 * i + 9)


def resources(world=16):
    return {r: Resource(job_id="j", rank=r, world_size=world, host=f"h{r // 4}",
                        coords=coords_for_rank(r, world, tp=1)) for r in range(world)}


def kernel_finding(i, rank, z, impact_ns, kernel="gemm", **extra):
    ev = {"direction": "slower", "ratio": 1.3, "z": z, "z_threshold": 4.5, **extra}
    return Finding(level="L3", kind="degraded_kernel", job_id="j", window=win(i), scope=Scope(kernel=kernel),
                   suspects=(SuspectRank(rank, z, ev, impact_ns=impact_ns),))


def test_threshold_meets_its_false_alarm_target_and_grows_with_the_job():
    cfg = SequentialConfig()
    h = threshold(1024, 3.0, cfg)
    target = 1024 * cfg.places_per_rank * cfg.false_alarm_hours * 3600 / 3.0
    assert arl0(h, cfg.allowance) == pytest.approx(target, rel=1e-6)
    assert threshold(4, 3.0) < h < threshold(1024, 0.3)       # more ranks, more iterations: higher
    assert 8 < threshold(4, 0.2) < h < 14                      # the docstring's figures
    assert threshold(16, float("nan")) == threshold(16, 1.0)  # no step measured: 1 s assumed


def test_simulated_null_crosses_less_often_than_the_target():
    """N(0, 1) per-iteration excess, summed in 10-iteration windows as the levels report them: over
    2,000 streams of 200 windows none reaches h of a 4-rank job; a 1σ shift per iteration is caught."""
    rng = np.random.default_rng(3)
    h = threshold(4, 1.0)
    stat = np.zeros(2000)
    crossed = np.zeros(2000, dtype=bool)
    for _ in range(200):
        z = rng.standard_normal(2000)                     # a window mean's z over 10 iterations
        stat = np.maximum(0.0, stat + math.sqrt(10) * z - 10 * 1.0)
        crossed |= stat >= h
    assert crossed.sum() == 0
    shifted = Cusum()
    hits = [bool(shifted.update({(1, "k"): window_sum(2.0 * math.sqrt(10), 10)}, 10, h)) for _ in range(3)]
    assert hits[1] or hits[0]                             # 2σ per iteration: within two windows


def test_cusum_accumulates_weak_evidence_and_resets_when_it_reverses():
    h = threshold(1024, 3.0)
    c = Cusum()
    strong = window_sum(10.0, 10)
    assert c.update({(5, "gemm"): strong}, 10, h) == {(5, "gemm")}          # one window is enough
    weak = window_sum(4.6, 10)                                               # just over a typical z*
    c2 = Cusum()
    assert c2.update({(7, "attn"): weak}, 10, h) == set()
    assert c2.update({(7, "attn"): weak}, 10, h) == set()
    assert c2.update({(7, "attn"): weak}, 10, h) == {(7, "attn")}           # the third window names it
    for _ in range(3):                                                       # recovered: it falls back
        c2.update({}, 10, h)
    assert c2.stat == {} and c.update({}, 10, h) == {(5, "gemm")}
    assert c.stat[(5, "gemm")] <= 2 * h                                      # capped: resets in a few windows


def test_a_strong_peer_finding_is_named_in_its_first_window_a_weak_one_waits():
    """The verdict (merge step 3): a rank 40 % slower in a kernel (z 30 over 10 iterations) is named at
    once, where k of n waited two windows; a rank at z 4.6 stays pending in its first window and is
    named by k of n in its second (the CUSUM alone would wait for a third)."""
    res = resources()
    p = Persistence(2, 3)
    its = {r: 10.0 for r in res}
    v = merge("j", win(0), [kernel_finding(0, 5, 30.0, 40 * MS)], res, step_ns=400 * MS,
              iterations=its, persistence=p)
    assert [s.rank for s in v.ranks] == [5] and v.state == "degraded"
    q = Persistence(2, 3)
    states = []
    for i in range(3):
        v = merge("j", win(i), [kernel_finding(i, 9, 4.6, 12 * MS, kernel="attn")], res, step_ns=400 * MS,
                  iterations=its, persistence=q)
        states.append((v.state, [s.rank for s in v.ranks], list(v.pending)))
    assert states[0] == ("suspected", [], [9])
    assert states[1] == ("degraded", [9], [])      # k of n still names it in its second window


def test_host_timed_evidence_keeps_k_of_n():
    """A CPU operator of a 4-rank job 40 % slower for one window (a scheduler burst on a shared host
    looks like this): host-timed, so one window names nobody however large its z; the same values
    timed on the device are named at once."""
    res = resources(4)
    its = {r: 10.0 for r in res}
    f = kernel_finding(0, 2, 47.0, 30 * MS, host_timed=True)
    v = merge("j", win(0), [f], res, step_ns=400 * MS, iterations=its, persistence=Persistence(2, 3))
    assert v.state == "suspected" and list(v.pending) == [2] and not v.ranks
    device = kernel_finding(0, 2, 47.0, 30 * MS)
    v = merge("j", win(0), [device], res, step_ns=400 * MS, iterations=its, persistence=Persistence(2, 3))
    assert [s.rank for s in v.ranks] == [2]


def test_a_wait_is_not_accumulated_as_own_work():
    """A rank slower inside a communication phase waited there: that evidence never enters the CUSUM
    (a healthy 16-rank simulated job named a rank slower in pp-send in one window before this)."""
    res = resources()
    its = {r: 10.0 for r in res}
    ev = {"direction": "slower", "ratio": 1.3, "significance_z": 40.0, "communication": True}
    f = Finding(level="L2", kind="slow_communication", job_id="j", window=win(0), scope=Scope(phase="pp-send"),
                evidence={"communication": True}, suspects=(SuspectRank(1, 40.0, ev, impact_ns=30 * MS),))
    own = kernel_finding(0, 1, 4.0, 5 * MS)          # weak own work: the rank is a culprit, not yet named
    v = merge("j", win(0), [f, own], res, step_ns=400 * MS, iterations=its, persistence=Persistence(2, 3))
    assert not v.ranks and list(v.pending) == [1]


def test_config_is_checked():
    from trainscope.proto.errors import ConfigError
    with pytest.raises(ConfigError, match="sequential.allowance"):
        SequentialConfig(allowance=0)
    with pytest.raises(ConfigError, match="sequential.places_per_rank"):
        SequentialConfig(places_per_rank=0)


def test_a_huge_z_that_costs_one_percent_of_the_step_does_not_name_at_once():
    """Step 1b: a real trace's kernel 2.5x its peers for one window (peer z in the hundreds) costing 1 %
    of the step: bounded by its cost against the step's noise, one window names nobody; the same z at
    10 % of the step names the rank."""
    res = resources()
    its = {r: 10.0 for r in res}
    cheap = kernel_finding(0, 2, 300.0, 0.8 * MS, kernel="elementwise_kernel")
    v = merge("j", win(0), [cheap], res, step_ns=80 * MS, iterations=its, persistence=Persistence(2, 3))
    assert not v.ranks and list(v.pending) == [2]
    costly = kernel_finding(0, 2, 300.0, 8 * MS, kernel="elementwise_kernel")
    v = merge("j", win(0), [costly], res, step_ns=80 * MS, iterations=its, persistence=Persistence(2, 3))
    assert [s.rank for s in v.ranks] == [2]


def noisy_window(i, sd_pct, world=16, step_ms=100.0, seed=0):
    """A JobWindow whose ranks' iteration marks vary by ``sd_pct`` % of the step (a shared host's noise)."""
    from trainscope.analyzer.model import JobWindow
    rng = np.random.default_rng(seed * 100 + i)
    jw = JobWindow(job_id="j", window=win(i))
    for r in range(world):
        iw = records_pb2.IterationWindow()
        t = 0
        for it in range(10 * i, 10 * i + 10):
            d = int(step_ms * MS * (1 + rng.normal(0, sd_pct / 100)))
            iw.marks.add(iteration=it, start_ns=t, end_ns=t + d)
            t += d
        jw.iterations[r] = iw
    return jw


def test_step_noise_is_the_iteration_times_spread_with_a_floor():
    from trainscope.analyzer.sequential import step_noise_ns
    cfg = SequentialConfig()
    jw = noisy_window(0, 5.0, world=8)
    noise = step_noise_ns(jw, 100 * MS, cfg)
    assert 3.5 * MS < noise < 6.5 * MS                     # about the 5 ms it was drawn with
    assert step_noise_ns(None, 100 * MS, cfg) == pytest.approx(1 * MS)     # no marks: the 1 % floor
    assert window_sum(10.0, 10, excess_ns=2 * MS, noise_ns=1 * MS) == pytest.approx(20.0)
    assert window_sum(1.0, 10, excess_ns=2 * MS, noise_ns=1 * MS) == pytest.approx(math.sqrt(10))


def test_a_rank_with_fewer_iterations_than_its_peers_waits_for_k_of_n():
    """Records lost or late on a loaded host leave a rank fewer iteration marks than its peers: its
    values per iteration may be totals over too few iterations, so that window does not accumulate."""
    res = resources()
    its = {r: 10.0 for r in res}
    its[5] = 6.0
    v = merge("j", win(0), [kernel_finding(0, 5, 30.0, 40 * MS)], res, step_ns=400 * MS, iterations=its,
              persistence=Persistence(2, 3))
    assert not v.ranks and list(v.pending) == [5]


def late_start(i, rank, late_collectives, impact_ns, members=range(16)):
    """A collectives-level late start (Mycroft §5) as ``collectives._late_finding`` builds it."""
    ev = {"function": f"late start to allreduce (group dp0, seq {100 * i + 7})", "late_start": True,
          "late_collectives": late_collectives, "op": "allreduce", "group": "dp0"}
    return Finding(level="collectives", kind="late_start", job_id="j", window=win(i), scope=Scope(group="collective"),
                   suspects=(SuspectRank(rank, 3.0, ev, impact_ns=impact_ns, role="culprit"),),
                   evidence={"communication": False, "group": "dp0", "rule": "Mycroft §5 late start",
                             "members": list(members)})


def test_a_device_timed_late_start_repeated_in_its_window_is_named_in_that_window():
    """A rank that started its all-reduce last, 40 ms after its peers, in 5 iterations of a 400 ms step
    (device-timed: a GPU job) carries 5 % of the step: its window's sum crosses h and it is named in
    the first window, as a peer z would be. One late arrival in the window (one event), or the same
    lateness timed by the host (a CPU job: a scheduler burst delays a rank for a whole window), waits
    for a second window (k of n)."""
    gpu = {r: dataclasses.replace(x, device=f"cuda:{r % 8}") for r, x in resources().items()}
    cpu = {r: dataclasses.replace(x, device="cpu") for r, x in resources().items()}
    its = {r: 10.0 for r in gpu}
    v = merge("j", win(0), [late_start(0, 6, 5, 20 * MS)], gpu, step_ns=400 * MS, iterations=its,
              persistence=Persistence(2, 3))
    assert [s.rank for s in v.ranks] == [6], v.summary
    for res, n in ((gpu, 1), (cpu, 5)):
        p = Persistence(2, 3)
        v = merge("j", win(0), [late_start(0, 6, n, 20 * MS)], res, step_ns=400 * MS, iterations=its, persistence=p)
        assert not v.ranks and list(v.pending) == [6], (n, v.summary)
        v = merge("j", win(1), [late_start(1, 6, n, 20 * MS)], res, step_ns=400 * MS, iterations=its, persistence=p)
        assert [s.rank for s in v.ranks] == [6], (n, v.summary)      # the place held in 2 windows of 3


def late_arrival(i, rank, z, own_z, impact_ns):
    """An L3 late arrival: the rank's reduce-scatter shorter than its peers' (they waited in it)."""
    ev = {"direction": "faster", "ratio": 0.52, "z": -z, "own_z": -own_z, "z_threshold": 4.9}
    return Finding(level="L3", kind="late_arrival", job_id="j", window=win(i),
                   scope=Scope(kernel="ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"),
                   evidence={"communication": True}, suspects=(SuspectRank(rank, z, ev, impact_ns=impact_ns),))


def test_a_window_the_ranks_own_noise_explains_waits_for_k_of_n():
    """Steps 1c-1d: a kernel slower than its peers' from a few 3-4x calls (z 7.5 against the peers, 2.1
    against its own calls: a noisy rank's window, as in a simulated healthy 64-rank job, seed 319) is
    not named in its first window, nor is the late arrival to the reduce-scatter those calls caused (z 13);
    the same late arrival with no slow work of its own (a host delay before the collective) is, and so
    is a kernel whose own calls agree with its peers' verdict."""
    res = resources()
    its = {r: 10.0 for r in res}

    def first(findings):
        v = merge("j", win(0), findings, res, step_ns=400 * MS, iterations=its, persistence=Persistence(2, 3))
        return [s.rank for s in v.ranks], list(v.pending)
    noisy = kernel_finding(0, 5, 7.5, 25 * MS, kernel="flash_bwd", own_z=2.1)
    assert first([noisy, late_arrival(0, 5, 13.0, 8.1, 40 * MS)]) == ([], [5])
    assert first([noisy]) == ([], [5])
    assert first([late_arrival(0, 5, 13.0, 8.1, 40 * MS)]) == ([5], [])
    assert first([kernel_finding(0, 5, 9.0, 25 * MS, kernel="flash_bwd", own_z=9.0)]) == ([5], [])


def test_a_fault_that_makes_the_whole_step_vary_is_weighed_against_the_jobs_earlier_noise():
    """Step 1b's noise is the smaller of the window's and the job's earlier windows' (median): an
    intermittent delay on one rank makes every rank's step vary (they wait for it), and measured in its
    own window the delay would be its own yardstick. The first window has no past; a calm window after
    a noisy one keeps its own (smaller) noise."""
    p = Persistence(2, 3)
    assert p.step_noise(30 * MS) == 30 * MS
    assert p.step_noise(1300 * MS) == 30 * MS                 # the faulty window against the calm one
    assert p.step_noise(20 * MS) == 20 * MS
    assert p.step_noise(900 * MS) == 30 * MS                  # median of 30, 1300, 20


def test_a_flag_the_steps_own_noise_explains_does_not_repeat_into_a_suspect():
    """Merge step 3b: beside a busy process a CPU job's steps vary by 8 %; a host-timed finding costing
    3 % of the step (σ/√10 = 2.5 %: within two standard errors of the window's mean step) in two
    windows of three stays pending. The same 3 % on a calm host (1 % noise), or 20 % on the busy one,
    is named in the second window."""
    res = resources()
    for sd, cost, named in ((8.0, 3.0, False), (1.0, 3.0, True), (8.0, 20.0, True)):
        p = Persistence(2, 3)
        for i in range(2):
            jw = noisy_window(i, sd)
            f = kernel_finding(i, 5, 12.0, cost * MS, host_timed=True)
            v = merge("j", win(i), [f], res, jw=jw, step_ns=100 * MS, persistence=p)
        assert ([s.rank for s in v.ranks] == [5]) is named, (sd, cost, v.summary)
        assert named or list(v.pending) == [5]


def loader_finding(i, rank, cost_ms):
    """An L2 straggler in the data loader phase, as ``l2_phases`` flags a rank against its peers."""
    ev = {"direction": "slower", "ratio": 10.0, "significance_z": 6.0}
    return Finding(level="L2", kind="straggler", job_id="j", window=win(i), scope=Scope(phase="dataloader", group="dp"),
                   suspects=(SuspectRank(rank, 6.0, ev, impact_ns=cost_ms * MS),))


def with_loader_stats(jw, slow: int, p50_ms: float, max_ms: float):
    """Every rank's data loader over the window's 10 iterations: 0.6 ms median, bursts to 8 ms; ``slow``'s
    median and max as given."""
    for r in jw.iterations:
        pw = records_pb2.PhaseWindow()
        p50, top = (p50_ms, max_ms) if r == slow else (0.6, 8.0)
        pw.phases.add(phase="dataloader", count=10, p50_ns=p50 * MS, max_ns=top * MS, mean_ns=p50 * MS,
                      p99_ns=top * MS)
        jw.phases[r] = pw
    return jw


def test_a_phase_slow_in_its_median_iteration_counts_however_noisy_the_step():
    """Merge step 3b's second test: beside a busy process the step varied by 60 % (σ measured 40 %:
    the bar, 2σ/√10, 27 % of the step) and a data loader 20 ms slower in its median iteration (20 % of
    the step) sat under it; against its own phase's spread (bursts to 8 ms) it is far out, and it is
    named in the second window. The scheduler's bursts (median 0.6 ms like its peers, one occurrence at
    80 ms, the same mean cost) stay pending."""
    res = {r: dataclasses.replace(x, device="cpu") for r, x in resources(world=4).items()}
    for p50, top, named in ((21.0, 35.0, True), (0.6, 80.0, False)):
        p = Persistence(2, 3)
        for i in range(2):
            jw = with_loader_stats(noisy_window(i, 60.0, world=4), 2, p50, top)
            v = merge("j", win(i), [loader_finding(i, 2, 20.0)], res, jw=jw, step_ns=100 * MS, persistence=p)
        assert ([s.rank for s in v.ranks] == [2]) is named, (p50, top, v.summary)
        assert named or list(v.pending) == [2]


def test_a_waiter_whose_chain_ends_at_a_pending_rank_is_not_named(monkeypatch):
    """Merge step 3: a waiter is named only with the rank it waited for, along chains: rank 3 waited for
    rank 1 (measured), rank 1 for rank 0 in another group, and rank 0 is flagged for the first time
    (pending). Rank 1 is pending with it, and so is rank 3: nobody is named alone."""
    from trainscope.analyzer.attribution import Evidence, RankVerdict
    from trainscope.analyzer import merge as merge_mod
    res = resources(4)

    def waiter(r, on):
        e = Evidence(r, "collectives", "collective_wait", f"wait{r}", True, True, 2.0, 9 * MS, waited_for=on)
        return RankVerdict(r, "waiter", 9 * MS, 9 * MS, waited_for=on, evidence=[e])
    flagged = {0: RankVerdict(0, "culprit", 10 * MS, 10 * MS), 1: waiter(1, 0), 3: waiter(3, 1)}
    monkeypatch.setattr(merge_mod, "attribute", lambda *a, **k: list(flagged.values()))
    p = Persistence(2, 3)
    places = {r: merge_mod._places_of(rv) for r, rv in flagged.items() if r != 0}
    p.update(0, places)                                           # the waiters were flagged before: held
    v = merge("j", win(1), [kernel_finding(1, 0, 3.0, 10 * MS)], res, step_ns=100 * MS, persistence=p)
    assert not v.ranks and sorted(v.pending) == [0, 1, 3], v.summary
