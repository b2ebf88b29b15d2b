"""Selective injection: is this Python process a training rank? (ARGUS Appendix A)

Loaded by ``sitecustomize`` in *every* Python process that inherits the
environment (launchers, data-loader and compile workers, tools the job runs),
so it imports only the standard library and ``trainscope.proto.env`` (itself
stdlib-only: the variable names and the launcher identity it shares with
``collector/launch.py``) and decides from the environment and the command line
alone:

1. Off when ``TRAINSCOPE_AUTOSTART`` or ``TRAINSCOPE_ENABLED`` say so.
2. Skip children of a rank: a rank that started its collector exports
   ``TRAINSCOPE_RANK_PID``; a process that inherits it with another pid is a
   data-loader worker, a compile worker or a tool, not a rank.
3. Skip launchers (torchrun, ``torch.distributed.run``/``launch``, DeepSpeed,
   Accelerate) and multiprocessing / compile-worker entry points.
4. Need a distributed worker identity: ``RANK`` and ``WORLD_SIZE`` (torchrun
   and friends), Open MPI or Slurm task variables, or being the direct child
   of ``trainscope run`` (a single-process job: rank 0 of 1).
5. If ``TRAINSCOPE_MATCH`` is set, the command line must match it (a regex;
   ``trainscope run`` sets it to the training script or module).

Only when all pass is ``trainscope.collector.launch.start_in_process`` imported
and called. ``TRAINSCOPE_DEBUG_BOOT=1`` prints the decision to stderr.
"""
from __future__ import annotations

import os
import re
import sys

from trainscope.proto.env import (  # stdlib-only module: the names are a contract with launch
    AUTOSTART, DEBUG_BOOT as DEBUG, ENABLED, MATCH, RANK_PID, RUN_PID, identity, switch)

#: Launcher modules / console scripts: they start ranks, they are not ranks.
LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "torchrun", "deepspeed.launcher.runner",
             "deepspeed.launcher.launch", "deepspeed", "accelerate", "accelerate.commands.launch")
#: Entry points of helper processes that inherit a rank's environment.
HELPER_MODULES = ("torch._inductor", "torch.utils.cpp_extension", "pip", "setuptools", "triton",
                  "trainscope")
HELPER_CODE = ("multiprocessing", "compile_worker", "concurrent.futures", "joblib")


def _entry(argv: list[str]) -> str:
    """The module (``-m x``) or script a command line runs, '' for ``-c``/interactive."""
    args = argv[1:]
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("-m") and len(a) > 2:
            return a[2:]
        if a == "-c" or a.startswith("-c"):
            return "-c " + (args[i + 1] if a == "-c" and i + 1 < len(args) else a[2:])
        if a in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return a
    return ""


def select(environ=None, argv: list[str] | None = None, pid: int | None = None,
           ppid: int | None = None) -> tuple[bool, str]:
    """Whether to start the collector here, and why (the steps in the module docstring)."""
    environ = os.environ if environ is None else environ
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    pid = os.getpid() if pid is None else pid
    ppid = os.getppid() if ppid is None else ppid
    if not switch(AUTOSTART, environ=environ) or not switch(ENABLED, environ=environ):
        return False, "disabled by environment"
    owner = environ.get(RANK_PID)
    if owner and owner != str(pid):
        return False, f"child of rank process {owner}"
    entry = _entry(argv)
    if entry in LAUNCHERS or os.path.basename(entry) in LAUNCHERS:
        return False, f"launcher ({entry})"
    helper = ("--multiprocessing-fork" in argv
              or (entry.startswith("-c ") and any(h in entry for h in HELPER_CODE))
              or any(entry == m or entry.startswith(m + ".") for m in HELPER_MODULES))
    if helper:
        return False, f"helper process ({entry[:60]})"
    ident = identity(environ)
    if ident is None:
        if environ.get(RUN_PID) != str(ppid):
            return False, "no distributed worker identity"
    pattern = environ.get(MATCH)
    if pattern:
        try:
            if not re.search(pattern, " ".join(argv)):
                return False, f"command line does not match {pattern!r}"
        except re.error:
            return False, f"bad {MATCH} regex {pattern!r}"
    return True, "rank process" if ident else "single-process job under trainscope run"


def boot() -> None:
    ok, why = select()
    if os.environ.get(DEBUG):
        print(f"trainscope boot pid={os.getpid()}: {'start' if ok else 'skip'} ({why})", file=sys.stderr)
    if ok:
        from trainscope.collector.launch import start_in_process
        start_in_process()
