"""Localise abnormal function behaviour across ranks (EROICA §4.3, eq. 6-11).

Input: every rank's behaviour patterns P_{f,w} = (β, μ, σ) (``patterns.py``).
Ranks are compared within their role (ranks running the same code: one role
for a data-parallel job; a pipeline stage each otherwise).

Steps:
1. Matrices β, μ, σ of shape (ranks, functions), with (0, 0, 0) where a
   function never reached a rank's critical path.
2. Expected range R_f (eq. 6). Given (``expected``: per function name or per
   kind, e.g. ``PAPER_RANGES``, EROICA's production ranges: Python β ≤ 0.01,
   collectives β ≤ 0.3, compute unbounded) or, when not, from the job itself:
   the median over the role's ranks plus max(``floor``, k·s) per dimension,
   s = max(1.4826·MAD, ``rel_floor``·median) (one-sided: being *more* on
   the path, or slower per execution, is what costs time). ``floor`` = 0.01
   is EROICA's "within 1 % is measurement noise"; 1.4826·MAD estimates a
   standard deviation robustly, and ``rel_floor`` = 2 % is the project's
   measured GPU-to-GPU personality (docs/noise.md): with 8 ranks the MAD
   alone can come out far below it by chance. σ is unbounded unless given,
   as in all of EROICA's ranges (its spread has heavy tails; what it costs
   shows in β and μ); it still counts in Δ.
3. Distance from expectation D_{f,w} (eq. 7): the Manhattan distance from
   P_{f,w} to R_f, with μ the median execution μ̃ (``patterns`` step 6) and β
   the smaller of the steady β (its lower quartile over iterations,
   ``patterns`` step 4) and the typical β̃ = n·μ̃·(μ/μ̃ over the role)/|T|
   (the rank's executions spread like its peers' around its own median: one
   kernel name has many shapes), and step 2's range from them too; the idle
   pseudo-function, whose executions are gaps of any length, by its steady
   β. The scheduler on a shared host inflates a few iterations (which the
   steady β leaves out) or a few executions in every iteration (which β̃
   leaves out); a slower device or a function run more often moves both. On a loaded 2-core host a 4-rank dive's healthy rank had
   ``aten::addmm`` at β 0.074 (preempted), the faulty rank, running it 2.5
   times as often, 0.080: the range from β (median 0.056, MAD 0.022) held
   both; their steady β were 0.0065 and 0.020. With the steady β alone a
   healthy rank was named for a ``<genexpr>`` of the data loader (β 0.089,
   peers 0.015, its executions 2 µs at the median, 13 µs on average).
   Every dimension in shares of the window: μ and σ times
   the role's median executions per window (what that much time per
   execution costs over a typical window). So the three dimensions are
   comparable and the 1 % floor means the same thing in each: a
   per-execution excess that costs under 1 % of the window is noise.
4. Differential distance Δ_{f,w} (eq. 8-10): patterns max-normalised per
   function over the role's ranks; Δ = the share of N = min(100, |W|)
   sampled ranks (seeded: the same input gives the same answer) whose
   normalised pattern is at Manhattan distance ≥ δ = 0.4.
5. Abnormal (eq. 11): β > 0.01 ∧ (D > 0 ∨ Δ > M_f + k·MAD_f), k = 5,
   M_f and MAD_f the median and median absolute deviation of Δ over the role.
   Δ is a share of N ranks, so MAD_f is taken as at least 1/N (its
   resolution): without it, a job where every Δ is 0 but two ranks differ
   from each other would call both outliers (MAD = 0). A Δ outlier must
   also be material: its β, or its μ in window shares (step 3), at least
   max(``floor``, k·``rel_floor``·median) from the role's median — EROICA's
   "fluctuations within 1 % are measurement noise" (§4.3) and the
   personality floor applied to Δ as step 2 applies them to D.
   Without it, at 1,000+ ranks the ranks in the joint tails of healthy noise
   differ from enough sampled peers (Δ ≈ 0.1 against M = 0, MAD = 0) to be
   called outliers while costing well under 1 % of the window.
   Steadiness (``steady``, an addition): the function's β in its
   lower-quartile iteration (``patterns`` step 4: out of line in about three
   iterations of four) must also be that far from the role's median: a
   4-rank gloo job on a shared 2-core host had a healthy rank named for
   ``aten::select`` or ``stack`` costing 4 ms per iteration, all of it one
   preempted iteration, and a 6-rank one beside a busy process named healthy
   ranks for ``aten::cat``/``aten::copy_`` preempted in two iterations of
   four; a hot loop costs in every iteration. "That far" is
   max(``floor``, k·``rel_floor``·β·(1 − β)): a relative spread r of a
   function's time moves its share of the step by r·β·(1 − β), so near the
   whole step a slower function gains little share (a recorded CPU job's
   helper at 0.80 on its peers, 0.87 on the rank doing five times its work).
6. Impact, s per iteration: (β_w − median β) × the rank's mean iteration
   time (the extra critical-path time the function costs the rank per step),
   when the traces have iteration marks.
7. Waiting is not a cause (an addition, Mycroft §5's late start): a rank
   whose only slower functions are communication (a collective's host or
   device time) while another rank of the dive is slower in a function of
   its own (compute, memory, Python) waited in the collective for that rank:
   it is taken off the collective's outlier (named in its evidence); it is
   neither a cause nor, by a shorter collective, a late arrival. A
   4-rank gloo job whose rank 2 ran a hot loop had healthy rank 0 named for
   ``c10d::allreduce_`` on a loaded host. A blocking wait of the host
   (``time.sleep``, ``select``/``poll``, an ``Event``/``Condition`` wait, a
   queue's ``get``: ``WAITING``) is waiting too: a rank longer in it woke up
   late (the scheduler) or waited for something else; it is taken off the
   same way and never counts as the other ranks' cause (issue #22: a 6-rank
   dive of a hot loop on rank 1 also named healthy rank 2 for
   ``<built-in function sleep>``, 2.5 ms per iteration). With no rank slower
   in work of its own, such ranks still waited (a member longest in a
   collective arrived first): the outlier is kept, marked ``not_cause``
   "waited", and names nobody (beside a busy process, healthy 4-rank dives named a rank
   for ``c10d::allreduce_`` in 5 of 7 runs, 2.5-4.5 ms per iteration).
8. A slower rank that made nobody wait is not a cause (an addition, Mycroft
   §5's late start seen from the dive): a named rank is late when it waits
   for its peers (``patterns`` step 7, per iteration) less than the role's
   unnamed ranks by at least half its own cost, beyond its arrival's noise;
   beside a late rank, another named rank of its role whose cost is within
   that noise, or that clearly waited as long as the unnamed ranks, was
   slower at no cost to the job: its outliers are marked ``absorbed`` and
   name nobody (``absorbed``; after the threads' outliers are in, so a rank
   named for a thread counts as named, and is never judged).
Assumption: ranks of one role run the same code, so a function's pattern
differs between them only when something is wrong (§3 of the paper).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Mapping, Sequence

import numpy as np

from trainscope.analyzer.deepdive.patterns import Patterns, waits_for_peers
from trainscope.proto.errors import ConfigError

INF = math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class ExpectedRange:
    """R_f of eq. 6: closed intervals per dimension (β share; μ, σ in seconds)."""

    beta: tuple[float, float] = (0.0, 1.0)
    mu: tuple[float, float] = (0.0, INF)
    sigma: tuple[float, float] = (0.0, INF)


#: EROICA §4.3's production ranges, by kind of function.
PAPER_RANGES: Mapping[str, ExpectedRange] = {
    "python": ExpectedRange(beta=(0.0, 0.01)),
    "cpu": ExpectedRange(beta=(0.0, 0.01)),
    "runtime": ExpectedRange(beta=(0.0, 0.01)),
    "communication": ExpectedRange(beta=(0.0, 0.3)),
    "memory": ExpectedRange(beta=(0.0, 1.0)),
    "compute": ExpectedRange(beta=(0.0, 1.0)),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalizeConfig:
    n_sample: int = 100
    """N of eq. 9: ranks sampled per comparison (min(N, |W|))."""
    delta: float = 0.4
    """δ of eq. 10: normalised Manhattan distance at which two patterns differ."""
    k: float = 5.0
    """k of eq. 11: MAD multiplier for Δ, and for the self-derived expected range."""
    min_beta: float = 0.01
    """Eq. 11: a function must take more than this share of the window to matter."""
    floor: float = 0.01
    """Smallest half-width of a self-derived expected range, in window shares (1 % noise, §4.3)."""
    rel_floor: float = 0.02
    """Smallest rank-to-rank spread, as a share of the median (GPU-to-GPU personality, docs/noise.md)."""
    seed: int = 0
    steady: bool = True
    """An outlier's β must be out of line in its lower-quartile iteration too (``patterns`` step 4), and D is
    measured on that steady β and the median execution (step 3): stalls of a few iterations (a rank
    preempted on a shared host) are not a function's behaviour. False: EROICA's β and μ."""

    def __post_init__(self) -> None:
        if self.n_sample < 1:
            raise ConfigError("deepdive.n_sample", self.n_sample, "must be >= 1")
        if not 0 < self.delta <= 3:
            raise ConfigError("deepdive.delta", self.delta, "must be in (0, 3]")
        if self.k <= 0:
            raise ConfigError("deepdive.k", self.k, "must be > 0")
        if not 0 <= self.min_beta < 1:
            raise ConfigError("deepdive.min_beta", self.min_beta, "must be in [0, 1)")
        if self.floor < 0:
            raise ConfigError("deepdive.floor", self.floor, "must be >= 0")
        if self.rel_floor < 0:
            raise ConfigError("deepdive.rel_floor", self.rel_floor, "must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Outlier:
    """One function found abnormal on one or more ranks (step 5), best first within."""

    function: str
    kind: str
    role: str
    ranks: tuple[int, ...]
    d: tuple[float, ...]            # D_{f,w} per rank
    delta: tuple[float, ...]        # Δ_{f,w} per rank
    beta: tuple[float, ...]
    mu: tuple[float, ...]           # s
    sigma: tuple[float, ...]        # s
    impact_s: tuple[float | None, ...]   # s per iteration (step 6), None without iteration marks
    slower: tuple[bool, ...]
    expected: tuple[float, float, float]      # the role's median (β, μ, σ)
    delta_threshold: float                    # M_f + k·MAD_f
    common: bool                    # on more than half the role's ranks: a problem of the whole job (§4.3 type 1)
    launched_by: str = ""
    evidence: str = ""
    not_cause: str = ""             # steps 7-8: "waited" (its ranks waited in it), "absorbed": names no rank


def _mad(x: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    m = np.median(x, axis=axis)
    return m, np.median(np.abs(x - np.expand_dims(m, axis)), axis=axis)


def _present_median(M: np.ndarray) -> np.ndarray:
    """Per function (column), the median over the ranks where it is present (> 0); 0 where none."""
    with np.errstate(all="ignore"):
        return np.nan_to_num(np.nanmedian(np.where(M > 0, M, np.nan), axis=0), nan=0.0)


def _half_width(m: np.ndarray, mad: np.ndarray, cfg: LocalizeConfig) -> np.ndarray:
    """Step 2: max(floor, k·s), s = max(1.4826·MAD, rel_floor·|median|)."""
    return np.maximum(cfg.floor, cfg.k * np.maximum(1.4826 * mad, cfg.rel_floor * np.abs(m)))


def _matrices(pats: Sequence[Patterns]) -> tuple[list[str], list[str], list[dict[int, str]], np.ndarray,
                                                np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                np.ndarray]:
    """Step 1: β, μ, σ, n, steady β and median μ̃ (ranks, functions)."""
    index: dict[str, int] = {}
    kinds: list[str] = []
    launched: list[dict[int, str]] = []    # per function: rank row -> its launcher (they can differ)
    for i, p in enumerate(pats):
        for f, kd, lb in zip(p.functions, p.kinds, p.launched_by):
            if f not in index:
                index[f] = len(index)
                kinds.append(kd)
                launched.append({})
            if lb:
                launched[index[f]][i] = lb
    B = np.zeros((len(pats), len(index)))
    MU = np.zeros_like(B)
    SG = np.zeros_like(B)
    N = np.zeros_like(B)
    BM = np.zeros_like(B)
    MT = np.zeros_like(B)
    for i, p in enumerate(pats):
        cols = np.fromiter((index[f] for f in p.functions), dtype=np.int64, count=len(p.functions))
        B[i, cols], MU[i, cols], SG[i, cols], N[i, cols] = p.beta, p.mu, p.sigma, p.count
        BM[i, cols] = p.beta if p.beta_steady is None else p.beta_steady
        MT[i, cols] = p.mu if p.mu_median is None else p.mu_median
    return list(index), kinds, launched, B, MU, SG, N, BM, MT


def differential_distance(B: np.ndarray, MU: np.ndarray, SG: np.ndarray, cfg: LocalizeConfig,
                          rng: np.random.Generator) -> np.ndarray:
    """Step 4 for one role: Δ (ranks, functions). Chunked over functions to bound memory."""
    R, F = B.shape
    out = np.zeros((R, F))
    if R < 2 or F == 0:
        return out
    n = min(cfg.n_sample, R)
    sample = np.arange(R) if n == R else rng.choice(R, size=n, replace=False)
    chunk = max(1, int(4e6 // (R * n)))
    xs = []
    for M in (B, MU, SG):
        hi = M.max(axis=0)
        xs.append(np.divide(M, hi, out=np.zeros_like(M), where=hi > 0).astype(np.float32))
    for a in range(0, F, chunk):
        b = min(a + chunk, F)
        acc = np.zeros((R, n, b - a), dtype=np.float32)
        tmp = np.empty_like(acc)
        for x in xs:
            np.subtract(x[:, None, a:b], x[sample][None, :, a:b], out=tmp)
            np.abs(tmp, out=tmp)
            acc += tmp
        out[:, a:b] = np.count_nonzero(acc >= cfg.delta, axis=1) / n
    return out


def localize(patterns: Mapping[int, Patterns], *, roles: Mapping[int, str] | None = None,
             expected: Mapping[str, ExpectedRange] | None = None,
             cfg: LocalizeConfig = LocalizeConfig(), absorb: bool = True) -> list[Outlier]:
    """Steps 1-6 for every role; outliers sorted by their largest impact (then D, Δ)."""
    by_role: dict[str, list[int]] = {}
    for r in sorted(patterns):
        by_role.setdefault((roles or {}).get(r, "job"), []).append(r)
    rng = np.random.default_rng(cfg.seed)
    out: list[Outlier] = []
    for role, ranks in sorted(by_role.items()):
        pats = [patterns[r] for r in ranks]
        funcs, kinds, launched, B, MU, SG, N, BM, MT = _matrices(pats)
        if not funcs:
            continue
        R = len(ranks)
        # 2. expected range, on the steady, typical β and the median execution (patterns steps 4 and 6;
        # EROICA's β and μ without the steadiness rule)
        ref_mu, ref_mt = _present_median(MU), _present_median(MT)     # over the ranks it reached the path on
        win = np.array([p.window_s for p in pats])[:, None]
        if cfg.steady:
            # the smaller of the steady β and the typical β̃ = n·μ̃·(μ/μ̃ of the role)/|T|: preemption
            # inflates a few iterations (the first) or a few executions (the second); a fault moves both
            # (the idle pseudo-function's "executions" are gaps of any length: its steady β alone)
            shape = np.divide(ref_mu, ref_mt, out=np.ones_like(ref_mu), where=ref_mt > 0)
            BD, MD = np.minimum(BM, N * MT * shape / np.where(win > 0, win, 1.0)), MT.copy()
            idle = np.array([k == "idle" for k in kinds])
            BD[:, idle], MD[:, idle] = BM[:, idle], MU[:, idle]
            ref_md = np.where(idle, ref_mu, ref_mt)
        else:
            BD, MD, ref_md = B, MU, ref_mu
        mB = np.median(B, axis=0)
        mBD, madBD = _mad(BD)
        with np.errstate(all="ignore"):
            per = np.nanmedian(np.where(N > 0, win / np.maximum(N, 1), np.nan), axis=0)
        # μ, σ in window shares: what that much per execution costs at the role's typical
        # executions per window
        scale = np.where(np.isfinite(per) & (per > 0), per, 1.0)
        mu_r, sg_r = MD / scale, SG / scale
        mM, madM = _mad(mu_r)
        hiB = mBD + _half_width(mBD, madBD, cfg)
        hiM = mM + _half_width(mM, madM, cfg)
        # σ is left unbounded by default, as in every one of EROICA's ranges: a spread of
        # durations has heavy tails (one 3x call moves it), and what it costs shows in β and μ
        hiS = np.full_like(mM, np.inf)
        loB = np.zeros_like(hiB)
        loM = np.zeros_like(hiM)
        loS = np.zeros_like(hiS)
        given = np.zeros(len(funcs), dtype=bool)
        if expected:
            for j, (f, kd) in enumerate(zip(funcs, kinds)):
                e = expected.get(f) or expected.get(kd)
                if e is not None:
                    given[j] = True
                    loB[j], hiB[j] = e.beta
                    loM[j], hiM[j] = e.mu[0] / scale[j], e.mu[1] / scale[j]
                    loS[j], hiS[j] = e.sigma[0] / scale[j], e.sigma[1] / scale[j]
        # 3. distance from expectation (a function absent from a rank's path is at the origin), measured
        # on the steady, typical β and the median execution: a few iterations or executions the
        # scheduler interrupted do not move it
        D = (np.maximum(0, BD - hiB) + np.maximum(0, loB - BD)
             + np.maximum(0, mu_r - hiM) + np.maximum(0, loM - mu_r) * (MU > 0)
             + np.maximum(0, sg_r - hiS) + np.maximum(0, loS - sg_r) * (MU > 0))
        # 4. differential distance
        Dl = differential_distance(B, MU, SG, cfg, rng)
        mD, madD = _mad(Dl)
        # Δ moves in steps of 1/N: its spread cannot be told finer than one sampled rank
        thr = mD + cfg.k * np.maximum(madD, 1.0 / min(cfg.n_sample, R))
        # 5. abnormal, and by at least the noise floor in window shares
        band_b = np.maximum(cfg.floor, cfg.k * cfg.rel_floor * mBD)
        band_m = np.maximum(cfg.floor, cfg.k * cfg.rel_floor * ref_md / scale)
        material = (np.abs(BD - mBD) >= band_b) | (np.abs(mu_r - ref_md / scale) >= band_m)
        bad = (B > cfg.min_beta) & ((D > 0) | ((Dl > thr) & material))
        if cfg.steady:
            # ... in about three iterations of four too: stalls of one or two iterations move β, not that
            mBM = np.median(BM, axis=0)
            # a relative spread r of a function's time moves its share β of the step by r·β·(1 − β) (the rest of
            # the step stays): near the whole step a 5x slower function gains little share (0.80 -> 0.87 in a
            # recorded CPU job whose peers' helper was preempted), and k·r·β would have hidden it
            steady = np.abs(BM - mBM) >= np.maximum(cfg.floor, cfg.k * cfg.rel_floor * mBM * (1 - mBM))
            # against a given range: β out of it in that iteration too, or D from μ/σ alone
            in_b = (BD <= hiB) & (BD >= loB)
            steady[:, given] = ((BM > hiB) | (BM < loB) | ((D > 0) & in_b))[:, given]
            bad &= steady
        # 6. impact per iteration
        per_iter = np.array([p.window_s / p.iterations if p.iterations else np.nan for p in pats])
        impact = (B - mB) * per_iter[:, None]
        slower = (BD > mBD) | ((MD > ref_md) & (BD >= mBD))
        for j in np.flatnonzero(bad.any(axis=0)):
            rows = np.flatnonzero(bad[:, j])
            imp = impact[rows, j]
            rows = rows[np.argsort(-np.nan_to_num(imp, nan=-np.inf), kind="stable")]
            out.append(_outlier(funcs[j], kinds[j], role, [ranks[i] for i in rows], rows, j, D, Dl, B, MU, SG,
                                impact, slower, (float(mB[j]), float(ref_mu[j]), float(np.median(SG[:, j]))),
                                float(thr[j]), R, launched[j], expected is not None and (
                                    funcs[j] in expected or kinds[j] in expected)))
    out = _waiting_is_not_a_cause(out)
    if absorb:          # step 8 (``localize_columns`` runs it itself, once the threads' outliers are in)
        out = absorbed(out, arrival_waits(patterns, roles), cfg.floor)
    out.sort(key=lambda o: (-max((x for x in o.impact_s if x is not None), default=0.0), -max(o.d), -max(o.delta)))
    return out


#: Step 7: host functions that block (the thread sleeps or waits for something else, it does no work).
#: ``<built-in method wait of ...>``: a C++ object's blocking wait (c10d's ``Work.wait`` under every gloo/NCCL
#: collective: a healthy rank of a slower-matmul dive was named for it, 0.33 of the window against 0.23).
#: ``select``/``poll`` after ``::`` are tensor ops (``aten::select`` indexes a tensor), not the system calls.
WAITING = re.compile(r"built-in function sleep|\btime\.sleep\b|(?<!::)\bselect\b|(?<!::)\bpoll\b|\bepoll|built-in method wait\b|"
                     r"\b(Event|Condition|Semaphore|Barrier)\.wait\b|threading\.py(\(\d+\))?: wait\b|"
                     r"queue\.py.*\bget\b|\bQueue\.get\b", re.IGNORECASE)


@functools.lru_cache(maxsize=65536)
def _waits(function: str, kind: str) -> bool:
    """Steps 7-8: a collective, or a host function that blocks (``WAITING``). Cached: step 8 asks it of
    every function of every rank, and a job's ranks share their function names."""
    return kind == "communication" or (kind in ("python", "cpu") and bool(WAITING.search(function)))


def _is_wait(o) -> bool:
    return _waits(o.function, o.kind)


def _waiting_is_not_a_cause(out: list) -> list:
    """Step 7: on communication and blocking-wait outliers, the ranks slower in nothing else waited.

    When some rank is slower in a function of its own, they waited for it: they are taken off the
    outlier (named in its evidence), and an outlier left with no rank is dropped. When none is, they
    still waited (every member leaves a collective together, so the one longest in it arrived first;
    a longer sleep is a late wake-up): the outlier of those ranks is kept, marked ``not_cause``
    "waited", and names nobody. A collective longer on most ranks (``common``) is the job's.
    """
    causes = {r for o in out if not _is_wait(o) and not o.common
              for r, slow in zip(o.ranks, o.slower) if slow}
    fixed = []
    for o in out:
        waits = ([r for r, s in zip(o.ranks, o.slower) if s and r not in causes]
                 if _is_wait(o) and (causes or not o.common) else [])
        if not waits:
            fixed.append(o)
            continue
        who = ", ".join(map(str, waits))
        note = (f"rank(s) {who} waited in it for rank(s) {', '.join(map(str, sorted(causes)))}" if causes else
                f"rank(s) {who} waited in it longer than their peers, and no rank of this dive is slower in work "
                f"of its own: the rank waited for was late for another reason (its host, a rank outside the dive)")
        rest = [i for i, r in enumerate(o.ranks) if r not in waits]
        if rest:
            fixed.append(_subset(o, rest, note, o.not_cause))
        if not causes:          # no cause in the dive: the ranks that waited stay, naming nobody
            fixed.append(_subset(o, [i for i, r in enumerate(o.ranks) if r in waits], note, "waited"))
    return fixed


def _subset(o: Outlier, keep: list[int], note: str, not_cause: str) -> Outlier:
    pick = lambda t: tuple(t[i] for i in keep)  # noqa: E731
    return dataclasses.replace(
        o, ranks=pick(o.ranks), d=pick(o.d), delta=pick(o.delta), beta=pick(o.beta), mu=pick(o.mu),
        sigma=pick(o.sigma), impact_s=pick(o.impact_s), slower=pick(o.slower), not_cause=not_cause,
        evidence="; ".join(x for x in (o.evidence, note) if x))


#: Step 8: a cause's lateness at the collectives must account for at least this share of its own cost.
ABSORBED_SHARE = 0.5


def arrival_waits(patterns: Mapping[int, Patterns], roles: Mapping[int, str] | None = None
                  ) -> dict[int, tuple[str, np.ndarray, float]]:
    """Step 8's measure: rank -> (role, s waiting for peers on its path in each iteration (``patterns`` step
    7), its mean iteration in s). Without per-iteration figures, one value: the window's mean per
    iteration; NaN without iteration marks."""
    out = {}
    for r, p in patterns.items():
        it = p.window_s / p.iterations if p.iterations else math.nan
        if p.peer_waits is not None and p.peer_waits.size:
            w = np.asarray(p.peer_waits, dtype=float)
        else:
            w = np.array([it * sum(float(b) for f, k, b in zip(p.functions, p.kinds, p.beta)
                                   if waits_for_peers(f, k))])
        out[r] = ((roles or {}).get(r, "job"), w, it)
    return out


def absorbed(out: list, arrival: Mapping[int, tuple[str, np.ndarray, float]], floor: float = 0.01) -> list:
    """Step 8: a slower rank that made nobody wait is not a cause while another one did.

    In a synchronous job every rank waits at the collectives for the last to arrive; a rank whose own
    work costs it x more per iteration arrives about x later, and waits about x less than the ranks of
    its role named for nothing.

    1. Cost x: a named rank's impact per iteration summed over its outliers (not the waits', not a
       common one's). A rank named for another thread (``_thread_outliers``: its cost is the
       contention's, spread over the path and unknown) is never judged here.
    2. Lateness, per iteration i: d_i = ref_i − w_i, w the rank's time waiting for peers (``patterns``
       step 7), ref_i the median of the role's ranks named for nothing (all of the role's when every
       rank is named); late = mean d, its standard error s = sd(d)/√n (0 with one figure).
    3. A rank is *late* (a cause the job waited for) when x ≥ s (its cost can be told from its
       arrival's noise) and late ≥ ``ABSORBED_SHARE``·x > 0.
    4. When some rank of a role is late, that role's other named ranks whose cost is within their
       arrival's noise (x < s), or that waited about as long as the unnamed ranks (late within 2 s of
       0 or under ``floor`` of its mean iteration, and late + s < ``ABSORBED_SHARE``·x), were slower at no cost to the job: their outliers are
       kept, marked ``absorbed``, and name no rank. A rank in between stays named: late short of the
       share but not clearly, or clearly late by less than the share (on an oversubscribed host a
       rank's own CPU time slows the unnamed ranks too: a slow collate of 37 ms per iteration was late
       by 13 ± 3 ms). With no late rank, nothing changes: a small fault's lateness is lost in the
       waits' noise (a slower matmul, 2 ms per iteration, waiting about as long as its peers). Several
       faults of comparable cost each make the unnamed ranks wait, and stay named.

    Beside a busy process, 4-rank dives of a hot loop or GC on rank 2 (23-31 ms per iteration, 24 ms
    less waiting) also named healthy ranks for ``aten::gelu`` or ``aten::addmm`` (0.8-6.4 ms, waiting
    0.4 ms less or 2-5 ms longer); a 6-rank dive with four faults (25-90 ms per iteration each) named
    a healthy rank for 1.5 ms of ``aten::gelu`` whose arrival, against the one unnamed rank left, moved
    by 22 ms per iteration (late 20 ms on average: step 3's share alone called it a cause).
    """
    cost: dict[int, float] = {}
    named: set[int] = set()             # any cause named (a thread's outlier carries no cost of its own)
    threads: set[int] = set()
    for o in out:
        if o.not_cause or o.common or _is_wait(o):
            continue
        for r, s, x in zip(o.ranks, o.slower, o.impact_s):
            if s:
                named.add(r)
                if o.kind == "thread":
                    threads.add(r)
            if s and x is not None and x > 0:
                cost[r] = cost.get(r, 0.0) + x
    # 2. the reference per iteration: the role's ranks named for nothing (all of the role's when every rank
    # is named); ranks whose figures do not line up with the role's (another number of iterations) are left out
    by_role: dict[str, dict[int, np.ndarray]] = {}
    for r, (role, w, _) in arrival.items():
        if np.all(np.isfinite(w)):
            by_role.setdefault(role, {})[r] = w
    ref: dict[str, np.ndarray] = {}
    for role, ws in by_role.items():
        n = max({len(w) for w in ws.values()}, key=[len(w) for w in ws.values()].count)
        pool = [w for r, w in ws.items() if len(w) == n and r not in named] or \
               [w for w in ws.values() if len(w) == n]
        ref[role] = np.median(np.array(pool), axis=0)
    judged: dict[int, tuple[float, float]] = {}         # rank -> (late, s)
    for r, x in cost.items():
        role, w, _ = arrival.get(r, ("", np.array([math.nan]), math.nan))
        if r in threads or role not in ref or len(w) != len(ref[role]) or not np.all(np.isfinite(w)):
            continue
        d = ref[role] - w
        judged[r] = (float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0)
    # 3. late ranks; 4. the others of their role, unjudgeable or clearly not late
    late = {r for r, (m, se) in judged.items() if cost[r] >= se and m > 0 and m >= ABSORBED_SHARE * cost[r]}
    late_roles = {arrival[r][0] for r in late}
    waited = {r for r, (m, se) in judged.items()       # made the others wait: clearly, and by 1 % of a step
              if m - 2 * se > 0 and not m < floor * arrival[r][2]}
    absorbed = {r for r, (m, se) in judged.items() if r not in late and arrival[r][0] in late_roles
                and (cost[r] < se or (r not in waited and m + se < ABSORBED_SHARE * cost[r]))}
    if not absorbed:
        return out
    fixed = []
    for o in out:
        hit = [i for i, r in enumerate(o.ranks) if r in absorbed] if not (o.not_cause or o.common) else []
        if not hit:
            fixed.append(o)
            continue
        rest = [i for i in range(len(o.ranks)) if i not in hit]
        who = ", ".join(str(o.ranks[i]) for i in hit)
        note = (f"rank(s) {who} slower in it at no cost to the job: their arrival at the collectives was no later "
                f"than their peers' beyond its noise, while rank(s) {', '.join(map(str, sorted(late)))} made "
                f"the others wait")
        if rest:
            fixed.append(_subset(o, rest, "", o.not_cause))
        fixed.append(_subset(o, hit, note, "absorbed"))
    return fixed


def _outlier(func, kind, role, ranks, rows, j, D, Dl, B, MU, SG, impact, slower, ref, thr, R, launched,
             given) -> Outlier:
    imp = tuple(None if not np.isfinite(impact[i, j]) else float(impact[i, j]) for i in rows)
    why = []
    r0, i0 = ranks[0], rows[0]
    # the launcher on the first named rank (an op's caller there), else the one most ranks report
    launched = launched.get(i0) or (max(set(launched.values()), key=list(launched.values()).count)
                                    if launched else "")
    if D[i0, j] > 0:
        why.append(f"D={D[i0, j]:.3f} from the {'given' if given else 'job median'} expected range")
    if Dl[i0, j] > thr:
        why.append(f"Δ={Dl[i0, j]:.2f} > M+kMAD={thr:.2f} (differs from {Dl[i0, j]:.0%} of sampled ranks)")
    cost = f", costs {imp[0] * 1e3:.2f} ms per iteration" if imp[0] is not None and imp[0] > 0 else ""
    text = (f"{kind} function {func[:80]!r} on rank {r0}: β={B[i0, j]:.3f} of the window on the critical path "
            f"(median {ref[0]:.3f}), μ={MU[i0, j] * 1e3:.3f} ms per execution (median {ref[1] * 1e3:.3f} ms), "
            f"σ={SG[i0, j] * 1e3:.3f} ms; " + "; ".join(why) + cost
            + (f"; {len(ranks)} ranks in all" if len(ranks) > 1 else "")
            + (f"; launched by {launched[:60]!r}" if launched else ""))
    return Outlier(function=func, kind=kind, role=role, ranks=tuple(int(r) for r in ranks),
                   d=tuple(float(D[i, j]) for i in rows), delta=tuple(float(Dl[i, j]) for i in rows),
                   beta=tuple(float(B[i, j]) for i in rows), mu=tuple(float(MU[i, j]) for i in rows),
                   sigma=tuple(float(SG[i, j]) for i in rows), impact_s=imp,
                   slower=tuple(bool(slower[i, j]) for i in rows), expected=ref, delta_threshold=thr,
                   common=len(ranks) > R / 2, launched_by=launched, evidence=text)
