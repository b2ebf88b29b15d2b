"""Progress lines of long commands (issue #12 item 4): stderr only, on a terminal only, rate-limited.

No processes; a fake clock and fake terminal streams.
"""
from __future__ import annotations

import io
import time

from trainscope.deploy.render import Progress, SimProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_terminal_gets_one_redrawn_line_with_count_total_percent_and_seconds():
    out, clock = Terminal(), Clock()
    p = Progress("trainscope sim", 40, "iterations", stream=out, clock=clock)
    p.update(10)
    clock.t += 3
    p.update(20, note="rank 3")
    p.close()
    text = out.getvalue()
    assert "\n" not in text  # redrawn in place, never scrolls the terminal
    assert "\rtrainscope sim: 10/40 iterations (25 %), 0 s\x1b[K" in text
    assert "\rtrainscope sim: 20/40 iterations (50 %), 3 s, rank 3\x1b[K" in text
    assert text.endswith("\r\x1b[K")  # cleared, so what follows starts on a clean line


def test_updates_are_rate_limited():
    out, clock = Terminal(), Clock()
    p = Progress("x", 1000, "items", stream=out, clock=clock, interval_s=0.2)
    for i in range(1000):
        clock.t += 0.001  # 1 s in all
        p.update(i)
    assert 4 <= out.getvalue().count("\r") <= 6, out.getvalue()


def test_nothing_when_not_a_terminal():
    """Piped stderr (CI logs, the tests, `2>file`) stays free of progress lines."""
    out = io.StringIO()
    p = Progress("x", 10, "items", stream=out, clock=Clock())
    p.update(5)
    with p.ticking(after_s=0.0):
        time.sleep(0.05)
    p.close()
    assert out.getvalue() == ""


def test_a_quick_query_shows_nothing_a_slow_one_shows_its_time():
    fast = Terminal()
    with Progress("q", stream=fast).ticking(after_s=5.0):
        pass
    assert fast.getvalue() == ""
    slow = Terminal()
    with Progress("trainscope query kernels: reading s.sqlite", stream=slow, interval_s=0.01).ticking(after_s=0.0):
        time.sleep(0.1)
    assert "trainscope query kernels: reading s.sqlite: 0 s" in slow.getvalue()
    assert slow.getvalue().endswith("\r\x1b[K")


def test_the_sim_sink_reports_iterations_done():
    class Chunk:
        def __init__(self, its):
            self.iterations = its

    out = Terminal()
    sink = SimProgress(Progress("sim", 20, "iterations", stream=out, interval_s=0.0))
    sink.write(Chunk([0, 1, 2, 3, 4]))
    sink.write(Chunk([]))
    sink.close()
    assert "5/20 iterations (25 %)" in out.getvalue() and out.getvalue().endswith("\r\x1b[K")
