"""CDF reconstruction from (count, p50, p99) clusters and W1 (ARGUS §6.2)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from trainscope.analyzer.cdf import (
    Z99,
    empirical_cdf,
    log_grid,
    lognormal_params,
    mixture_cdf,
    mixture_cdfs,
    support,
    trapezoid_weights,
    w1,
    w1_to_samples,
)
from trainscope.processor.kde import cluster_keys


def mixture_mean(counts, p50, p99) -> float:
    """E[X] of the lognormal mixture: Σ w_c exp(μ_c + σ_c²/2)."""
    mu, sigma = lognormal_params(p50, p99)
    w = np.asarray(counts, float) / np.sum(counts)
    return float(np.sum(w * np.exp(mu + sigma**2 / 2)))


def test_log_grid_is_geometric_and_checks_arguments():
    g = log_grid(10.0, 1e4, 31)
    assert g[0] == pytest.approx(10.0) and g[-1] == pytest.approx(1e4)
    np.testing.assert_allclose(g[1:] / g[:-1], 10 ** 0.1)
    for lo, hi, n in [(0.0, 1.0, 5), (2.0, 1.0, 5), (1.0, 2.0, 1), (1.0, np.inf, 5)]:
        with pytest.raises(ValueError):
            log_grid(lo, hi, n)


def test_one_cluster_is_scipy_lognormal():
    p50, p99 = 2000.0, 5000.0
    grid = log_grid(100.0, 1e5, 400)
    sigma = (math.log(p99) - math.log(p50)) / 2.326
    expect = stats.lognorm(s=sigma, scale=p50).cdf(grid)
    np.testing.assert_allclose(mixture_cdf([7], [p50], [p99], grid), expect, rtol=1e-12, atol=1e-15)
    # p99 sits where the standard normal's 2.326 does: F(p99) = Φ(2.326).
    assert mixture_cdf([1], [p50], [p99], [p99])[0] == pytest.approx(stats.norm.cdf(Z99), abs=1e-12)


def test_mixture_weights_by_count_and_point_clusters_are_steps():
    grid = log_grid(1.0, 1e6, 601)
    f = mixture_cdf([300, 100], [100.0, 1e4], [110.0, 1.1e4], grid)
    # Between the two far-apart clusters the CDF rests at the first one's weight.
    between = (grid > 300) & (grid < 3000)
    np.testing.assert_allclose(f[between], 0.75, atol=1e-9)
    assert np.all(np.diff(f) >= -1e-15) and f[0] < 1e-9 and f[-1] == pytest.approx(1.0)
    step = mixture_cdf([5], [1000.0], [1000.0], grid)
    assert np.array_equal(step, (grid >= 1000.0).astype(float))


def test_batched_cdfs_equal_one_at_a_time():
    rng = np.random.default_rng(0)
    n_dists = 6
    owner = rng.permutation(np.repeat([0, 1, 2, 4, 5], [1, 3, 2, 1, 2]))
    counts = rng.integers(1, 100, owner.size)
    p50 = rng.uniform(1e3, 1e5, owner.size)
    p99 = p50 * rng.uniform(1.0, 3.0, owner.size)
    p99[0] = p50[0]  # a point cluster
    grid = log_grid(*support(p50, p99), 256)
    f = mixture_cdfs(counts, p50, p99, owner, n_dists, grid)
    assert f.shape == (n_dists, 256)
    for d in range(n_dists):
        sel = owner == d
        if sel.any():
            np.testing.assert_allclose(f[d], mixture_cdf(counts[sel], p50[sel], p99[sel], grid), atol=1e-14)
        else:
            assert np.isnan(f[d]).all()  # no clusters: no CDF
    with pytest.raises(ValueError):
        mixture_cdfs(counts, p50, p99, owner, 3, grid)


def test_w1_identity_symmetry_and_triangle():
    grid = log_grid(10.0, 1e6, 1024)
    a = mixture_cdf([10, 5], [1e3, 5e3], [2e3, 8e3], grid)
    b = mixture_cdf([10], [1.5e3], [4e3], grid)
    c = mixture_cdf([3, 3], [800.0, 2e4], [900.0, 3e4], grid)
    assert w1(a, a, grid) == 0.0
    assert w1(a, b, grid) == w1(b, a, grid) > 0
    assert w1(a, c, grid) <= w1(a, b, grid) + w1(b, c, grid)
    # Broadcasting: one row against many at once.
    many = w1(a, np.stack([a, b, c]), grid)
    np.testing.assert_allclose(many, [0.0, w1(a, b, grid), w1(a, c, grid)])
    # W1 as a weighted L1 norm (what a prefix-sum detector relies on).
    assert w1(a, b, grid) == pytest.approx(np.trapezoid(np.abs(a - b), grid), rel=1e-12)
    assert trapezoid_weights(grid).sum() == pytest.approx(grid[-1] - grid[0])


@pytest.mark.parametrize("k", [1.1, 1.5, 3.0])
def test_w1_of_a_scaled_distribution_is_the_mean_shift(k):
    # X and kX (k > 1) are ordered, so W1 = E[kX] - E[X] = (k - 1) E[X].
    counts, p50, p99 = [60, 30, 10], np.array([1e3, 4e3, 2e4]), np.array([1.5e3, 6e3, 3e4])
    grid = log_grid(*support(np.r_[p50, k * p50], np.r_[p99, k * p99], z=7.0), 8192)
    fa = mixture_cdf(counts, p50, p99, grid)
    fb = mixture_cdf(counts, k * p50, k * p99, grid)
    assert w1(fa, fb, grid) == pytest.approx((k - 1) * mixture_mean(counts, p50, p99), rel=2e-3)


def test_w1_of_two_points_is_their_distance():
    grid = log_grid(100.0, 1e4, 20001)
    fa, fb = mixture_cdf([1], [1000.0], [1000.0], grid), mixture_cdf([1], [3000.0], [3000.0], grid)
    assert w1(fa, fb, grid) == pytest.approx(2000.0, rel=1e-3)


def test_empirical_cdf_counts_ties():
    grid = np.array([0.5, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(empirical_cdf([1.0, 1.0, 2.0, 5.0], grid), [0.0, 0.5, 0.75, 0.75])


@pytest.mark.parametrize("shape", ["one", "two", "three"])
def test_fidelity_of_clusters_is_small_relative_to_median(shape):
    rng = np.random.default_rng(1)
    spec = {"one": [(5e3, 20_000)], "two": [(5e3, 15_000), (2e4, 5_000)],
            "three": [(2e3, 8_000), (8e3, 8_000), (4e4, 4_000)]}[shape]
    d = np.concatenate([rng.lognormal(math.log(m), 0.15, n) for m, n in spec])
    t = cluster_keys(d, np.zeros(d.size, np.int64), 1)
    assert len(t) == len(spec)
    err = w1_to_samples(d, t.count, t.p50, t.p99) / np.median(d)
    assert err < 0.01
    # Cross-check against scipy's exact sample W1 with a large draw from the mixture.
    mu, sigma = lognormal_params(t.p50, t.p99)
    comp = rng.choice(len(t), 200_000, p=t.count / t.count.sum())
    draw = np.exp(rng.normal(mu[comp], sigma[comp]))
    assert w1_to_samples(d, t.count, t.p50, t.p99) == pytest.approx(
        stats.wasserstein_distance(d, draw), rel=0.35, abs=0.002 * np.median(d)
    )


def test_fidelity_sees_a_bad_summary():
    rng = np.random.default_rng(2)
    d = rng.lognormal(math.log(5e3), 0.15, 10_000)
    good = w1_to_samples(d, [d.size], [np.median(d)], [np.percentile(d, 99)])
    bad = w1_to_samples(d, [d.size], [1.2 * np.median(d)], [1.2 * np.percentile(d, 99)])
    assert good < 0.01 * np.median(d)
    assert bad == pytest.approx(0.2 * d.mean(), rel=0.05)
