"""Prometheus series for what the analyzer currently flags (bounded).

Only flagged results become series (ARCHITECTURE.md: per-rank-per-kernel
series are not allowed for healthy ranks): one ``trainscope_suspect_score``
series per (job, level, kind, rank, phase, kernel) currently flagged, expiring
``ttl_s`` after the last window that flagged it, capped at ``max_series``.
Its value is the suspect's impact in **seconds lost per iteration**; only
suspects the verdict names (persistent, above the impact floor) and stalls
become series, so alerts inherit the verdict's calibration.

Every series holds one unit. Stalls, hangs and missing ranks are facts, not
per-iteration costs, so they have their own series:

* ``trainscope_stall_seconds{job, level, rank}``: seconds this rank's peers
  have waited for it. ``level="collectives"``: how long they had waited in a
  collective it never entered (the hang rule); ``level="L1"``: how long their
  telemetry went on after its own stopped (it stopped first), i.e. its
  iterations behind × its median iteration time.
* ``trainscope_rank_missing{job, rank}``: 1 while windows of the job close
  without the rank.

A stall suspect appears in ``trainscope_suspect_score`` (and the verdict's
impact series) only with the job's step time (a stopped job loses every
step) when the window knew it; otherwise only in ``trainscope_stall_seconds``.
A missing rank is never in ``trainscope_suspect_score`` (its cost is not
known). Job-level series: the verdict (state, confidence, suspects with role
and host), the L1 state, the stall flag, counts of diagnoses, and the
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
        self._flagged: dict[tuple, tuple[float, float]] = {}  # key -> (s/iteration, expires)
        self._stall: dict[tuple, tuple[float, float]] = {}    # (job, level, rank) -> (seconds, expires)
        self._missing: dict[tuple, tuple[float, float]] = {}  # (job, rank) -> (1, expires)
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
        step_s = verdict.step_s if verdict is not None else 0.0
        stalled = {s.rank for d in diagnoses if d.kind == "stall" and not d.informational for s in d.suspects}
        with self._lock:
            if verdict is not None and verdict.state:
                # a stalled rank's verdict impact is the hang's wait (seconds, not per iteration):
                # exported as the step it costs when known, else left to trainscope_stall_seconds
                self._verdict[verdict.job_id] = (
                    verdict.state, verdict.confidence,
                    [(str(s.rank), s.role, s.host, step_s if s.rank in stalled else s.impact_s)
                     for s in list(verdict.ranks)[:50] if s.rank not in stalled or step_s > 0])
            for d in diagnoses:
                self._diagnoses[(d.job_id, d.level, d.kind)] += 1
                if d.kind == "stall":
                    self._stalled[d.job_id] = 1
                if d.informational:
                    continue
                for s in d.suspects:
                    if d.kind == "missing_rank":
                        self._bounded(self._missing, (d.job_id, str(s.rank)), 1.0, now)
                        continue
                    if d.kind == "stall":
                        # stalls are facts named at once: the peers' wait in seconds in their own
                        # series, the lost step (s/iteration) here only when known
                        waited = _stall_seconds(d, s)
                        if waited is not None:
                            self._bounded(self._stall, (d.job_id, d.level, str(s.rank)), waited, now)
                        if step_s <= 0:
                            continue
                        value = step_s
                    elif named is not None and s.rank not in named:
                        continue   # not (yet) persistent: the verdict does not name it
                    else:
                        value = s.impact_s
                    key = (d.job_id, d.level, d.kind, str(s.rank), d.scope.phase, d.scope.kernel[:120])
                    self._bounded(self._flagged, key, value, now)

    def _bounded(self, series: dict, key: tuple, value: float, now: float) -> None:
        """Set one flagged series (caller holds the lock); a new key past ``max_series`` is dropped."""
        if key not in series and len(self._flagged) + len(self._stall) + len(self._missing) >= self.max_series:
            self.dropped_series += 1
            return
        series[key] = (value, now + self.ttl_s)

    def set_l1_state(self, job: str, state: str) -> None:
        with self._lock:
            self._l1_state[job] = state

    def set_stalled(self, job: str, stalled: bool) -> None:
        with self._lock:
            self._stalled[job] = int(stalled)

    def forget_job(self, job: str) -> None:
        """Drop every series of a job that ended or went away."""
        with self._lock:
            for series in (self._flagged, self._stall, self._missing):
                for k in [k for k in series if k[0] == job]:
                    del series[k]
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
            for series in (self._flagged, self._stall, self._missing):
                for k in [k for k, (_, exp) in series.items() if exp <= now]:
                    del series[k]
            flagged = list(self._flagged.items())
            stall = list(self._stall.items())
            missing = list(self._missing.items())
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
        g = GaugeMetricFamily("trainscope_stall_seconds",
                              "Seconds a stalled job's ranks have waited for this rank: level=collectives, in a "
                              "collective it never entered; level=L1, since its telemetry stopped before theirs",
                              labels=["job", "level", "rank"])
        for key, (seconds, _) in stall:
            g.add_metric(list(key), seconds)
        yield g
        g = GaugeMetricFamily("trainscope_rank_missing", "1 while windows of the job close without this rank",
                              labels=["job", "rank"])
        for key, (one, _) in missing:
            g.add_metric(list(key), one)
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
            for name in ("healthy", "suspected", "degraded", "stalled", "unknown"):
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
        fam = CounterMetricFamily("trainscope_analyzer_kernel_names",
                                  "Kernel-name dictionary (analyzer/kernel_names.py): entries taken (names_in), bad, "
                                  "conflicting or refused entries, ids left unknown, windows held or labelled",
                                  labels=["event"])
        for name, n in sorted(counters.items()):
            if name.startswith("kernel_names."):
                fam.add_metric([name.split(".", 1)[1]], n)
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


def _stall_seconds(d: records_pb2.Diagnosis, s: records_pb2.Suspect) -> float | None:
    """Seconds the peers waited for a stall suspect (module doc), None when the finding does not say."""
    ev = s.evidence.fields
    if "waited_s" in ev:                          # collective hang: the peers' wait in the collective
        return ev["waited_s"].number_value
    if "stopped_iterations_before_peers" in ev and s.impact_s > 0:   # telemetry clock: iterations x step
        return ev["stopped_iterations_before_peers"].number_value * s.impact_s
    return None
