"""Running real torch jobs in tests: torch 2.13's gloo exit-time abort.

torch 2.13's gloo sometimes aborts a rank at exit ("terminate called without an active
exception", std::terminate, SIGABRT, no Python frame) in plain ``torchrun`` too, without
trainscope: 2 of 23 plain runs measured with ``tests/benchmarks/bench_job_crashes.py``. A job
that died of exactly that is run once more; any other crash fails the test.
"""
from __future__ import annotations

import subprocess
from typing import Callable

TORCH_EXIT_ABORT = "terminate called without an active exception"


def torch_crashed(out: str) -> bool:
    """Did this output come from a job that died of torch's exit-time abort?"""
    return TORCH_EXIT_ABORT in (out or "")


def retry_torch_abort(run: Callable[[], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """``run()`` -> CompletedProcess; once more if a rank died of torch's exit-time abort."""
    p = run()
    if p.returncode != 0 and torch_crashed((p.stdout or "") + (p.stderr or "")):
        p = run()
    return p
