"""analyzer/metrics.py: every series holds the unit its help text gives.

``trainscope_suspect_score`` and ``trainscope_verdict_suspect_impact_seconds``
are seconds lost per iteration; a stall's wait is seconds in
``trainscope_stall_seconds``; a missing rank is a flag in
``trainscope_rank_missing``. The stall findings come from the real rules
(``stall.telemetry_stall``, the collective hang's finding shape) through
``merge`` as the service publishes them.
"""
from __future__ import annotations

import dataclasses

from trainscope.analyzer import stall
from trainscope.analyzer.merge import merge, merge_windows
from trainscope.analyzer.metrics import AnalyzerMetrics
from trainscope.analyzer.model import CULPRIT, MISSING, Finding, Scope, SuspectRank
from trainscope.proto.v1 import records_pb2


def _series(m: AnalyzerMetrics) -> dict[str, list[tuple[dict, float]]]:
    return {fam.name: [(s.labels, s.value) for s in fam.samples] for fam in m.collect()}


def _publish(m: AnalyzerMetrics, findings: list[Finding], step_ns: float = 0.0) -> records_pb2.Verdict:
    w = findings[0].window
    v = merge("j", w, findings, step_ns=step_ns)
    m.publish(list(v.findings), v)
    return v


def test_telemetry_stall_exports_seconds_behind_and_the_step_per_iteration():
    # 4 ranks of 2 s iterations; rank 1's telemetry stopped 3 iterations (6 s) before the others'
    step = 2e9
    hist = {r: [(i, int(step)) for i in range(10)] for r in range(4)}
    last_end = {r: int(100e9) for r in range(4)}
    wm = {0: int(130e9), 1: int(124e9), 2: int(130e9), 3: int(130e9)}
    f = stall.telemetry_stall("j", records_pb2.Window(index=7), last_iter_end=last_end, watermark=wm,
                              history=hist, ended=set(), factor=5.0)
    assert f is not None and [s.rank for s in f.suspects] == [1]
    m = AnalyzerMetrics()
    _publish(m, [dataclasses.replace(f, step_ns=step)], step_ns=step)
    got = _series(m)
    assert got["trainscope_stall_seconds"] == [({"job": "j", "level": "L1", "rank": "1"}, 6.0)]
    # s/iteration: a stopped job loses its whole step
    assert [(x["rank"], x["kind"], v) for x, v in got["trainscope_suspect_score"]] == [("1", "stall", 2.0)]
    assert [(x["rank"], v) for x, v in got["trainscope_verdict_suspect_impact_seconds"]] == [("1", 2.0)]


def test_collective_hang_wait_is_seconds_not_seconds_per_iteration():
    # the shape analyzer/collectives.py gives a hang: impact_ns = the peers' wait (17 s), no step known
    w = records_pb2.Window(index=3)
    hang = Finding(level="collectives", kind="stall", job_id="j", window=w, scope=Scope(group="collective"),
                   suspects=(SuspectRank(2, 17.0, {"group": "tp0", "seq": 41, "waited_s": 17.0},
                                         impact_ns=17e9, role=CULPRIT),),
                   severity=17.0, job_impact_ns=17e9, comparison="job")
    m = AnalyzerMetrics()
    v = _publish(m, [hang])
    assert v.state == "stalled" and [s.rank for s in v.ranks] == [2]
    # the CLI's verdict: the wait in seconds in the sentence, no 17 s "per iteration" as the impact
    assert "its peers waited 17 s" in v.summary and "ms/iteration" not in v.summary
    assert v.ranks[0].impact_s == 0.0 and merge_windows([v]).ranks[0].impact_s == 0.0
    got = _series(m)
    assert got["trainscope_stall_seconds"] == [({"job": "j", "level": "collectives", "rank": "2"}, 17.0)]
    assert got["trainscope_suspect_score"] == []              # 17 s is not a cost per iteration
    assert got["trainscope_verdict_suspect_impact_seconds"] == []
    assert got["trainscope_job_stalled"] == [({"job": "j"}, 1.0)]


def test_missing_rank_is_a_flag_not_a_score_and_a_straggler_keeps_its_impact():
    w = records_pb2.Window(index=5)
    missing = Finding(level="L2", kind="missing_rank", job_id="j", window=w, scope=Scope(group="job"),
                      suspects=(SuspectRank(12, 1.0, {"reported_ranks": 15}, role=MISSING),), comparison="job")
    slow = Finding(level="L2", kind="straggler", job_id="j", window=w, scope=Scope(phase="bwd", group="dp"),
                   suspects=(SuspectRank(5, 2.5, impact_ns=25e6),), severity=0.3)
    m = AnalyzerMetrics()
    _publish(m, [missing, slow], step_ns=300e6)
    got = _series(m)
    assert got["trainscope_rank_missing"] == [({"job": "j", "rank": "12"}, 1.0)]
    assert [(x["rank"], x["kind"], v) for x, v in got["trainscope_suspect_score"]] == [("5", "straggler", 0.025)]
    m.forget_job("j")
    got = _series(m)
    assert got["trainscope_rank_missing"] == [] and got["trainscope_suspect_score"] == []


def test_every_flagged_series_counts_against_one_bound():
    m = AnalyzerMetrics(max_series=2)
    w = records_pb2.Window(index=1)
    missing = Finding(level="L2", kind="missing_rank", job_id="j", window=w, scope=Scope(group="job"),
                      suspects=tuple(SuspectRank(r, 1.0, role=MISSING) for r in range(3)), comparison="job")
    m.publish([missing.to_pb()], None)
    assert len(_series(m)["trainscope_rank_missing"]) == 2 and m.dropped_series == 1
