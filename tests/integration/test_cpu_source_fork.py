"""The CPU-operator source across ``fork()`` (a DataLoader worker forked mid-window): forks a
process, so integration tier (moved from tests/unit/test_torch_cpu_source.py)."""
from __future__ import annotations

import os

import pytest

from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_fork_mid_window_closes_it_first_so_the_child_records_nothing():
    clock, got = Clock(), []
    src = CpuOpSource(CpuOpConfig(period_s=10, window_s=0.1, first_after_s=0), clock=clock)
    src.start(got.append)
    try:
        src.safe_point()
        assert torch.autograd._profiler_enabled()
        pid = os.fork()
        if pid == 0:  # the child (a DataLoader worker would be one): no profiler left on
            os._exit(3 if torch.autograd._profiler_enabled() else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not torch.autograd._profiler_enabled() and src.stats["closed_for_fork"] == 1
    finally:
        src.stop()
    assert src.stats["windows"] == 1
