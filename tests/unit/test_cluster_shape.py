"""A kernel cluster's shape (issue #15 item 2): p10..p90 packed in ``KernelCluster.shape``, the
piecewise rebuild from its knots (``analyzer/cdf.py``), and the analyzer reading it from the wire."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer import l3_kernels
from trainscope.analyzer.cdf import (
    KNOT_LEVELS, cluster_knots, empirical_cdf, knot_cdf, log_grid, mixture_cdf, support, w1, w1_to_samples,
)
from trainscope.analyzer.kernel_columns import kernel_columns
from trainscope.processor.kde import KdeConfig, cluster_keys
from trainscope.processor.model import ClosedWindow
from trainscope.processor.summarize import Summarizer
from trainscope.proto import cluster_shape
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2


def test_pack_unpack_round_trip_within_16_bits_of_log_range():
    rng = np.random.default_rng(1)
    lo = rng.uniform(1e3, 1e5, 200)
    hi = lo * rng.uniform(1.001, 1e3, 200)
    q = np.sort(np.exp(rng.uniform(np.log(lo)[:, None], np.log(hi)[:, None], (200, 4))), axis=1)
    back = cluster_shape.unpack(lo, hi, cluster_shape.pack(lo, hi, q))
    tol = np.log(hi / lo) / 65535 / 2 + 1e-12          # half a 16-bit step of ln(hi/lo)
    assert np.all(np.abs(np.log(back) - np.log(q)) <= tol[:, None])


def test_pack_marks_points_and_unsent_words():
    # a point cluster (min == max) sends 0 and reads back NaN ("not sent"); a real shape that is all
    # at min is never 0 (it would read as not sent)
    w = cluster_shape.pack([5.0, 1.0], [5.0, 10.0], [[5.0] * 4, [1.0] * 4])
    assert w[0] == 0 and w[1] != 0
    back = cluster_shape.unpack([5.0, 1.0], [5.0, 10.0], w)
    assert np.isnan(back[0]).all() and np.allclose(back[1], 1.0, rtol=1e-4)


def test_knots_use_the_shape_or_interpolate_without_it_and_lognormal_without_min_max():
    p50, p99, lo, hi = np.array([100.0] * 3), np.array([400.0] * 3), np.array([50.0] * 3), np.array([800.0] * 3)
    q = np.array([[60.0, 80.0, 150.0, 300.0]] * 3)
    word = cluster_shape.pack(lo, hi, q)
    word[1] = 0
    k = cluster_knots(p50, p99, lo, hi, word)
    np.testing.assert_allclose(np.exp(k[0]), [50, 60, 80, 100, 150, 300, 400, 800], rtol=1e-4)
    # without a shape: linear in ln between (0, min), (0.5, p50) and (0.5, p50), (0.99, p99)
    expect = np.interp(KNOT_LEVELS, [0, 0.5, 0.99, 1], np.log([50, 100, 400, 800]))
    np.testing.assert_allclose(k[1], expect, rtol=1e-12)
    assert np.isnan(cluster_knots(p50, p99)).all()               # no min/max: lognormal
    bad = cluster_knots(p50, p99, [0.0, 150.0, 50.0], [800.0, 800.0, 300.0], word)
    assert np.isnan(bad).all()                                   # min unknown, min > p50, max < p99


def test_knot_cdf_is_exact_at_the_knots_and_steps_at_point_masses():
    knots = np.log(np.array([[1.0, 2, 3, 4, 5, 6, 7, 8], [3.0] * 8]))
    f = knot_cdf(knots, knots[:1])
    np.testing.assert_allclose(f[0], KNOT_LEVELS, atol=1e-12)
    np.testing.assert_array_equal(f[1], (knots[0] >= np.log(3.0)).astype(float))


def test_piecewise_rebuild_beats_the_lognormal_on_a_skewed_cluster():
    # a flat-topped cluster with a far tail of a few calls: the lognormal from p50/p99 misplaces the body
    rng = np.random.default_rng(4)
    d = np.concatenate([rng.uniform(9_000, 12_000, 990), rng.uniform(30_000, 40_000, 10)])
    t = cluster_keys(d, np.zeros(d.size, np.int64), 1)
    assert len(t) == 1
    word = cluster_shape.pack(t.min, t.max, t.quantiles)
    med = np.median(d)
    ln = w1_to_samples(d, t.count, t.p50, t.p99) / med
    pw = w1_to_samples(d, t.count, t.p50, t.p99, lo=t.min, hi=t.max, shape=word) / med
    no_shape = w1_to_samples(d, t.count, t.p50, t.p99, lo=t.min, hi=t.max) / med
    assert pw < 0.02 and pw < no_shape < ln and ln > 2 * pw


def test_mixture_of_split_small_key_is_exact():
    # 7 calls spread over three orders of magnitude: split at 1.5x gaps, each piece rebuilt in its range
    d = np.array([7e3, 11e3, 12e3, 14e3, 149e3, 244e3, 3844e3])
    t = cluster_keys(d, np.zeros(7, np.int64), 1)
    word = cluster_shape.pack(t.min, t.max, t.quantiles)
    grid = log_grid(*support(t.p50, t.p99, 4.0, t.min, t.max, word), 4096)
    err = w1(empirical_cdf(d, grid), mixture_cdf(t.count, t.p50, t.p99, grid, t.min, t.max, word), grid)
    assert err / np.median(d) < 0.02
    one = cluster_keys(d, np.zeros(7, np.int64), 1, KdeConfig(split_small=False))
    grid1 = log_grid(*support(one.p50, one.p99), 4096)
    assert w1(empirical_cdf(d, grid1), mixture_cdf(one.count, one.p50, one.p99, grid1), grid1) / np.median(d) > 1.0


def _window(rank: int, clusters) -> records_pb2.KernelWindow:
    kw = records_pb2.KernelWindow()
    for name, cl in clusters:
        ks = kw.kernels.add(kernel=name, stream=7, count=sum(c[0] for c in cl), total_ns=1e6)
        for c in cl:
            ks.clusters.add(count=c[0], p50_ns=c[1], p99_ns=c[2], min_ns=c[3], max_ns=c[4], shape=c[5])
    return kw


def test_wire_reader_and_l3_table_carry_min_and_shape():
    word = int(cluster_shape.pack([50.0], [800.0], [[60.0, 80.0, 150.0, 300.0]])[0])
    kernels = {0: _window(0, [("gemm", [(10, 100.0, 400.0, 50.0, 800.0, word), (2, 2000.0, 2000.0, 2000.0, 2000.0, 0)])]),
               1: _window(1, [("gemm", [(12, 110.0, 420.0, 55.0, 810.0, 0)]), ("old", [(3, 5.0, 9.0, 0.0, 0.0, 0)])])}
    c = kernel_columns(kernels)
    np.testing.assert_array_equal(c.cl_min, [50.0, 2000.0, 55.0, 0.0])
    np.testing.assert_array_equal(c.cl_shape, np.array([word, 0, 0, 0], np.uint64))
    fast, slow = l3_kernels.flatten_kernels(kernels), l3_kernels.flatten_messages(kernels)
    np.testing.assert_array_equal(fast.cl_knots, slow.cl_knots)
    np.testing.assert_allclose(np.exp(fast.cl_knots[0]), [50, 60, 80, 100, 150, 300, 400, 800], rtol=1e-4)
    assert np.allclose(np.exp(fast.cl_knots[1]), 2000.0)           # a point cluster: all knots equal
    assert np.isnan(fast.cl_knots[3]).all()                         # no min/max sent: lognormal


def test_processor_summary_sends_the_shape_and_the_analyzer_rebuilds_from_it():
    # one key of 200 calls: a wide body and a tail; the window's cluster carries p10..p90 in its shape
    rng = np.random.default_rng(9)
    d = np.rint(np.concatenate([rng.uniform(9_000, 12_000, 196), rng.uniform(20_000, 25_000, 4)]))
    k = KernelColumns.build(("gemm",), np.arange(d.size) * 100_000 + 1, d, np.zeros(d.size, np.int64),
                            np.full(d.size, 7))
    cw = ClosedWindow(resource=Resource(job_id="j", rank=0, world_size=1), window=records_pb2.Window(index=0),
                      kernels=k, phases=(), iterations=(), stacks=())
    out = Summarizer().kernels(cw, cw.resource.to_pb())
    (ks,) = out.kernels
    c = ks.clusters[0]
    want = np.percentile(d[(d >= c.min_ns) & (d <= c.max_ns)], [10, 25, 75, 90])
    np.testing.assert_allclose(cluster_shape.unpack([c.min_ns], [c.max_ns], [c.shape])[0], want, rtol=1e-4)
    t = l3_kernels.flatten_kernels({0: out})
    assert not np.isnan(t.cl_knots).any()


def test_batched_mixture_cdfs_with_knots_equal_one_at_a_time():
    from trainscope.analyzer.cdf import mixture_cdfs
    rng = np.random.default_rng(3)
    n = 12
    lo = rng.uniform(1e3, 2e3, n)
    hi = lo * rng.uniform(1.0, 50.0, n)
    q = np.sort(np.exp(rng.uniform(np.log(lo)[:, None], np.log(hi)[:, None], (n, 6))), axis=1)
    p50, p99, inner = q[:, 2], q[:, 5], q[:, [0, 1, 3, 4]]
    word = cluster_shape.pack(lo, hi, inner)
    counts = rng.integers(1, 40, n)
    owner = rng.integers(0, 4, n)
    grid = log_grid(500.0, 2e5, 300)
    f = mixture_cdfs(counts, p50, p99, owner, 4, grid, lo, hi, word)
    for dd in range(4):
        s = owner == dd
        np.testing.assert_allclose(f[dd], mixture_cdf(counts[s], p50[s], p99[s], grid, lo[s], hi[s], word[s]),
                                   atol=1e-12)
    assert np.all(np.diff(f, axis=1) >= -1e-12) and np.allclose(f[:, -1], 1.0)
