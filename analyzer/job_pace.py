"""The job against its own recent pace: slower than itself, with no rank to blame.

A fault that slows every rank together (a degraded NIC or switch every group
crosses, congestion, a shared filesystem) leaves the peer comparisons
nothing: each rank is as slow as its peers. L1's change point needs
``min_segment`` points on each side after warm-up, which a job of a few
windows does not have (a 4x slower NIC took a 64-rank simulated job from
3.01 s to 3.9 s per step, +29 %, and every window said "healthy"). So, per
analysed window (NVRx's "individual" score, for the whole job):

1. The job's step per iteration: for each iteration the window's ranks
   report, the median over ranks of its duration (the ranks of a
   synchronous job share the step; the median ignores one rank's outlier).
   Each rank's first ``warmup_iterations`` are left out (allocation,
   compilation). Partial windows (ranks missing) and a job's short last
   window are neither judged nor used as baseline.
2. The baseline: the per-iteration steps of the last ``baseline_windows``
   windows that were neither flagged nor suspect (z ≥ 2 and half of
   ``min_shift`` slower), nor named a rank in their verdict (the service
   discards those after the merge: a rank 1.3 % of the step slower is under
   this level's threshold and not the job's healthy pace): the job's recent
   pace while it was healthy, so a slow stretch never becomes its own baseline.
3. The test (robust): d = median(now) − median(baseline); the baseline's
   spread s = 1.4826·MAD, floored at ``rel_floor`` of its median (a handful
   of steps can have a MAD near 0); z = d / (s·√(π/2)·√(1/n_now + 1/n_base))
   (the standard error of a median under normal noise). The steps of one
   window are not independent: a busy neighbour, a host's page cache, a
   checkpoint's I/O slow runs of consecutive steps, so a window's median
   moves more than √n predicts (a healthy 4-rank gloo job on a shared
   2-core host: window medians ±3 ms on 36 ms, single windows +20 %). So
   the error is also taken from the baseline's own window medians (the
   method of batch means for autocorrelated series, Law & Kelton,
   *Simulation Modeling and Analysis* §9.5.3): with at least
   ``batch_min_windows`` baseline windows of ``min_iterations`` steps,
   s_w = 1.4826·MAD of their medians, and the error of a new window's
   median against b is s_w·√(1 + 1/m) (m windows); the test uses the larger
   of the two errors. A job timed by the host's clock (CPU ranks: the
   scheduler sets its pace) is not judged before its baseline has
   ``batch_min_windows`` windows: until then nothing says how far a healthy
   window's median moves, and the first window is no better a baseline
   than the second (an idle 4-rank DDP gloo job, two ranks per core, read
   +11 % from its window 1 on against its window 0, and a window held out
   of the baseline as slower kept it there for the rest of the job). Those
   windows all enter the baseline. Device-timed steps keep the test from
   the first window: a GPU's step is set by its kernels. Flagged when
   z ≥ Φ⁻¹(1 − ``false_alarm``), d ≥ ``min_shift`` of the baseline, and each
   side has at least ``min_iterations`` steps.
4. The finding (level ``pace``, kind ``job_slowdown``) names no rank: its
   impact is d per iteration (``job_impact_ns``), with the shift in % and
   the baseline it was measured against (and its last window: a rank
   already slow then is inside the baseline, so this loss does not price
   it). ``merge`` makes the job
   ``degraded`` ("not localized") once it holds in k of the last n windows,
   and only when no rank explains it.

5. What the job lost, flagged or not (``JobLoss``): the *mean* step now against the
   mean step of the baseline windows, at least ``rel_floor`` of the step (the
   resolution of a step), with its z (the same errors as step 3, for a mean): the
   culprits' price (``merge._loss_share``). The mean, not step 3's median: the job
   loses every second of an intermittent fault (a 1 s GC pause in one step of ten,
   congestion on 3 steps of 10), which a median steps over (a simulated job
   4.7 % slower from GC pauses read 0.04 s/iteration by the median, 0.34 s by the
   mean). ``bound(before)`` measures it against the baseline windows before
   ``before`` only: a rank already slow in the baseline's last windows is inside
   them, and the loss against them is not its price. A rank's excess in its own
   kernels is not the job's loss where the step absorbs it: a degraded NVLink pair
   priced at 0.4 s/iteration each, ECC retries at 0.3-0.5 s, in simulated jobs that
   lost 0.04-0.1 s/iteration, under this level's 5 % threshold.

Assumption: the job's step is stationary while healthy, to within
``min_shift`` (a curriculum that lengthens sequences, an evaluation phase
inside training steps would read as a slowdown).
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from trainscope.analyzer.impact import WindowScale
from trainscope.analyzer.model import Finding, JobWindow, Scope
from trainscope.analyzer.sequential import MEDIAN_SE
from trainscope.analyzer.significance import MAD_SIGMA, z_threshold
from trainscope.analyzer.topology import check_number

LEVEL, KIND = "pace", "job_slowdown"
#: A window this many standard errors and half of ``min_shift`` slower, though not flagged, stays
#: out of the baseline (step 2): the first window of a slowdown often falls short of the test.
SUSPECT_Z = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PaceConfig:
    baseline_windows: int = 8
    """Unflagged windows whose steps form the job's baseline."""
    min_iterations: int = 5
    """Fewest steps on each side (after warm-up) before the job is judged."""
    min_shift: float = 0.05
    """Smallest slowdown reported, as a share of the baseline step: below, the step's own drift
    (data, sequence lengths, a checkpoint in a window) explains it."""
    rel_floor: float = 0.01
    """Floor of the baseline's per-step spread, as a share of its median step."""
    false_alarm: float = 1e-4
    """One-sided false-alarm rate per window; the verdict also needs it in k of n windows."""
    batch_min_windows: int = 4
    """Baseline windows needed before their medians' spread enters the error (step 3, batch means)."""

    def __post_init__(self) -> None:
        check_number("pace.baseline_windows", self.baseline_windows, lambda v: v >= 1, "must be an integer >= 1", int)
        check_number("pace.min_iterations", self.min_iterations, lambda v: v >= 2, "must be an integer >= 2", int)
        check_number("pace.min_shift", self.min_shift, lambda v: v > 0, "must be > 0")
        check_number("pace.rel_floor", self.rel_floor, lambda v: v >= 0, "must be >= 0")
        check_number("pace.false_alarm", self.false_alarm, lambda v: 0 < v < 1, "must be in (0, 1)")
        check_number("pace.batch_min_windows", self.batch_min_windows, lambda v: v >= 2, "must be an integer >= 2", int)


class Baseline:
    """Per-iteration job steps (ns) of the last n unflagged windows (step 2)."""

    def __init__(self, n: int) -> None:
        self.windows: collections.deque[np.ndarray] = collections.deque(maxlen=n)
        self.indices: collections.deque[int] = collections.deque(maxlen=n)   # their window indices

    def add(self, index: int, steps: np.ndarray) -> None:
        self.windows.append(steps)
        self.indices.append(index)

    def discard(self, index: int) -> None:
        """Step 2: window ``index`` is not the job's healthy pace after all (its verdict named a rank)."""
        if index in self.indices:
            i = list(self.indices).index(index)
            del self.windows[i]
            del self.indices[i]

    def steps(self) -> np.ndarray:
        return np.concatenate(list(self.windows)) if self.windows else np.empty(0)

    def window_medians(self, min_steps: int) -> np.ndarray:
        """The median step of each baseline window of at least ``min_steps`` steps (step 3)."""
        return np.array([float(np.median(w)) for w in self.windows if w.size >= min_steps])


def _batch_error(values: np.ndarray) -> float:
    """Step 3's batch means: the error of a new window's statistic against ``values``, the same
    statistic of the baseline's windows (1.4826·MAD of them, times √(1 + 1/m))."""
    return MAD_SIGMA * float(np.median(np.abs(values - np.median(values)))) * float(np.sqrt(1 + 1 / values.size))


@dataclasses.dataclass(frozen=True, slots=True)
class JobLoss:
    """Step 5: what the job lost this window against its own pace, per iteration (ns)."""

    now: np.ndarray                                  # this window's job steps (ns)
    windows: tuple[tuple[int, np.ndarray], ...]      # the baseline: (window index, its steps), oldest first
    cfg: PaceConfig

    def bound(self, before: int | None = None) -> tuple[float, float] | None:
        """(loss ns, its z) against the baseline windows whose index is below ``before`` (all:
        None); None when they hold under ``min_iterations`` steps. The loss is the difference of
        the means, floored at ``rel_floor`` of the baseline's median step; z divides the unfloored
        difference by step 3's error, taken for a mean (the baseline steps' standard deviation
        σ·√(1/n + 1/m), or the spread of the baseline windows' means where there are
        ``batch_min_windows`` of them, whichever is larger)."""
        kept = [w for i, w in self.windows if before is None or i < before]
        base = np.concatenate(kept) if kept else np.empty(0)
        if base.size < self.cfg.min_iterations or self.now.size < self.cfg.min_iterations:
            return None
        b = float(np.median(base))
        d = float(self.now.mean() - base.mean())
        spread = max(float(np.std(base, ddof=1)), self.cfg.rel_floor * b)     # a mean's error: the std
        se = spread * float(np.sqrt(1 / self.now.size + 1 / base.size))
        means = np.array([w.mean() for w in kept if w.size >= self.cfg.min_iterations])
        if means.size >= self.cfg.batch_min_windows:
            se = max(se, _batch_error(means))
        return max(d, self.cfg.rel_floor * b), (d / se if se > 0 else 0.0)


def job_steps(jw: JobWindow, first_iteration: dict[int, int], warmup: int) -> np.ndarray:
    """Step 1: the median over ranks of each iteration's duration, warm-up left out (ns)."""
    return job_step_series(jw, first_iteration, warmup)[1]


def job_step_series(jw: JobWindow, first_iteration: dict[int, int], warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 with its iterations: (iteration numbers ascending, the job's step of each, ns)."""
    its, durs = [], []
    for rank, rec in jw.iterations.items():
        start = first_iteration.get(rank, 0) + warmup
        for m in rec.marks:
            if m.iteration >= start and m.end_ns > m.start_ns:
                its.append(m.iteration)
                durs.append(m.end_ns - m.start_ns)
    if not its:
        return np.empty(0, dtype=np.int64), np.empty(0)
    it = np.asarray(its, dtype=np.int64)
    d = np.asarray(durs, dtype=np.float64)
    order = np.lexsort((d, it))
    it, d = it[order], d[order]
    cuts = np.flatnonzero(np.diff(it)) + 1
    return it[np.r_[0, cuts]], np.array([float(np.median(x)) for x in np.split(d, cuts)])


def analyze_pace(jw: JobWindow, scale: WindowScale, baseline: Baseline, steps: np.ndarray,
                 cfg: PaceConfig = PaceConfig(),
                 host_timed: bool = False) -> tuple[list[Finding], int, JobLoss | None]:
    """Steps 2-5 on this window's job steps (``job_steps``); records an unflagged window into the
    baseline. ``host_timed``: the ranks' steps are timed by the host (CPU ranks, step 3). Returns
    (findings, comparisons made: 1 when the job was judged, step 5's ``JobLoss`` when judged,
    else None)."""
    if steps.size < cfg.min_iterations:
        return [], 0, None
    base = baseline.steps()
    medians = baseline.window_medians(cfg.min_iterations)
    if base.size < cfg.min_iterations or (host_timed and medians.size < cfg.batch_min_windows):
        baseline.add(jw.window.index, steps)
        return [], 0, None
    b, now = float(np.median(base)), float(np.median(steps))
    spread = max(MAD_SIGMA * float(np.median(np.abs(base - b))), cfg.rel_floor * b)
    se = spread * MEDIAN_SE * np.sqrt(1 / steps.size + 1 / base.size)
    se_windows = 0.0
    if medians.size >= cfg.batch_min_windows:     # batch means: how far a healthy window's median moved
        se_windows = _batch_error(medians)
        se = max(se, se_windows)
    d = now - b
    z = d / se if se > 0 else 0.0
    z_star = z_threshold(cfg.false_alarm, 1)
    loss = JobLoss(steps, tuple(zip(baseline.indices, baseline.windows)), cfg)     # step 5
    if not (z >= z_star and d >= cfg.min_shift * b):
        if not (z >= SUSPECT_Z and d >= cfg.min_shift / 2 * b):
            baseline.add(jw.window.index, steps)   # a window already half-way slower stays out of the baseline
        return [], 1, loss
    return [Finding(level=LEVEL, kind=KIND, job_id=jw.job_id, window=jw.window, scope=Scope(group="job"),
                    severity=float(z), comparison="own_pace", job_impact_ns=d,
                    evidence={"step_now_s": round(now / 1e9, 6), "step_baseline_s": round(b / 1e9, 6),
                              "slowdown_pct": round(100 * d / b, 2), "impact_s": round(d / 1e9, 6),
                              "z": round(float(z), 2), "z_threshold": round(z_star, 2),
                              "window_error_s": round(se_windows / 1e9, 6),
                              "iterations_now": int(steps.size), "iterations_baseline": int(base.size),
                              "baseline_windows": len(baseline.windows),
                              "baseline_last_window": int(baseline.indices[-1]),
                              "ranks": len(jw.iterations)})], 1, loss
