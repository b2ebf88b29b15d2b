"""L4 deep dive: localise the function behind a slowdown from per-rank profiler traces.

ARGUS keeps L4 (full profiler traces, §6.3) for the moments the always-on
levels have narrowed a problem down; EROICA (§4.2-4.3) shows how to turn
such traces from every worker into a verdict without comparing raw events:
summarise each function's behaviour on each rank's critical path, then find
the ranks whose behaviour is far from the expected or unlike their peers'.

Pipeline (one module per role):
``trace.read_trace`` (Kineto JSON -> columns) -> ``critical_path`` ->
``patterns.behaviour_patterns`` (β, μ, σ per function) -> ``localize``
(D, Δ, MAD outliers) -> ``DeepDiveResult`` -> ``to_findings`` (level "L4").

The seam with the trigger side: a deep dive is a mapping rank -> trace path,
the traces covering the same iterations on every rank.
"""
from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from typing import Any, Mapping

import numpy as np

from trainscope.analyzer.deepdive.critical_path import LEVEL_NAMES, CriticalPath, critical_path
from trainscope.analyzer.deepdive.localize import (
    PAPER_RANGES, ExpectedRange, LocalizeConfig, Outlier, absorbed, arrival_waits, localize,
)
from trainscope.analyzer.deepdive.patterns import Patterns, behaviour_patterns, thread_patterns
from trainscope.analyzer.deepdive.trace import TraceColumns, TraceError, read_trace
from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.proto.v1 import records_pb2

__all__ = ["DeepDiveResult", "ExpectedRange", "LocalizeConfig", "Outlier", "PAPER_RANGES", "RankSummary",
           "TraceError", "localize_columns", "localize_traces", "read_trace", "trace_paths"]

_RANK_FILE = re.compile(r"^rank-?(\d+)\.json(\.gz)?$")

_DEVICE_KINDS = ("compute", "memory")


@dataclasses.dataclass(frozen=True, slots=True)
class RankSummary:
    """One rank's critical path in brief."""

    rank: int
    path: str
    events: int
    window_s: float
    iterations: int
    step_s: float | None                       # mean iteration time, None without ProfilerStep marks
    level_share: Mapping[str, float]           # share of the window per priority level (idle included)
    top: tuple[tuple[str, str, float, float, float], ...]   # (function, kind, β, μ s, σ s), largest β first


@dataclasses.dataclass(frozen=True, slots=True)
class DeepDiveResult:
    job_id: str
    ranks: tuple[RankSummary, ...]
    outliers: tuple[Outlier, ...]
    params: Mapping[str, Any]
    analysis_s: float
    warnings: tuple[str, ...] = ()
    first_iteration: int = -1
    last_iteration: int = -1

    @property
    def healthy(self) -> bool:
        """No outlier but those that name no cause (ranks that waited or were absorbed: ``localize`` 7-8)."""
        return all(o.not_cause for o in self.outliers)

    def to_findings(self) -> list[Finding]:
        """One level-"L4" ``Finding`` per outlier function.

        Suspects carry ``function``, ``direction`` and ``ratio`` so
        ``attribution.evidence_of`` types them like any other level's: a
        rank slower in its own work is culprit evidence, one longer in a
        collective is a waiter. A function abnormal on more than half of a
        role's ranks is a problem of the whole job (EROICA §4.3, type 1): it
        names no rank and carries the cost as ``job_impact_ns``. A rank with
        *less* of a non-collective function on its path is left out (another
        function pushed it off the path; it is kept in ``outliers``); a rank
        with less of a collective arrived late, and its shortfall is what its
        peers waited: that is its impact.
        """
        steps = [r.step_s for r in self.ranks if r.step_s]
        step_ns = statistics.median(steps) * 1e9 if steps else 0.0
        window = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS if self.first_iteration >= 0
                                    else records_pb2.WINDOW_KIND_TIME,
                                    index=max(self.first_iteration, 0),
                                    first_iteration=max(self.first_iteration, 0),
                                    last_iteration=max(self.last_iteration, 0))
        out = []
        for o in self.outliers:
            if o.not_cause:         # ranks that waited or were absorbed (localize steps 7-8): no cause
                continue
            comm = o.kind == "communication"
            sus = []
            for i, r in enumerate(o.ranks):
                if not o.slower[i] and not comm:
                    continue    # less of its own work on the path: pushed off by another function, not a cause
                ref = o.expected[1] if o.mu[i] > 0 and o.expected[1] > 0 else 0.0
                ratio = o.mu[i] / ref if ref else (o.beta[i] / o.expected[0] if o.expected[0] > 0 else 1.0)
                # a collective shorter than its peers': the rank arrived late and its peers waited
                # that long (attribution's rule), so the shortfall is what it costs the job
                cost = (o.impact_s[i] or 0.0) if o.slower[i] else abs(o.impact_s[i] or 0.0)
                sus.append(SuspectRank(
                    rank=r, score=max(o.d[i], o.delta[i]), impact_ns=max(0.0, cost * 1e9),
                    evidence={"function": o.function, "kind": o.kind,
                              "direction": "slower" if o.slower[i] else "faster",
                              "ratio": float(ratio), "D": o.d[i], "Delta": o.delta[i], "beta": o.beta[i],
                              "mu_s": o.mu[i], "sigma_s": o.sigma[i], "launched_by": o.launched_by}))
            ev = {"function": o.function, "communication": comm, "role": o.role, "common": o.common,
                  "delta_threshold": o.delta_threshold, "expected_beta": o.expected[0],
                  "expected_mu_s": o.expected[1], "why": o.evidence}
            scope = Scope(kernel=o.function if o.kind in _DEVICE_KINDS or (comm and o.launched_by) else "",
                          group="job" if o.role == "job" else o.role)
            impacts = [x for x in o.impact_s if x is not None and x > 0]
            if o.common:
                out.append(Finding(level="L4", kind="function_outlier", job_id=self.job_id, window=window,
                                   scope=scope, severity=max(max(o.d), max(o.delta)), evidence=ev,
                                   comparison="job", step_ns=step_ns,
                                   job_impact_ns=statistics.median(impacts) * 1e9 if impacts else 0.0))
            elif sus:
                out.append(Finding(level="L4", kind="function_outlier", job_id=self.job_id, window=window,
                                   scope=scope, suspects=tuple(sus), severity=max(s.score for s in sus),
                                   evidence=ev, comparison="peers", step_ns=step_ns))
        return out


def summarize(rank: int, cp: CriticalPath, pats: Patterns, top: int = 10) -> RankSummary:
    shares = {k: v / cp.window_us if cp.window_us > 0 else 0.0 for k, v in cp.time_by_level().items()}
    o = np.argsort(-pats.beta, kind="stable")[:top]
    return RankSummary(rank=rank, path=cp.trace.path, events=len(cp.trace), window_s=cp.window_us * 1e-6,
                       iterations=cp.iterations,
                       step_s=cp.window_us * 1e-6 / cp.iterations if cp.iterations else None,
                       level_share={k: shares[k] for k in LEVEL_NAMES},
                       top=tuple((pats.functions[i], pats.kinds[i], float(pats.beta[i]), float(pats.mu[i]),
                                  float(pats.sigma[i])) for i in o))


def localize_columns(traces: Mapping[int, TraceColumns], *, job_id: str = "",
                     expected: Mapping[str, ExpectedRange] | None = None, roles: Mapping[int, str] | None = None,
                     cfg: LocalizeConfig = LocalizeConfig()) -> DeepDiveResult:
    """The deep dive on traces already read (benchmarks and tests use it to skip the JSON)."""
    t = time.perf_counter()
    pats: dict[int, Patterns] = {}
    threads: dict[int, Patterns] = {}
    summaries = []
    warnings = []
    steps: dict[int, tuple[int, ...]] = {}
    for r in sorted(traces):
        cp = critical_path(traces[r])
        pats[r] = behaviour_patterns(cp)
        threads[r] = thread_patterns(cp)
        summaries.append(summarize(r, cp, pats[r]))
        steps[r] = traces[r].step_ids
        if traces[r].rank >= 0 and traces[r].rank != r:
            warnings.append(f"rank {r}: its trace says rank {traces[r].rank} ({traces[r].path})")
    if len({len(s) for s in steps.values()}) > 1:
        warnings.append("the traces cover different numbers of iterations: "
                        + ", ".join(f"rank {r}: {len(s)}" for r, s in sorted(steps.items())[:8]))
    outliers = localize(pats, roles=roles, expected=expected, cfg=cfg, absorb=False)
    outliers += _thread_outliers(threads, pats, roles=roles, expected=expected, cfg=cfg)
    outliers = absorbed(outliers, arrival_waits(pats, roles), cfg.floor)          # localize step 8
    ids = [i for s in steps.values() for i in s if i >= 0]
    return DeepDiveResult(job_id=job_id, ranks=tuple(summaries), outliers=tuple(outliers),
                          params=dataclasses.asdict(cfg), analysis_s=time.perf_counter() - t,
                          warnings=tuple(warnings), first_iteration=min(ids, default=-1),
                          last_iteration=max(ids, default=-1))


def _thread_outliers(threads: Mapping[int, Patterns], pats: Mapping[int, Patterns], *,
                     roles: Mapping[int, str] | None, expected: Mapping[str, ExpectedRange] | None,
                     cfg: LocalizeConfig) -> list[Outlier]:
    """Other threads' functions (``patterns.thread_patterns``) localised like the path's, apart from it.

    1. ``localize`` on the threads' patterns (the job's own expected range: EROICA gives none for them).
    2. Only functions the role's median rank does not run (median β under ``floor``): a thread every
       rank runs shows its parked frame for a share of the window that differs by rank (gRPC's poller
       threads: 1.1-1.8 of the window on six ranks of one job), so "more of it" is not evidence.
       A rank is kept only when its training thread is slower too (a non-common, non-collective path
       outlier, slower): a thread of its own that costs the training step nothing is not a cause
       (a rank may run an idle helper thread its peers do not).
       The symptoms are the path's outliers *without* the steadiness rule (``localize`` step 5): a
       thread holding the GIL slows whichever function the training thread runs at each hand-off, a
       different one in each iteration, so no single function is slower in three iterations of four
       (a 6-rank dive beside a busy process lost a spinning thread's rank that way); the thread
       itself runs in every iteration, and steadiness applies to it.
    3. The evidence names the training thread's functions it slows (the contention's symptoms); the
       cost is theirs, already counted on the path, so the thread's impact is left unknown (None).
    """
    if not any(len(p.functions) for p in threads.values()):
        return []
    candidates = [o for o in localize(threads, roles=roles, cfg=cfg)
                  if o.expected[0] < cfg.floor]   # else the role's median rank runs it too: parked-frame noise
    if not candidates:
        return []
    symptoms: dict[int, list[str]] = {}
    for o in localize(pats, roles=roles, expected=expected, cfg=dataclasses.replace(cfg, steady=False),
                      absorb=False):
        if o.common or o.not_cause or o.kind == "communication":
            continue
        for r, slower in zip(o.ranks, o.slower):
            if slower:
                symptoms.setdefault(r, []).append(o.function)
    out = []
    for o in candidates:
        keep = [i for i, (r, slower) in enumerate(zip(o.ranks, o.slower)) if slower and r in symptoms]
        if not keep:
            continue
        r0, i0 = o.ranks[keep[0]], keep[0]
        names = ", ".join(repr(f[:60]) for f in symptoms[r0][:3])
        text = (f"thread function {o.function[:80]!r} on rank {r0}: runs (innermost) {o.beta[i0]:.0%} of the "
                f"window on a thread other than the training thread (median over peers {o.expected[0]:.0%}), "
                f"while that rank's training thread is slower in {names}: CPU or GIL contention from that "
                f"thread" + (f"; {len(keep)} ranks in all" if len(keep) > 1 else ""))
        pick = lambda xs: tuple(xs[i] for i in keep)  # noqa: E731
        out.append(dataclasses.replace(o, ranks=pick(o.ranks), d=pick(o.d), delta=pick(o.delta), beta=pick(o.beta),
                                       mu=pick(o.mu), sigma=pick(o.sigma), impact_s=(None,) * len(keep),
                                       slower=pick(o.slower), evidence=text))
    return out


def trace_paths(directory: str | os.PathLike) -> dict[int, str]:
    """rank -> path of the ``rank-<N>.json[.gz]`` files in ``directory`` (the replay contract's layout,
    ARCHITECTURE.md). Raises ``TraceError`` when there are none."""
    d = os.fspath(directory)
    try:
        names = os.listdir(d)
    except OSError as e:
        raise TraceError(d, f"cannot list the directory ({e.strerror}): pass the deep dive's trace directory") from None
    out = {int(m.group(1)): os.path.join(d, n) for n in sorted(names) if (m := _RANK_FILE.match(n))}
    if not out:
        raise TraceError(d, "no rank-<N>.json or rank-<N>.json.gz files: pass the deep dive's trace directory")
    return out


def localize_traces(traces: Mapping[int, str | os.PathLike], *, job_id: str = "",
                    expected: Mapping[str, ExpectedRange] | None = None, roles: Mapping[int, str] | None = None,
                    cfg: LocalizeConfig = LocalizeConfig()) -> DeepDiveResult:
    """Read every rank's trace (rank -> path) and localise (see the module docstring).

    ``expected``: per function name or kind (``PAPER_RANGES``), else the
    job's median over ranks of the same role. ``roles``: rank -> role
    (ranks compared only within a role); all one role when not given.
    Raises ``TraceError`` naming the file when a trace cannot be read.
    """
    if not traces:
        raise TraceError("(none)", "no traces given: pass one trace per rank")
    cols = {int(r): read_trace(p) for r, p in traces.items()}
    return localize_columns(cols, job_id=job_id, expected=expected, roles=roles, cfg=cfg)
