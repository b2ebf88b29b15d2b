"""End a rank without torch 2.13's gloo exit-time abort (issue #23: handled where it happens).

torch 2.13's gloo sometimes aborts a rank while the interpreter tears down ("terminate called
without an active exception", std::terminate in a C++ destructor, no Python frame), in plain
``torchrun`` too, without trainscope: 2 of 23 plain runs measured with
``tests/benchmarks/bench_job_crashes.py``. The training is over by then; only the teardown
crashes. ``skip_teardown(rc)``, called once the rank's work is done, makes the process end with
``os._exit(rc)`` as the *last* exit step: Python still runs the threading at-exit hooks (where the
trainscope collector flushes, ``collector/launch._at_exit``) and every ``atexit`` handler
registered before it, then exits without module teardown and C++ static destructors, where the
abort happens. The test jobs call it; the tests then never need to run a job twice.
"""
from __future__ import annotations

import atexit
import os
import sys


def _end(rc: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more to say
            pass
    os._exit(rc)


def skip_teardown(rc: int = 0) -> int:
    """Register the final ``os._exit(rc)`` (atexit runs last-registered first, so call this last)."""
    atexit.register(_end, int(rc or 0))
    return rc
