"""A test launcher for multi-rank torch jobs that imports torch once (issue #23: the suite's real jobs).

    python tests/support/forkrun.py --nproc-per-node 4 SCRIPT [ARGS...]

What ``torchrun --standalone --nproc-per-node N`` does for the ranks (one process each, with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a free loopback
port, the script's folder first on ``sys.path``, the others stopped when one fails), except that the ranks
are forked from this process after it imported torch, as a zygote does. On this 2-core machine
``import torch`` costs 3 CPU-s a process: torchrun's launcher and its four ranks paid 15 CPU-s of each
4-rank job's ~18, and the suite's ~25 jobs most of its real-job tier. The ranks are still real torch
processes of their own, each with its own gloo connections and its own trainscope collector; what
torchrun itself does (its elastic agent, its rendezvous) is tested where the README's command is
(``test_readme_commands.test_run_a_torchrun_job``) and where a test is about the launcher.

Under ``trainscope run`` the collector's start-up hook (``collector/bootstrap``) runs in every Python
process at its start, so here in the launcher, which is no rank: the launcher is therefore started with
``TRAINSCOPE_ENABLED=0`` (``command()`` does that) and each forked rank removes it and runs the hook then,
once its rank identity is in its environment, as a rank started by torchrun would at its start (its command
line, ``sys.orig_argv``, stays the launcher's, which ``trainscope run``'s script match names).
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import signal
import sys
import time

#: Set by ``command()`` for the launcher; each rank removes it before its start-up hook runs.
DISABLE = ("TRAINSCOPE_ENABLED", "0")


def command(script, *args: str, world: int = 4) -> list[str]:
    """The argv that runs ``script`` on ``world`` ranks through this launcher."""
    return ["env", f"{DISABLE[0]}={DISABLE[1]}", sys.executable, os.path.abspath(__file__),
            "--nproc-per-node", str(world), str(script), *args]


def _rank(script: str, args: list[str], rank: int, world: int, port: int) -> None:
    """In the forked child: become rank ``rank`` and run the script as ``__main__``; never returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get(DISABLE[0]) == DISABLE[1]:
        del os.environ[DISABLE[0]]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)             # a rank's own, as a fresh interpreter has them
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    boot = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    hook = os.path.join(boot, "_trainscope_boot.py")
    if boot and os.path.isfile(hook):       # under trainscope run: its start-up hook, now that this is a rank
        spec = importlib.util.spec_from_file_location("_trainscope_boot", hook)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.boot()
    runpy.run_path(script, run_name="__main__")   # its SystemExit ends this child as it would a rank
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--nproc-per-node" or not argv[1].isdigit() or int(argv[1]) < 1:
        print("usage: forkrun.py --nproc-per-node N SCRIPT [ARGS...] (N ≥ 1)", file=sys.stderr)
        return 2
    world, script, args = int(argv[1]), argv[2], argv[3:]
    if world > 1:                 # as torchrun does, before torch (and its OpenMP runtime) is loaded
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    importlib.import_module("torch.distributed")   # the point: torch once, before the ranks are forked
    from ports import free_port      # tests/support/ports.py, beside this script (its folder is first on sys.path)
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    kids: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(script, args, rank, world, port)
        kids[pid] = rank

    def stop(sig, _frame) -> None:
        for pid in kids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = 0
    while kids:
        pid, status = os.wait()
        if pid not in kids:
            continue
        kids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code if code > 0 else 128 - code
            print(f"forkrun: rank exited with {code}; stopping the others", file=sys.stderr)
            stop(signal.SIGTERM, None)
            deadline = time.monotonic() + 10
            while kids and time.monotonic() < deadline:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    time.sleep(0.1)
                    continue
                kids.pop(pid, None)
            stop(signal.SIGKILL, None)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
