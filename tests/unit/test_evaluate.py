"""Scoring verdicts against the simulator's ground truth (analyzer/evaluate.py), as bench_detection uses it."""
from trainscope.analyzer.evaluate import evaluate
from trainscope.proto.v1 import records_pb2


def _verdicts(top: int, group: str) -> list[records_pb2.Verdict]:
    out = []
    for i in range(4):
        v = records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=i))
        if i >= 2:
            v.state, v.group = "degraded", group
            v.ranks.add(rank=top, role="culprit")
        out.append(v)
    return out


def _truth(kind: str) -> dict:
    return {"faults": [{"type": kind, "spec": f"{kind}:rank=29", "ranks": [29], "onset_iteration": 10,
                        "host_names": ["h3"], "scope": {"rank": [29]},
                        "peer_groups": {"tp": [[28, 29]], "dp": [[1, 29]]}}]}


def test_an_nvlink_fault_is_right_when_its_tp_pair_is_named_and_not_otherwise():
    f = evaluate(_verdicts(28, "tp 14"), _truth("nvlink_degrade"), 10).faults[0]
    assert f.right and not f.top1 and f.stable == 1.0 and f.windows_to_diagnosis == 1
    assert not evaluate(_verdicts(1, "dp 1"), _truth("nvlink_degrade"), 10).faults[0].right
    assert not evaluate(_verdicts(28, ""), _truth("nvlink_degrade"), 10).faults[0].right
    # a GPU's own fault needs the rank itself: its TP partner is a wrong answer
    assert not evaluate(_verdicts(28, "tp 14"), _truth("gpu_throttle"), 10).faults[0].right
    assert evaluate(_verdicts(29, ""), _truth("gpu_throttle"), 10).faults[0].right


def test_a_hang_reported_with_the_last_closed_window_is_not_a_false_alarm():
    v0 = records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0),
                             state="stalled")
    v0.ranks.add(rank=13, role="culprit")
    v0.findings.add(kind="stall", level="L1").suspects.add(rank=13)
    truth = {"hung": True, "faults": [{"type": "hang", "spec": "hang:rank=13", "ranks": [13], "onset_iteration": 15}]}
    ev = evaluate([v0, records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS,
                                                                     index=1))], truth, 10)
    assert ev.false_alarm_windows == 0 and ev.faults[0].right
    v0.ranks[0].rank = 4          # a stall naming another rank before the hang is a false alarm
    ev = evaluate([v0, records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS,
                                                                     index=2))], truth, 10)
    assert ev.false_alarm_windows == 1


def test_a_failed_nic_is_scored_by_the_collectives_stall_published_on_a_time_window():
    """nic_fail stops the job like a hang; every rank waits alike, so the iteration windows' stall names
    nobody, and the collectives level's stall (a time window, published when seen) names the NIC's rank."""
    it = records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0),
                             state="stalled")
    it.findings.add(kind="stall", level="L1")
    coll = records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_TIME, index=0), state="stalled")
    coll.ranks.add(rank=28, role="culprit")
    coll.findings.add(kind="stall", level="collectives").suspects.add(rank=28)
    truth = {"hung": True, "faults": [{"type": "nic_fail", "spec": "nic_fail:rank=29", "ranks": [28, 29],
                                       "onset_iteration": 10}]}
    f = evaluate([it, coll], truth, 10).faults[0]
    assert f.caught and f.top1 and f.right
    healthy = records_pb2.Verdict(window=records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0),
                                  state="healthy")    # the iteration rule had not seen the stall yet
    assert evaluate([healthy, coll], truth, 10).faults[0].top1
    coll.ranks[0].rank = 3
    assert not evaluate([it, coll], truth, 10).faults[0].top1
