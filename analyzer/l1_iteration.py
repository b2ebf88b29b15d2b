"""L1: iteration-time anomalies, jitter, regression and stall (ARGUS §6.1, Appendix B; EROICA §4.1).

An iteration-time series is classified as stable, jitter, regression or
both (ARGUS §6.1):

0. Noise (assumption: multiplicative noise, so thresholds are ratios):
   σ̂ = 1.4826·MAD of ln(x / lower median of its 2W neighbours), robust to
   spikes (even when up to ~half the points are spikes, as with frequent GC
   pauses) and steps, unbiased for white noise by √(1 + π/(4W)) (the
   neighbours' median is itself noisy). "Significantly exceeds" means ≥ e = max(
   ``exceed_factor``, e^(``noise_sigmas``·σ̂)), and θ is at least that; the
   configured values are floors, so a quiet job (σ̂ ≈ 0.3 %) shows a 15 %
   GC pause while a noisy one (5 %) needs ~27 % before a point counts.
1. Jitter, phase 1 (sensitivity gating, App. B): a window of ``W`` points
   slides over the series; where max/min > θ the window is a candidate;
   overlapping or adjacent candidates merge into intervals.
2. Jitter, phase 2 (effective width, App. B): the baseline is the median of
   the points outside an interval; the longest contiguous run inside it whose
   points all exceed e × baseline is the *effective* jitter,
   which undoes the sliding window's smearing of a spike narrower than ``W``.
   An interval with no such run (a dip, or noise) is dropped. When a
   regression was found, each point's baseline is taken on its own side of
   the change point, so a step is not mistaken for a spike.
3. Regression (App. B): every split ``t`` leaving ``min_segment`` points on
   each side is scanned with prefix sums (O(n)); a split is valid when
   μR/μL ≥ ``min_regression_ratio`` and σ/μ ≤ ``max_rel_std`` on both sides;
   the valid split with the largest ratio wins. Assumption: spikes narrower
   than ``W`` are jitter, not a level, so they are clipped to a running median
   (a Hampel-style filter, which keeps steps) before the scan; otherwise a
   single spike would break the "both segments are stable" condition.
4. Stall (EROICA §4.1, rule 2): one rule for the whole analyzer, read on two
   clocks, in ``stall.py``.
5. Job level (``l1_findings``): the job's iteration time is, per iteration,
   the max over ranks (the job waits for its slowest rank, and the final
   gradient sync aligns them, ARGUS §9.3), built without a ranks × history
   matrix. Suspects are named only when a few ranks' own series carry the
   anomaly and the others do not, judged on ``suspect_context`` points
   around it (so memory is ranks × ~2·context, whatever the history).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Mapping

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainscope.analyzer.model import Finding, SuspectRank
from trainscope.analyzer.topology import check_number
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class L1Config:
    """Thresholds of L1; defaults suit iteration times with ~2-5 % noise."""

    window: int = 5
    """W: width (points) of the sliding window of jitter phase 1."""
    ratio_threshold: float = 1.15
    """θ floor: a window whose max/min exceeds θ is a jitter candidate (θ ≥ the exceed factor)."""
    exceed_factor: float = 1.1
    """Floor of e: a point significantly exceeds the baseline at ≥ e × baseline (phase 2, despiking)."""
    noise_sigmas: float = 5.0
    """e = max(exceed_factor, exp(noise_sigmas · σ̂)): robust σ of log noise a point must clear."""
    min_regression_ratio: float = 1.1
    """Smallest μR/μL that counts as a regression."""
    max_rel_std: float = 0.1
    """Largest σ/μ either side of a change point may have (after despiking)."""
    min_segment: int = 10
    """Fewest points either side of a change point."""
    despike: bool = True
    """Clip spikes narrower than W to a running median before the change-point scan (step 3)."""
    max_suspect_fraction: float = 0.25
    """Name suspects only when at most this fraction of ranks (at least one) carry the anomaly."""
    suspect_context: int = 64
    """Points either side of an anomaly read from each rank's own series to judge who carries it."""

    def __post_init__(self) -> None:
        check_number("l1.window", self.window, lambda v: v >= 2, "must be an integer >= 2", int)
        check_number("l1.ratio_threshold", self.ratio_threshold, lambda v: v > 1, "must be > 1")
        check_number("l1.exceed_factor", self.exceed_factor, lambda v: v > 1, "must be > 1")
        check_number("l1.noise_sigmas", self.noise_sigmas, lambda v: v >= 0, "must be >= 0")
        check_number("l1.min_regression_ratio", self.min_regression_ratio, lambda v: v > 1,
                     "must be > 1")
        check_number("l1.max_rel_std", self.max_rel_std, lambda v: v > 0, "must be > 0")
        check_number("l1.min_segment", self.min_segment, lambda v: v >= 2,
                     "must be an integer >= 2", int)
        check_number("l1.suspect_context", self.suspect_context, lambda v: v >= 1,
                     "must be an integer >= 1", int)
        check_number("l1.max_suspect_fraction", self.max_suspect_fraction, lambda v: 0 < v <= 1,
                     "must be in (0, 1]")
        if not isinstance(self.despike, bool):
            raise ConfigError("l1.despike", self.despike, "must be a bool")


@dataclasses.dataclass(frozen=True, slots=True)
class JitterInterval:
    """A merged candidate interval ``[start, end)`` and its effective part (indices into the series)."""

    start: int
    end: int
    effective_start: int
    effective_end: int
    effective_width: int
    peak_ratio: float          # max point / baseline within the effective part


@dataclasses.dataclass(frozen=True, slots=True)
class Regression:
    """The most significant change point: ``series[split:]`` is the slow part."""

    split: int
    ratio: float
    mean_before: float
    mean_after: float


@dataclasses.dataclass(frozen=True, slots=True)
class L1Result:
    state: str                               # stable | jitter | regression | both
    jitter: tuple[JitterInterval, ...] = ()
    regression: Regression | None = None


def _series(series) -> np.ndarray:
    x = np.asarray(series, dtype=np.float64).ravel()
    if x.size and not (np.all(np.isfinite(x)) and x.min() > 0):
        raise ValueError("iteration times must be finite and > 0")
    return x


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and (exclusive) ends of the runs of True in ``mask``."""
    d = np.diff(np.r_[0, mask.astype(np.int8), 0])
    return np.flatnonzero(d == 1), np.flatnonzero(d == -1)


def _running_median(x: np.ndarray, h: int) -> np.ndarray:
    """Centred running median of 2h+1 points (edges padded with the end values)."""
    return np.median(sliding_window_view(np.pad(x, h, mode="edge"), 2 * h + 1), axis=1)


def thresholds(series, cfg: L1Config = L1Config()) -> tuple[float, float, float]:
    """(θ, e, σ̂) for ``series`` (step 0)."""
    x = _series(series)
    if x.size < 3:
        return cfg.ratio_threshold, cfg.exceed_factor, 0.0
    h = cfg.window
    around = np.delete(sliding_window_view(np.pad(x, h, mode="edge"), 2 * h + 1), h, axis=1)
    r = np.log(x / np.partition(around, h - 1, axis=1)[:, h - 1])
    sigma = float(1.4826 * np.median(np.abs(r - np.median(r))) / np.sqrt(1 + np.pi / (4 * h)))
    exceed = max(cfg.exceed_factor, float(np.exp(cfg.noise_sigmas * sigma)))
    return max(cfg.ratio_threshold, exceed), exceed, sigma


def detect_jitter(series, cfg: L1Config = L1Config(), *,
                  split: int | None = None) -> list[JitterInterval]:
    """Jitter intervals of ``series`` (steps 1-2); ``split``: a known change point (step 2)."""
    x = _series(series)
    n = x.size
    w = min(cfg.window, n)
    if n < 2:
        return []
    theta, exceed, _ = thresholds(x, cfg)
    # Phase 1: windows whose max/min exceeds θ; coverage merges overlapping and adjacent ones.
    view = sliding_window_view(x, w)
    cand = np.flatnonzero(view.max(axis=1) > theta * view.min(axis=1))
    if cand.size == 0:
        return []
    delta = np.bincount(cand, minlength=n + 1)[: n + 1].astype(np.int64)
    delta -= np.bincount(cand + w, minlength=n + 1)[: n + 1]
    starts, ends = _runs(np.cumsum(delta)[:n] > 0)
    out = []
    idx = np.arange(n)
    for s, e in zip(starts.tolist(), ends.tolist()):
        # Phase 2: baseline outside the interval (per side of a known change point).
        outside = (idx < s) | (idx >= e)
        base = np.empty(e - s)
        sides = [(0, n)] if split is None else [(0, split), (split, n)]
        for lo, hi in sides:
            pts = (idx[s:e] >= lo) & (idx[s:e] < hi)
            if not pts.any():
                continue
            ref = x[outside & (idx >= lo) & (idx < hi)]
            if ref.size == 0:    # the interval covers this side: all outside, else everything
                ref = x[outside] if outside.any() else x
            base[pts] = np.median(ref)
        high = x[s:e] >= exceed * base
        rs, re_ = _runs(high)
        if rs.size == 0:
            continue
        k = int(np.argmax(re_ - rs))
        es, ee = s + int(rs[k]), s + int(re_[k])
        peak = float(np.max(x[es:ee] / base[es - s:ee - s]))
        out.append(JitterInterval(s, e, es, ee, ee - es, peak))
    return out


def _despike(x: np.ndarray, cfg: L1Config) -> np.ndarray:
    """Clip points beyond e× (or below 1/e×) a centred running median of 2W+1 points (step 3)."""
    if x.size < 3:
        return x
    _, exceed, _ = thresholds(x, cfg)
    med = _running_median(x, cfg.window)
    far = (x >= exceed * med) | (x * exceed <= med)
    return np.where(far, med, x)


def detect_regression(series, cfg: L1Config = L1Config()) -> Regression | None:
    """The valid change point with the largest μR/μL, or None (step 3, O(n) prefix sums)."""
    x = _series(series)
    n, m = x.size, cfg.min_segment
    if n < 2 * m:
        return None
    y = _despike(x, cfg) if cfg.despike else x
    scale = float(np.median(y))
    y = y / scale                               # well-conditioned sums of squares
    s1 = np.r_[0.0, np.cumsum(y)]
    s2 = np.r_[0.0, np.cumsum(y * y)]
    t = np.arange(m, n - m + 1)                 # left = y[:t], right = y[t:]
    nl, nr = t.astype(np.float64), (n - t).astype(np.float64)
    mu_l, mu_r = s1[t] / nl, (s1[n] - s1[t]) / nr
    var_l = np.maximum(s2[t] / nl - mu_l**2, 0.0)
    var_r = np.maximum((s2[n] - s2[t]) / nr - mu_r**2, 0.0)
    ratio = mu_r / mu_l
    valid = ((ratio >= cfg.min_regression_ratio)
             & (np.sqrt(var_l) <= cfg.max_rel_std * mu_l)
             & (np.sqrt(var_r) <= cfg.max_rel_std * mu_r))
    if not valid.any():
        return None
    k = int(np.argmax(np.where(valid, ratio, -np.inf)))
    return Regression(int(t[k]), float(ratio[k]), float(mu_l[k] * scale), float(mu_r[k] * scale))


def classify(series, cfg: L1Config = L1Config()) -> L1Result:
    """stable | jitter | regression | both (ARGUS §6.1)."""
    reg = detect_regression(series, cfg)
    jit = tuple(detect_jitter(series, cfg, split=reg.split if reg else None))
    state = {(False, False): "stable", (True, False): "jitter",
             (False, True): "regression", (True, True): "both"}[(bool(jit), reg is not None)]
    return L1Result(state, jit, reg)


# ---------------------------------------------------------------- job level (step 5)


def _clean(series_by_rank) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
    """Ranks and their (iterations, durations) sorted by iteration, without bad points."""
    ranks = sorted(series_by_rank)
    cols = []
    for r in ranks:
        it, d = series_by_rank[r]
        it, d = np.asarray(it, dtype=np.int64).ravel(), np.asarray(d, dtype=np.float64).ravel()
        if it.shape != d.shape:
            raise ValueError(f"rank {r}: iterations and durations differ in length")
        ok = np.isfinite(d) & (d > 0)
        it, d = it[ok], d[ok]
        if it.size > 1 and not np.all(it[1:] > it[:-1]):
            o = np.argsort(it, kind="stable")
            it, d = it[o], d[o]
        cols.append((it, d))
    return ranks, cols


def _job_series(cols) -> tuple[np.ndarray, np.ndarray]:
    """Union of iterations and, per iteration, the max over ranks (step 5), in O(points) memory."""
    cols = [c for c in cols if c[0].size]
    if not cols:
        return np.empty(0, np.int64), np.empty(0)
    lo, hi = min(int(c[0][0]) for c in cols), max(int(c[0][-1]) for c in cols)
    if hi - lo + 1 <= 4 * max(c[0].size for c in cols) + 1024:     # dense range: a bitmap
        job = np.full(hi - lo + 1, -np.inf)
        for it, d in cols:
            if np.any(it[1:] == it[:-1]):          # repeated marks: a rank's own max
                np.maximum.at(job, it - lo, d)
            else:
                job[it - lo] = np.maximum(job[it - lo], d)
        iters = np.flatnonzero(job > -np.inf)
        return iters + lo, job[iters]
    iters = np.unique(np.concatenate([c[0] for c in cols]))
    job = np.full(iters.size, -np.inf)
    for it, d in cols:
        np.maximum.at(job, np.searchsorted(iters, it), d)
    return iters, job


def _columns(cols, want: np.ndarray) -> np.ndarray:
    """(ranks × len(want)) durations at the iterations ``want`` (sorted), NaN where missing."""
    m = np.full((len(cols), want.size), np.nan)
    for i, (it, d) in enumerate(cols):
        a, b = np.searchsorted(it, [want[0], want[-1] + 1])
        it, d = it[a:b], d[a:b]
        pos = np.searchsorted(want, it)
        ok = want[np.minimum(pos, want.size - 1)] == it
        m[i, pos[ok]] = d[ok]
    return m


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _carriers(ranks, ratio: np.ndarray, threshold: float, cfg: L1Config) -> tuple[SuspectRank, ...]:
    """Ranks whose own ratio ≥ threshold, if only a few do (step 5)."""
    ok = np.isfinite(ratio)
    hit = ok & (ratio >= threshold)
    n = int(ok.sum())
    if n < 2 or not hit.any() or hit.sum() > max(1, int(cfg.max_suspect_fraction * n)) \
            or hit.sum() == n:
        return ()
    others = float(np.median(ratio[ok & ~hit]))
    order = np.argsort(-np.where(hit, ratio, -np.inf), kind="stable")[: int(hit.sum())]
    return tuple(SuspectRank(int(ranks[i]), float(ratio[i]),
                             {"own_ratio": float(ratio[i]), "others_median_ratio": others})
                 for i in order)


def _window_iterations(window: records_pb2.Window) -> int:
    if window.kind == records_pb2.WINDOW_KIND_ITERATIONS and window.last_iteration >= window.first_iteration:
        return int(window.last_iteration - window.first_iteration + 1)
    return 1


def l1_findings(
    job_id: str,
    series_by_rank: Mapping[int, tuple[np.ndarray, np.ndarray]],
    window: records_pb2.Window,
    cfg: L1Config = L1Config(),
    *,
    since_iteration: int | None = None,
    report_any_regression: bool = False,
) -> list[Finding]:
    """Job-level jitter and regression findings over a bounded history (step 5).

    ``series_by_rank``: {rank: (iterations, durations_ns)}. Only anomalies new
    to this window are reported: a jitter interval whose effective part ends
    at or after ``since_iteration``, a regression whose change point became
    detectable (``min_segment`` points after it) at or after it. By default
    ``since_iteration`` is the window's first iteration for an iterations
    window, and None (report everything in the series) for a time window.
    ``report_any_regression``: report a regression found anywhere in the
    history (the caller deduplicates): a change point becomes detectable
    only ``min_segment`` points after it, often after its window was
    analysed.
    """
    ranks, cols = _clean(series_by_rank)
    iters, job = _job_series(cols)
    if iters.size == 0:
        return []
    res = classify(job, cfg)
    if res.state == "stable":
        return []
    if since_iteration is None and window.kind == records_pb2.WINDOW_KIND_ITERATIONS \
            and window.last_iteration >= window.first_iteration and window.last_iteration > 0:
        since_iteration = int(window.first_iteration)
    since = -np.inf if since_iteration is None else since_iteration
    out = []
    it = iters.tolist()
    n, ctx = iters.size, cfg.suspect_context
    split = res.regression.split if res.regression else None
    jits = [j for j in res.jitter if it[j.effective_end - 1] >= since]
    if jits:
        theta, exceed, sigma = thresholds(job, cfg)
        intervals, best = [], {}
        for j in jits:
            intervals.append({
                "first_iteration": it[j.start], "last_iteration": it[j.end - 1],
                "effective_first_iteration": it[j.effective_start],
                "effective_last_iteration": it[j.effective_end - 1],
                "effective_width": j.effective_width, "peak_ratio": j.peak_ratio,
            })
            # each rank's own baseline: its points within ctx of the interval, outside it
            # (on the anomaly's side of a change point)
            lo, hi = max(0, j.start - ctx), min(n, j.end + ctx)
            if split is not None:
                lo, hi = (lo, min(hi, split)) if j.effective_start < split else (max(lo, split), hi)
            cols_at = np.arange(lo, hi)
            outside = (cols_at < j.start) | (cols_at >= j.end)
            m = _columns(cols, iters[cols_at])
            eff = (cols_at >= j.effective_start) & (cols_at < j.effective_end)
            with _quiet():     # a rank with no point in a slice gives NaN, not a warning
                base = np.nanmedian(m[:, outside] if outside.any() else m, axis=1)
                own = np.nanmax(m[:, eff], axis=1) / base
            for s in _carriers(ranks, own, exceed, cfg):
                if s.rank not in best or s.score > best[s.rank].score:
                    best[s.rank] = s
        baseline = float(np.median(job))
        # cost: the extra time of the effective points, spread over the window's iterations
        excess = sum(float(np.sum(np.maximum(job[j.effective_start:j.effective_end] - baseline, 0.0)))
                     for j in jits)
        width = sum(j.effective_width for j in jits)
        per_iter = excess / max(width, _window_iterations(window))
        suspects = tuple(dataclasses.replace(s, impact_ns=per_iter)
                         for s in sorted(best.values(), key=lambda s: -s.score))
        out.append(Finding(
            level="L1", kind="jitter", job_id=job_id, window=window, suspects=suspects,
            severity=max(j.peak_ratio for j in jits),
            evidence={"state": res.state, "intervals": intervals, "series_points": int(n),
                      "start_iteration": intervals[0]["effective_first_iteration"],
                      "end_iteration": intervals[-1]["effective_last_iteration"],
                      "baseline_ns": float(np.median(job)), "window_points": cfg.window,
                      "ratio_threshold": theta, "exceed_factor": exceed, "noise_sigma": sigma},
            job_impact_ns=per_iter,
        ))
    reg = res.regression
    if reg is not None and (report_any_regression or it[min(reg.split + cfg.min_segment - 1, n - 1)] >= since):
        cols_at = np.arange(max(0, reg.split - ctx), min(n, reg.split + ctx))
        m = _columns(cols, iters[cols_at])
        after = cols_at >= reg.split
        with _quiet():
            own = np.nanmean(m[:, after], axis=1) / np.nanmean(m[:, ~after], axis=1)
        lost = reg.mean_after - reg.mean_before
        out.append(Finding(
            level="L1", kind="regression", job_id=job_id, window=window,
            suspects=tuple(dataclasses.replace(s, impact_ns=lost)
                           for s in _carriers(ranks, own, cfg.min_regression_ratio, cfg)),
            severity=reg.ratio, job_impact_ns=lost,
            evidence={"state": res.state, "split_iteration": it[reg.split],
                      "last_iteration_before": it[reg.split - 1], "ratio": reg.ratio,
                      "mean_before_ns": reg.mean_before, "mean_after_ns": reg.mean_after,
                      "points_before": reg.split, "points_after": int(n - reg.split)},
        ))
    return out
