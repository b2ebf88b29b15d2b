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


def test_the_site_names_the_nic_and_switch_a_rank_uses():
    """TRAINSCOPE_NIC (one per local rank, qualified with the host) and TRAINSCOPE_SWITCH reach the
    rank's Resource attributes, which the verdict aggregates on (merge step 4)."""
    import socket

    from trainscope.collector.sdk import Collector, CollectorConfig

    cfg = CollectorConfig.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                                    "TRAINSCOPE_NIC": "mlx5_0, mlx5_0,mlx5_1,mlx5_1", "TRAINSCOPE_SWITCH": "leaf-7"})
    res = Collector(cfg, exporter=object()).resource
    assert res.attributes == {"nic": f"{socket.gethostname()}/mlx5_1", "switch": "leaf-7"}
    assert Collector(CollectorConfig.from_env({}), exporter=object()).resource.attributes == {}
