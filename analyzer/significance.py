"""Significance against the peers' spread, corrected for the number of comparisons.

A job with 300 kernels × 1,000 ranks makes 300,000 rank-to-peers comparisons
per window; one with 10 kernels × 16 ranks makes 160. With one fixed
threshold the first raises ~2,000× more false alarms. So every detector that
compares ranks with peers states its family of comparisons and tests each at
the Bonferroni level α / M (the family-wise false-alarm probability of the
window stays ≤ α whatever M is).

1. Statistic: a rank's value x_r (e.g. time per iteration in one kernel)
   against its group: z_r = (x_r − median) / s_r with
   s_r = sqrt(spread² + (rel_floor·median)²):
   - spread = 1.4826·MAD: the peers' spread, robust to the outlier itself;
     it already holds the sampling noise of every peer's value. In groups
     of fewer than ``SMALL_GROUP`` peers the MAD is too coarse (three
     identical peers have MAD = 0), so there the spread is at least se_r,
     the sampling error of the rank's value under the null (its calls
     behave like its peers');
   - rel_floor·median: the persistent per-rank "personality" measured on
     real traces (``docs/noise.md``), which a small group's MAD can miss
     (three identical peers have MAD = 0).
2. Threshold: |z| ≥ z* = Φ⁻¹(1 − α/M) (one-sided per direction). Assumption:
   z is close to normal under the null; heavy tails are handled by se_r and
   the floor, not by the quantile. Host-timed values (CPU-clock phases, CPU
   operators) of ranks sharing a host's cores carry scheduling noise that a
   handful of peers cannot estimate: in groups under ``SMALL_GROUP`` ranks
   their threshold is the Student t quantile with n − 1 degrees of freedom
   (``small_group_threshold``), so 4 ranks sharing 2 CPU cores do not name
   whichever the scheduler slowed. Device-timed values keep the normal one.
3. Persistence (``Persistence``): a suspect must hold in the same place
   (phase, kernel, category) in ``k`` of the last ``n`` windows before the
   verdict names it (stalls and hangs excepted);
   with per-window false-alarm probability p the job-level rate falls to
   about C(n,k)·p^k. A place flagged with a device-timed peer z is also
   confirmed sooner, once the CUSUM of its per-iteration excess crosses its
   threshold (``sequential.py``).
4. Onset (``Persistence.onset``): each rank's impact per window, sub-threshold
   (informational) findings included, over the last ``history`` windows; the
   single mean-shift change point of that series (the split maximising
   Welch's t of after − before, at least ``ONSET_T``) is when the rank went
   bad, which can be before significance was reached or across a window
   that missed it; without a clear change point, the first window of the
   current run.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
from statistics import NormalDist

from trainscope.analyzer.sequential import MAD_SIGMA, Cusum, SequentialConfig
from trainscope.analyzer.topology import check_number

#: Below this many peers the MAD is too coarse alone; the sampling error bounds the spread from below.
SMALL_GROUP = 8


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SignificanceConfig:
    alpha: float = 1e-3
    """Family-wise false-alarm probability per window and level (Bonferroni over the comparisons)."""
    rel_floor: float = 0.02
    """Floor of the peers' spread as a fraction of their median (per-rank personality, docs/noise.md)."""
    persist_k: int = 2
    """A suspect must be flagged in k ...."""
    persist_n: int = 3
    """... of the last n windows before a verdict names it (stalls and hangs excepted)."""

    def __post_init__(self) -> None:
        check_number("significance.alpha", self.alpha, lambda v: 0 < v < 1, "must be in (0, 1)")
        check_number("significance.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("significance.persist_k", self.persist_k, lambda v: v >= 1, "must be an integer >= 1", int)
        check_number("significance.persist_n", self.persist_n, lambda v: v >= self.persist_k,
                     "must be an integer >= persist_k", int)


def z_threshold(alpha: float, comparisons: int) -> float:
    """z* = Φ⁻¹(1 − α/M) (step 2). The standard library's Φ⁻¹ (Wichura's AS241, ~1e-16 relative): importing
    scipy.special for it cost every ``trainscope query verdict`` 0.5 s of its 1 s."""
    p = alpha / max(int(comparisons), 1)
    return -NormalDist().inv_cdf(p) if 0.0 < p < 1.0 else (float("inf") if p <= 0.0 else float("-inf"))


def t_isf(p, df):
    """Student's t quantile with upper tail ``p`` at ``df`` degrees of freedom (``scipy.stats.t.isf``).
    ``scipy.special.stdtrit`` inverts the t CDF; scipy.stats cost the analyzer 1.3 s of CPU to import on its
    first small group, in the middle of a job it shares a host with (a healthy 4-rank job read that burst
    as "slower than its own pace")."""
    from scipy.special import stdtrit

    return -stdtrit(df, p)


def small_group_threshold(alpha: float, comparisons: int, n) -> np.ndarray:
    """Step 2 for groups of ``n`` ranks: below ``SMALL_GROUP`` the spread is estimated from a
    handful of peers, so z is Student-t-like with n − 1 degrees of freedom; the threshold is its
    quantile at α/M (the normal one from ``SMALL_GROUP`` on)."""
    n = np.asarray(n, dtype=np.float64)
    p = alpha / max(int(comparisons), 1)
    z = z_threshold(alpha, comparisons)
    small = n < SMALL_GROUP
    out = np.full(n.shape, z)
    if small.any():
        out[small] = t_isf(p, np.maximum(n[small] - 1, 1))
    return out


def robust_z(x: np.ndarray, se: np.ndarray | None = None, rel_floor: float = 0.0,
             axis: int = -1, se_any_size: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """z of every element against the median of its row (step 1).

    ``x``: (..., n) values of n peers. Returns (z, median, scale) with
    median and scale broadcastable against ``x``. ``se`` (each value's sampling
    error under the null) bounds the spread from below in groups under
    ``SMALL_GROUP``, or in groups of any size with ``se_any_size``.
    """
    x = np.asarray(x, dtype=np.float64)
    med = np.median(x, axis=axis, keepdims=True)
    mad = np.median(np.abs(x - med), axis=axis, keepdims=True)
    spread = (MAD_SIGMA * mad) ** 2
    if se is not None and (se_any_size or x.shape[axis] < SMALL_GROUP):
        spread = np.maximum(spread, np.asarray(se, dtype=np.float64) ** 2)
    var = spread + (rel_floor * np.abs(med)) ** 2
    scale = np.sqrt(var)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(scale > 0, (x - med) / scale, 0.0)
    return z, med, scale


#: Step 4: the t a change point needs (the maximum over ~n splits of a stationary series rarely reaches it).
ONSET_T = 4.0


def change_point(x: np.ndarray, min_t: float = ONSET_T) -> int | None:
    """Step 4: the split s (x[s:] is the raised part) maximising the two-sample t of after − before
    (pooled variance, so a one-window segment borrows the other's spread), or None.

    O(n) with prefix sums. A variance floor of 5 % of the raised part's mean keeps a
    noiseless step from dividing by zero."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 3:
        return None
    c1, c2 = np.cumsum(x), np.cumsum(x * x)
    s = np.arange(1, n)
    n1, n2 = s.astype(np.float64), (n - s).astype(np.float64)
    m1 = c1[s - 1] / n1
    m2 = (c1[-1] - c1[s - 1]) / n2
    ss = np.maximum(c2[-1] - n1 * m1 ** 2 - n2 * m2 ** 2, 0.0)      # within-segment sum of squares
    var = ss / max(n - 2, 1) + (0.05 * np.maximum(m2, 0.0)) ** 2
    t = (m2 - m1) / np.sqrt(var * (1 / n1 + 1 / n2) + 1e-300)
    best = int(np.argmax(t))
    return int(s[best]) if t[best] >= min_t else None


class Persistence:
    """Which ranks have been flagged, *in the same place*, in k of the last n windows of one job (step 3).

    A real fault keeps showing where it is (the same phase, kernel or
    category window after window); noise on a busy host moves from place to
    place. ``update(index, flagged)`` takes {rank: places flagged in this
    window} once per analysed window, in window order; windows never analysed
    count as not flagged. It returns the confirmed ranks. ``since(rank)`` is
    the first window of the rank's current run (the onset the verdict
    reports).
    """

    def __init__(self, k: int, n: int, history: int = 64, sequential=None) -> None:
        self.k, self.n = k, n
        self.sequential = sequential if sequential is not None else SequentialConfig()
        self.cusum = Cusum(self.sequential.allowance)   # peer-z places (sequential.py)
        self._indices: collections.deque[int] = collections.deque(maxlen=history)
        self._observed: dict[int, dict[int, float]] = {}   # rank -> {window: impact ns} (step 4)
        self._recent: collections.deque[tuple[int, dict[int, frozenset[str]]]] = collections.deque(maxlen=n)
        self._since: dict[tuple[int, str], int] = {}      # (rank, place) -> first window of its run
        self._held: set[tuple[int, str]] = set()           # (rank, place) confirmed by the last update
        self._impact: dict[int, float] = {}
        self._noise: collections.deque[float] = collections.deque(maxlen=16)   # step noise, earlier windows
        self.windows = 0

    def update(self, index: int, flagged, impact: dict[int, float] | None = None,
               final: bool = False, observed: dict[int, float] | None = None,
               sums: dict[tuple[int, str], float] | None = None, iterations: float = 1.0,
               h: float = float("inf")) -> set[int]:
        """Record one window; return the confirmed ranks. ``flagged``: {rank: places} (or ranks,
        one place each). ``final``: the job ended (a replay's last windows): a job that had fewer
        than k windows in all confirms what every window flagged. ``observed``: every rank's
        impact in this window, sub-threshold findings included (step 4). ``sums``: {(rank, place):
        Σ y_i} of the places flagged with a peer z (``sequential.py``): those places are confirmed
        as soon as their CUSUM crosses ``h`` over this window's ``iterations``, else by the count."""
        self._observe(index, observed or {})
        if not isinstance(flagged, dict):
            flagged = {r: ("*",) for r in flagged}
        flagged = {r: frozenset(p) or frozenset(("*",)) for r, p in flagged.items()}
        self.windows += 1
        self._recent.append((index, flagged))
        window = [f for i, f in self._recent if i > index - self.n]
        counts = collections.Counter((r, p) for f in window for r, places in f.items() for p in places)
        for r, places in flagged.items():
            for p in places:
                self._since.setdefault((r, p), index)
            if impact and r in impact:   # smoothed impact keeps the top suspect stable
                prev = self._impact.get(r)
                self._impact[r] = impact[r] if prev is None else 0.5 * prev + 0.5 * impact[r]
        for key in list(self._since):
            if counts.get(key, 0) == 0:
                del self._since[key]
        seen = {r for r, _ in counts}
        for r in list(self._impact):
            if r not in seen:
                del self._impact[r]
        need = self.k if not (final and self.windows < self.k) else self.windows
        # the sequential test names a place sooner where its evidence is strong; k of n stays the rule
        # for every place (a real-stream rank flagged near its threshold in two windows was named by it)
        crossed = self.cusum.update(sums or {}, iterations, h)
        self._held = {key for key, c in counts.items() if key in crossed or c >= need}
        return {r for r, _ in self._held}

    def step_noise(self, now_ns: float) -> float:
        """``sequential.py`` step 1b's noise for this window: the smaller of this window's and the median
        of the job's earlier windows'. A fault that delays a rank in some iterations makes
        the whole job's step vary with it (everyone waits): an intermittent 1 s NCCL delay on one of 32
        ranks raised a 3 s step's noise from ~30 ms to 1.3 s, so its own 1.2 s/iteration weighed less
        than the allowance and the rank waited two windows more."""
        past = sorted(self._noise)
        self._noise.append(now_ns)
        if not past or now_ns <= 0:
            return now_ns
        return min(now_ns, past[len(past) // 2])

    def held_places(self, rank: int) -> set[str]:
        """The places that hold ``rank`` as of the last ``update`` (k of n, or the sequential test)."""
        return {p for r, p in self._held if r == rank}

    def held(self, rank: int) -> float:
        """Fraction of the last n windows in which ``rank`` was flagged."""
        return sum(1 for _, f in self._recent if rank in f) / self.n

    def since(self, rank: int) -> int | None:
        """The first window of the run of the place(s) that made ``rank`` a suspect (else of any place)."""
        held = [self._since[key] for key in self._held if key[0] == rank and key in self._since]
        if held:
            return min(held)
        anywhere = [i for (r, _), i in self._since.items() if r == rank]
        return min(anywhere) if anywhere else None

    def smoothed_impact(self, rank: int) -> float:
        return self._impact.get(rank, 0.0)

    def _observe(self, index: int, observed: dict[int, float]) -> None:
        if self._indices and index <= self._indices[-1]:
            return                                   # a window seen twice keeps its first record
        self._indices.append(index)
        oldest = self._indices[0]
        for r, x in observed.items():
            if x > 0:
                self._observed.setdefault(r, {})[index] = float(x)
        for r in list(self._observed):               # bounded: only the windows still in history
            series = self._observed[r]
            for i in [i for i in series if i < oldest]:
                del series[i]
            if not series:
                del self._observed[r]

    def onset(self, rank: int) -> int | None:
        """Step 4: the window ``rank`` went bad (change point of its impact series), else ``since``."""
        run = self.since(rank)
        series = self._observed.get(rank)
        if run is None or not series:
            return run
        idx = list(self._indices)
        split = change_point(np.array([series.get(i, 0.0) for i in idx]))
        return idx[split] if split is not None and idx[split] <= idx[-1] else run
