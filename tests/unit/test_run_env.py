"""`trainscope run`'s summary, and verdict lines' window labels (issue #12 item 4).

No processes.
"""
from __future__ import annotations


def test_drops_are_said_by_cause_in_words_not_as_a_dict():
    from trainscope.deploy.launcher import _by_cause

    assert _by_cause({}) == "" and _by_cause({"queue_full": 0}) == ""
    assert _by_cause({"unauthenticated": 1, "queue_full": 1200}) == " (queue_full 1,200, unauthenticated 1)"


def test_verdict_lines_name_windows_by_their_iterations():
    from trainscope.deploy.render import render_verdicts, window_label
    from trainscope.proto.v1 import records_pb2

    w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=4, first_iteration=40, last_iteration=49)
    assert window_label(w) == "window 4 (iterations 40-49)"
    v = records_pb2.Verdict(window=w, summary="job j: degraded", ranks=[records_pb2.Suspect(rank=3)])
    assert render_verdicts([v]) == "verdict:\n  window 4 (iterations 40-49): job j: degraded"
