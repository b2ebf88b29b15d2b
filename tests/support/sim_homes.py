"""Homes for simulator runs that tests start without one.

The simulator writes its ground truth to its home; given none, ``run_sim`` makes a temporary
directory and leaves it to the caller (a library call's result names it), and a test suite that
never removes them leaves dozens in /tmp per run. ``sim_home()`` gives one inside a directory
removed when the test process ends.
"""
from __future__ import annotations

import tempfile

_HOMES = tempfile.TemporaryDirectory(prefix="trainscope-test-sim-")


def sim_home() -> str:
    """A fresh directory for one simulator run's home, removed with the test process."""
    return tempfile.mkdtemp(dir=_HOMES.name)
