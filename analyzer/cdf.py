"""CDFs rebuilt from kernel cluster summaries, and W1 between them (ARGUS §6.2).

A kernel's duration distribution on one rank arrives as a few clusters
``(count, p50, p99, min, max, shape)`` (ARGUS §5.2, ``trainscope.processor.kde``).
This module turns them back into a CDF (eq. 2), evaluates it on a log-uniform
grid, and measures the Wasserstein-1 distance between two CDFs (eq. 3) by
trapezoid on that grid. Everything is vectorised: many clusters, many
distributions, many pairs at once. Detectors (L3) build on these primitives.

Cluster shape. ARGUS §6.2 assumes each cluster lognormal (median = location,
p99 = scale). On the real Kineto traces that assumption was the largest error
left once small keys are split (tests/benchmarks/bench_compression.py): real
clusters are skewed, flat-topped or hold a few far calls, and a lognormal's
tails run past the cluster's min and max into its neighbours. So where a
cluster's min and max are known, its quantile function is rebuilt piecewise
linear in log-duration through the knots min, p10, p25, p50, p75, p90, p99,
max (``KNOT_LEVELS``; the inner four from ``KernelCluster.shape``, else
interpolated from min, p50, p99 and max): bounded by the cluster's own range,
exact at the nine levels, a step where knots coincide (point clusters). A
cluster without min/max (older records) stays lognormal, and a lognormal
whose p99 equals its p50 is a point mass (a step at p50).
"""
from __future__ import annotations

import numpy as np
from scipy.special import ndtr

from trainscope.proto import cluster_shape

#: Quantile levels of a cluster's knots: min, p10, p25, p50, p75, p90, p99, max.
KNOT_LEVELS = np.array([0.0, *cluster_shape.LEVELS[:2], 0.5, *cluster_shape.LEVELS[2:], 0.99, 1.0])

#: z_0.99, the standard normal's 99th percentile, as ARGUS §6.2 writes it.
Z99 = 2.326


def log_grid(lo: float, hi: float, points: int = 512) -> np.ndarray:
    """``points`` values from ``lo`` to ``hi`` (both > 0), equally spaced in log (ARGUS §6.2)."""
    if not (lo > 0 and hi > lo and np.isfinite(hi)):
        raise ValueError(f"need 0 < lo < hi < inf, got lo={lo!r} hi={hi!r}")
    if points < 2:
        raise ValueError(f"need at least 2 grid points, got {points}")
    return np.geomspace(lo, hi, points)


def lognormal_params(p50, p99) -> tuple[np.ndarray, np.ndarray]:
    """Per cluster: μ = ln p50 and σ = (ln p99 - ln p50) / 2.326 (ARGUS §6.2)."""
    mu = np.log(np.asarray(p50, dtype=np.float64))
    sigma = (np.log(np.asarray(p99, dtype=np.float64)) - mu) / Z99
    return mu, np.maximum(sigma, 0.0)


def mixture_moments(counts, p50, p99, start) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of each count-weighted lognormal mixture (clusters ``start[d]:start[d+1]``).

    Lognormal moments: m = e^(μ + σ²/2), v = (e^(σ²) − 1)·e^(2μ + σ²); the
    mixture's variance adds the spread between its clusters' means.
    """
    counts = np.asarray(counts, dtype=np.float64)
    mu, sigma = lognormal_params(p50, p99)
    s2 = np.minimum(sigma * sigma, 50.0)          # e^50: beyond any real tail; keeps it finite
    m = np.exp(mu + s2 / 2)
    v = np.expm1(s2) * np.exp(2 * mu + s2)
    start = np.asarray(start, dtype=np.int64)
    n = np.add.reduceat(counts, start[:-1]) if counts.size else np.zeros(0)
    mean = np.add.reduceat(counts * m, start[:-1]) / n if counts.size else np.zeros(0)
    second = np.add.reduceat(counts * (v + m * m), start[:-1]) / n if counts.size else np.zeros(0)
    return mean, np.maximum(second - mean * mean, 0.0)


def cluster_knots(p50, p99, lo=None, hi=None, shape=None) -> np.ndarray:
    """Per cluster, ln-durations of its quantile knots at ``KNOT_LEVELS``, shape (n, 8).

    1. A cluster needs 0 < min ≤ p50 ≤ p99 ≤ max (finite) for knots; others
       get a NaN row (rebuilt lognormal). ``lo``/``hi`` None: all NaN.
    2. Knots min, p50, p99, max as sent; p10, p25, p75, p90 from ``shape``
       (``cluster_shape.unpack``), or, where it is 0/absent, linear in
       ln-duration between (0, min) and (0.5, p50), and (0.5, p50) and (0.99, p99).
    3. Made non-decreasing and clipped to [ln min, ln max] (rounding of the
       16-bit positions must not reorder knots).
    """
    p50 = np.asarray(p50, dtype=np.float64)
    p99 = np.maximum(np.asarray(p99, dtype=np.float64), p50)
    n = p50.shape[0]
    out = np.full((n, KNOT_LEVELS.size), np.nan)
    if lo is None or hi is None or n == 0:
        return out
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ok = (lo > 0) & (lo <= p50) & (p99 <= hi) & np.isfinite(hi)
    if not ok.any():
        return out
    llo, l50, l99, lhi = (np.log(v[ok]) for v in (lo, p50, p99, hi))
    inner = np.log(cluster_shape.unpack(lo[ok], hi[ok], np.zeros(int(ok.sum()), np.uint64)
                                        if shape is None else np.asarray(shape, np.uint64)[ok]))
    lv = cluster_shape.LEVELS
    fill = np.stack([llo + (l50 - llo) * (lv[0] / 0.5), llo + (l50 - llo) * (lv[1] / 0.5),
                     l50 + (l99 - l50) * ((lv[2] - 0.5) / 0.49), l50 + (l99 - l50) * ((lv[3] - 0.5) / 0.49)], axis=1)
    inner = np.where(np.isnan(inner), fill, inner)
    k = np.column_stack([llo, inner[:, :2], l50, inner[:, 2:], l99, lhi])
    k = np.minimum(np.maximum.accumulate(k, axis=1), lhi[:, None])
    out[ok] = k
    return out


def knot_cdf(knots: np.ndarray, lx: np.ndarray) -> np.ndarray:
    """CDF of piecewise-linear (in ln-duration) quantile functions at ln-durations ``lx``.

    ``knots`` (n, K) at ``KNOT_LEVELS``; ``lx`` broadcasts to (n, G). Between
    knots j and j+1 the CDF rises linearly by the levels' difference; knots
    that coincide are a step (a point mass) of that size.
    """
    du = np.diff(KNOT_LEVELS)
    out = np.zeros(np.broadcast_shapes(knots.shape[:1] + (1,), np.shape(lx)))
    for j in range(du.size):
        a, b = knots[:, j:j + 1], knots[:, j + 1:j + 2]
        width = b - a
        flat = width <= 0.0
        t = (lx - a) / np.where(flat, 1.0, width)
        np.clip(t, 0.0, 1.0, out=t)
        if flat.any():
            t = np.where(flat, (lx >= a).astype(np.float64), t)
        out += du[j] * t
    return out


def cluster_cdf_rows(lx: np.ndarray, mu: np.ndarray, sigma: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Each cluster's CDF at its own row of ln-durations ``lx`` (n, G): the knots' shape where
    a cluster has knots (``cluster_knots``), else lognormal Φ((ln x − μ)/σ) (σ = 0: a step at e^μ)."""
    lx = np.asarray(lx, dtype=np.float64)
    has = ~np.isnan(knots[:, 0])
    out = np.empty(np.broadcast_shapes((mu.shape[0], 1), lx.shape))
    rows = lx if lx.shape[0] == mu.shape[0] else np.broadcast_to(lx, out.shape)
    if has.any():
        out[has] = knot_cdf(knots[has], rows[has])
    ln = ~has
    if ln.any():
        diff = rows[ln] - mu[ln][:, None]
        s = sigma[ln]
        point = s == 0.0
        z = ndtr(diff / np.where(point, 1.0, s)[:, None])
        if point.any():
            z[point] = (diff[point] >= 0.0).astype(np.float64)
        out[ln] = z
    return out


def cluster_support_ln(mu, sigma, knots, z: float = 4.0) -> tuple[np.ndarray, np.ndarray]:
    """Per cluster, the ln-duration range of its rebuilt CDF: [ln min, ln max] for a cluster with
    knots, else μ ± zσ (all but ~Φ(−z) of a lognormal)."""
    has = ~np.isnan(knots[:, 0])
    return np.where(has, knots[:, 0], mu - z * sigma), np.where(has, knots[:, -1], mu + z * sigma)


def support(p50, p99, z: float = 4.0, lo=None, hi=None, shape=None, knots=None) -> tuple[float, float]:
    """A range holding every cluster's rebuilt CDF: [min, max] for clusters with knots
    (``cluster_knots``, or ``knots`` as it returned them), else all but ~Φ(-z):
    [min e^(μ-zσ), max e^(μ+zσ)].

    Use it to choose one grid for distributions that will be compared.
    """
    mu, sigma = lognormal_params(p50, p99)
    if mu.size == 0:
        raise ValueError("no clusters")
    if knots is None:
        knots = cluster_knots(p50, p99, lo, hi, shape)
    a, b = cluster_support_ln(mu, sigma, np.asarray(knots, dtype=np.float64), z)
    lo, hi = float(np.exp(np.min(a))), float(np.exp(np.max(b)))
    if hi <= lo:  # every cluster is one and the same point
        lo, hi = lo * 0.5, hi * 2.0
    return lo, hi


def _component_cdf(mu: np.ndarray, sigma: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Φ((ln x - μ)/σ) per cluster (rows) and grid point (columns); σ = 0 is a step at e^μ."""
    lx = np.log(grid)[None, :]
    diff = lx - mu[:, None]
    point = sigma == 0.0
    z = diff / np.where(point, 1.0, sigma)[:, None]
    out = ndtr(z)
    if point.any():
        out[point] = (diff[point] >= 0.0).astype(np.float64)
    return out


def mixture_cdf(counts, p50, p99, grid, lo=None, hi=None, shape=None) -> np.ndarray:
    """The mixture CDF of one distribution's clusters on ``grid`` (ARGUS §6.2 eq. 2).

    1. Per cluster: with min/max (``lo``/``hi``), the piecewise quantile
       function through its knots (``cluster_knots``, module docstring);
       without, lognormal with μ = ln p50, σ = (ln p99 - ln p50)/2.326.
    2. F(x) = Σ_c count_c / Σ count · F_c(x); σ_c = 0 or equal knots give a step.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0 or counts.sum() <= 0:
        raise ValueError("a distribution needs at least one cluster with count > 0")
    mu, sigma = lognormal_params(p50, p99)
    grid = np.asarray(grid, dtype=np.float64)
    if lo is None or hi is None:
        return (counts / counts.sum()) @ _component_cdf(mu, sigma, grid)
    knots = cluster_knots(p50, p99, lo, hi, shape)
    return (counts / counts.sum()) @ cluster_cdf_rows(np.log(grid)[None, :], mu, sigma, knots)


def mixture_cdfs(counts, p50, p99, owner, n_dists: int, grid, lo=None, hi=None, shape=None,
                 knots=None) -> np.ndarray:
    """Mixture CDFs of many distributions at once, shape (n_dists, len(grid)).

    Clusters are flat arrays; ``owner[i]`` is the distribution of cluster
    ``i`` (any order). Steps as ``mixture_cdf``, with the weights normalised
    per owner and the rows summed per owner by one ``add.reduceat``. A
    distribution with no clusters (or zero count) gets a row of NaN.
    ``knots``: ``cluster_knots``'s result, instead of ``lo``/``hi``/``shape``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    owner = np.asarray(owner, dtype=np.int64)
    grid = np.asarray(grid, dtype=np.float64)
    out = np.full((n_dists, grid.shape[0]), np.nan)
    if counts.size == 0:
        return out
    if owner.min() < 0 or owner.max() >= n_dists:
        raise ValueError(f"owner must lie in [0, {n_dists})")
    order = np.argsort(owner, kind="stable")
    owner, counts = owner[order], counts[order]
    mu, sigma = lognormal_params(np.asarray(p50)[order], np.asarray(p99)[order])
    total = np.bincount(owner, counts, minlength=n_dists)
    weight = counts / np.where(total > 0, total, 1.0)[owner]
    if knots is not None:
        comp = cluster_cdf_rows(np.log(grid)[None, :], mu, sigma, np.asarray(knots, dtype=np.float64)[order])
    elif lo is None or hi is None:
        comp = _component_cdf(mu, sigma, grid)
    else:
        knots = cluster_knots(np.asarray(p50)[order], np.asarray(p99)[order], np.asarray(lo)[order],
                              np.asarray(hi)[order], None if shape is None else np.asarray(shape)[order])
        comp = cluster_cdf_rows(np.log(grid)[None, :], mu, sigma, knots)
    comp *= weight[:, None]
    first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    dists = owner[first]
    out[dists] = np.add.reduceat(comp, first, axis=0)
    out[total <= 0] = np.nan
    return out


def trapezoid_weights(grid) -> np.ndarray:
    """Weights w with ∫ f dx ≈ Σ w_g f(x_g) by the trapezoid rule on ``grid``.

    With them W1 is a weighted L1 norm, Σ_g w_g |Fa_g - Fb_g|, which lets a
    detector get each rank's mean W1 to all peers from per-grid-point sorted
    CDF values and prefix sums instead of a pairwise matrix.
    """
    grid = np.asarray(grid, dtype=np.float64)
    dx = np.diff(grid)
    w = np.zeros_like(grid)
    w[:-1] += dx / 2.0
    w[1:] += dx / 2.0
    return w


def w1(fa, fb, grid) -> np.ndarray | float:
    """W1 = ∫ |Fa(x) - Fb(x)| dx by trapezoid on ``grid`` (ARGUS §6.2 eq. 3).

    ``fa`` and ``fb`` broadcast against each other along leading axes; the
    last axis is the grid. The integral covers only the grid's range: choose
    it to hold both supports (``support``), outside which both CDFs agree.
    """
    res = np.abs(np.asarray(fa) - np.asarray(fb)) @ trapezoid_weights(grid)
    return float(res) if np.ndim(res) == 0 else res


def empirical_cdf(samples, grid) -> np.ndarray:
    """Fraction of ``samples`` at or below each grid point."""
    s = np.sort(np.asarray(samples, dtype=np.float64))
    return np.searchsorted(s, np.asarray(grid, dtype=np.float64), side="right") / s.shape[0]


def w1_to_samples(samples, counts, p50, p99, points: int = 4096, z: float = 4.0,
                  lo=None, hi=None, shape=None) -> float:
    """W1 between raw samples and the mixture rebuilt from their clusters (fidelity).

    1. Grid: log-uniform over the union of the samples' range and the
       mixture's ``support`` (ARGUS §6.2 integrates on a log-uniform grid).
    2. Empirical CDF of the samples and mixture CDF (eq. 2) on the grid.
    3. W1 by trapezoid (eq. 3). Divide by the median for a relative error.
    """
    samples = np.asarray(samples, dtype=np.float64)
    if samples.size == 0:
        raise ValueError("no samples")
    a, b = support(p50, p99, z, lo, hi, shape)
    grid = log_grid(min(a, float(samples.min())), max(b, float(samples.max())) * (1 + 1e-12), points)
    return w1(empirical_cdf(samples, grid), mixture_cdf(counts, p50, p99, grid, lo, hi, shape), grid)
