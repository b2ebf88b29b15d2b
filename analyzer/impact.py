"""Impact in time units: what a deviation costs, in seconds per iteration.

A finding matters by what it costs the job, not by how far one kernel's
distribution is from its peers': a 3x spike of a 20 µs kernel once in a
window costs nothing on a 300 ms step, while every compute kernel 5 % slower
costs 5 % of the step. Every suspect therefore carries ``impact_ns``: the
nanoseconds per iteration attributable to it, and every finding is scored
against the window's step time.

1. ``window_scale(jw)``: per rank, how many iterations the window holds (its
   iteration marks; without marks, what an iterations window says it spans;
   with neither, the whole window is one "iteration"), and
   the step time: the median over ranks of their mean iteration time, else
   the median window length per iteration.
2. Detectors turn a per-window excess into a per-iteration impact with
   ``per_iteration`` (an excess of total time in the window divided by the
   rank's iterations).
3. ``apply_floor``: findings whose largest impact is below ``floor_pct`` of
   the step (or below ``floor_ns``; an L1 jitter no rank carries: below
   ``jitter_floor_pct``), and every finding of a short window
   (under half its iterations: the end of a job), are *informational*: they stay as
   evidence, never name suspects, never alert (ARCHITECTURE.md, replay
   contract). Stalls and missing ranks are not scaled by impact: a hang's
   cost is the whole step. A finding above the floor names only its suspects
   above it (the others stay in its evidence as ``below_floor``): with one
   fault, a slow group's healthy member is not a culprit beside it.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np

from trainscope.analyzer.model import Finding, JobWindow
from trainscope.analyzer.topology import check_number
from trainscope.proto.v1 import records_pb2

#: Finding kinds that are never informational because of their impact.
UNSCALED_KINDS = frozenset({"stall", "hang", "missing_rank"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ImpactConfig:
    floor_pct: float = 1.0
    """A finding costing less than this % of the step is informational (never a suspect or alert)."""
    floor_ns: float = 0.0
    """...or less than this many ns per iteration (absolute floor; 0 = off)."""
    jitter_floor_pct: float = 3.0
    """Floor of an L1 jitter no rank carries (it has no place to act on): the job's step is the
    max over its ranks, whose noise spikes single iterations by 10-20 % now and then (measured:
    1.4-1.9 % of the step per 10-iteration window on a healthy simulated 1,024-rank job)."""

    def __post_init__(self) -> None:
        check_number("impact.floor_pct", self.floor_pct, lambda v: 0 <= v < 100, "must be in [0, 100)")
        check_number("impact.jitter_floor_pct", self.jitter_floor_pct, lambda v: 0 <= v < 100,
                     "must be in [0, 100)")
        check_number("impact.floor_ns", self.floor_ns, lambda v: v >= 0, "must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class WindowScale:
    """Iterations per rank and the step time of one window (step 1)."""

    step_ns: float                      # 0 when unknown
    iterations: Mapping[int, float]     # rank -> iterations in the window (>= 1)
    default_iterations: float = 1.0
    nominal_iterations: float = 0.0     # what an iterations window spans; 0 for time windows
    marks_median: float = -1.0          # median iteration marks per rank record; -1: no iteration records

    @property
    def short(self) -> bool:
        """An iterations window whose iteration records hold under half its iterations (a job's
        last window, the tail after the last step): too few steps to compare ranks on; its
        findings are informational."""
        return self.nominal_iterations > 0 and 0 <= self.marks_median < 0.5 * self.nominal_iterations

    def of(self, rank: int) -> float:
        return self.iterations.get(rank, self.default_iterations)

    def per_iteration(self, rank: int, excess_ns: float) -> float:
        """An excess of total time in the window, per iteration of ``rank`` (step 2)."""
        return float(excess_ns) / self.of(rank)

    def pct(self, ns: float) -> float:
        return 100.0 * ns / self.step_ns if self.step_ns > 0 else 0.0

    def iterations_array(self, ranks: Iterable[int]) -> np.ndarray:
        return np.array([self.of(r) for r in ranks], dtype=np.float64)


def window_scale(jw: JobWindow) -> WindowScale:
    """Step 1."""
    w = jw.window
    fixed = None
    if w.kind == records_pb2.WINDOW_KIND_ITERATIONS and w.last_iteration >= w.first_iteration \
            and (w.last_iteration or w.first_iteration):
        fixed = float(w.last_iteration - w.first_iteration + 1)
    iters: dict[int, float] = {}
    means: list[float] = []
    for rank, rec in jw.iterations.items():
        n = len(rec.marks)
        if n:             # what the rank ran: a job's last window is often short
            iters[rank] = float(n)
        elif fixed is not None:
            iters[rank] = fixed
        if rec.mean_ns > 0:
            means.append(rec.mean_ns)
        elif n:
            d = [m.end_ns - m.start_ns for m in rec.marks if m.end_ns > m.start_ns]
            if d:
                means.append(float(np.mean(d)))
    default = float(np.median(list(iters.values()))) if iters else (fixed if fixed is not None else 1.0)
    if means:
        step = float(np.median(means))
    else:  # no iteration marks: the window itself is the unit
        lengths = [(r.window.end_ns - r.window.start_ns) / default
                   for recs in (jw.kernels, jw.phases) for r in recs.values()
                   if r.window.end_ns > r.window.start_ns]
        step = float(np.median(lengths)) if lengths else 0.0
    marks = [len(rec.marks) for rec in jw.iterations.values()]
    return WindowScale(step, iters, max(default, 1.0), fixed or 0.0,
                       float(np.median(marks)) if marks else -1.0)


def apply_floor(findings: list[Finding], scale: WindowScale, cfg: ImpactConfig) -> list[Finding]:
    """Step 3: mark findings below the floor informational and give every finding the step time."""
    floor = max(cfg.floor_ns, cfg.floor_pct / 100.0 * scale.step_ns)
    unplaced = max(floor, cfg.jitter_floor_pct / 100.0 * scale.step_ns)
    out = []
    for f in findings:
        at = unplaced if (f.level == "L1" and f.kind == "jitter" and not f.suspects) else floor
        small = f.kind not in UNSCALED_KINDS and f.level != "L5" and (f.impact_ns < at or scale.short)
        f = dataclasses.replace(f, informational=f.informational or small, step_ns=scale.step_ns)
        out.append(f if small or f.kind in UNSCALED_KINDS or f.level in _ROLE_LEVELS else _members_above(f, at))
    return out


#: Levels whose suspects below the floor carry a role of their own (waiters of a late start, a hang's
#: members): their findings keep every suspect.
_ROLE_LEVELS = frozenset({"L5", "collectives"})


def _members_above(f: Finding, at: float) -> Finding:
    """Step 3 per suspect: a finding above the floor names only its suspects above it (a slow group
    whose one member costs 8 % and the other 0.5 %); the others stay as evidence (``below_floor``)."""
    if len(f.suspects) < 2 or all(s.impact_ns >= at for s in f.suspects):
        return f
    keep = tuple(s for s in f.suspects if s.impact_ns >= at)
    below = [{"rank": s.rank, "impact_s": s.impact_ns / 1e9} for s in f.suspects if s.impact_ns < at]
    return dataclasses.replace(f, suspects=keep, evidence={**f.evidence, "below_floor": below})
