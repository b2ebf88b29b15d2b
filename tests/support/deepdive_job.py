"""A small real gloo job for deep dives, with one named fault per rank, and one dive of it (tests and benchmarks).

``run_once(tmp, faults)`` writes ``TRAIN_SCRIPT`` (nothing in it knows trainscope), starts a real processor
on 127.0.0.1:0 in this process and the job under ``trainscope run`` (its ranks forked after one ``import
torch``), waits until the processor has seen 12 iterations on every rank, asks ``trainscope profile`` for
a 4-iteration dive, then stops the job. Faults (``rank=fault`` arguments of the script):

- ``slow_collate``: the data loader's ``collate_fn`` does ~20 ms of Python per batch;
- ``gc``: ``gc.collect()`` every step (every rank froze its startup objects and holds 200k tracked objects);
- ``busy_thread``: a helper thread spinning in pure Python;
- ``unfused``: tanh-GELU written as ~8 elementwise ops, six times over, where peers run the fused op;
- ``hot_loop``: a Python loop (~20 ms) in the step;
- ``matmul``: the first layer's matmul done four times (a throttled device: the same work, slower).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support import forkrun
from support.pipeline import start_processor
from trainscope.processor.control import ControlConfig
from trainscope.processor.windows import WindowConfig
from trainscope.proto import env

ITERATIONS = 4
#: The job runs until the caller's stop file exists (after the dive), not a fixed number of steps: on a
#: loaded host the ``profile`` command's own start-up took longer than a 70-step job had left, and the
#: dive's ranks ended "truncated" or never started. This bounds it if nobody stops it.
MAX_STEPS = 3000
SCRIPT_NAME = "train_faults.py"

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


def hot_loop(n):
    s = 0
    for i in range(n):
        s += i * i
    return s


def spin():
    x = 0
    while True:
        x += 1


class SlowerLinear(nn.Linear):
    # the same layer's matmul done four times (a throttled device: the same work, slower)
    def forward(self, x):
        for _ in range(4):
            y = nn.functional.linear(x, self.weight, self.bias)
        return y


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
    first = SlowerLinear(64, 1024) if fault == "matmul" else nn.Linear(64, 1024)
    model = nn.Sequential(first, Unfused() if fault == "unfused" else Fused(), nn.Linear(1024, 8))
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
        if fault == "hot_loop":
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


def line_of(text: str, after: str = "") -> int:
    """1-based line of ``text`` in the script (the first one after ``after``): Kineto names carry it."""
    lines = TRAIN_SCRIPT.split("\n")
    start = next(i for i, ln in enumerate(lines) if after in ln) if after else 0
    return next(i for i, ln in enumerate(lines) if i >= start and text in ln) + 1


def run_once(tmp: Path, faults: dict[int, str], world: int, job_id: str = "faults"):
    """(the job's exit status, its output, the profile command's result, the dive folder)."""
    tmp.mkdir(parents=True, exist_ok=True)
    train = tmp / SCRIPT_NAME
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
         "--no-stacks", "--run-dir", str(tmp / "run"), "--job-id", job_id, "--",
         *forkrun.command(train, str(MAX_STEPS), str(stop), *(f"{r}={f}" for r, f in faults.items()), world=world)],
        env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (proc.control.latest(job_id)[0] < 12
                                               or len(proc.control.subscribers(job_id)) < world):
            if job.poll() is not None:
                raise RuntimeError(job.communicate()[0][-3000:])
            time.sleep(0.2)
        if proc.control.subscribers(job_id) != list(range(world)):
            raise RuntimeError(f"ranks subscribed: {proc.control.subscribers(job_id)}")
        p = subprocess.run([sys.executable, "-m", "trainscope.deploy.cli", "profile", "--job", job_id,
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
