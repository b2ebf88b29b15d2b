"""One real 6-rank gloo job, four kinds of fault on four ranks, two healthy ranks: one deep dive names each.

A real processor on 127.0.0.1:0 (in this process) and a real torch job (CPU, gloo) under
``trainscope run``; nothing in the training script knows trainscope. Every rank runs the same
loop (data loader, a small MLP, ``time.sleep`` for the rest of a step, all-reduce of the
gradients); four ranks carry one problem each that only a function-level view explains
(issue #14's list; L1-L3 can only say which rank is late):

- rank 1, slow collate: the data loader's ``collate_fn`` does ~20 ms of Python per batch;
- rank 2, ``gc.collect()`` every step: every rank froze its startup objects (``gc.freeze()``,
  as long-running trainers do) and holds 200k tracked objects; only rank 2 collects them each step
  (a full collection of torch's ~180k startup objects alone takes ~160 ms, which would dwarf the
  other faults of this one job);
- rank 3, a busy thread: a helper thread spinning in pure Python takes the CPU and the GIL; the
  training thread's functions take longer at every GIL hand-off, and the thread's own function
  is on no critical path (``patterns.thread_patterns``);
- rank 4, unfused ops: its model's activation is tanh-GELU written as ~8 elementwise ops, six
  times over, where its peers run the one fused ``gelu`` op.

Once the processor has seen the job's iterations, ``trainscope profile`` asks for a 4-iteration
deep dive; the analyzer's follower (``analyzer/deepdive/results.py``) analyses it. Asserted: each
faulty rank is named for its fault's function (the collate function; ``gc.collect``'s built-in,
called from the loop; the spinning thread's function; the elementwise ops called from the
unfused ``forward``), the healthy ranks 0 and 5 for nothing, and the stored L4 diagnoses name the
four faulty ranks only. The job ~25-40 s on this shared 2-core host.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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

WORLD = 6
ITERATIONS = 4
FAULTS = {1: "slow_collate", 2: "gc", 3: "busy_thread", 4: "unfused"}
HEALTHY = sorted(set(range(WORLD)) - set(FAULTS))
#: The job runs until the test creates its stop file (after the dive), not a fixed number of steps: on a
#: loaded host the ``profile`` command's own start-up took longer than a 70-step job had left, and the
#: dive's ranks ended "truncated" or never started. This bounds it if the test never stops it.
MAX_STEPS = 3000

#: A small gloo job; ``rank=fault`` arguments give ranks their fault. Nothing here knows trainscope.
TRAIN_SCRIPT = """
import gc, os, sys, threading, time
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate


def slow_collate(batch):
    s = 0
    for i in range(200_000):
        s += i * i
    return default_collate(batch)


def spin():
    x = 0
    while True:
        x += 1


class Fused(nn.Module):
    def forward(self, h):
        return nn.functional.gelu(h, approximate="tanh")


class Unfused(nn.Module):
    def forward(self, h):
        for _ in range(6):
            h = h * 0.5 * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h * h * h)))
        return h


def main():
    steps, stop = int(sys.argv[1]), sys.argv[2]
    fault = dict(a.split("=") for a in sys.argv[3:])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fault = fault.get(str(rank), "")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 1024), Unfused() if fault == "unfused" else Fused(), nn.Linear(1024, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    gc.freeze()
    held = [[i] for i in range(200_000)]
    if fault == "busy_thread":
        threading.Thread(target=spin, daemon=True).start()
    loader = DataLoader(TensorDataset(torch.randn(16 * 128, 64, generator=g),
                                      torch.randn(16 * 128, 8, generator=g)), batch_size=128,
                        collate_fn=slow_collate if fault == "slow_collate" else default_collate)
    batches = (b for _ in range(steps) for b in loader)
    for step in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        time.sleep(0.02)
        if fault == "gc":
            gc.collect()
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


def line_of(text: str, after: str = "") -> int:
    """1-based line of ``text`` in the script (the first one after ``after``): Kineto names carry it."""
    lines = TRAIN_SCRIPT.split("\n")
    start = next(i for i, ln in enumerate(lines) if after in ln) if after else 0
    return next(i for i, ln in enumerate(lines) if i >= start and text in ln) + 1


def run_once(tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    train = tmp / "train_faults.py"
    train.write_text(TRAIN_SCRIPT)
    deep, stop = tmp / "deep", tmp / "stop"
    proc = start_processor(window=WindowConfig(iterations=10, lateness_s=1),
                           # the lead covers the command's delay on a loaded 2-core host (a rank that reaches the start
                           # iteration first reports "missed", as designed)
                           control=ControlConfig(directory=str(deep), lead_s=4.0, cooldown_s=600))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}
    environ[env.DEEP_DIVE_DIR] = str(deep)
    # the CPU operator source's own profiler windows (50 ms every 30 s) can hold the profiler when the
    # dive starts, and that rank then reports busy (a known limit, docs/deep_dive.md): off here
    environ[env.CPU_OPS] = "0"
    job = subprocess.Popen(
        [sys.executable, "-m", "trainscope.deploy.cli", "run", "--processor", proc.address, "--no-processor",
         "--no-stacks", "--run-dir", str(tmp / "run"), "--job-id", "faults", "--",
         *forkrun.command(train, str(MAX_STEPS), str(stop), *(f"{r}={f}" for r, f in FAULTS.items()), world=WORLD)],
        env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (proc.control.latest("faults")[0] < 12
                                               or len(proc.control.subscribers("faults")) < WORLD):
            assert job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.2)
        assert proc.control.subscribers("faults") == list(range(WORLD))
        p = subprocess.run([sys.executable, "-m", "trainscope.deploy.cli", "profile", "--job", "faults",
                            "--processor", proc.address, "--iterations", str(ITERATIONS), "--wait", "60", "--json"],
                           env=environ, capture_output=True, text=True, timeout=90)
        stop.touch()      # the dive is in (or the command gave up): the job ends after its next step
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.communicate(timeout=30)
        proc.stop()
    return job.returncode, out, p, deep


@pytest.fixture(scope="module")
def dive(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deep_dive_faults")
    return run_once(tmp / "a1")


def test_one_dive_names_each_fault_on_its_rank_and_no_healthy_rank(dive, tmp_path):
    from trainscope.analyzer.deepdive.results import DeepDiveFollower, FollowerConfig
    from trainscope.analyzer.store import DiagnosisStore

    rc, out, p, deep = dive
    assert p.returncode == 0, (p.stdout, p.stderr, out[-2000:])
    assert json.loads(p.stdout)["complete"] is True
    store = DiagnosisStore(str(tmp_path / "store.sqlite"))
    (doc,) = DeepDiveFollower(str(deep), store, FollowerConfig(verdict_wait_s=0)).scan()
    assert doc["ranks_analysed"] == list(range(WORLD)), doc
    print("\n" + "\n".join(f"outlier {o['kind']} {o['function'][:70]} ranks {o['ranks']} slower {o['slower']} "
                            f"impact {o['impact_s']} called from {o['launched_by'][:50]!r}" for o in doc["outliers"]))
    named: dict[int, list[dict]] = {}
    for o in doc["outliers"]:
        assert not o["common"], o
        for r, slower in zip(o["ranks"], o["slower"]):
            if slower:
                named.setdefault(r, []).append(o)
    assert set(named) == set(FAULTS), {r: [o["function"] for o in os] for r, os in named.items()}  # 0 and 5: nothing
    assert doc["suspects"] == sorted(FAULTS)
    fn = {r: {o["function"] for o in os} for r, os in named.items()}
    # rank 1: the collate function itself
    assert f"train_faults.py({line_of('def slow_collate')}): slow_collate" in fn[1], fn[1]
    # rank 2: gc.collect's built-in, called from the training loop
    (gc_out,) = [o for o in named[2] if o["function"] == "<built-in function collect>"]
    # (a frame already running when profiling began is named at its line then, not its definition's)
    assert re.fullmatch(r"train_faults\.py\(\d+\): main", gc_out["launched_by"]), gc_out
    # rank 3: the spinning thread's function (off the critical path), with the training thread slower
    # (the spinning thread's function; another frame of that thread may be named beside it)
    threads = [o for o in named[3] if o["kind"] == "thread"]
    spin = [o for o in threads if re.fullmatch(r"train_faults\.py\(\d+\): spin", o["function"])]
    assert spin and spin[0]["beta"][0] > 0.5, threads
    # its symptoms on the training thread's path (GIL hand-offs) land on a different function each iteration on
    # a loaded host, so whether one of them is steady enough to be named beside the thread varies with the load:
    # the fault's own function is the thread's; any path symptom named is on rank 3 (the set of ranks above)
    print(f"rank 3 path symptoms named beside the thread: {[o['function'] for o in named[3] if o['kind'] != 'thread']}")
    # rank 4: elementwise ops called from the unfused forward
    unfused_fwd = f"train_faults.py({line_of('def forward', after='class Unfused')}): forward"
    ops = [o for o in named[4] if o["function"] in ("aten::mul", "aten::add", "aten::tanh", "aten::pow")]
    assert ops and any(o["launched_by"] == unfused_fwd for o in ops), named[4]
    # stored as L4 diagnoses naming the four faulty ranks only
    diags = list(store.diagnoses("faults", level="L4"))
    assert {s.rank for d in diags for s in d.suspects} == set(FAULTS)
    store.close()
    assert rc == 0, out[-3000:]
