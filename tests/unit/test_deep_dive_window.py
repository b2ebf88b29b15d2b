"""The deep-dive window in a rank (collector/deep_dive.py) and its iteration boundaries.

The profiler is a fake (it records calls and writes a small Chrome trace): what
is tested is the bounded window logic (arm, open at the exact start iteration,
close after N iterations, duration and byte caps, one at a time, missed starts,
files 0600). The real torch.profiler runs in tests/integration/test_deep_dive.py.
"""
from __future__ import annotations

import json
import os
import stat

import pytest

from trainscope.collector.deep_dive import DeepDiveLimits, DeepDiveWindow, trace_dir
from trainscope.collector.iteration_detector import DATALOADER, OPTIMIZER, IterationDetector, IterationDetectorConfig
from trainscope.proto.model import Resource
from trainscope.proto.v1 import control_pb2

O = control_pb2.DeepDiveOutcome


class FakeProfiler:
    made: list = []

    def __init__(self, with_stack: bool, trace_bytes: int = 0) -> None:
        self.calls, self.steps, self.pad = [], [], trace_bytes
        FakeProfiler.made.append(self)

    def start(self, it):
        self.calls.append("start")
        self.steps.append(it)

    def step(self, it):
        self.steps.append(it)

    def stop(self):
        self.calls.append("stop")

    def save(self, path):
        ev = [{"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "dur": 1000.0} for i in self.steps]
        ev += [{"ph": "X", "name": "aten::mm", "cat": "cpu_op", "dur": 10.0}] * 3
        with open(path, "w") as f:
            json.dump({"traceEvents": ev, "pad": "x" * self.pad}, f)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(tmp_path, rank=1, limits=DeepDiveLimits(), pad=0, clock=None):
    reports = []
    FakeProfiler.made = []
    w = DeepDiveWindow(str(tmp_path / "dd"), Resource(job_id="j/1", rank=rank, world_size=4).to_pb(),
                       reports.append, limits=limits,
                       profiler_factory=lambda ws: FakeProfiler(ws, pad), clock=clock or Clock())
    return w, reports


def cmd(start=10, n=3, dive="d1", ranks=(), max_bytes=0, max_s=0.0):
    return control_pb2.DeepDiveCommand(dive_id=dive, job_id="j/1", start_iteration=start, iterations=n,
                                       ranks=list(ranks), max_bytes=max_bytes, max_duration_s=max_s, with_stack=True)


def run_iterations(w, its):
    for it in its:
        w.before_batch(it)


def test_window_opens_at_the_start_iteration_and_covers_exactly_n(tmp_path):
    w, reports = make(tmp_path)
    assert w.arm(cmd(start=10, n=3)) is None
    run_iterations(w, range(5, 10))
    assert FakeProfiler.made == [] and w.busy           # armed, not yet open
    w.before_batch(None)                                 # a batch inside an iteration: no boundary
    run_iterations(w, [10, 11, 12])
    (prof,) = FakeProfiler.made
    assert prof.steps == [10, 11, 12] and prof.calls == ["start"]
    w.before_batch(13)                                   # the boundary of start + n closes it
    assert prof.calls == ["start", "stop"]
    assert w.wait_written(5)
    (rep,) = reports
    assert rep.outcome == O.DEEP_DIVE_OUTCOME_DONE
    assert (rep.first_iteration, rep.last_iteration) == (10, 12)
    assert rep.trace_path == os.path.join(trace_dir(str(tmp_path / "dd"), "j/1", "d1"), "rank-1.json")
    assert "j_1" in rep.trace_path                       # the job id made one safe path component
    assert stat.S_IMODE(os.stat(rep.trace_path).st_mode) == 0o600
    for d in (tmp_path / "dd", tmp_path / "dd" / "j_1", os.path.dirname(rep.trace_path)):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.listdir(os.path.dirname(rep.trace_path)) == ["rank-1.json"]   # no .part left
    assert rep.trace_bytes == os.path.getsize(rep.trace_path)
    assert not w.busy
    run_iterations(w, range(14, 30))                     # nothing more happens
    assert len(FakeProfiler.made) == 1 and len(reports) == 1


def test_an_epoch_end_opens_no_second_profiler_step(tmp_path):
    """At an epoch's end the exhausted loader's last ``__next__`` (StopIteration) and the next epoch's
    first both come before the same iteration's first batch: one ProfilerStep per iteration (a real
    4-rank job cycling a 16-batch loader had ``ProfilerStep#96`` twice, the first 0.3 ms long)."""
    w, reports = make(tmp_path)
    w.arm(cmd(start=10, n=3))
    run_iterations(w, [10, 11, 11, 12, 12, 13])
    (prof,) = FakeProfiler.made
    assert prof.steps == [10, 11, 12] and prof.calls == ["start", "stop"]
    assert w.wait_written(5)
    assert (reports[0].first_iteration, reports[0].last_iteration) == (10, 12)


def test_a_start_iteration_already_passed_is_missed_never_started_late(tmp_path):
    w, reports = make(tmp_path)
    w.arm(cmd(start=10))
    w.before_batch(12)
    assert FakeProfiler.made == []
    (rep,) = reports
    assert rep.outcome == O.DEEP_DIVE_OUTCOME_MISSED and "12" in rep.detail
    assert not w.busy


def test_one_window_at_a_time(tmp_path):
    w, reports = make(tmp_path)
    assert w.arm(cmd(start=10, dive="a")) is None
    assert w.arm(cmd(start=11, dive="b")) is not None
    assert reports[-1].outcome == O.DEEP_DIVE_OUTCOME_BUSY and reports[-1].dive_id == "b"
    run_iterations(w, [10, 11])
    assert w.arm(cmd(start=20, dive="c")) is not None   # open: still busy
    run_iterations(w, [12, 13])
    w.wait_written(5)
    assert w.arm(cmd(start=20, dive="d")) is None       # done: a new one is accepted


def test_duration_cap_truncates_with_the_iterations_covered(tmp_path):
    clock = Clock()
    w, reports = make(tmp_path, limits=DeepDiveLimits(max_duration_s=5.0), clock=clock)
    w.arm(cmd(start=10, n=100, max_s=60.0))             # the rank's own cap (5 s) wins
    for it in range(10, 20):
        w.before_batch(it)
        clock.t += 1.0
    w.wait_written(5)
    (rep,) = reports
    assert rep.outcome == O.DEEP_DIVE_OUTCOME_TRUNCATED and "duration" in rep.detail
    assert (rep.first_iteration, rep.last_iteration) == (10, 14)


def test_iterations_are_capped(tmp_path):
    w, reports = make(tmp_path, limits=DeepDiveLimits(max_iterations=2))
    w.arm(cmd(start=1, n=50))
    run_iterations(w, range(1, 10))
    w.wait_written(5)
    assert (reports[0].first_iteration, reports[0].last_iteration) == (1, 2)


def test_a_trace_over_the_byte_cap_is_removed(tmp_path):
    w, reports = make(tmp_path, pad=20_000)
    w.arm(cmd(start=1, n=1, max_bytes=10_000))
    run_iterations(w, [1, 2])
    w.wait_written(5)
    (rep,) = reports
    assert rep.outcome == O.DEEP_DIVE_OUTCOME_OVERSIZE and rep.trace_bytes > 10_000 and not rep.trace_path
    d = trace_dir(str(tmp_path / "dd"), "j/1", "d1")
    assert os.listdir(d) == []                          # nothing left behind, .part included


def test_commands_for_other_ranks_and_bad_ids_are_ignored_or_refused(tmp_path):
    w, reports = make(tmp_path, rank=1)
    assert w.arm(cmd(ranks=(0, 2))) == "not for this rank" and reports == [] and not w.busy
    assert w.arm(cmd(ranks=(1,))) is None
    w2, reports2 = make(tmp_path, rank=1)
    assert w2.arm(cmd(dive="../escape")) is not None and not w2.busy
    assert reports2[0].outcome == O.DEEP_DIVE_OUTCOME_FAILED


def test_without_a_profiler_every_command_is_answered_unavailable_and_said_once(tmp_path, caplog):
    reports = []
    w = DeepDiveWindow(str(tmp_path), Resource(job_id="j", rank=0, world_size=1).to_pb(), reports.append,
                       available=(False, "torch is not installed"))
    with caplog.at_level("WARNING"):
        w.arm(cmd(dive="a"))
        w.arm(cmd(dive="b"))
    assert [r.outcome for r in reports] == [O.DEEP_DIVE_OUTCOME_UNAVAILABLE] * 2
    assert sum("torch is not installed" in r.message for r in caplog.records) == 1


def test_a_failing_profiler_never_raises_into_training(tmp_path):
    reports = []

    class Broken(FakeProfiler):
        def start(self, it):
            raise RuntimeError("profiler exploded")

    w = DeepDiveWindow(str(tmp_path), Resource(job_id="j", rank=0, world_size=1).to_pb(), reports.append,
                       profiler_factory=lambda ws: Broken(ws))
    w.arm(cmd(start=3))
    w.before_batch(3)                                   # no exception
    assert reports[0].outcome == O.DEEP_DIVE_OUTCOME_FAILED and "exploded" in reports[0].detail
    assert not w.busy


def test_close_at_exit_writes_what_was_traced(tmp_path):
    w, reports = make(tmp_path)
    w.arm(cmd(start=4, n=10))
    run_iterations(w, [4, 5, 6])
    w.close_at_exit()
    (rep,) = reports
    assert rep.outcome == O.DEEP_DIVE_OUTCOME_TRUNCATED
    assert (rep.first_iteration, rep.last_iteration) == (4, 6)   # the last ProfilerStep opened


@pytest.mark.parametrize("pattern", ["DO", "DDO", "DOO"])
def test_detector_names_the_iteration_a_batch_opens(pattern):
    """IterationDetector.opening(): the number of the iteration the next D opens, while learning and after."""
    det = IterationDetector(lambda *a: None, IterationDetectorConfig(m=3))
    seen = []
    t = 0
    for it in range(12):
        for i, sym in enumerate(pattern):
            if sym == DATALOADER:
                seen.append((it, det.opening()) if i == 0 else (it, det.opening() is None))
            det.event(sym, t, t + 1)
            t += 2
    assert det.pattern == pattern
    for it, got in seen:
        assert got is True or got == it, seen
    assert [g for _, g in seen if g is not True] == list(range(12))
