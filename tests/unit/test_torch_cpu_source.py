"""CPU fallback kernel source: operators (exclusive time) from windows opened at optimizer-step boundaries."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource, events_to_columns, pair_events
from trainscope.proto.columnar import KIND_KERNEL
from trainscope.proto.errors import ConfigError


EVENTS = (  # thread 1: linear [0,100) > addmm [10,90) > resolve_conj [20,25); relu [100,120)
    ["aten::linear", "aten::addmm", "aten::resolve_conj", "aten::relu", "aten::mul"],
    [0, 10, 20, 100, 5], [100, 80, 5, 20, 50], [1, 1, 1, 1, 2])  # thread 2: independent


def rows(cols):
    return sorted((cols.names[i], int(s), int(d), int(st)) for i, s, d, st in
                  zip(cols.name_id, cols.start_ns, cols.duration_ns, cols.stream))


def test_self_time_attributes_each_nanosecond_once_per_thread():
    cols = events_to_columns(*EVENTS)
    assert rows(cols) == [("aten::addmm", 10, 75, 0), ("aten::linear", 0, 20, 0), ("aten::mul", 5, 50, 1),
                          ("aten::relu", 100, 20, 0), ("aten::resolve_conj", 20, 5, 0)]
    assert int(cols.duration_ns[cols.stream == 0].sum()) == 120  # thread 1 was busy 120 ns
    assert (cols.kind == KIND_KERNEL).all()
    assert list(cols.start_ns) == sorted(cols.start_ns)


def test_top_level_and_all_modes():
    top = events_to_columns(*EVENTS, mode="top")
    assert rows(top) == [("aten::linear", 0, 100, 0), ("aten::mul", 5, 50, 1), ("aten::relu", 100, 20, 0)]
    every = events_to_columns(*EVENTS, mode="all")
    assert len(every) == 5 and int(every.duration_ns.sum()) == 255
    assert len(events_to_columns([], [], [], [])) == 0
    with pytest.raises(ConfigError, match="mode"):
        events_to_columns(*EVENTS, mode="leaves")


def test_config_parses_the_environment_form():
    cfg = CpuOpConfig.parse("period_s=10, window_s=0.2,first_after_s=0,max_events=100,mode=top")
    assert (cfg.period_s, cfg.window_s, cfg.first_after_s, cfg.max_events, cfg.mode) == (10, 0.2, 0, 100, "top")
    with pytest.raises(ConfigError, match="TRAINSCOPE_CPU_OPS"):
        CpuOpConfig.parse("period=3", "TRAINSCOPE_CPU_OPS")
    with pytest.raises(ConfigError, match="window_s"):
        CpuOpConfig(period_s=1, window_s=2)


class Ev:
    """A push/pop profiler event as torch's ``_disable_profiler_legacy`` returns them."""

    def __init__(self, kind, handle, us, name="", thread=1):
        self._k, self._h, self._us, self._n, self._t = kind, handle, us, name, thread

    def kind(self):
        return self._k

    def handle(self):
        return self._h

    def start_us(self):
        return self._us

    def name(self):
        return self._n

    def thread_id(self):
        return self._t


def test_push_pop_pairs_become_operators_and_strays_are_left_out():
    lists = [[Ev("mark", 0, 0.0, "__start_profile"),
              Ev("pop", 7, 1.0),                          # opened before the window: no start
              Ev("push", 1, 2.0, "aten::linear"), Ev("push", 2, 2.5, "aten::addmm"),
              Ev("pop", 2, 3.25), Ev("pop", 1, 4.0),
              Ev("push", 3, 5.0, "aten::relu")],          # still open when the window closed
             [Ev("push", 9, 2.0, "aten::mul", thread=2), Ev("pop", 9, 2.001)]]
    names, start, dur, tid, total = pair_events(lists, limit=10)
    assert sorted(zip(names, start, dur, tid)) == [("aten::addmm", 2500, 750, 1), ("aten::linear", 2000, 2000, 1),
                                                   ("aten::mul", 2000, 1, 2)]
    assert total == 3
    names, *_, total = pair_events(lists, limit=1)
    assert len(names) == 1 and total == 3


torch = pytest.importorskip("torch")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def model_and_step():
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(4, 16)

    def step():
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    return step


def test_windows_open_and_close_at_optimizer_steps_on_the_training_thread():
    clock, got = Clock(), []
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.5, first_after_s=2), clock=clock)
    assert src.available, src.reason
    step = model_and_step()
    before = time.time_ns()
    src.start(got.append)
    try:
        step()                                   # the first step starts the clock
        clock.t += 1.9
        step()
        assert not torch.autograd._profiler_enabled() and src.stats["windows"] == 0
        clock.t += 0.2
        step()                                   # first_after_s passed: a window opens at this step's end
        assert torch.autograd._profiler_enabled()
        step()                                   # < window_s later: still open, this step is recorded
        clock.t += 0.5
        step()                                   # window_s passed: closes at this step's end
        assert not torch.autograd._profiler_enabled()
        clock.t += 5
        step()                                   # not due before period_s
        assert not torch.autograd._profiler_enabled()
    finally:
        src.stop()
    after = time.time_ns()
    assert src.stats["windows"] == 1 and src.stats["errors"] == 0
    assert len(got) == 1
    cols = got[0]
    names = {cols.names[i] for i in cols.name_id}
    assert {"aten::addmm", "aten::relu", "aten::sum"} <= names   # forward
    assert any("Backward" in n for n in names)                    # backward, on the same thread
    assert before < int(cols.start_ns.min()) and int(cols.start_ns.max()) < after   # wall clock ns
    assert len(set(cols.stream.tolist())) == 1                    # one thread: the training thread
    assert src.stats["kept"] == len(cols)
    # unhooked: steps after stop open nothing
    clock.t += 100
    step()
    assert not torch.autograd._profiler_enabled() and src.stats["windows"] == 1


def test_a_window_only_its_own_thread_closes_and_stop_closes_it_there():
    clock, got = Clock(), []
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.1, first_after_s=0), clock=clock)
    src.start(got.append)
    src.safe_point()                              # opens on this thread
    assert torch.autograd._profiler_enabled()
    clock.t += 1
    other = threading.Thread(target=src.safe_point)
    other.start()
    other.join()
    assert torch.autograd._profiler_enabled()      # another thread's step may not close it
    torch.randn(3).relu()
    src.stop()                                     # on the owner thread: closed and read before it returns
    assert not torch.autograd._profiler_enabled()
    assert src.stats["windows"] == 1 and got and "aten::relu" in got[0].names


def test_the_jobs_own_profiler_is_left_alone_and_closes_an_open_window_first():
    clock, got = Clock(), []
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.05, first_after_s=0), clock=clock)
    src.start(got.append)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            src.safe_point()
        assert src.stats["skipped_busy"] == 1 and src.stats["windows"] == 0
        clock.t += 10
        src.safe_point()                           # a window is open on this thread ...
        assert torch.autograd._profiler_enabled()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.randn(3).relu()                  # ... and the job's profiler still starts
        assert any(e.name == "aten::relu" for e in prof.events())
        assert src.stats["yielded"] == 1 and src.stats["windows"] == 1
    finally:
        src.stop()
    assert not torch.autograd._profiler_enabled()


def test_an_operator_spanning_two_windows_is_harmless():
    """The pattern that corrupts the heap under Kineto: an operator opened in one window ends in the next."""
    clock, got = Clock(), []
    src = CpuOpSource(CpuOpConfig(period_s=0.2, window_s=0.1, first_after_s=0), clock=clock)
    src.start(got.append)
    try:
        for _ in range(200):
            with torch.autograd.profiler.record_function("spans-windows"):
                torch.randn(8, 8).relu()
                clock.t += 0.1
                src.safe_point()                   # closes or opens inside the open scope
    finally:
        src.stop()
    assert src.stats["windows"] >= 60 and src.stats["errors"] == 0
    assert sum(len(c) for c in got) > 0


def test_a_window_over_max_events_is_truncated_and_the_next_one_halved():
    clock, got = Clock(), []
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.1, min_window_s=0.01, max_events=50, first_after_s=0),
                      clock=clock)
    step = model_and_step()
    src.start(got.append)
    try:
        src.safe_point()
        for _ in range(10):
            step()
        clock.t += 0.2
        src.safe_point()
    finally:
        src.stop()
    assert src.stats["truncated"] > 0 and src._window_s == pytest.approx(0.05)
    cols = got[0]
    assert len(cols) <= 50
    assert np.all(np.diff(cols.start_ns.astype(np.int64)) >= 0)
