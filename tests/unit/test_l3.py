"""L3 kernel-distribution outliers across ranks (ARGUS §6.2)."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.cdf import log_grid, mixture_cdfs, support, trapezoid_weights, w1
from trainscope.analyzer.l3_kernels import (
    KernelTable, L3Config, _cdf_block, _key_grids, abs_dev_sums, analyze_kernels, flatten_kernels,
    kernel_findings, mean_w1_to_peers, score_kernels,
)
from trainscope.analyzer.model import JobWindow
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas"
KEYS = [(GEMM, 7, [(400, 180e3, 230e3)]),
        ("flash_fwd_kernel", 7, [(200, 95e3, 120e3)]),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 32, [(40, 2.1e6, 3.3e6), (8, 9e6, 1.3e7)]),
        ("Memcpy HtoD (Pageable -> Device)", 7, [(10, 12e3, 12e3)])]     # a point mass


def job(world, *, tp=1, pp=1, seed=0, noise=0.01, edit=None, device="cuda", keys=KEYS) -> JobWindow:
    """Every rank runs ``keys`` with lognormal rank-to-rank noise; ``edit(rank, key, clusters)`` alters one."""
    rng = np.random.default_rng(seed)
    win = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=3, first_iteration=30,
                             last_iteration=39)
    jw = JobWindow(job_id="j", window=win)
    for r in range(world):
        # GPU kernels: device-timed (a rank without a device counts as a CPU-operator source, host-timed)
        res = Resource(job_id="j", rank=r, world_size=world, device=f"cuda:{r % 8}" if device == "cuda" else device,
                       coords=coords_for_rank(r, world, tp=tp, pp=pp))
        jw.resources[r] = res
        kw = records_pb2.KernelWindow(resource=res.to_pb(), window=win)
        for k, (name, stream, clusters) in enumerate(keys):
            cl = []
            for count, p50, p99 in clusters:
                f = np.exp(rng.normal(0.0, noise))
                tail = p99 / p50 * np.exp(rng.normal(0.0, 3 * noise)) if p99 > p50 else 1.0
                cl.append((int(count), p50 * f, p50 * f * tail))
            if edit is not None:
                cl = edit(r, k, cl)
            if cl is None:
                continue
            # exact busy time of lognormal clusters: count · p50 · e^(σ²/2)
            total = sum(c * p50 * np.exp((np.log(p99 / p50) / 2.326) ** 2 / 2) for c, p50, p99 in cl)
            ks = kw.kernels.add(kernel=name, stream=stream, count=sum(c for c, _, _ in cl), total_ns=total)
            for c, p50, p99 in cl:
                ks.clusters.add(count=c, p50_ns=p50, p99_ns=p99, min_ns=p50 * 0.9, max_ns=p99 * 1.1)
        jw.kernels[r] = kw
    return jw


def brute_mean_w1(cdfs, grid):
    n = cdfs.shape[0]
    return np.array([sum(w1(cdfs[a], cdfs[b], grid) for b in range(n) if b != a) / (n - 1)
                     for a in range(n)])


def test_prefix_sum_mean_w1_equals_all_pairs_on_random_cdfs():
    rng = np.random.default_rng(7)
    for n in (2, 3, 5, 64, 257):
        counts = rng.integers(1, 50, 2 * n)
        p50 = rng.uniform(1e3, 1e5, 2 * n)
        p99 = p50 * rng.uniform(1.0, 4.0, 2 * n)
        owner = np.repeat(np.arange(n), 2)
        grid = log_grid(500.0, 1e6, 97)
        f = mixture_cdfs(counts, p50, p99, owner, n, grid)
        f[n // 2] = f[0]                       # ties must not matter
        fast = mean_w1_to_peers(f, trapezoid_weights(grid))
        np.testing.assert_allclose(fast, brute_mean_w1(f, grid), rtol=1e-12, atol=1e-9)
    # batched (groups × grid × ranks) with one weight row per group
    v = rng.random((3, 11, 9))
    w = rng.random((3, 11))
    expect = np.abs(v[..., :, None] - v[..., None, :]).sum(-1)
    np.testing.assert_allclose(abs_dev_sums(v, w), (expect * w[..., None]).sum(1), rtol=1e-12)


def test_scores_from_the_table_equal_brute_force_on_cdf_module():
    jw = job(16, seed=3, noise=0.05)
    t = flatten_kernels(jw.kernels)
    cfg = L3Config(grid_points=64)
    res = score_kernels(t, np.zeros(16, dtype=np.int64), cfg)
    assert res.segments_scored == len(KEYS) and res.dists_scored == 16 * len(KEYS)
    # Bonferroni family: every (rank, key) plus every (rank, category) comparison
    assert res.comparisons == 16 * len(KEYS) + 16 * 3
    # rebuild one key by hand with cdf.mixture_cdfs on the same kind of grid
    k = 2
    d = np.flatnonzero(t.dist_key == k)
    cl = np.concatenate([np.arange(t.cl_start[i], t.cl_start[i + 1]) for i in d])
    owner = np.repeat(np.arange(d.size), np.diff(t.cl_start)[d])
    grid = log_grid(*support(t.cl_p50[cl], t.cl_p99[cl], cfg.support_z, knots=t.cl_knots[cl]), cfg.grid_points)
    f = mixture_cdfs(t.cl_count[cl], t.cl_p50[cl], t.cl_p99[cl], owner, d.size, grid, knots=t.cl_knots[cl])
    order = np.argsort(t.dist_key, kind="stable")
    key_first = np.flatnonzero(np.r_[True, np.diff(t.dist_key[order]) != 0])
    lgrid, wgrid, mu, sigma = _key_grids(t, order, key_first, cfg)
    mine = _cdf_block(t, d, np.full(d.size, k), lgrid, mu, sigma, 0, cfg.grid_points)
    np.testing.assert_allclose(mine, f, atol=1e-12)
    np.testing.assert_allclose(mean_w1_to_peers(mine, wgrid[k]), brute_mean_w1(f, grid), rtol=1e-9)


def _flagged(findings, kind="degraded_kernel"):
    return [(f.scope.kernel, f.scope.group_index, [s.rank for s in f.suspects]) for f in findings
            if f.kind == kind]


def test_shifted_distribution_names_the_rank_and_kernel():
    def slow(r, k, cl):
        return [(c, p50 * 1.3, p99 * 1.3) for c, p50, p99 in cl] if (r, k) == (13, 0) else cl
    jw = job(32, edit=slow)
    found = analyze_kernels(jw)
    assert _flagged(found) == [(GEMM, 0, [13])]
    f = [f for f in found if f.kind == "degraded_kernel"][0]
    s = f.suspects[0]
    assert f.level == "L3" and f.scope.stream == 7 and f.scope.group == "dp"
    assert s.evidence["ratio"] == pytest.approx(1.3, rel=0.05)
    assert s.evidence["z"] >= s.evidence["z_threshold"] and s.evidence["count"] == 400
    # impact: the extra busy time per iteration (10 iterations in the window)
    assert s.impact_ns == pytest.approx(s.evidence["time_per_iteration_ns"] - s.evidence["group_median_ns"])
    assert s.impact_ns == pytest.approx(0.3 * 400 * 180e3 / 10, rel=0.1)
    assert f.to_pb().suspects[0].rank == 13


def test_a_sampled_kernel_source_is_priced_per_iteration_it_covered():
    """The same shift seen by a source that recorded 2 of the window's 10 iterations (the
    CPU-operator sampler; ``KernelWindow.iterations`` = 2 on every rank): its busy time is over 2
    iterations, so the rank's impact is 5x what dividing by 10 gives, the cost it really has."""
    def slow(r, k, cl):
        return [(c, p50 * 1.3, p99 * 1.3) for c, p50, p99 in cl] if (r, k) == (13, 0) else cl
    full = analyze_kernels(job(32, edit=slow))
    sampled = job(32, edit=slow)
    for kw in sampled.kernels.values():
        kw.iterations = 2
    part = analyze_kernels(sampled)
    assert _flagged(part) == _flagged(full) == [(GEMM, 0, [13])]
    [a] = [f.suspects[0].impact_ns for f in full if f.kind == "degraded_kernel"]
    [b] = [f.suspects[0].impact_ns for f in part if f.kind == "degraded_kernel"]
    assert b == pytest.approx(5 * a, rel=1e-6)


def test_tail_only_inflation_is_found_ecc_like():
    # same median, 2 % of the calls ten times slower: intermittent retries (ARGUS Table 6, ECC)
    def tail(r, k, cl):
        return cl + [(4, cl[0][1] * 10, cl[0][1] * 12)] if (r, k) == (5, 1) else cl
    found = analyze_kernels(job(24, edit=tail))
    assert _flagged(found) == [("flash_fwd_kernel", 0, [5])]
    ev = [f for f in found if f.kind == "degraded_kernel"][0].suspects[0].evidence
    # the median did not move; the time did (the tail costs busy time)
    assert ev["p50_ns"] == pytest.approx(ev["group_median_p50_ns"], rel=0.05)
    assert ev["ratio"] == pytest.approx(1.18, abs=0.05)
    assert ev["time_per_iteration_ns"] > ev["group_median_ns"] and ev["direction"] == "slower"


def test_own_z_keeps_a_shift_and_discounts_a_tail():
    """Step 5f: every flagged rank carries ``own_z``, its excess against the larger of the peers'
    spread and its own calls' sampling error. A 1.3x shift moves every call and keeps its z; a tail
    of 4 calls 10x the rest (still flagged: the decision keeps the peers' error) is within a few of
    its own standard errors, so the sequential test does not read it as ten iterations of evidence."""
    def shift(r, k, cl):
        return [(c, p50 * 1.3, p99 * 1.3) for c, p50, p99 in cl] if (r, k) == (13, 0) else cl

    def tail(r, k, cl):
        return cl + [(4, cl[0][1] * 10, cl[0][1] * 12)] if (r, k) == (5, 1) else cl
    [s] = [f.suspects[0] for f in analyze_kernels(job(24, edit=shift)) if f.kind == "degraded_kernel"]
    assert s.rank == 13 and s.evidence["own_z"] == pytest.approx(s.evidence["z"], rel=0.1)
    [s] = [f.suspects[0] for f in analyze_kernels(job(24, edit=tail)) if f.kind == "degraded_kernel"]
    assert s.rank == 5 and s.evidence["z"] >= s.evidence["z_threshold"]
    assert 0 < s.evidence["own_z"] < s.evidence["z"] / 2


def test_host_timed_operators_need_a_slower_typical_call():
    """Step 5c for CPU operators (host-timed): the scheduler preempts a rank at any call, often at
    two in one window. Two preempted calls of 14 (each ~20x the typical call, the rank 1.5x its
    peers in total), or one sampled call 50x its peers', name nobody; every call 3x slower does."""
    op = ("autograd::engine::evaluate_function: AddmmBackward0", 1, [(14, 20e3, 30e3)])
    single = ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1, [(1, 240e3, 240e3)])

    def run(edit):
        saved = list(KEYS)
        KEYS[:] = [op, single]
        try:
            found = analyze_kernels(job(4, seed=5, edit=edit, device="cpu"))
            return sorted({s.rank for f in found if f.kind in ("degraded_kernel", "degraded_kernels")
                           for s in f.suspects})
        finally:
            KEYS[:] = saved

    def preempted(r, k, cl):   # two of its 14 calls preempted: 11 ms and 6 ms
        return [(12, cl[0][1], cl[0][2]), (1, 11e6, 11e6), (1, 6e6, 6e6)] if (r, k) == (2, 0) else cl

    def one_call(r, k, cl):    # its one sampled call of the data loader, 50x
        return [(1, 50 * cl[0][1], 50 * cl[0][1])] if (r, k) == (2, 1) else cl

    def slower(r, k, cl):      # every call 3x (4 host-timed ranks: a Student t threshold of 3 degrees of freedom)
        return [(c, 3.0 * a, 3.0 * b) for c, a, b in cl] if (r, k) == (2, 0) else cl

    assert run(None) == []
    assert run(preempted) == []
    assert run(one_call) == []
    assert run(slower) == [2]


def test_one_spiked_call_of_a_big_once_per_step_kernel_names_nobody_but_a_shift_does():
    """Step 5c, the false alarm of jobs built from the real embedding-heavy streams: a kernel
    run once per step (5 calls a window, ~3 % of the step each) whose one call spiked ×3 on
    one rank is a spike, not a slow rank; the same kernel 1.3× slower on every call is."""
    big = ("split_embedding_codegen_forward_unweighted_kernel", 7, [(5, 2.5e6, 2.6e6)])

    def run(edit):
        saved = list(KEYS)
        KEYS.append(big)
        try:
            return analyze_kernels(job(16, seed=3, edit=edit))
        finally:
            KEYS[:] = saved

    def spike(r, k, cl):   # one call at 3x: the KDE keeps it as its own cluster of one
        return [(4, cl[0][1], cl[0][2]), (1, 3 * cl[0][1], 3 * cl[0][1])] if (r, k) == (6, 4) else cl

    def shift(r, k, cl):
        return [(c, p50 * 1.3, p99 * 1.3) for c, p50, p99 in cl] if (r, k) == (6, 4) else cl
    assert _flagged(run(spike)) == []
    assert _flagged(run(shift)) == [(big[0], 0, [6])]


def test_many_kernels_each_significantly_slower_cost_their_summed_excess():
    """Step 5d: rank 7 runs six small GEMMs 1.3x slower, each significant but each a small share of the
    step; the compute sum (5b) hides it under a large kernel whose time differs 8 % from rank to rank.
    One ``degraded_kernels`` finding prices the six together; the healthy twin and two slow kernels
    (under ``min_many_kernels``) give no such finding."""
    small = [(f"gemm_{i}", 7, [(100, 50e3, 60e3)]) for i in range(6)]
    keys = [("big_gemm", 7, [(100, 2e6, 2.4e6)])] + small
    spread = np.exp(np.random.default_rng(1).normal(0.0, 0.08, 32))

    def run(slow_kernels, rank=7):
        def edit(r, k, cl):
            f = spread[r] if k == 0 else 1.3 if (r == rank and 1 <= k <= slow_kernels) else 1.0
            return [(c, p50 * f, p99 * f) for c, p50, p99 in cl]
        return analyze_kernels(job(32, keys=keys, edit=edit))

    found = run(6)
    assert sorted(k for k, _, ranks in _flagged(found) if ranks == [7]) == sorted(n for n, _, _ in small)
    assert not [f for f in found if f.kind == "degraded_kernel" and f.scope.kernel == "big_gemm"]
    (many,) = [f for f in found if f.kind == "degraded_kernels"]
    (s,) = many.suspects
    assert many.scope.kernel == "[compute]" and s.rank == 7 and s.evidence["significant_kernels"] == 6
    each = [x.impact_ns for f in found if f.kind == "degraded_kernel" for x in f.suspects]
    assert s.impact_ns == pytest.approx(sum(each)) and s.impact_ns == pytest.approx(6 * 0.3 * 100 * 50e3 / 10, rel=0.1)
    assert s.evidence["ratio"] == pytest.approx(1.3, rel=0.05) and s.score >= s.evidence["z_threshold"]
    assert not [f for f in run(2) if f.kind == "degraded_kernels"]
    assert not [f for f in run(0) if f.level == "L3" and not f.informational]


def test_a_rank_whose_typical_kernel_is_slower_is_named_with_its_categorys_excess():
    """Step 5e: rank 7 runs every compute kernel 1.1x slower (a throttled GPU). Each kernel carries a
    per-(rank, kernel) personality of σ 0.03 (docs/noise.md), so too few kernels are significant alone, and
    the compute sum is hidden under a large kernel whose time differs 8 % from rank to rank. The median
    of its 25 kernels' ratios to their peers is significant: one ``degraded_kernels`` finding, its impact
    the compute time beyond the peers' pace. Healthy twins (four seeds) and the same slowdown on
    host-timed CPU operators (a preempted rank is slower everywhere at once) give no such finding."""
    keys = [("big_gemm", 7, [(100, 2e6, 2.4e6)])] + [(f"gemm_{i}", 7, [(100, 50e3, 60e3)]) for i in range(24)]
    spread = np.exp(np.random.default_rng(1).normal(0.0, 0.08, 32))

    def run(factor, seed=0, device="cuda"):
        def edit(r, k, cl):
            f = (spread[r] if k == 0 else 1.0) * (factor if r == 7 else 1.0)
            return [(c, p50 * f, p99 * f) for c, p50, p99 in cl]
        return analyze_kernels(job(32, keys=keys, edit=edit, noise=0.03, seed=seed, device=device))

    found = run(1.1)
    assert len([f for f in found if f.kind == "degraded_kernel"]) < L3Config().min_many_kernels   # not 5d
    (typ,) = [f for f in found if f.kind == "degraded_kernels"]
    (s,) = typ.suspects
    assert typ.scope.kernel == "[compute]" and s.rank == 7 and typ.evidence["rule"].startswith("L3 step 5e")
    assert s.score >= s.evidence["z_threshold"] and s.evidence["ratio"] == pytest.approx(1.1, rel=0.03)
    compute = s.evidence["time_per_iteration_ns"]
    assert s.impact_ns == pytest.approx(compute * (1 - 1 / 1.1), rel=0.3)
    for seed in range(4):
        assert not [f for f in run(1.0, seed) if f.level == "L3" and not f.informational], seed
    assert not [f for f in run(1.1, device="cpu") if f.kind == "degraded_kernels"]


def test_more_of_a_heavy_tail_on_one_rank_is_within_its_sampling_error():
    """Step 5c's sampling-error floor in a group of 8 (not only under ``SMALL_GROUP``): host-to-device
    copies with a heavy tail (84 calls, a few ~10x the rest, as in a real stream); one healthy rank drew
    8 big calls where its peers drew 4, 1.4x their total, far outside their MAD but within the sampling
    error of 84 such calls. Not flagged; the same copies 1.4x slower in every call are."""
    copy = "Memcpy HtoD (Pinned -> Device)"

    def run(edit):
        return analyze_kernels(job(8, keys=[(copy, 25, [(80, 50e3, 60e3), (4, 500e3, 600e3)])], edit=edit))

    def more_tail(r, k, cl):
        return [(76, *cl[0][1:]), (8, *cl[1][1:])] if r == 3 else cl
    assert not [f for f in run(more_tail) if f.level == "L3" and not f.informational]

    def slower(r, k, cl):
        return [(c, p50 * 1.4, p99 * 1.4) for c, p50, p99 in cl] if r == 3 else cl
    found = [f for f in run(slower) if f.kind == "degraded_kernel"]
    assert [[s.rank for s in f.suspects] for f in found] == [[3]]


def test_a_kde_merge_of_the_same_distribution_is_not_flagged():
    # the processor merged the two ReduceScatter modes on rank 4 (few samples near the valley): the rebuilt
    # CDF crosses its peers' and W1 is large, but the exact mean and max did not move (module step 5b)
    jw = job(32)
    ks = jw.kernels[4].kernels[2]
    lo, hi = ks.clusters[0].min_ns, max(c.max_ns for c in ks.clusters)
    del ks.clusters[:]
    ks.clusters.add(count=48, p50_ns=2.6e6, p99_ns=1.2e7, min_ns=lo, max_ns=hi)
    t = flatten_kernels(jw.kernels)
    # W1 alone would single it out: rank 4 is by far the farthest from its peers
    k = 2
    d = np.flatnonzero(t.dist_key == k)
    order = np.argsort(t.dist_key, kind="stable")
    key_first = np.flatnonzero(np.r_[True, np.diff(t.dist_key[order]) != 0])
    cfg = L3Config()
    lgrid, wgrid, mu, sigma = _key_grids(t, order, key_first, cfg)
    w = mean_w1_to_peers(_cdf_block(t, d, np.full(d.size, k), lgrid, mu, sigma, 0, cfg.grid_points), wgrid[k])
    assert t.dist_rank[d][np.argmax(w)] == 4 and w.max() > 5 * np.median(w)
    # ... but its busy time did not move: no finding
    assert analyze_kernels(jw) == []


def test_a_late_arrivers_shorter_collective_is_flagged_as_faster():
    def late(r, k, cl):    # peers wait for rank 11 inside the collective: its kernel is the short one
        return [(c, p50 * 0.6, p99 * 0.6) for c, p50, p99 in cl] if (r, k) == (11, 2) else cl
    found = analyze_kernels(job(16, edit=late))
    # not slower there: never "degraded" (issue #22), its own kind
    assert not [f for f in found if f.kind.startswith("degraded_kernel")]
    [f] = [f for f in found if f.kind == "late_arrival" and not f.scope.kernel.startswith("[")]
    s = f.suspects[0].evidence
    assert f.suspects[0].rank == 11 and s["direction"] == "faster" and s["role"] == "late_arriver"
    assert s["ratio"] == pytest.approx(0.6, abs=0.03)
    # the communication category says the same, about the same rank
    assert {x.rank for g in found for x in g.suspects} == {11}


def test_groups_are_respected_and_each_group_judged_alone():
    # tp=2: ranks of tp coordinate 1 run a 2x slower kernel (different role): not an outlier
    def role(r, k, cl):
        if k == 0 and r % 2 == 1:
            cl = [(c, p50 * 2, p99 * 2) for c, p50, p99 in cl]
        if (r, k) == (6, 0):
            cl = [(c, p50 * 1.25, p99 * 1.25) for c, p50, p99 in cl]
        return cl
    found = analyze_kernels(job(32, tp=2, edit=role))
    assert _flagged(found) == [(GEMM, 0, [6])]


@pytest.mark.parametrize("world", [8, 64, 1024])
def test_healthy_groups_yield_nothing(world):
    jw = job(world, seed=world, noise=0.01)
    assert analyze_kernels(jw) == []


def test_missing_kernel_is_reported_on_the_absent_rank():
    def hang(r, k, cl):
        return None if (r, k) == (9, 2) else cl      # rank 9 stopped entering the ReduceScatter
    found = analyze_kernels(job(16, tp=2, edit=hang))           # rank 9: tp=1, group 1 of 8 ranks
    miss = [f for f in found if f.kind == "missing_kernel"]
    assert [(f.scope.kernel, f.scope.stream, f.scope.group_index, [s.rank for s in f.suspects])
            for f in miss] == [("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 32, 1, [9])]
    assert miss[0].evidence["present_on"] == 7 and miss[0].evidence["group_size"] == 8
    # absent from a (possibly sampled) window is evidence, never a suspect: the stall rule names hangs
    assert miss[0].informational and not miss[0].to_pb().suspects
    assert miss[0].to_pb().evidence["candidates"][0]["rank"] == 9
    assert not _flagged(found)
    # absent on too many ranks of the group (a role difference, not a hang): nothing
    few = analyze_kernels(job(16, tp=2, edit=lambda r, k, cl: None if k == 2 and r in (1, 3, 5) else cl))
    assert [f for f in few if f.kind == "missing_kernel"] == []


def test_low_level_entry_point_and_empty_input():
    t = KernelTable.from_arrays(keys=[("k", 1)], ranks=[0, 1, 2, 3, 4], dist_rank=[0, 1, 2, 3, 4],
                                dist_key=[0] * 5, cl_start=[0, 1, 2, 3, 4, 5], cl_count=[10] * 5,
                                cl_p50=[100.0, 101, 99, 100, 200], cl_p99=[120.0, 121, 119, 120, 240])
    win = records_pb2.Window()
    found = kernel_findings("j", win, t, {0: [0, 1, 2, 3, 4]})
    assert [s.rank for s in found[0].suspects] == [4]
    assert analyze_kernels(JobWindow(job_id="j", window=win)) == []
    empty = flatten_kernels({0: records_pb2.KernelWindow()})
    bad = records_pb2.KernelWindow()
    ks = bad.kernels.add(kernel="k", stream=1)
    ks.clusters.add(count=5, p50_ns=0.0, p99_ns=10.0)            # malformed: dropped, with its key
    ks.clusters.add(count=0, p50_ns=5.0, p99_ns=10.0)            # empty: dropped
    assert flatten_kernels({0: bad}).dist_rank.size == 0
    with pytest.raises(ValueError):
        KernelTable.from_arrays([("k", 1)], [0], [0], [0], [0, 1], [3], [-1.0], [2.0])
    assert score_kernels(empty, np.zeros(1, dtype=np.int64)).segments_scored == 0


def test_config_is_validated():
    for field, bad in [("alpha", 0), ("grid_points", 4), ("min_ranks", 2), ("missing_min_present", 1.5),
                       ("false_alarm", 0.0), ("grid_points", 64.0), ("false_alarm", 1.0),
                       ("rel_floor", -0.1), ("min_many_kernels", 1),
                       ("typical_min_kernels", 2), ("typical_floor", -0.01)]:
        with pytest.raises(ConfigError) as e:
            L3Config(**{field: bad})
        assert e.value.setting == f"l3.{field}"
