"""Prometheus series for what the analyzer currently flags (bounded).

Only flagged results become series (ARCHITECTURE.md: per-rank-per-kernel
series are not allowed for healthy ranks): one ``trainscope_suspect_score``
series per (job, level, kind, rank, phase, kernel) currently flagged, expiring
``ttl_s`` after the last window that flagged it, capped at ``max_series``.
Its value is the suspect's impact in **seconds lost per iteration**; only
suspects the verdict names (persistent, above the impact floor) and stalls
become series, so alerts inherit the verdict's calibration.
Job-level series: the verdict (state, confidence, suspects with role and
host), the L1 state, the stall flag, counts of diagnoses, and the
analyzer's own health (records in, bad records, windows analysed, detector
failures per level).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainscope.proto.v1 import records_pb2

L1_STATES = ("stable", "jitter", "regression", "both")


class AnalyzerMetrics:
    """Custom collector; ``publish`` is the DiagnosisSink side of it."""

    name = "prometheus"

    def __init__(self, *, max_series: int = 10_000, ttl_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_series = max_series
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flagged: dict[tuple, tuple[float, float]] = {}  # key -> (score, expires)
        self._diagnoses: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._l1_state: dict[str, str] = {}
        self._stalled: dict[str, int] = {}
        self._verdict: dict[str, tuple[str, float, list[tuple[str, str, str, float]]]] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.detector_failures: collections.Counter[str] = collections.Counter()
        self.dropped_series = 0

    # --- DiagnosisSink ---------------------------------------------------
    def publish(self, diagnoses: list[records_pb2.Diagnosis], verdict: records_pb2.Verdict | None) -> None:
        now = self._clock()
        named = None if verdict is None else {s.rank for s in verdict.ranks}
        with self._lock:
            if verdict is not None and verdict.state:
                self._verdict[verdict.job_id] = (
                    verdict.state, verdict.confidence,
                    [(str(s.rank), s.role, s.host, s.impact_s) for s in list(verdict.ranks)[:50]])
            for d in diagnoses:
                self._diagnoses[(d.job_id, d.level, d.kind)] += 1
                if d.kind == "stall":
                    self._stalled[d.job_id] = 1
                if d.informational:
                    continue
                # stalls and missing ranks are facts, not deviations: named at once, valued by their
                # own score (iterations behind; 1); every other suspect by its impact, once named
                fact = d.kind in ("stall", "missing_rank")
                for s in d.suspects:
                    if named is not None and not fact and s.rank not in named:
                        continue   # not (yet) persistent: the verdict does not name it
                    score = s.score if fact else s.impact_s
                    key = (d.job_id, d.level, d.kind, str(s.rank), d.scope.phase, d.scope.kernel[:120])
                    if key not in self._flagged and len(self._flagged) >= self.max_series:
                        self.dropped_series += 1
                        continue
                    self._flagged[key] = (score, now + self.ttl_s)

    def set_l1_state(self, job: str, state: str) -> None:
        with self._lock:
            self._l1_state[job] = state

    def set_stalled(self, job: str, stalled: bool) -> None:
        with self._lock:
            self._stalled[job] = int(stalled)

    def forget_job(self, job: str) -> None:
        """Drop every series of a job that ended or went away."""
        with self._lock:
            for k in [k for k in self._flagged if k[0] == job]:
                del self._flagged[k]
            for k in [k for k in self._diagnoses if k[0] == job]:
                del self._diagnoses[k]
            self._l1_state.pop(job, None)
            self._stalled.pop(job, None)
            self._verdict.pop(job, None)

    def close(self) -> None:
        pass

    # --- collector ---------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        with self._lock:
            for k in [k for k, (_, exp) in self._flagged.items() if exp <= now]:
                del self._flagged[k]
            flagged = list(self._flagged.items())
            diag = list(self._diagnoses.items())
            states = list(self._l1_state.items())
            stalled = list(self._stalled.items())
            counters = dict(self.counters)
            verdicts = list(self._verdict.items())
            failures = dict(self.detector_failures)
        g = GaugeMetricFamily("trainscope_suspect_score",
                              "Impact of a currently flagged suspect rank, seconds lost per iteration",
                              labels=["job", "level", "kind", "rank", "phase", "kernel"])
        for key, (score, _) in flagged:
            g.add_metric(list(key), score)
        yield g
        c = CounterMetricFamily("trainscope_diagnoses", "Diagnoses emitted", labels=["job", "level", "kind"])
        for key, n in diag:
            c.add_metric(list(key), n)
        yield c
        s = GaugeMetricFamily("trainscope_job_iteration_state", "L1 classification of the job's iteration time (1 = current)",
                              labels=["job", "state"])
        for job, state in states:
            for st in L1_STATES:
                s.add_metric([job, st], 1.0 if st == state else 0.0)
        yield s
        vs = GaugeMetricFamily("trainscope_verdict_state", "The job's latest verdict (1 = current state)",
                               labels=["job", "state"])
        vc = GaugeMetricFamily("trainscope_verdict_confidence", "Confidence of the job's latest verdict (0-1)",
                               labels=["job"])
        vi = GaugeMetricFamily("trainscope_verdict_suspect_impact_seconds",
                               "Merged impact of a suspect named by the latest verdict, seconds per iteration",
                               labels=["job", "rank", "role", "host"])
        for job, (state, conf, suspects) in verdicts:
            for name in ("healthy", "degraded", "stalled", "unknown"):
                vs.add_metric([job, name], 1.0 if name == state else 0.0)
            vc.add_metric([job], conf)
            for rank, role, host, impact in suspects:
                vi.add_metric([job, rank, role, host], impact)
        yield vs
        yield vc
        yield vi
        st = GaugeMetricFamily("trainscope_job_stalled", "1 when no iteration completed for 5x the recent mean (EROICA §4.1)",
                               labels=["job"])
        for job, v in stalled:
            st.add_metric([job], v)
        yield st
        for name, doc in (("records_in", "Records consumed"), ("bad_records", "Records that could not be parsed"),
                          ("windows_analyzed", "Windows analysed"), ("late_records", "Records for windows already analysed")):
            fam = CounterMetricFamily(f"trainscope_analyzer_{name}", doc)
            fam.add_metric([], counters.get(name, 0))
            yield fam
        fam = CounterMetricFamily("trainscope_analyzer_detector_failures",
                                  "Windows on which a detector level raised (the others still ran)",
                                  labels=["level"])
        for level, n in failures.items():
            fam.add_metric([level], n)
        yield fam
        fam = CounterMetricFamily("trainscope_analyzer_dropped_series", "Flagged series refused by the bound")
        fam.add_metric([], self.dropped_series)
        yield fam

    def describe(self):
        return []
