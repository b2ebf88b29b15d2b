"""A completed deep dive analysed and merged into the job's verdict (``analyzer/deepdive/results.py``).

Dives are laid out as ``processor/control.py`` leaves them (``<root>/<job>/<dive>/`` with
``manifest.json`` and ``rank-<R>.json``); the traces are small hand-written CPU-only kineto traces
(a step function, a hot loop, a gloo wait whose name carries each process's object address). The
store is the analyzer's real ``DiagnosisStore`` on a temporary SQLite file, holding the verdict the
analyzer gave the window that covers the dive.
"""
from __future__ import annotations

import json
import os
import stat

from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig, analyze_dive
from trainscope.analyzer.merge import merge_windows
from trainscope.analyzer.store import DiagnosisStore
from trainscope.proto.v1 import records_pb2

WAIT = "<built-in method wait of torch._C._distributed_c10d.Work object at 0x{:x}>"


def write_trace(path, rank: int, hot_us: float, first: int = 10) -> None:
    ev, t = [], 5000.0 + 333.0 * rank
    for i in range(4):
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{first + i}", "ts": t, "dur": 1000.0,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "train.py(20): step", "ts": t + 1, "dur": 998.0,
                "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": "train.py(31): hot_loop", "ts": t + 10,
                "dur": hot_us, "pid": 1, "tid": 1},
               {"ph": "X", "cat": "python_function", "name": WAIT.format(0x7F0000000000 + 0x1000 * rank + i),
                "ts": t + 20 + hot_us, "dur": 900.0 - hot_us, "pid": 1, "tid": 1}]
        t += 1000.0
    path.write_text(json.dumps({"traceEvents": ev}))


def make_dive(root, job: str, dive: str, hot: dict[int, float], *, complete: bool = True) -> str:
    d = root / job / dive
    d.mkdir(parents=True)
    ranks = {}
    for r in range(4):
        p = d / f"rank-{r}.json"
        write_trace(p, r, hot.get(r, 100.0))
        ranks[str(r)] = {"outcome": "done", "first_iteration": 10, "last_iteration": 13, "trace": str(p)}
    (d / "manifest.json").write_text(json.dumps({
        "dive_id": dive, "job": job, "trigger": "manual", "start_iteration": 10, "iterations": 4,
        "requested_unix_ns": 1, "complete": complete, "partial": False, "ranks_expected": [0, 1, 2, 3],
        "ranks": ranks}))
    return str(d)


def window_verdict(job: str) -> records_pb2.Verdict:
    w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=1, first_iteration=10,
                           last_iteration=19)
    return records_pb2.Verdict(job_id=job, window=w, state="healthy", step_s=0.001, summary="job j: healthy",
                               comparison="peers")


def test_a_dive_is_analysed_and_its_suspect_merged_into_the_covering_window(tmp_path):
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    store.put([], window_verdict("j"))
    d = make_dive(tmp_path / "deep", "j", "dive1", {1: 500.0})
    f = DeepDiveFollower(str(tmp_path / "deep"), store)
    (doc,) = f.scan()
    assert doc["suspects"] == [1], doc["outliers"]
    assert doc["outliers"][0]["function"] == "train.py(31): hot_loop"
    assert doc["verdict"]["merged"] is True and doc["verdict"]["ranks"] == [1]
    # the Perfetto view: the suspect and a healthy peer, each with its critical path as a track of its own
    view = doc["perfetto"]
    assert view["suspect"]["rank"] == 1 and view["peer"]["rank"] != 1
    for who in ("suspect", "peer"):
        cp = view[who]["critical_path"]
        assert stat.S_IMODE(os.stat(cp).st_mode) == 0o600
        spans = [e for e in json.load(open(cp))["traceEvents"] if e["ph"] == "X"]
        assert {e["name"] for e in spans} >= {"train.py(31): hot_loop"}
        assert sum(e["dur"] for e in spans) > 3000          # 4 steps of ~1 ms on the path
    assert stat.S_IMODE(os.stat(os.path.join(d, "analysis.json")).st_mode) == 0o600
    # stored: L4 diagnoses under the window, and the window's verdict now names rank 1
    l4 = list(store.diagnoses("j", level="L4"))
    assert l4 and all(x.window.index == 1 for x in l4)
    v = store.latest_verdict("j")
    assert [s.rank for s in v.ranks] == [1] and v.state == "degraded" and v.confidence > 0
    assert v.ranks[0].impact_pct > 10      # 0.4 ms of a ~1.1 ms step
    assert "hot_loop" in v.ranks[0].why or any(x.level == "L4" for x in v.findings)
    job = merge_windows(store.verdicts("j"))
    assert [s.rank for s in job.ranks] == [1]
    assert f.scan() == []                                   # analysed once


def test_healthy_dive_leaves_the_verdict_alone_and_bad_dives_say_why(tmp_path):
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    store.put([], window_verdict("j"))
    make_dive(tmp_path / "deep", "j", "ok", {})
    make_dive(tmp_path / "deep", "j", "running", {1: 500.0}, complete=False)     # not complete: not read
    bad = make_dive(tmp_path / "deep", "j", "bad", {})
    for r in range(3):
        os.unlink(os.path.join(bad, f"rank-{r}.json"))
    f = DeepDiveFollower(str(tmp_path / "deep"), store, FollowerConfig(verdict_wait_s=0))
    docs = {x["dive_id"]: x for x in f.scan()}
    assert set(docs) == {"ok", "bad"}
    assert docs["ok"]["outliers"] == [] and docs["ok"]["verdict"]["merged"] is False
    assert "at least 2" in docs["bad"]["error"]
    assert store.latest_verdict("j").ranks == [] and store.latest_verdict("j").state == "healthy"
    assert list(store.diagnoses("j", level="L4")) == []


def test_without_a_covering_window_the_diagnoses_are_stored_alone(tmp_path):
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    make_dive(tmp_path / "deep", "k", "d", {2: 500.0})
    t = [0.0]
    f = DeepDiveFollower(str(tmp_path / "deep"), store, FollowerConfig(verdict_wait_s=10), clock=lambda: t[0])
    assert f.scan() == []                    # waits for the window's verdict
    t[0] = 11.0
    (doc,) = f.scan()
    assert doc["verdict"]["merged"] is False and "within 10 s" in doc["verdict"]["why"]
    (diag,) = list(store.diagnoses("k", level="L4"))
    assert [s.rank for s in diag.suspects] == [2]
    assert store.latest_verdict("k") is None


def test_analyze_dive_without_manifest(tmp_path):
    doc, res = analyze_dive(str(tmp_path))
    assert res is None and "manifest" in doc["error"]


def test_two_functions_on_one_rank_are_two_diagnoses(tmp_path):
    """Level, window, scope and suspects alike: the function tells them apart (else one replaces the other)."""
    import dataclasses

    from trainscope.analyzer.deepdive.results import _diagnosis
    from trainscope.analyzer.model import Finding, SuspectRank

    a = Finding(level="L4", kind="function_outlier", job_id="j", window=records_pb2.Window(index=1),
                suspects=(SuspectRank(rank=2, score=1.0),), evidence={"function": "train.py(8): hot_loop"})
    b = dataclasses.replace(a, evidence={"function": "<built-in method wait of Work object>"})
    assert a.id == b.id and _diagnosis(a).id != _diagnosis(b).id
    store = DiagnosisStore(str(tmp_path / "s.sqlite"))
    store.put([_diagnosis(a), _diagnosis(b)], None)
    assert store.count_diagnoses("j") == 2
