"""CDFs rebuilt from kernel cluster summaries, and W1 between them (ARGUS §6.2).

A kernel's duration distribution on one rank arrives as a few clusters
``(count, p50, p99)`` (ARGUS §5.2, ``trainscope.processor.kde``). This module
turns them back into a CDF (eq. 2), evaluates it on a log-uniform grid, and
measures the Wasserstein-1 distance between two CDFs (eq. 3) by trapezoid on
that grid. Everything is vectorised: many clusters, many distributions, many
pairs at once. Detectors (L3) build on these primitives.

Assumption (ARGUS §6.2): each cluster is lognormal, so its median fixes the
location and its p99 the scale; a cluster whose p99 equals its p50 is a point
mass (a step at p50).
"""
from __future__ import annotations

import numpy as np
from scipy.special import ndtr

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


def support(p50, p99, z: float = 4.0) -> tuple[float, float]:
    """A range holding all but ~Φ(-z) of every cluster: [min e^(μ-zσ), max e^(μ+zσ)].

    Use it to choose one grid for distributions that will be compared.
    """
    mu, sigma = lognormal_params(p50, p99)
    if mu.size == 0:
        raise ValueError("no clusters")
    lo, hi = float(np.exp(np.min(mu - z * sigma))), float(np.exp(np.max(mu + z * sigma)))
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


def mixture_cdf(counts, p50, p99, grid) -> np.ndarray:
    """The mixture CDF of one distribution's clusters on ``grid`` (ARGUS §6.2 eq. 2).

    1. Per cluster, μ = ln p50, σ = (ln p99 - ln p50)/2.326.
    2. F(x) = Σ_c count_c / Σ count · Φ((ln x - μ_c)/σ_c); σ_c = 0 gives a step.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0 or counts.sum() <= 0:
        raise ValueError("a distribution needs at least one cluster with count > 0")
    mu, sigma = lognormal_params(p50, p99)
    grid = np.asarray(grid, dtype=np.float64)
    return (counts / counts.sum()) @ _component_cdf(mu, sigma, grid)


def mixture_cdfs(counts, p50, p99, owner, n_dists: int, grid) -> np.ndarray:
    """Mixture CDFs of many distributions at once, shape (n_dists, len(grid)).

    Clusters are flat arrays; ``owner[i]`` is the distribution of cluster
    ``i`` (any order). Steps as ``mixture_cdf``, with the weights normalised
    per owner and the rows summed per owner by one ``add.reduceat``. A
    distribution with no clusters (or zero count) gets a row of NaN.
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
    comp = _component_cdf(mu, sigma, grid)
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


def w1_to_samples(samples, counts, p50, p99, points: int = 4096, z: float = 4.0) -> float:
    """W1 between raw samples and the mixture rebuilt from their clusters (fidelity).

    1. Grid: log-uniform over the union of the samples' range and the
       mixture's ``support`` (ARGUS §6.2 integrates on a log-uniform grid).
    2. Empirical CDF of the samples and mixture CDF (eq. 2) on the grid.
    3. W1 by trapezoid (eq. 3). Divide by the median for a relative error.
    """
    samples = np.asarray(samples, dtype=np.float64)
    if samples.size == 0:
        raise ValueError("no samples")
    lo, hi = support(p50, p99, z)
    grid = log_grid(min(lo, float(samples.min())), max(hi, float(samples.max())) * (1 + 1e-12), points)
    return w1(empirical_cdf(samples, grid), mixture_cdf(counts, p50, p99, grid), grid)
