"""CPU fallback kernel source: operators (exclusive time) from short profiler windows."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource, events_to_columns
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


torch = pytest.importorskip("torch")


def busy(stop: threading.Event):
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 16)
    while not stop.is_set():
        m(x).sum().backward()


def test_a_window_captures_another_threads_operators_on_the_wall_clock():
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.1, first_after_s=0))
    assert src.available, src.reason
    stop = threading.Event()
    t = threading.Thread(target=busy, args=(stop,))
    t.start()
    try:
        time.sleep(0.05)
        before = time.time_ns()
        cols = src.window()
        after = time.time_ns()
    finally:
        stop.set()
        t.join()
    names = {cols.names[i] for i in cols.name_id}
    assert {"aten::addmm", "aten::linear", "aten::relu"} <= names
    assert before - 10**9 < int(cols.start_ns.min()) and int(cols.start_ns.max()) < after
    assert src.stats["windows"] == 1 and src.stats["kept"] == len(cols)
    assert not torch.autograd._profiler_enabled()


def test_windows_run_in_the_background_after_the_gate_and_stop_promptly():
    got = []
    gate = threading.Event()
    src = CpuOpSource(CpuOpConfig(period_s=0.3, window_s=0.05, first_after_s=0), gate=gate)
    stop = threading.Event()
    t = threading.Thread(target=busy, args=(stop,))
    t.start()
    try:
        src.start(got.append)
        time.sleep(0.4)
        assert got == [] and src.stats["windows"] == 0  # training has not started
        gate.set()
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        src.stop()
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        t.join()
    assert len(got) >= 2 and all(len(c) for c in got)


def test_a_busy_profiler_is_left_alone():
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.05))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert src.window() is None
    assert src.stats["skipped_busy"] == 1


def test_a_window_over_max_events_is_truncated_and_the_next_one_halved():
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.1, min_window_s=0.01, max_events=50, first_after_s=0))
    stop = threading.Event()
    t = threading.Thread(target=busy, args=(stop,))
    t.start()
    try:
        cols = src.window()
    finally:
        stop.set()
        t.join()
    assert src.stats["truncated"] > 0 and src._window_s == pytest.approx(0.05)
    assert len(cols) <= 50
    assert np.all(np.diff(cols.start_ns.astype(np.int64)) >= 0)
