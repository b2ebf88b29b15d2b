"""`trainscope run`'s job environment and summary, and verdict lines' window labels (issue #12 item 4).

The collector's CPU-ops windows start torch's profiler; Kineto (torch 2.13) prints
``USDT:``/``STAGE:`` lines at every log level below 6. No processes here: the
environment the launcher builds is checked; the real torch job runs in
tests/integration/test_readme_commands.py.
"""
from __future__ import annotations

from trainscope.deploy.launcher import RunConfig, child_env


def _env(base: dict) -> dict:
    return child_env(RunConfig(command=("python3", "train.py")), job_id="j", processor="unix:///x.sock",
                     run_dir="/tmp/r", base=base)


def test_kineto_is_quiet_in_the_job_by_default():
    assert _env({})["KINETO_LOG_LEVEL"] == "6"


def test_a_level_the_user_chose_is_kept():
    assert _env({"KINETO_LOG_LEVEL": "2"})["KINETO_LOG_LEVEL"] == "2"


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
