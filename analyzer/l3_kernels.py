"""L3: which rank runs which kernel slowly, from cluster summaries (ARGUS §6.2).

Ranks with the same parallel role run identical kernel sequences, so for
every (kernel, stream) their duration distributions should agree. Per
(kernel, stream) and comparison group (``RoutingConfig.kernel_group_dim``):

1. Flatten the protobufs once (``flatten_kernels``) into flat numpy arrays:
   one *distribution* per (rank, key) and its clusters (count, p50, p99).
   Everything after this works on arrays, across keys and groups at once.
2. Grid: per key, ``grid_points`` log-uniform points spanning the support of
   every cluster of the key (``cdf.support``: e^(μ ± zσ)).
3. CDF of each distribution on its key's grid, the count-weighted mixture of
   its clusters (eq. 2; ``cdf.mixture_cdfs``'s maths, batched with a grid per
   cluster): each cluster's piecewise quantile function through min, p10,
   p25, p50, p75, p90, p99 and max (``cdf.cluster_knots``; issue #15: the
   lognormal of ARGUS §6.2 was 4-7x less faithful on real traces), or the
   lognormal from p50/p99 when a record has no min/max.
4. Score = mean W1 to every peer of the group (eq. 3 averaged), *without* a
   pairwise matrix: W1 is Σ_g w_g |F_a(g) − F_b(g)| (trapezoid weights), and
   for one grid point with values sorted s_0 ≤ … ≤ s_{n−1} and exclusive
   prefix sums P_i, Σ_b |s_i − s_b| = s_i(2i − n) − 2P_i + P_n. So one sort
   along the rank axis for all grid points at once (O(n log n) each),
   prefix sums, and a weighted scatter back to the ranks; divide by n − 1.
   Groups of equal size are stacked and processed together; blocks of grid
   points bound the memory.
5. Decide by time, with significance (``significance.py``). What a
   kernel costs is its busy time per iteration x_r = total_ns / iterations
   (exact, from ``KernelStats.total_ns``). Per segment: robust z of x_r
   against the group's median with the peers' spread (1.4826·MAD), the
   sampling error of a total over ``count`` calls (from the clusters'
   mixture variance) and the per-rank personality floor; the sampling error is the peers' median per-call spread × √count
   (the null hypothesis: this rank's calls behave like its peers'); flagged
   when z ≥ z* = Φ⁻¹(1 − α/M), M = every (rank, key) and
   (rank, category) comparison of the window (Bonferroni: 300 kernels ×
   1,000 ranks keep the false-alarm rate of 10 × 16). A collective kernel
   significantly *shorter* than its peers' is flagged too: the late
   arriver's collectives are its shortest (ARGUS §9.5); its kind is
   ``late_arrival``, never ``degraded_kernel`` (it is not slower there). The W1 score (eq. 3)
   and the IQR fence (eq. 4) stay as evidence of how the distribution
   changed, not as the decision: W1 grows when the KDE splits modes
   differently on equal data, and it ranks a 3x spike of a 20 µs kernel
   above a 5 % slowdown of the whole step. The impact of a suspect is
   |x_r − median| (ns per iteration).
5b. Categories: per rank, the summed time per iteration of its compute,
   memory (memcpy/memset) and communication kernels, tested the same way.
   A rank 5 % slower on every compute kernel is significant in the sum
   while no single kernel is (kind ``degraded_kernels``, scope kernel
   ``[compute]``, ``[memory]`` or ``[communication]``).
5c. One call is not a slow rank: a rank flagged slower must still be
   significant with its largest call replaced by its typical one (the
   dominant cluster's p50; the largest is the processor's exact max, else
   the top cluster's p99), its peers' totals trimmed the same way. Real
   once-per-step kernels spike (docs/noise.md: 1.3–9.6 % of calls > 1.2×,
   tail to 3–5×); on embedding-heavy streams one such kernel is ~3 % of
   the step, so one spike in a 5-step window passed the 1 % impact floor
   and persistence picked the rank up when it spiked again. A consistent
   slowdown, an ECC-like tail of many slow calls or a late arriver keep
   their significance; the impact reported stays the full excess. A
   device kernel must then also be slower in its typical call (count ×
   p50) or, without its largest call, beyond the sampling error of its
   total (the peers' per-call spread × √count) in a group of any size: the
   MAD ignores a heavy tail (docs/verdict.md, pinned copies).
   Host-timed operators (CPU operators of ranks sharing a host's cores)
   go further: a rank's value must stay significant as its *typical*
   call times its calls (count × p50), and fewer than
   ``HOST_TYPICAL_MIN_CALLS`` calls give no evidence at all. The
   scheduler preempts a rank at any call, often at several in one
   window: a healthy 4-rank gloo job beside two busy processes had
   ``AddmmBackward0`` at 69x its peers (14 calls, p50 as the peers', two
   preempted calls of 11 and ~6 ms), and an idle one ``c10d::allreduce_``
   at 60x from one sampled call (count 1). A slower operator (a slower
   matmul, a slower data loader) is slower in its typical call.
5d. Many kernels, each significant: a rank whose device kernels of one
   category are *each* significantly slower (step 5, z ≥ z*) costs their
   excesses together. One ``degraded_kernels`` finding per (rank,
   category) sums them (impact = Σ excess; score = the largest z, no
   evidence is pooled beyond what each kernel passed alone) when at least
   ``min_many_kernels`` are flagged and the category sum (5b) was not: a 15 %
   throttle on 1 of 32 ranks of an 8-step capture was significant on 15
   kernels, each under the impact floor, while its compute sum (1.10x) was
   not against peers' personalities. Not for host-timed operators (a
   preempted rank is slower on every operator of the window at once).
5e. The typical kernel: per (rank, category), the median over the rank's
   device kernels of ln(x / the kernel's group median), tested against the
   peers' medians (robust z with the median's standard error and
   ``typical_floor``) when the rank runs at least ``typical_min_kernels``
   of them; each test is a comparison of the Bonferroni M. A throttled GPU
   is slower on every kernel: the median ratio averages the per-kernel
   personality out (σ 0.03 / √kernels) where the sum (5b) is dominated by a
   few large kernels and each kernel (5, 5d) has its own. Impact: the
   category time beyond the peers' pace, sum × (1 − e^(−shift)). Not for
   host-timed operators (a preempted rank is slower everywhere at once).
5f. Against its own noise (evidence for the sequential test, not the
   decision): each flagged rank's ``own_z``, its excess over the larger of
   the peers' spread and its own sampling error (its calls' standard
   deviation × √count per iteration). The decision keeps the peers' error
   (an ECC-like tail must not widen its own yardstick); the CUSUM, which
   treats a window's iterations as independent draws, must not read a
   noisy rank's wide window as many small excesses (``sequential.py`` 1c).
6. A key present on ≥ ``missing_min_present`` of a group's ranks and absent
   on the others is evidence too (e.g. a hang: the culprit stops entering a
   collective): kind ``missing_kernel``, the absent ranks as suspects. A
   group's ranks are those that sent a KernelWindow for the window.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from trainscope.analyzer.cdf import (
    cluster_cdf_rows, cluster_knots, cluster_support_ln, lognormal_params, mixture_moments,
)
from trainscope.analyzer.impact import WindowScale, window_scale
from trainscope.analyzer.kernel_columns import WireError, kernel_columns
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.sequential import MAD_SIGMA, MEDIAN_SE
from trainscope.analyzer.significance import robust_z, small_group_threshold, z_threshold
from trainscope.analyzer.topology import (
    CATEGORIES, RoutingConfig, check_number, cpu_only, group_of, rank_to_group, resources_with,
)
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2


#: L3 kind of a collective kernel significantly *shorter* than its peers': the rank arrived late.
LATE_ARRIVAL = "late_arrival"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class L3Config:
    """Thresholds and numerics of L3 (ARGUS §6.2)."""

    alpha: float = 3.0
    """α of the IQR fence Q3 + α(Q3 − Q1) (eq. 4)."""
    grid_points: int = 256
    """Points of each key's log-uniform grid."""
    support_z: float = 4.0
    """The grid spans e^(μ ± z·σ) of every cluster of the key."""
    min_ranks: int = 4
    """Fewest ranks holding a key for a group to be scored."""
    false_alarm: float = 1e-3
    """Family-wise false-alarm probability per window (Bonferroni over every comparison, step 5)."""
    rel_floor: float = 0.02
    """Floor of the peers' spread, × their median time (per-rank personality, docs/noise.md)."""
    category_rel_floor: float = 0.005
    """The same floor for a rank's category sums: per-kernel personalities average out over the
    many kernels of a category (0.03 / √kernels, docs/noise.md)."""
    min_many_kernels: int = 3
    """Step 5d: fewest individually significant slower kernels of one category whose excesses are summed."""
    typical_min_kernels: int = 8
    """Step 5e: fewest kernels of one category on a rank for its typical ratio to be tested."""
    typical_floor: float = 0.01
    """Step 5e: floor of the spread of the peers' typical ratios (ln units, ~1 %): the per-step factor
    every kernel of a rank shares (σ 0.015 per step, docs/noise.md) that a few peers' MAD may miss."""
    missing_min_present: float = 0.75
    """A key on at least this fraction of a group's ranks (not all) makes the rest ``missing_kernel``."""
    block_elements: int = 1 << 21
    """Elements (distributions × grid points) per working block: bounds memory (~10 arrays of this)."""
    routing: RoutingConfig = RoutingConfig()
    """Supplies ``kernel_group_dim``, the dimension kernels are compared within."""

    def __post_init__(self) -> None:
        check_number("l3.alpha", self.alpha, lambda v: v > 0, "must be > 0")
        check_number("l3.grid_points", self.grid_points, lambda v: v >= 8,
                     "must be an integer >= 8", int)
        check_number("l3.support_z", self.support_z, lambda v: v > 0, "must be > 0")
        check_number("l3.min_ranks", self.min_ranks, lambda v: v >= 3, "must be an integer >= 3", int)
        check_number("l3.false_alarm", self.false_alarm, lambda v: 0 < v < 1, "must be in (0, 1)")
        check_number("l3.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("l3.category_rel_floor", self.category_rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("l3.min_many_kernels", self.min_many_kernels, lambda v: v >= 2, "must be an integer >= 2", int)
        check_number("l3.typical_min_kernels", self.typical_min_kernels, lambda v: v >= 3,
                     "must be an integer >= 3", int)
        check_number("l3.typical_floor", self.typical_floor, lambda v: v >= 0, "must be >= 0")
        check_number("l3.missing_min_present", self.missing_min_present, lambda v: 0 < v <= 1,
                     "must be in (0, 1]")
        check_number("l3.block_elements", self.block_elements, lambda v: v >= 1024,
                     "must be an integer >= 1024", int)
        if not isinstance(self.routing, RoutingConfig):
            raise ConfigError("l3.routing", self.routing, "must be a RoutingConfig")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KernelTable:
    """Every rank's kernel clusters of one window as flat arrays (step 1).

    Distribution ``d`` is key ``keys[dist_key[d]]`` on rank ``dist_rank[d]``;
    its clusters are ``cl_*[cl_start[d]:cl_start[d + 1]]``.
    """

    keys: tuple[tuple[str, int], ...]
    ranks: np.ndarray            # ranks that sent a KernelWindow, sorted
    dist_rank: np.ndarray
    dist_key: np.ndarray
    cl_start: np.ndarray         # (D + 1,)
    cl_count: np.ndarray
    cl_p50: np.ndarray
    cl_p99: np.ndarray
    dist_count: np.ndarray
    dist_mean_ns: np.ndarray
    dist_p50_ns: np.ndarray      # the dominant (largest-count) cluster's p50
    dist_p99_ns: np.ndarray
    dist_max_ns: np.ndarray      # the largest cluster max_ns; NaN when not given
    dist_sd_ns: np.ndarray       # per-call standard deviation of the rebuilt mixture
    cl_knots: np.ndarray | None = None   # (clusters, 8) ln-duration knots, NaN rows: lognormal (step 3)

    @classmethod
    def from_arrays(cls, keys, ranks, dist_rank, dist_key, cl_start, cl_count, cl_p50, cl_p99,
                    dist_total_ns=None, cl_max_ns=None, cl_min_ns=None, cl_shape=None) -> "KernelTable":
        """Build from flat arrays; derives counts, mean, max and dominant cluster per distribution.

        ``dist_total_ns`` (exact busy time) gives the exact mean; without it
        the count-weighted p50. ``cl_max_ns`` ≤ 0 or absent means unknown. With
        ``cl_min_ns`` and ``cl_max_ns`` (and ``cl_shape``) the CDFs use each
        cluster's knots (step 3), else the lognormal.
        """
        cl_start = np.asarray(cl_start, dtype=np.int64)
        cl_count = np.asarray(cl_count, dtype=np.float64)
        cl_p50 = np.asarray(cl_p50, dtype=np.float64)
        cl_p99 = np.maximum(np.asarray(cl_p99, dtype=np.float64), cl_p50)
        n_dist = cl_start.size - 1
        knots = cluster_knots(cl_p50, cl_p99, cl_min_ns, cl_max_ns, cl_shape)
        lens = np.diff(cl_start)
        if n_dist < 0 or cl_start[0] != 0 or cl_start[-1] != cl_count.size or (lens <= 0).any():
            raise ValueError("cl_start must rise strictly from 0 to the number of clusters")
        if not (cl_p50.size == cl_p99.size == cl_count.size and np.all(cl_count > 0)
                and np.all(np.isfinite(cl_p99)) and np.all((cl_p50 > 0) & np.isfinite(cl_p50))):
            raise ValueError("clusters need count > 0 and finite p50 > 0, p99")
        if not (np.size(dist_rank) == np.size(dist_key) == n_dist):
            raise ValueError("dist_rank and dist_key need one entry per distribution")
        if n_dist == 0:
            z = np.empty(0)
            return cls(tuple(keys), np.asarray(ranks, np.int64), z.astype(np.int64), z.astype(np.int64),
                       cl_start, cl_count, cl_p50, cl_p99, z, z, z, z, z, z, knots)
        first = cl_start[:-1]
        owner = np.repeat(np.arange(n_dist), lens)
        count = np.add.reduceat(cl_count, first)
        best = np.maximum.reduceat(cl_count, first)
        idx = np.arange(cl_count.size)
        dom = np.minimum.reduceat(np.where(cl_count == best[owner], idx, cl_count.size), first)
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = np.add.reduceat(cl_count * cl_p50, first) / count
            if dist_total_ns is not None:
                total = np.asarray(dist_total_ns, dtype=np.float64)
                mean = np.where(total > 0, total / count, mean)
        if cl_max_ns is None:
            dmax = np.full(n_dist, np.nan)
        else:
            dmax = np.maximum.reduceat(np.asarray(cl_max_ns, dtype=np.float64), first)
            dmax = np.where(dmax > 0, dmax, np.nan)
        _, var = mixture_moments(cl_count, cl_p50, cl_p99, cl_start)
        return cls(tuple(keys), np.asarray(ranks, np.int64), np.asarray(dist_rank, np.int64),
                   np.asarray(dist_key, np.int64), cl_start, cl_count, cl_p50, cl_p99,
                   count, mean, cl_p50[dom], cl_p99[dom], dmax, np.sqrt(var), knots)


def flatten_kernels(kernels: Mapping[int, records_pb2.KernelWindow]) -> KernelTable:
    """The window's ``KernelWindow`` messages as one ``KernelTable`` (step 1).

    Read from their wire format for all ranks at once (``kernel_columns``: no
    Python object per rank, kernel or cluster); bytes that reader does not
    handle fall back to reading the messages (``flatten_messages``), with the
    same result.
    """
    try:
        c = kernel_columns(kernels)
    except WireError:
        return flatten_messages(kernels)
    return _table(c.keys, sorted(kernels), c.dist_rank, c.dist_key, c.dist_total_ns, np.diff(c.cl_start),
                  c.cl_count, c.cl_p50, c.cl_p99, c.cl_max, c.cl_min, c.cl_shape)


def flatten_messages(kernels: Mapping[int, records_pb2.KernelWindow]) -> KernelTable:
    """Step 1 message by message (the reference ``flatten_kernels`` is checked against; ~2 µs per kernel)."""
    key_id: dict[tuple[str, int], int] = {}
    d_rank, d_key, d_total, lens = [], [], [], []
    cnt, p50, p99, mx, mn, sh = [], [], [], [], [], []
    for rank in sorted(kernels):
        for ks in kernels[rank].kernels:
            cls = ks.clusters
            if not len(cls):
                continue
            k = (ks.kernel, ks.stream)
            kid = key_id.get(k)
            if kid is None:
                kid = key_id[k] = len(key_id)
            d_rank.append(rank)
            d_key.append(kid)
            d_total.append(ks.total_ns)
            lens.append(len(cls))
            for c in cls:
                cnt.append(c.count)
                p50.append(c.p50_ns)
                p99.append(c.p99_ns)
                mx.append(c.max_ns)
                mn.append(c.min_ns)
                sh.append(c.shape)
    return _table(sorted(key_id, key=key_id.get), sorted(kernels), d_rank, d_key, d_total, lens,
                  cnt, p50, p99, mx, mn, sh)


def _table(keys, ranks, d_rank, d_key, d_total, lens, cnt, p50, p99, mx, mn, sh) -> KernelTable:
    """Drop empty or malformed clusters, and distributions left with none; then ``from_arrays``."""
    cl_count = np.asarray(cnt, dtype=np.float64)
    cl_p50, cl_p99 = np.asarray(p50, np.float64), np.asarray(p99, np.float64)
    keep_cl = (cl_count > 0) & (cl_p50 > 0) & np.isfinite(cl_p50) & np.isfinite(cl_p99)
    lens = np.asarray(lens, dtype=np.int64)
    owner = np.repeat(np.arange(lens.size), lens)
    new_lens = np.bincount(owner[keep_cl], minlength=lens.size)
    keep_d = new_lens > 0
    return KernelTable.from_arrays(
        keys=keys, ranks=ranks,
        dist_rank=np.asarray(d_rank, np.int64)[keep_d], dist_key=np.asarray(d_key, np.int64)[keep_d],
        cl_start=np.r_[0, np.cumsum(new_lens[keep_d])], cl_count=cl_count[keep_cl],
        cl_p50=cl_p50[keep_cl], cl_p99=cl_p99[keep_cl],
        dist_total_ns=np.asarray(d_total, np.float64)[keep_d],
        cl_max_ns=np.asarray(mx, np.float64)[keep_cl],
        cl_min_ns=np.asarray(mn, np.float64)[keep_cl], cl_shape=np.asarray(sh, np.uint64)[keep_cl],
    )


def abs_dev_sums(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_g w_g Σ_b |v[..., g, a] − v[..., g, b]| per a, from sorted values and prefix sums (step 4).

    ``values``: (..., G, n) with values ≥ 0 (CDFs), ``weights``: (..., G).
    Returns (..., n). No (n × n) array is ever built: O(G · n log n) time,
    O(G · n) memory.

    Sorting trick: a non-negative float64's bit pattern orders like its
    value, so each value's lowest ⌈log2 n⌉ mantissa bits are replaced by its
    rank index and one plain integer sort (much faster than ``argsort``)
    yields the order; the exact values are then gathered back, so the
    truncation only decides the order of values equal to ~1e-11, whose
    differences it cannot matter for.
    """
    v = np.asarray(values, dtype=np.float64)
    n = v.shape[-1]
    if n == 0:
        return np.zeros(v.shape[:-2] + (0,))
    bits = max(1, (n - 1).bit_length())
    if bits > 24:
        raise ValueError(f"at most 2**24 distributions per group, got {n}")
    mask = np.uint64((1 << bits) - 1)
    key = np.empty(v.shape, dtype=np.uint64)            # C order, whatever v's strides
    np.bitwise_and(v.view(np.uint64), ~mask, out=key)
    key |= np.arange(n, dtype=np.uint64)
    key.sort(axis=-1)
    key &= mask
    idx = key.view(np.int64)
    s = np.take_along_axis(v, idx, axis=-1)
    p = np.cumsum(s, axis=-1)
    total = p[..., -1:].copy()
    # Σ_b |s_i − s_b| = s_i(2i − n) − 2 P_i(excl.) + T = s_i(2i + 2 − n) − 2 P_i(incl.) + T
    s *= 2.0 * np.arange(n) + 2.0 - n
    p *= 2.0
    s -= p
    s += total
    s *= np.asarray(weights, dtype=np.float64)[..., None]
    lead = int(np.prod(v.shape[:-2], dtype=np.int64))
    idx = idx.reshape(lead, -1, n)
    idx += (np.arange(lead, dtype=np.int64) * n)[:, None, None]
    out = np.bincount(idx.ravel(), weights=s.ravel(), minlength=lead * n)
    return out.reshape(*v.shape[:-2], n)


def mean_w1_to_peers(cdfs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Mean W1 of each distribution to the others.

    ``cdfs``: (..., n, G) on a grid whose trapezoid weights are ``weights`` (..., G).
    """
    cdfs = np.asarray(cdfs, dtype=np.float64)
    n = cdfs.shape[-2]
    if n < 2:
        return np.zeros(cdfs.shape[:-1])
    return abs_dev_sums(np.swapaxes(cdfs, -1, -2), weights) / (n - 1)


def _key_grids(t: KernelTable, order: np.ndarray, key_first: np.ndarray, cfg: L3Config):
    """Per key present in ``order`` (dists sorted by key): log grid and trapezoid weights (step 2)."""
    mu, sigma = lognormal_params(t.cl_p50, t.cl_p99)
    lo_c, hi_c = cluster_support_ln(mu, sigma, _knots(t), cfg.support_z)
    first = t.cl_start[:-1]
    lo_d, hi_d = np.minimum.reduceat(lo_c, first), np.maximum.reduceat(hi_c, first)
    lo = np.exp(np.minimum.reduceat(lo_d[order], key_first))
    hi = np.exp(np.maximum.reduceat(hi_d[order], key_first))
    flat = ~(hi > lo)
    lo, hi = np.where(flat, lo * 0.5, lo), np.where(flat, hi * 2.0, hi)
    grid = np.geomspace(lo, hi, cfg.grid_points, axis=1)
    dx = np.diff(grid, axis=1)
    w = np.zeros_like(grid)
    w[:, :-1] += dx / 2.0
    w[:, 1:] += dx / 2.0
    return np.log(grid), w, mu, sigma


def _knots(t: KernelTable) -> np.ndarray:
    """The table's cluster knots; all NaN (lognormal) for a table built without them."""
    return t.cl_knots if t.cl_knots is not None else np.full((t.cl_count.size, 8), np.nan)


def _cdf_block(t: KernelTable, dists: np.ndarray, gslot: np.ndarray, lgrid: np.ndarray,
               mu: np.ndarray, sigma: np.ndarray, g0: int, g1: int) -> np.ndarray:
    """CDFs (len(dists), g1 − g0) of ``dists`` on their keys' grids (``gslot``: grid row per dist)."""
    starts, lens = t.cl_start[dists], t.cl_start[dists + 1] - t.cl_start[dists]
    single = bool((lens == 1).all())
    if single:
        cl, rows = starts, gslot
    else:
        local_first = np.r_[0, np.cumsum(lens)[:-1]]
        owner = np.repeat(np.arange(dists.size), lens)
        cl = np.repeat(starts - local_first, lens) + np.arange(int(lens.sum()))
        rows = gslot[owner]
    comp = cluster_cdf_rows(lgrid[rows, g0:g1], mu[cl], sigma[cl], _knots(t)[cl])   # eq. 2, per cluster
    comp *= (t.cl_count[cl] / (t.dist_count[dists] if single else t.dist_count[dists][owner]))[:, None]
    if single:
        return comp
    f = comp[local_first]
    for j in range(1, int(lens.max())):
        sel = np.flatnonzero(lens > j)
        f[sel] += comp[local_first[sel] + j]
    return f


@dataclasses.dataclass(frozen=True, slots=True)
class Outliers:
    """Flagged ranks of one (key, group), or of one (category, group) when ``key`` < 0 (step 5)."""

    key: int
    group: int
    ranks: np.ndarray        # flagged ranks, largest impact first
    dists: np.ndarray        # their distributions (−1 for a category)
    x_ns: np.ndarray         # their time per iteration
    z: np.ndarray            # their z (negative: shorter than the peers)
    w1: np.ndarray           # their mean W1 to the peers (NaN for a category)
    median_ns: float         # the group's median time per iteration
    scale_ns: float          # the peers' spread (1.4826·MAD) with the personality floor
    z_star: float
    group_size: int
    median_p50_ns: float
    median_mean_ns: float
    w1_fence: float          # ARGUS eq. 4 over the segment's W1 scores (evidence)
    category: str = ""
    rule: str = ""           # "typical": step 5e (median_ns is the rank's category time at its peers' pace)
    z_own: np.ndarray | None = None   # their z with their own sampling error where it is the larger (step 5f)


@dataclasses.dataclass(frozen=True, slots=True)
class Missing:
    """A key absent on a few ranks of a group (step 6)."""

    key: int
    group: int
    absent: tuple[int, ...]
    present: int
    group_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class L3Result:
    outliers: list[Outliers]
    missing: list[Missing]
    segments_scored: int
    dists_scored: int
    comparisons: int = 0
    z_star: float = 0.0


def _categories(t: KernelTable, cfg: L3Config) -> np.ndarray:
    """Per key: its index into ``topology.CATEGORIES`` (step 5b)."""
    return np.array([cfg.routing.category(k) for k, _ in t.keys], dtype=np.int64)


def score_kernels(t: KernelTable, rank_group: np.ndarray, cfg: L3Config = L3Config(),
                  iterations: np.ndarray | None = None, host_timed: bool = False,
                  w1_everywhere: bool = False) -> L3Result:
    """Steps 2-6 over flat arrays; ``rank_group[i]`` is the group of ``t.ranks[i]`` (−1: none),
    ``iterations[i]`` the iterations ``t.ranks[i]`` ran in the window (default 1).

    The decision (step 5) needs only the times per iteration, so the CDFs and
    W1 (steps 2-4, the evidence) are rebuilt only for the segments where a
    rank is flagged: a healthy window costs no CDF at all. ``w1_everywhere``
    scores every segment as before issue #15 (same findings; for benchmarks
    and the equivalence test)."""
    rank_group = np.asarray(rank_group, dtype=np.int64)
    if t.dist_rank.size == 0:
        return L3Result([], [], 0, 0)
    rank_iters = np.ones(t.ranks.size) if iterations is None else np.maximum(
        np.asarray(iterations, dtype=np.float64), 1.0)
    rank_pos = np.searchsorted(t.ranks, t.dist_rank)
    dist_iters = rank_iters[rank_pos]
    dg = rank_group[rank_pos]
    order = np.lexsort((t.dist_rank, dg, t.dist_key))
    order = order[dg[order] >= 0]
    k_s, g_s = t.dist_key[order], dg[order]
    seg_first = np.flatnonzero(np.r_[True, (k_s[1:] != k_s[:-1]) | (g_s[1:] != g_s[:-1])])
    seg_n = np.diff(np.r_[seg_first, order.size])
    seg_key, seg_group = k_s[seg_first], g_s[seg_first]
    group_ids, group_size = np.unique(rank_group[rank_group >= 0], return_counts=True)
    seg_gsize = group_size[np.searchsorted(group_ids, seg_group)]

    missing = []
    gaps = np.flatnonzero((seg_n < seg_gsize) & (seg_n >= cfg.missing_min_present * seg_gsize))
    if gaps.size:
        by_group = np.argsort(rank_group, kind="stable")
        bounds = np.searchsorted(rank_group[by_group], group_ids)
        for i in gaps.tolist():
            present = set(t.dist_rank[order[seg_first[i]:seg_first[i] + seg_n[i]]].tolist())
            b = bounds[np.searchsorted(group_ids, seg_group[i])]
            members = t.ranks[by_group[b:b + seg_gsize[i]]].tolist()
            missing.append(Missing(int(seg_key[i]), int(seg_group[i]),
                                   tuple(r for r in members if r not in present),
                                   int(seg_n[i]), int(seg_gsize[i])))

    scored = seg_n >= cfg.min_ranks
    outliers: list[Outliers] = []
    if not scored.any():
        return L3Result(outliers, missing, 0, 0)
    # per-rank category sums (step 5b): (rank position, category) -> time, variance per iteration
    cat = _categories(t, cfg)
    x_all = t.dist_mean_ns * t.dist_count / dist_iters
    # sampling error under the null: the rank's calls behave like its peers' (the median
    # per-call spread of the segment), so the anomaly cannot inflate its own yardstick
    seg_of_pos = np.repeat(np.arange(seg_first.size), seg_n)
    sd_sorted = t.dist_sd_ns[order][np.lexsort((t.dist_sd_ns[order], seg_of_pos))]
    seg_sd = (sd_sorted[seg_first + (seg_n - 1) // 2] + sd_sorted[seg_first + seg_n // 2]) / 2
    null_sd = t.dist_sd_ns.copy()
    null_sd[order] = seg_sd[seg_of_pos]
    se2_all = (null_sd ** 2) * t.dist_count / dist_iters ** 2
    own2_all = (t.dist_sd_ns ** 2) * t.dist_count / dist_iters ** 2    # step 5f: its own calls' error
    cat_x = np.zeros((t.ranks.size, 3))
    cat_v = np.zeros((t.ranks.size, 3))
    cat_own = np.zeros((t.ranks.size, 3))
    np.add.at(cat_x, (rank_pos, cat[t.dist_key]), x_all)
    np.add.at(cat_v, (rank_pos, cat[t.dist_key]), se2_all)
    np.add.at(cat_own, (rank_pos, cat[t.dist_key]), own2_all)
    # step 5c: the same totals with each rank's largest call replaced by its typical one; host-timed:
    # its typical call times its calls, nothing from fewer than HOST_TYPICAL_MIN_CALLS calls
    if host_timed:
        loo_all = np.where(t.dist_count >= HOST_TYPICAL_MIN_CALLS, t.dist_p50_ns * t.dist_count / dist_iters, 0.0)
        cat_loo = np.zeros((t.ranks.size, 3))
        np.add.at(cat_loo, (rank_pos, cat[t.dist_key]), loo_all)
    else:
        one_call = _largest_call_excess(t) / dist_iters
        loo_all = x_all - one_call
        typ_all = t.dist_p50_ns * t.dist_count / dist_iters     # step 5c: its typical call times its calls
        cat_one = np.zeros((t.ranks.size, 3))
        np.maximum.at(cat_one, (rank_pos, cat[t.dist_key]), one_call)
        cat_loo = cat_x - cat_one
        cat_typ = np.zeros((t.ranks.size, 3))
        np.add.at(cat_typ, (rank_pos, cat[t.dist_key]), typ_all)
    cat_groups = [(g, np.flatnonzero(rank_group == g)) for g in group_ids.tolist()]
    cat_groups = [(g, m) for g, m in cat_groups if m.size >= cfg.min_ranks]
    n_cat = sum(int((cat_x[m] > 0).any(axis=0).sum()) * m.size for _, m in cat_groups)
    typical = None if host_timed else _typical_ratios(t, order, seg_first, seg_n, scored, x_all, rank_pos, cat, cfg)
    if typical is not None:     # step 5e's tests are comparisons of the family too
        n_cat += sum(int(typical_cells(t, rank_group, cfg)[m].sum()) for _, m in cat_groups)
    comparisons = int(seg_n[scored].sum()) + n_cat
    z_star = z_threshold(cfg.false_alarm, comparisons)

    def z_for(n: int) -> float:
        # host-timed kernels (CPU operators of ranks sharing cores): Student t below SMALL_GROUP ranks
        if not host_timed:
            return z_star
        return float(small_group_threshold(cfg.false_alarm, comparisons, [n])[0])
    comm_key = cat == 2

    key_first = np.flatnonzero(np.r_[True, k_s[1:] != k_s[:-1]])
    lgrid, wgrid, mu, sigma = _key_grids(t, order, key_first, cfg)
    slot_of_key = np.full(len(t.keys), -1, dtype=np.int64)
    slot_of_key[k_s[key_first]] = np.arange(key_first.size)
    dist_slot = np.full(t.dist_rank.size, -1, dtype=np.int64)
    dist_slot[order] = slot_of_key[k_s]
    G = cfg.grid_points
    for n in np.unique(seg_n[scored]).tolist():
        segs = np.flatnonzero(scored & (seg_n == n))
        d_all = order[(seg_first[segs][:, None] + np.arange(n)).ravel()].reshape(segs.size, n)
        # the decision first (step 5, time per iteration): W1 is evidence, rebuilt only where a rank is flagged
        if not w1_everywhere:
            z, _, _ = robust_z(x_all[d_all], np.sqrt(se2_all[d_all]), cfg.rel_floor)
            zs = z_for(n)
            hit = (z >= zs) | ((z <= -zs) & comm_key[seg_key[segs]][:, None])
            keep = hit.any(axis=1)
            segs, d_all = segs[keep], d_all[keep]
        per_chunk = max(1, cfg.block_elements // (n * G))
        gb = G if per_chunk > 1 else max(1, min(G, cfg.block_elements // n))
        for c0 in range(0, segs.size, per_chunk):
            chunk = segs[c0:c0 + per_chunk]
            d2 = d_all[c0:c0 + per_chunk]
            dists = d2.ravel()
            gslot = dist_slot[dists]
            wk = wgrid[slot_of_key[seg_key[chunk]]]
            acc = np.zeros((chunk.size, n))
            for g0 in range(0, G, gb):
                g1 = min(G, g0 + gb)
                f = _cdf_block(t, dists, gslot, lgrid, mu, sigma, g0, g1)
                f = f.reshape(chunk.size, n, g1 - g0).transpose(0, 2, 1)
                acc += abs_dev_sums(f, wk[:, g0:g1])
            scores = acc / (n - 1)
            outliers += _flag(t, seg_key[chunk], seg_group[chunk], d2, scores, x_all[d2],
                              np.sqrt(se2_all[d2]), comm_key[seg_key[chunk]], z_for(n), cfg,
                              x_loo=loo_all[d2], x_typ=None if host_timed else typ_all[d2],
                              se_own=np.sqrt(own2_all[d2]))
    for g, m in cat_groups:
        for c in range(3):
            x = cat_x[m, c]
            if not (x > 0).any():
                continue
            outliers += _flag(t, np.array([-1 - c]), np.array([g]), np.full((1, m.size), -1), None,
                              x[None, :], np.sqrt(cat_v[m, c])[None, :], np.array([c == 2]), z_for(m.size), cfg,
                              ranks=t.ranks[m][None, :], category=CATEGORIES[c], x_loo=cat_loo[m, c][None, :],
                              x_typ=None if host_timed else cat_typ[m, c][None, :],
                              se_own=np.sqrt(cat_own[m, c])[None, :])
    if typical is not None:
        outliers += _typical_outliers(typical, cat_x, cat_groups, outliers, t, z_star, cfg)
    outliers.sort(key=lambda o: -float(np.abs(o.x_ns - o.median_ns).max()))
    return L3Result(outliers, missing, int(scored.sum()), int(seg_n[scored].sum()), comparisons, z_star)


#: Step 5c: a host-timed operator with fewer calls in a window than this gives no evidence (its median
#: is not its typical call: one preempted call of two is half of it).
HOST_TYPICAL_MIN_CALLS = 3


def typical_cells(t: KernelTable, rank_group: np.ndarray, cfg: L3Config) -> np.ndarray:
    """Step 5e's tests, (rank position, category) -> bool: the rank runs at least
    ``typical_min_kernels`` compute (or memory) kernels in segments of at least ``min_ranks`` ranks
    (what the Bonferroni M counts; ``partition.group_comparisons`` counts the same)."""
    out = np.zeros((t.ranks.size, 3), dtype=bool)
    if t.dist_rank.size == 0:
        return out
    pos = np.searchsorted(t.ranks, t.dist_rank)
    dg = np.asarray(rank_group, dtype=np.int64)[pos]
    ok = dg >= 0
    pairs, inv, n = np.unique(np.stack([t.dist_key[ok], dg[ok]]), axis=1, return_inverse=True, return_counts=True)
    scored = (n >= cfg.min_ranks)[inv.ravel()]
    c = _categories(t, cfg)[t.dist_key[ok]]
    keep = scored & (c != 2)
    k = np.zeros((t.ranks.size, 3), dtype=np.int64)
    np.add.at(k, (pos[ok][keep], c[keep]), 1)
    out[:] = k >= cfg.typical_min_kernels
    return out


def _typical_ratios(t: KernelTable, order, seg_first, seg_n, scored, x_all, rank_pos, cat,
                    cfg: L3Config) -> tuple[np.ndarray, np.ndarray]:
    """Step 5e, per (rank position, category): the median over the rank's device kernels of
    ln(its time per iteration / the kernel's group median) and that median's standard error (from the
    spread of the rank's own ratios); NaN where fewer than
    ``typical_min_kernels``. Communication kernels are left out (their time is waiting)."""
    n_seg = seg_first.size
    seg_of = np.repeat(np.arange(n_seg), seg_n)
    xs = x_all[order]
    by_val = np.lexsort((xs, seg_of))
    mid = (xs[by_val][seg_first + (seg_n - 1) // 2] + xs[by_val][seg_first + seg_n // 2]) / 2
    med = mid[seg_of]
    c = cat[t.dist_key[order]]
    use = scored[seg_of] & (c != 2) & (xs > 0) & (med > 0)
    pos, c, lr = rank_pos[order][use], c[use], np.log(xs[use] / med[use])
    cell = pos * 3 + c
    shape = (t.ranks.size, 3)
    m = np.full(shape, np.nan)
    se = np.full(shape, np.nan)
    if lr.size:
        o = np.lexsort((lr, cell))
        cs, ls = cell[o], lr[o]
        first = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])
        n = np.diff(np.r_[first, cs.size])
        ok = n >= cfg.typical_min_kernels
        f, n, cells = first[ok], n[ok], cs[first[ok]]
        mv = (ls[f + (n - 1) // 2] + ls[f + n // 2]) / 2
        m.flat[cells] = mv
        # the spread of the rank's own ratios (MAD), cell by cell: deviations sorted within each cell
        dev = np.abs(ls - m.flat[cs])
        o2 = np.lexsort((dev, cs))
        dev = dev[o2]
        mad = (dev[f + (n - 1) // 2] + dev[f + n // 2]) / 2
        # the standard error of a sample median: sqrt(pi/2) * sigma / sqrt(n)
        se.flat[cells] = MEDIAN_SE * MAD_SIGMA * mad / np.sqrt(n)
    return m, se


def _typical_outliers(typical, cat_x, cat_groups, found: list[Outliers], t: KernelTable, z_star: float,
                      cfg: L3Config) -> list[Outliers]:
    """Step 5e: a rank whose typical kernel of a category is significantly slower than its peers'
    typical kernel, where the category sum (5b) did not flag it; its impact is the category time
    it spends beyond its peers' pace (sum × (1 − e^(−shift)))."""
    m, se = typical
    summed = {(o.group, o.category, int(r)) for o in found if o.key < 0 for r in o.ranks.tolist()}
    out = []
    for g, members in cat_groups:
        for c in (0, 1):
            mv = m[members, c]
            have = np.isfinite(mv)
            if have.sum() < cfg.min_ranks:
                continue
            mv_h = mv[have]
            med = float(np.median(mv_h))
            spread = MAD_SIGMA * float(np.median(np.abs(mv_h - med)))
            scale = np.sqrt(spread ** 2 + cfg.typical_floor ** 2 + np.nan_to_num(se[members, c]) ** 2)
            z = np.where(have, (np.nan_to_num(mv) - med) / scale, 0.0)
            for i in np.flatnonzero(z >= z_star).tolist():
                r = int(t.ranks[members[i]])
                if (g, CATEGORIES[c], r) in summed:
                    continue
                x = float(cat_x[members[i], c])
                shift = float(mv[i] - med)
                base = x * float(np.exp(-shift))
                out.append(Outliers(-1 - c, g, np.array([r]), np.array([-1]), np.array([x]), np.array([z[i]]),
                                    np.array([np.nan]), base, float(scale[i]) * base, z_star, int(members.size),
                                    0.0, 0.0, float("nan"), CATEGORIES[c], "typical"))
    return out


def _largest_call_excess(t: KernelTable) -> np.ndarray:
    """Step 5c: per distribution, what its largest call adds over a typical call (ns; 0 for a
    single call): the exact max when the processor sent it, else the top cluster's p99."""
    top_p99 = t.cl_p99[t.cl_start[1:] - 1]
    largest = np.where(np.isfinite(t.dist_max_ns), t.dist_max_ns, top_p99)
    return np.where(t.dist_count >= 2, np.maximum(largest - t.dist_p50_ns, 0.0), 0.0)


def _flag(t, seg_key, seg_group, dists, w1, x, se, comm, z_star, cfg, *, ranks=None,
          category: str = "", x_loo=None, x_typ=None, se_own=None) -> list[Outliers]:
    """Step 5 for a batch of segments: rows of ``x`` (time per iteration) are peer groups;
    ``x_loo`` the same with each rank's largest call replaced by a typical one (step 5c); ``x_typ``
    (device kernels) each rank's typical call times its calls; ``se_own`` each value's sampling
    error from its own calls (step 5f)."""
    floor = cfg.category_rel_floor if category else cfg.rel_floor
    z, med, scale = robust_z(x, se, floor)
    if se_own is not None:      # step 5f: the yardstick is the larger of the peers' spread and its own error
        with np.errstate(divide="ignore", invalid="ignore"):
            own_scale = np.maximum(np.broadcast_to(scale, x.shape), se_own)
            z_own = np.where(own_scale > 0, (x - med) / own_scale, 0.0)
    med, scale = med[:, 0], np.sqrt(np.maximum(scale[:, 0] ** 2 - 0.0, 0.0))
    slower = z >= z_star
    if x_loo is not None and slower.any():
        slower &= robust_z(x_loo, se, floor)[0] >= z_star
    if x_typ is not None and slower.any():
        # device kernels, step 5c, and further: slower in its typical call (a shift: a throttle, a slower
        # kernel), or in its total without the largest call beyond the total's sampling error in a group
        # of any size (a tail: ECC-like retries). The peers' MAD ignores the tail by design: a real stream's pinned
        # host-to-device copies (84 calls, a few ~10x the rest) drew 1.85x their 8 peers' on a healthy
        # rank of a 12-step capture, 1.41x without the largest call, p50 as theirs: z 13.7 against the
        # MAD, 1.7 against the sampling error
        slower &= ((robust_z(x_typ, None, floor)[0] >= z_star)
                   | (robust_z(x_loo, se, floor, se_any_size=True)[0] >= z_star))
    hit = slower | ((z <= -z_star) & comm[:, None])
    if not hit.any():
        return []
    ranks = t.dist_rank[dists] if ranks is None else ranks
    if w1 is not None:
        q1, q3 = np.percentile(w1, [25, 75], axis=1)
        fence = q3 + cfg.alpha * (q3 - q1)
        p50_med = np.median(t.dist_p50_ns[dists], axis=1)
        mean_med = np.median(t.dist_mean_ns[dists], axis=1)
    out = []
    for i in np.flatnonzero(hit.any(axis=1)).tolist():
        j = np.flatnonzero(hit[i])
        j = j[np.argsort(-np.abs(x[i, j] - med[i]), kind="stable")]
        mad_scale = float(np.median(np.abs(x[i] - med[i])) * 1.4826)
        out.append(Outliers(
            int(seg_key[i]), int(seg_group[i]), ranks[i, j], dists[i, j], x[i, j], z[i, j],
            w1[i, j] if w1 is not None else np.full(j.size, np.nan), float(med[i]),
            float(np.hypot(mad_scale, floor * med[i])), z_star, int(x.shape[1]),
            float(p50_med[i]) if w1 is not None else 0.0, float(mean_med[i]) if w1 is not None else 0.0,
            float(fence[i]) if w1 is not None else float("nan"), category,
            z_own=z_own[i, j] if se_own is not None else None))
    return out


def kernel_findings(job_id: str, window: records_pb2.Window, t: KernelTable,
                    groups: Mapping[int, Sequence[int]], cfg: L3Config = L3Config(),
                    dim: str | None = None, scale: WindowScale | None = None,
                    host_timed: bool = False, covered: Mapping[int, int] | None = None) -> list[Finding]:
    """L3 findings from a flat table and comparison groups ({group index: ranks}). ``covered``:
    {rank: iterations its kernel events fell in} (``KernelWindow.iterations``; 0 or absent: all):
    a duty-cycled source's busy time is per covered iteration, not per iteration of the window
    (the CPU-operator sampler saw 1 step in 10, and a data loader 30 ms/iteration slower priced
    at 3 ms)."""
    dim = dim or cfg.routing.kernel_group_dim
    rg = rank_to_group(groups)
    rank_group = np.array([rg.get(r, -1) for r in t.ranks.tolist()], dtype=np.int64)
    iters = scale.iterations_array(t.ranks.tolist()) if scale is not None else None
    if iters is not None and covered:
        seen = np.array([covered.get(r, 0) for r in t.ranks.tolist()], dtype=np.float64)
        iters = np.where(seen > 0, np.minimum(iters, seen), iters)
    res = score_kernels(t, rank_group, cfg, iters, host_timed)
    out = []
    for o in res.outliers:
        if o.key >= 0:
            kernel, stream = t.keys[o.key]
        else:
            kernel, stream = f"[{o.category}]", -1
        comm = cfg.routing.is_communication(kernel)
        suspects = []
        for k in range(o.ranks.size):
            x, d = float(o.x_ns[k]), int(o.dists[k])
            slower = x >= o.median_ns
            ev = {"time_per_iteration_ns": x, "group_median_ns": o.median_ns,
                  "ratio": x / o.median_ns if o.median_ns > 0 else 0.0,
                  "z": float(o.z[k]), "z_threshold": o.z_star,
                  "direction": "slower" if slower else "faster"}
            if o.z_own is not None:
                ev["own_z"] = float(o.z_own[k])
            if host_timed:   # CPU operators: scheduler bursts span whole windows (sequential.py: k of n)
                ev["host_timed"] = True
            if d >= 0:
                ev |= {"w1_ns": float(o.w1[k]), "w1_fence_ns": o.w1_fence,
                       "p50_ns": float(t.dist_p50_ns[d]), "p99_ns": float(t.dist_p99_ns[d]),
                       "group_median_p50_ns": o.median_p50_ns, "count": int(t.dist_count[d]),
                       "mean_ns": float(t.dist_mean_ns[d]), "group_median_mean_ns": o.median_mean_ns,
                       "max_ns": float(t.dist_max_ns[d]) if np.isfinite(t.dist_max_ns[d]) else 0.0}
            if comm and not slower:
                ev["role"] = "late_arriver"   # its peers waited for it (ARGUS §9.5)
            suspects.append(SuspectRank(int(o.ranks[k]), float(abs(o.z[k])), ev,
                                        impact_ns=abs(x - o.median_ns)))
        # a collective kernel shorter than its peers' is not degraded: the rank arrived late and the
        # others waited in it (ARGUS §9.5); its own finding kind, never "degraded_kernel"
        slow = tuple(x for x in suspects if x.evidence["direction"] == "slower")
        late = tuple(x for x in suspects if x.evidence["direction"] == "faster")
        for members, kind in ((slow, "degraded_kernels" if o.key < 0 else "degraded_kernel"),
                              (late, LATE_ARRIVAL)):
            if not members:
                continue
            out.append(Finding(
                level="L3", kind=kind, job_id=job_id, window=window,
                scope=Scope(kernel=kernel, stream=int(stream), group=dim, group_index=o.group),
                suspects=members, severity=max(float(x.score) for x in members),
                evidence={"group_size": o.group_size, "group_median_ns": o.median_ns,
                          "peer_spread_ns": o.scale_ns, "z_threshold": o.z_star,
                          "comparisons": res.comparisons, "false_alarm": cfg.false_alarm,
                          "communication": comm, **({"category": o.category} if o.category else {}),
                          **({"rule": "L3 step 5e (typical kernel)"} if o.rule == "typical" else {})},
            ))
    if not host_timed:
        out += _many_kernels(job_id, window, out, cfg, dim)
    for m in res.missing:
        kernel, stream = t.keys[m.key]
        # absent from a sampled window is weak evidence (CPU-operator sampling, ARGUS §5.1):
        # informational; a hang is named by the stall rule
        out.append(Finding(
            level="L3", kind="missing_kernel", job_id=job_id, window=window,
            scope=Scope(kernel=kernel, stream=int(stream), group=dim, group_index=m.group),
            suspects=tuple(SuspectRank(r, 1.0, {"present_on": m.present, "group_size": m.group_size})
                           for r in m.absent),
            severity=1.0 - m.present / m.group_size, informational=True,
            evidence={"present_on": m.present, "group_size": m.group_size,
                      "explanation": "peers ran this kernel in the window; the suspects did not"},
        ))
    return out


def _many_kernels(job_id: str, window: records_pb2.Window, found: list[Finding], cfg: L3Config,
                  dim: str) -> list[Finding]:
    """Step 5d: per (rank, category), the rank's individually significant slower device kernels as one
    finding whose impact is their summed excess, where the category sum (5b) did not flag the rank."""
    summed = {(s.rank, f.scope.kernel) for f in found if f.kind == "degraded_kernels" for s in f.suspects}
    per: dict[tuple[int, int], list[tuple[Finding, SuspectRank]]] = {}
    for f in found:
        if f.kind != "degraded_kernel" or f.evidence.get("communication"):
            continue
        c = cfg.routing.category(f.scope.kernel)
        for s in f.suspects:
            per.setdefault((s.rank, c), []).append((f, s))
    out = []
    for (rank, c), hits in sorted(per.items()):
        label = f"[{CATEGORIES[c]}]"
        if len(hits) < cfg.min_many_kernels or (rank, label) in summed:
            continue
        hits.sort(key=lambda h: -h[1].impact_ns)
        x = sum(s.evidence["time_per_iteration_ns"] for _, s in hits)
        med = sum(s.evidence["group_median_ns"] for _, s in hits)
        top = max(hits, key=lambda h: h[1].score)
        ev = {"time_per_iteration_ns": x, "group_median_ns": med, "ratio": x / med if med > 0 else 0.0,
              "z": float(top[1].evidence["z"]), "z_threshold": float(top[1].evidence["z_threshold"]),
              "direction": "slower", "kernels": [f.scope.kernel for f, _ in hits][:10],
              "significant_kernels": len(hits), "rule": "L3 step 5d"}
        suspect = SuspectRank(rank, float(top[1].score), ev, impact_ns=float(sum(s.impact_ns for _, s in hits)))
        f0 = top[0]
        out.append(Finding(
            level="L3", kind="degraded_kernels", job_id=job_id, window=window,
            scope=Scope(kernel=label, stream=-1, group=dim, group_index=f0.scope.group_index),
            suspects=(suspect,), severity=suspect.score,
            evidence={**{k: f0.evidence[k] for k in ("comparisons", "false_alarm", "z_threshold") if k in f0.evidence},
                      "communication": False, "category": CATEGORIES[c], "group_size": f0.evidence.get("group_size")}))
    return out


def analyze_kernels(jw: JobWindow, cfg: L3Config = L3Config(), scale: WindowScale | None = None) -> list[Finding]:
    """L3 findings for one window of one job (module steps 1-6)."""
    if not jw.kernels:
        return []
    dim = cfg.routing.kernel_group_dim
    groups = group_of(resources_with(jw.resources, jw.kernels), dim)
    # CPU-operator "kernels" (the CPU fallback) are host-timed: ranks sharing cores are scheduled
    host_timed = cpu_only(jw.resources)
    return kernel_findings(jw.job_id, jw.window, flatten_kernels(jw.kernels), groups, cfg, dim,
                           scale if scale is not None else window_scale(jw), host_timed,
                           covered_iterations(jw.kernels))


def covered_iterations(kernels: Mapping[int, records_pb2.KernelWindow]) -> dict[int, int]:
    """{rank: iterations its kernel events fell in}, where the processor said (``kernel_findings``)."""
    return {r: int(kw.iterations) for r, kw in kernels.items() if kw.iterations}
