"""The degradation trigger end to end (EROICA §4.1): a real job slows down mid-run, the analyzer opens a dive by itself.

A real processor (127.0.0.1:0, with its store) and the real analyzer service (``AnalyzerDaemon``
tailing that store, ``deep_dive_processors`` = the processor: what ``trainscope analyzer
--deep-dive-processor ADDR`` runs), both in this process; a real 4-rank gloo job under ``trainscope
run``. From iteration ``SLOW_FROM`` on, rank 1 runs a Python hot loop (~20 ms) in every step: the
job's step grows by about half. Nobody runs ``trainscope profile``: the analyzer's triggers see the
windows' steps (10 iterations each) and, after 3 windows in a row >= 5 % over the recent shortest,
ask the processor for a deep dive; every rank profiles the same 5 iterations. The analyzer's
follower then analyses it. Asserted: one dive, its trigger ``degradation`` and its reason the
windows' steps, iterations after the slowdown began, the L4 analysis naming ``hot_loop`` on rank 1
and no other rank, the trigger's counter (``fired``, ``sent``).

The verdict and stall triggers are switched off on the daemon's triggers (``TriggerConfig``): L1 names
the late rank about as early as the degradation fires, and this test is about the degradation
trigger. The job runs until its dive is complete (~25 s on this shared 2-core host, dives at iterations
171-191 beside a busy process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import forkrun
from support.pipeline import start_processor
from trainscope.processor.control import ControlConfig
from trainscope.processor.windows import WindowConfig
from trainscope.proto import env

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

WORLD = 4
SLOW_RANK = 1
SLOW_FROM = 60
#: The job runs until the test's stop file exists (the dive is complete, or ``DIVE_DEADLINE_S`` passed), not a
#: fixed number of steps: the trigger fires a time after the slowdown (windows close, the analyzer polls, the
#: dive starts ``lead_s`` ahead), and a fixed 220-step job ended before its dive on a faster host (the dive
#: "complete": false). This bounds it if nobody stops it.
MAX_STEPS = 3000
DIVE_DEADLINE_S = 120

#: A small gloo job whose rank SLOW_RANK starts a Python hot loop at iteration SLOW_FROM; nothing here knows trainscope.
TRAIN_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def hot_loop(n):
    s = 0
    for i in range(n):
        s += i * i
    return s


def main():
    steps, slow_rank, slow_from, stop = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    loader = DataLoader(TensorDataset(torch.randn(64 * 32, 64, generator=g),
                                      torch.randn(64 * 32, 8, generator=g)), batch_size=32)
    batches = (b for _ in range(steps) for b in loader)
    for step in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        time.sleep(0.02)
        if rank == slow_rank and step >= slow_from:
            hot_loop(150_000)
        loss.backward()
        # the stop file's flag rides on the gradients' all-reduce: every rank stops after the same step
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()] + [torch.tensor([float(os.path.exists(stop))])])
        dist.all_reduce(flat)
        opt.step()
        if flat[-1] > 0:
            break
    dist.barrier()
    dist.destroy_process_group()


main()
# torch 2.13's gloo can abort in interpreter teardown (tests/support/clean_exit.py): exit after the
# at-exit hooks (the collector's flush), without teardown
import atexit, os, sys  # noqa: E401
atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0)))
"""


def _dive_complete(jobdir: Path) -> bool:
    """A dive of the job whose manifest says complete (every rank's traces written)."""
    for m in jobdir.glob("*/manifest.json") if jobdir.is_dir() else ():
        try:
            if json.loads(m.read_text()).get("complete"):
                return True
        except (OSError, ValueError):      # being written
            continue
    return False


def run_once(tmp: Path):
    from trainscope.analyzer.triggers import TriggerConfig
    from trainscope.deploy.analyzer_daemon import AnalyzerDaemon, AnalyzerDaemonConfig

    tmp.mkdir(parents=True, exist_ok=True)
    train = tmp / "train_slowdown.py"
    train.write_text(TRAIN_SCRIPT)
    deep = tmp / "deep"
    store = tmp / "store.sqlite"
    stop_file = tmp / "stop"
    proc = start_processor(window=WindowConfig(iterations=10, lateness_s=1), store_path=str(store),
                           control=ControlConfig(directory=str(deep), lead_s=1.5, cooldown_s=600))
    daemon = AnalyzerDaemon(AnalyzerDaemonConfig(store_path=str(store), spool_dir=str(tmp / "spool"),
                                                 deep_dive_processors=(proc.address,)))
    daemon.triggers.config = TriggerConfig(on_verdict=False, on_stall=False)   # the degradation trigger alone
    stop = threading.Event()
    analyzer = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    daemon.start()
    analyzer.start()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}
    environ[env.DEEP_DIVE_DIR] = str(deep)
    environ[env.CPU_OPS] = "0"   # its profiler windows can make a rank report busy at the dive's start
    job = subprocess.Popen(
        [sys.executable, "-m", "trainscope.deploy.cli", "run", "--processor", proc.address, "--no-processor",
         "--no-stacks", "--run-dir", str(tmp / "run"), "--job-id", "slows", "--",
         *forkrun.command(train, str(MAX_STEPS), str(SLOW_RANK), str(SLOW_FROM), str(stop_file), world=WORLD)],
        env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + DIVE_DEADLINE_S
        while job.poll() is None and time.monotonic() < deadline and not _dive_complete(deep / "slows"):
            time.sleep(0.2)
        stop_file.touch()      # the dive is in (or the deadline passed): the job ends after its next step
        out, _ = job.communicate(timeout=120)
        proc.control.wait_summaries(10)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.communicate(timeout=30)
        stop.set()
        analyzer.join(10)
        triggers = daemon.triggers
        daemon.stop()
        proc.stop()
    return job.returncode, out, triggers, deep, store


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deep_dive_trigger")
    got = run_once(tmp / "a1")
    return got


def test_a_mid_run_slowdown_triggers_a_dive_that_names_the_rank(slowed, tmp_path):
    from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig
    from trainscope.analyzer.store import DiagnosisStore

    rc, out, triggers, deep, store_path = slowed
    fired = list(triggers.fired)
    print("\n" + "\n".join(f"fired {d.trigger} window {d.window}: {d.reason}" for d in fired))
    assert [d.trigger for d in fired] == ["degradation"], (fired, dict(triggers.counts), out[-2000:])
    assert "over the recent shortest" in fired[0].reason and fired[0].window * 10 >= SLOW_FROM, fired
    assert triggers.counts[("degradation", "fired")] == 1 and triggers.counts[("degradation", "sent")] == 1, \
        dict(triggers.counts)
    dives = [p for p in (deep / "slows").iterdir() if p.is_dir()]
    assert len(dives) == 1, dives
    man = json.loads((dives[0] / "manifest.json").read_text())
    assert man["trigger"] == "degradation" and man["complete"] and not man["partial"], man
    print(f"dive {man['dive_id']}: iterations {man['start_iteration']}-{man['start_iteration'] + 4} "
          f"(slowdown from {SLOW_FROM})")
    assert man["start_iteration"] > SLOW_FROM and man["iterations"] == 5, man
    assert {r["outcome"] for r in man["ranks"].values()} == {"done"} and len(man["ranks"]) == WORLD, man
    assert len({(r["first_iteration"], r["last_iteration"]) for r in man["ranks"].values()}) == 1   # the same iterations
    # the analyzer's follower analyses it: hot_loop on rank 1, no other rank
    store = DiagnosisStore(str(store_path))
    (doc,) = DeepDiveFollower(str(deep), store, FollowerConfig(verdict_wait_s=0)).scan()
    named = {(o["function"], r) for o in doc["outliers"] if not o["common"]
             for r, slower in zip(o["ranks"], o["slower"]) if slower}
    print("\n".join(f"outlier {o['function']} ranks {o['ranks']} impact {o['impact_s']}" for o in doc["outliers"]))
    assert any(f.endswith(": hot_loop") and r == SLOW_RANK for f, r in named), doc["outliers"]
    assert {r for _, r in named} == {SLOW_RANK}, named
    assert doc["trigger"] == "degradation"
    store.close()
    assert rc == 0, out[-3000:]
