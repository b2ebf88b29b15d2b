"""Kernel-duration compression: KDE valley clustering (ARGUS §5.2).

All raw durations of one (kernel, stream, rank, window) become a few cluster
rows ``(count, p50, p99, min, max)`` plus the inner quantiles p10, p25, p75,
p90 (``quantiles``: the cluster's shape, so the analyzer's rebuild is faithful). Many keys are clustered in one call:
every step is a numpy pass over all samples (linear in n) or over a
keys x grid array; the only Python loop runs over keys that still have two or
more candidate valleys after the vectorised filters, with a tiny body.

Assumptions (ARGUS §5.2): kernel durations are right-skewed and roughly
lognormal per mode, so modes separate in log-duration; a mode is a peak of the
log-duration density and the boundary between modes is a valley of it.
"""
from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np
from statistics import NormalDist

from trainscope.proto.cluster_shape import LEVELS as SHAPE_LEVELS
from trainscope.proto.errors import BadInput, ConfigError

# Below this fraction of a row's peak the FFT-smoothed density is round-off:
# treat it as zero, so a flat empty gap between modes is one valley, not many.
_ZERO_DENSITY = 1e-10
# Smallest grid per key; grids are powers of two so keys batch by grid size.
_MIN_GRID = 32
# Composite sort key: 20 bits of key id above 44 bits of integer duration.
_KEY_SHIFT = 44


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KdeConfig:
    """Settings of the KDE valley clustering (ARGUS §5.2)."""

    grid_points: int = 1024
    """Most grid points per key. Each key's grid spans its own log-duration
    range plus 3 bandwidths each side; a key gets the smallest power of two
    (at least 32) that gives ``cells_per_bandwidth`` cells per bandwidth,
    capped here. Beyond the cap the bandwidth is floored at one cell."""

    cells_per_bandwidth: float = 4.0
    """Grid resolution sought: grid cells per KDE bandwidth."""

    min_cluster_count: int = 3
    """Cluster-level filter (ARGUS §5.2): a valley is kept only if every
    cluster it creates has at least this many samples."""

    min_cluster_frac: float = 0.01
    """Cluster-level filter, relative: every cluster also needs at least this
    fraction of its key's samples. Keeps sparse tails from becoming modes."""

    min_spacing: float = math.log(1.5)
    """Spacing filter (ARGUS §5.2): least log-duration distance between
    adjacent retained boundaries (log(1.5): boundaries at least 1.5x apart)."""

    min_significance: float = 2.0
    """Valley significance (an addition to ARGUS), in standard deviations:
    the samples within half a bandwidth of the lower of the two peaks must
    exceed those around the valley by this many Poisson sigmas, (N_peak -
    N_valley) / sqrt(N_peak + N_valley), strictly (4 vs 0 samples, exactly 2
    sigmas, is not enough). With m candidate valleys in a key the one-sided
    tail probability is divided by m (Bonferroni): a sparse tail offers many
    small dips, and they are noise, not modes. 0 turns it off."""

    refine_passes: int = 2
    """Re-run steps 3-7 inside each new cluster up to this many times. Scott's
    bandwidth is too wide for a key whose modes lie far apart (its σ is mostly
    the distance between modes), so near modes merge on the first pass; each
    cluster's own σ resolves them. 0 is ARGUS §5.2 as written."""

    exact_below: int = 8
    """Keys with fewer samples skip the KDE (as do keys whose samples are all
    equal): too few points for a density. See ``split_small``."""

    split_small: bool = True
    """A key below ``exact_below`` samples is split wherever two adjacent
    sorted samples lie at least ``min_spacing`` apart in log-duration (step 8b):
    7 calls of 7, 11, 12, 14, 149, 244 and 3844 µs are 4 clusters, not one
    whose p50 and p99 describe none of them (on the real traces' one-step
    windows this one rule took the median relative W1 from 3.8 % to 0 %).
    False: one cluster per small key, as before issue #15."""

    quantum: float | None = None
    """Resolution of the durations (e.g. 1000 for microsecond traces in ns).
    Equal values are spread evenly over their quantum before the KDE so that
    clock ticks do not look like modes. ``None``: the gcd of the batch when
    the durations are integers, else 0 (continuous). Statistics always use
    the raw values."""

    def __post_init__(self) -> None:
        if not isinstance(self.grid_points, int) or self.grid_points < _MIN_GRID:
            raise ConfigError("kde.grid_points", self.grid_points, f"an int >= {_MIN_GRID}")
        if not self.cells_per_bandwidth > 0:
            raise ConfigError("kde.cells_per_bandwidth", self.cells_per_bandwidth, "must be > 0")
        if not isinstance(self.min_cluster_count, int) or self.min_cluster_count < 1:
            raise ConfigError("kde.min_cluster_count", self.min_cluster_count, "an int >= 1")
        if not 0.0 <= self.min_cluster_frac < 0.5:
            raise ConfigError("kde.min_cluster_frac", self.min_cluster_frac, "in [0, 0.5)")
        if not self.min_spacing >= 0.0:
            raise ConfigError("kde.min_spacing", self.min_spacing, "a log distance >= 0")
        if not 0.0 <= self.min_significance < 30.0:
            raise ConfigError("kde.min_significance", self.min_significance, "in [0, 30)")
        if not isinstance(self.refine_passes, int) or self.refine_passes < 0:
            raise ConfigError("kde.refine_passes", self.refine_passes, "an int >= 0")
        if not isinstance(self.exact_below, int) or self.exact_below < 2:
            raise ConfigError("kde.exact_below", self.exact_below, "an int >= 2")
        if self.quantum is not None and not self.quantum >= 0.0:
            raise ConfigError("kde.quantum", self.quantum, "None or >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterTable:
    """Clusters of many keys, one row per cluster, ordered by key then p50.

    ``count`` is int64, the rest float64 in the unit of the input durations.
    """

    key: np.ndarray
    count: np.ndarray
    p50: np.ndarray
    p99: np.ndarray
    min: np.ndarray
    max: np.ndarray
    quantiles: np.ndarray
    """(rows, 4): p10, p25, p75, p90 (``trainscope.proto.cluster_shape.LEVELS``)."""

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @classmethod
    def empty(cls) -> "ClusterTable":
        i, f = np.zeros(0, np.int64), np.zeros(0, np.float64)
        return cls(i, i.copy(), f, f.copy(), f.copy(), f.copy(), np.zeros((0, len(SHAPE_LEVELS))))

    def offsets(self, n_keys: int) -> np.ndarray:
        """Row offsets per key: rows of key k are ``offsets[k]:offsets[k+1]``."""
        return np.searchsorted(self.key, np.arange(n_keys + 1), side="left")

    def rows(self, k: int) -> slice:
        """The rows of key ``k`` as a slice."""
        lo, hi = np.searchsorted(self.key, [k, k + 1], side="left")
        return slice(int(lo), int(hi))

    def take(self, index) -> "ClusterTable":
        """A subset of rows (slice, mask or integer index)."""
        return ClusterTable(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def cluster_keys(durations, keys, n_keys: int, config: KdeConfig = KdeConfig()) -> ClusterTable:
    """Cluster the durations of every key by KDE valleys (ARGUS §5.2).

    ``durations`` (> 0, float or unsigned int) and ``keys`` (ints in
    ``[0, n_keys)``, any order) are parallel arrays. Steps:

    1. Sort all samples by (key, duration) at once: one sort of a packed
       uint64 (key << 44 | duration) for integer durations, else a lexsort.
    2. Log-transform (ARGUS §5.2: modes are lognormal-like, so valleys are
       found in log-duration). For the density only, equal values are spread
       evenly over the duration quantum (``KdeConfig.quantum``).
    3. Per key: n, σ of log-duration, Scott's bandwidth h = 1.06·σ·n^-1/5.
       Keys with n < ``exact_below`` or all values equal are one cluster.
    4. Per key, an equally spaced grid over [min - 3h, max + 3h] with a
       power-of-two size; one bincount bins every sample of every key.
    5. Gaussian KDE (eq. 1) as binning then convolution: per grid size, one
       FFT of all rows, each row multiplied by its own Gaussian transfer
       function (its bandwidth in cells), one inverse FFT. Linear in n.
    6. Every local minimum of a row (a flat run counts once, at its middle)
       is a candidate boundary, with its significance z (``min_significance``).
    7. Filters: significance; cluster-level (ARGUS: both sides of the valley
       hold at least max(min_cluster_count, min_cluster_frac·n) samples);
       spacing (ARGUS: adjacent retained boundaries at least ``min_spacing``
       apart in log-duration). Vectorised against the key's ends; where two
       or more candidates remain, most significant first against the
       boundaries already kept.
    8. Refinement: steps 3-7 again inside every cluster that a pass created,
       with its own σ, the key's cluster-size floor and the boundaries kept
       so far as spacing fences (``refine_passes``).
    8b. Small keys (fewer than ``exact_below`` samples, no KDE): a boundary
       between every two adjacent samples at least ``min_spacing`` apart in
       log-duration (``split_small``; one vectorised comparison).
    9. Clusters are runs of the sorted samples between boundaries: count,
       min, max, and p10/p25/p50/p75/p90/p99 by the same linear interpolation
       as ``numpy.percentile`` (index arithmetic on the sorted array).
    """
    d_sorted, k_sorted, quantum = _sort(durations, keys, n_keys, config.quantum)
    n = d_sorted.shape[0]
    if n == 0:
        return ClusterTable.empty()
    counts = np.bincount(k_sorted, minlength=n_keys)
    present = np.flatnonzero(counts)
    key_e = np.cumsum(counts[present])
    key_s = key_e - counts[present]

    # Step 2: log-duration; the raw one places samples, the spread one feeds the density.
    x = np.log(d_sorted)
    xd = _spread_ties(d_sorted, k_sorted, quantum) if quantum > 0 else x

    # A segment is a key (first pass) or a cluster (refinement): its sample
    # range, cluster-size floor (from its key's n) and log-duration fences.
    seg_s, seg_e = key_s, key_e
    seg_m = np.maximum(config.min_cluster_count, np.ceil(config.min_cluster_frac * counts[present]))
    seg_lb = np.full(present.shape[0], -np.inf)
    seg_rb = np.full(present.shape[0], np.inf)
    found = []
    for _ in range(1 + config.refine_passes):
        new, new_b = _split_pass(x, xd, seg_s, seg_e, seg_m, seg_lb, seg_rb, config)
        if new.size == 0:
            break
        found.append(new)
        # Step 8: the pieces of every segment that split are examined again.
        owner = np.searchsorted(seg_s, new, side="right") - 1
        split_segs = np.unique(owner)
        piece_s = np.concatenate((seg_s[split_segs], new))
        piece_lb = np.concatenate((seg_lb[split_segs], new_b))
        order = np.argsort(piece_s, kind="stable")
        piece_s, piece_lb = piece_s[order], piece_lb[order]
        piece_owner = np.searchsorted(seg_s, piece_s, side="right") - 1
        last = np.append(piece_owner[1:] != piece_owner[:-1], True)
        piece_e = np.where(last, seg_e[piece_owner], np.append(piece_s[1:], n))
        piece_rb = np.where(last, seg_rb[piece_owner], np.append(piece_lb[1:], np.inf))
        seg_s, seg_e, seg_m, seg_lb, seg_rb = piece_s, piece_e, seg_m[piece_owner], piece_lb, piece_rb
    if config.split_small:
        # Step 8b: gaps of at least min_spacing inside keys too small for a KDE.
        small = np.repeat(counts[present] < config.exact_below, counts[present])
        gap = (x[1:] - x[:-1] >= config.min_spacing) & small[1:] & (k_sorted[1:] == k_sorted[:-1])
        found.append(np.flatnonzero(gap) + 1)
    splits = np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
    return _summarise(d_sorted, k_sorted, key_s, splits)


# --------------------------------------------------------------------------- steps


def _split_pass(x, xd, seg_s, seg_e, seg_m, seg_lb, seg_rb, config: KdeConfig):
    """Steps 3-7 over the segments [seg_s, seg_e) of the sorted samples.

    Returns the new splits (global index of the first sample right of each
    boundary) and their log-duration positions, both sorted. Samples of the
    segments are gathered into one run (no copy when they tile the array).
    """
    lens = seg_e - seg_s
    if seg_s[0] == 0 and int(lens.sum()) == x.shape[0]:
        idx, xl, xdl = None, x, xd
    else:
        local_s = np.cumsum(lens) - lens
        idx = np.arange(int(lens.sum())) + np.repeat(seg_s - local_s, lens)
        xl, xdl = x[idx], xd[idx]
    le = np.cumsum(lens)
    ls = le - lens

    # Step 3: Scott's rule per segment.
    cnt = lens.astype(np.float64)
    y = xdl - np.repeat(xdl[ls], lens)  # shifted per segment: E[y²] - E[y]² stays accurate
    mean = np.add.reduceat(y, ls) / cnt
    var = np.add.reduceat(y * y, ls) / cnt - mean * mean
    h = 1.06 * np.sqrt(np.maximum(var, 0.0)) * cnt ** -0.2
    kde = (lens >= config.exact_below) & (xl[le - 1] > xl[ls]) & (h > 1e-9)
    if not kde.any():
        return np.zeros(0, np.int64), np.zeros(0)
    local, b = _valleys(xl, xdl, lens, np.flatnonzero(kde), h[kde], ls, le, seg_m, seg_lb, seg_rb, config)
    return (local if idx is None else idx[local]), b


def _sort(durations, keys, n_keys: int, quantum: float | None):
    """Step 1: samples sorted by (key, duration); returns (float64 durations, keys, quantum).

    Raises ``BadInput`` (a ``ValueError``) for a non-positive or non-finite
    duration, a key outside [0, n_keys), or mismatched shapes.
    """
    d = np.asarray(durations)
    k = np.asarray(keys)
    if d.shape != k.shape or d.ndim != 1:
        raise BadInput("shape", f"durations {d.shape} and keys {k.shape} must be equal 1-d shapes")
    if d.size == 0:
        return np.zeros(0), np.zeros(0, np.int64), 0.0
    if d.dtype.kind == "f":
        if not (d.min() > 0 and np.isfinite(d.max())):
            raise BadInput("duration", "durations must be finite and > 0")
        integral = bool(np.all(d == np.rint(d))) and d.max() < 2.0 ** _KEY_SHIFT
        if integral:
            d = d.astype(np.uint64)
    else:
        if d.min() <= 0:
            raise BadInput("duration", "durations must be > 0")
        integral = int(d.max()) < 2 ** _KEY_SHIFT
        if not integral:
            d = d.astype(np.float64)
    if int(k.min()) < 0 or int(k.max()) >= n_keys:
        raise BadInput("key", f"keys must lie in [0, {n_keys})")
    if integral and n_keys <= 1 << (64 - _KEY_SHIFT):
        packed = (k.astype(np.uint64) << np.uint64(_KEY_SHIFT)) | d.astype(np.uint64)
        packed.sort()
        k_sorted = (packed >> np.uint64(_KEY_SHIFT)).astype(np.int64)
        d_int = packed & np.uint64((1 << _KEY_SHIFT) - 1)
        if quantum is None:
            quantum = float(np.gcd.reduce(d_int.astype(np.int64)))
        return d_int.astype(np.float64), k_sorted, float(quantum)
    d = d.astype(np.float64)
    order = np.lexsort((d, k))
    if quantum is None:
        quantum = float(np.gcd.reduce(d.astype(np.int64))) if integral else 0.0
    return d[order], k[order].astype(np.int64), float(quantum)


def _spread_ties(d: np.ndarray, k: np.ndarray, quantum: float) -> np.ndarray:
    """Step 2: log of equal values spread evenly over [v - q/2, v + q/2).

    A run of r equal values v (one key) becomes v + q·((j + 0.5)/r - 0.5),
    j = 0..r-1: the expected positions of r samples uniform in the tick,
    so a quantised clock gives the density of the unquantised durations.
    """
    n = d.shape[0]
    new = np.empty(n, bool)
    new[0] = True
    np.logical_or(d[1:] != d[:-1], k[1:] != k[:-1], out=new[1:])
    run_start = np.flatnonzero(new)
    run_len = np.diff(np.append(run_start, n))
    pos = np.arange(n) - np.repeat(run_start, run_len)
    q = np.minimum(quantum, d)  # a quantum larger than the value would cross zero
    return np.log(d + q * ((pos + 0.5) / np.repeat(run_len, run_len) - 0.5))


def _valleys(x, xd, lens, kseg, h, starts, ends, seg_m, seg_lb, seg_rb, config: KdeConfig):
    """Steps 4-7 for the segments ``kseg`` (bandwidths ``h``): sorted (splits, boundaries).

    ``lens``, ``starts``/``ends``, ``seg_m`` and ``seg_lb``/``seg_rb`` are
    every segment's size, range, least cluster size and spacing fences.
    """
    lo = xd[starts[kseg]] - 3.0 * h
    span = (xd[ends[kseg] - 1] + 3.0 * h) - lo
    want = np.ceil(config.cells_per_bandwidth * span / h)
    grid = np.minimum(_MIN_GRID * 2 ** np.ceil(np.log2(np.maximum(want / _MIN_GRID, 1.0))), config.grid_points)
    grid = grid.astype(np.int64)
    # Rows ordered by grid size, so each size's rows are one contiguous block.
    by_size = np.argsort(grid, kind="stable")
    kseg, h, lo, span, grid = kseg[by_size], h[by_size], lo[by_size], span[by_size], grid[by_size]
    cell = span / grid
    h_cells = np.maximum(h / cell, 1.0)
    base = np.concatenate(([0], np.cumsum(grid)))
    total = int(base[-1])

    # Step 4: one bincount bins every sample into its row's cells: flat cell =
    # x·a + c per segment; segments without a KDE go to one spare cell. Data
    # end 3 bandwidths before their grid does, so no index spills over.
    a = np.zeros(lens.shape[0])
    c = np.full(lens.shape[0], float(total))
    a[kseg] = 1.0 / cell
    c[kseg] = base[:-1] - lo / cell
    cells = (xd * np.repeat(a, lens) + np.repeat(c, lens)).astype(np.int64)
    flat = np.bincount(cells, minlength=total + 1)[:total].astype(np.float64)

    # Steps 5-6 per grid size; significance with a Bonferroni factor per row.
    c_row, c_pos, c_z = [], [], []
    first_row = np.flatnonzero(np.r_[True, grid[1:] != grid[:-1]])
    for r0, r1 in zip(first_row.tolist(), np.append(first_row[1:], grid.shape[0]).tolist()):
        g = int(grid[r0])
        rows = np.arange(r0, r1)
        hist = flat[base[r0]:base[r1]].reshape(r1 - r0, g)
        r, p, z = _minima(_smooth(hist, h_cells[rows]), hist, h_cells[rows])
        if config.min_significance > 0 and r.size:
            m = np.bincount(r)[r]
            # strictly deeper: a tie (small integer counts, 4 vs 0 is exactly 2 sigmas) is not a valley
            keep = z > _bonferroni_z(config.min_significance, m) * (1.0 + 1e-12)
            r, p, z = r[keep], p[keep], z[keep]
        c_row.append(rows[r])
        c_pos.append(p)
        c_z.append(z)
    c_row = np.concatenate(c_row)
    empty = np.zeros(0, np.int64), np.zeros(0)
    if c_row.size == 0:
        return empty
    c_z = np.concatenate(c_z)
    b = lo[c_row] + (np.concatenate(c_pos) + 0.5) * cell[c_row]  # log-duration of the boundary

    # Step 7, vectorised: cluster size and spacing against the segment's ends.
    c_seg = kseg[c_row]
    m = seg_m[c_seg].astype(np.int64)
    split = _search(x, lens, starts, ends, c_seg, b)
    lb, rb = seg_lb[c_seg], seg_rb[c_seg]
    ok = (
        (split - starts[c_seg] >= m) & (ends[c_seg] - split >= m)
        & (b - lb >= config.min_spacing) & (rb - b >= config.min_spacing)
    )
    if not ok.any():
        return empty
    c_seg, b, split, c_z, m, lb, rb = c_seg[ok], b[ok], split[ok], c_z[ok], m[ok], lb[ok], rb[ok]
    # Regroup by segment, most significant first.
    order = np.lexsort((-c_z, c_seg))
    c_seg, b, split, m, lb, rb = c_seg[order], b[order], split[order], m[order], lb[order], rb[order]
    first = np.flatnonzero(np.r_[True, c_seg[1:] != c_seg[:-1]])
    size = np.diff(np.append(first, c_seg.size))
    one = first[size == 1]
    kept_i, kept_b = [split[one]], [b[one]]
    # Step 7, sequential: only segments with two or more surviving candidates.
    for g0, gl in zip(first[size > 1].tolist(), size[size > 1].tolist()):
        s = int(c_seg[g0])
        ki, kb = _greedy(b[g0:g0 + gl].tolist(), split[g0:g0 + gl].tolist(), int(starts[s]), int(ends[s]),
                         float(lb[g0]), float(rb[g0]), int(m[g0]), config.min_spacing)
        kept_i.append(np.asarray(ki, np.int64))
        kept_b.append(np.asarray(kb, np.float64))
    out_i, out_b = np.concatenate(kept_i), np.concatenate(kept_b)
    order = np.argsort(out_i)
    return out_i[order], out_b[order]


def _smooth(hist: np.ndarray, h_cells: np.ndarray) -> np.ndarray:
    """Step 5: Gaussian KDE of each row, its own bandwidth, by one batched FFT.

    Rows are zero-padded to twice their length; the grid already extends 3
    bandwidths past the data and a bandwidth is at most ~1/6 of the grid, so
    the circular wrap is below e^-18 of the peak.
    """
    g = hist.shape[1]
    spec = np.fft.rfft(hist, n=2 * g, axis=1)
    f = np.arange(g + 1) / (2 * g)  # cycles per cell
    spec *= np.exp(-2.0 * (np.pi * h_cells[:, None] * f[None, :]) ** 2)
    dens = np.fft.irfft(spec, n=2 * g, axis=1)[:, :g]
    dens[dens < _ZERO_DENSITY * dens.max(axis=1, keepdims=True)] = 0.0
    return dens


def _minima(dens: np.ndarray, hist: np.ndarray, h_cells: np.ndarray):
    """Step 6: local minima of every row: (row, position in cells, z).

    The nonzero steps of each row (zero-padded at both ends) are compressed
    into one sequence; where a row's direction turns, there is an extremum,
    at the middle of its flat run. Rows alternate peak, valley, ..., peak.
    A valley's peaks are the highest peaks to its left and to its right
    (segmented running maxima over the short list of extrema). z compares
    sample counts from the histogram within half a bandwidth of the valley
    and of the lower peak: (N_peak - N_valley) / sqrt(N_peak + N_valley),
    the drop in Poisson sigmas.
    """
    k, g = dens.shape
    padded = np.zeros((k, g + 2))
    padded[:, 1:-1] = dens
    step = np.diff(padded, axis=1).ravel()  # step c of a row: dens[c] - dens[c-1]
    nz = np.flatnonzero(step)
    up = step[nz] > 0
    turn = np.flatnonzero((nz[1:] // (g + 1) == nz[:-1] // (g + 1)) & (up[1:] != up[:-1]))
    empty = np.zeros(0, np.int64)
    if turn.size == 0:
        return empty, empty.astype(np.float64), empty.astype(np.float64)
    er = nz[turn] // (g + 1)
    flat_lo = nz[turn] % (g + 1)  # the flat run is dens[flat_lo .. flat_hi]
    flat_hi = nz[turn + 1] % (g + 1) - 1
    mid = (flat_lo + flat_hi) // 2
    valley = ~up[turn]
    # Segmented running maxima of peak heights (valleys count as -0.5; rows
    # are kept apart by an offset of 2 per row on heights scaled to [0, 1]).
    height = np.where(valley, -0.5, dens[er, flat_lo] / dens.max(axis=1)[er])
    n_ext = er.shape[0]
    at = np.arange(n_ext)
    key = height + 2.0 * er
    run = np.maximum.accumulate(key)
    left = np.maximum.accumulate(np.where(key >= run, at, 0))
    key_r = (height + 2.0 * (k - er))[::-1]
    run_r = np.maximum.accumulate(key_r)
    right = n_ext - 1 - np.maximum.accumulate(np.where(key_r >= run_r, at, 0))[::-1]
    v = np.flatnonzero(valley)
    r, pos = er[v], (flat_lo[v] + flat_hi[v]) / 2.0
    cum = np.zeros((k, g + 1))
    np.cumsum(hist, axis=1, out=cum[:, 1:])
    w = np.rint(h_cells[r] / 2.0).astype(np.int64)

    def around(c):
        return cum[r, np.minimum(c + w + 1, g)] - cum[r, np.maximum(c - w, 0)]

    n_valley = around(mid[v])
    n_peak = np.minimum(around(mid[left[v]]), around(mid[right[v]]))
    z = (n_peak - n_valley) / np.sqrt(np.maximum(n_peak + n_valley, 1.0))
    return r, pos, z


def _search(x, lens, starts, ends, c_seg, b) -> np.ndarray:
    """Index of the first sample of segment ``c_seg`` with log-duration >= ``b``: one
    searchsorted, as shifting segment i's values by i·stride makes the order plain."""
    stride = 2.0 * (float(np.abs(x).max()) + 1.0)
    shift = np.repeat(np.arange(lens.shape[0]) * stride, lens)
    i = np.searchsorted(x + shift, b + c_seg * stride, side="left")
    return np.clip(i, starts[c_seg], ends[c_seg])


def _greedy(bs, splits, start, end, lb, rb, m, spacing) -> tuple[list[int], list[float]]:
    """Step 7 for one segment: candidates most significant first, each kept if
    both filters hold against the boundaries kept so far and the fences."""
    kb: list[float] = []
    ki: list[int] = []
    for bb, si in zip(bs, splits):
        pos = bisect.bisect(kb, bb)
        lo_b, lo_i = (kb[pos - 1], ki[pos - 1]) if pos else (lb, start)
        hi_b, hi_i = (kb[pos], ki[pos]) if pos < len(kb) else (rb, end)
        if bb - lo_b < spacing or hi_b - bb < spacing or si - lo_i < m or hi_i - si < m:
            continue
        kb.insert(pos, bb)
        ki.insert(pos, si)
    return ki, kb


def _summarise(d, k_sorted, key_starts, splits) -> ClusterTable:
    """Step 9: count, min, max, p50, p99 and the inner quantiles of every run between boundaries."""
    s = np.concatenate((key_starts, splits))
    s.sort()
    e = np.append(s[1:], d.shape[0])
    cnt = e - s
    p50, p99 = _percentile_sorted(d, s, cnt, 0.5), _percentile_sorted(d, s, cnt, 0.99)
    inner = np.stack([_percentile_sorted(d, s, cnt, q) for q in SHAPE_LEVELS], axis=1)
    return ClusterTable(
        key=k_sorted[s], count=cnt.astype(np.int64), p50=p50, p99=p99, min=d[s], max=d[e - 1],
        quantiles=inner,
    )


def _percentile_sorted(d, s, cnt, q: float) -> np.ndarray:
    """``numpy.percentile(d[s:s+cnt], 100·q)`` for every run, 'linear' method.

    Same arithmetic as numpy: virtual index (n-1)·q, gamma its fractional
    part, and numpy's two-sided lerp (b - diff·(1-gamma) when gamma >= 0.5).
    """
    vi = (cnt - 1) * q
    prev = np.floor(vi)
    gamma = vi - prev
    prev = prev.astype(np.int64)
    nxt = np.minimum(prev + 1, cnt - 1)
    a, b = d[s + prev], d[s + nxt]
    diff = b - a
    out = a + diff * gamma
    hi = gamma >= 0.5
    out[hi] = b[hi] - diff[hi] * (1.0 - gamma[hi])
    return out


def _bonferroni_z(z: float, m: np.ndarray) -> np.ndarray:
    """Φ⁻¹(1 − Φ(−z)/m) per element of ``m`` (the minima compared in a row): a one-sided z
    threshold at the tail probability of ``z``, Bonferroni-corrected. The standard library's Φ and
    Φ⁻¹ over the few distinct ``m`` (scipy.special cost every processor 0.5 s to import)."""
    nd = NormalDist()
    tail = nd.cdf(-z)
    ms, inv = np.unique(m, return_inverse=True)
    thr = [nd.inv_cdf(1.0 - tail / k) if 1.0 - tail / k < 1.0 else float("inf") for k in ms.tolist()]
    return np.asarray(thr, dtype=np.float64)[inv.reshape(np.shape(m))]
