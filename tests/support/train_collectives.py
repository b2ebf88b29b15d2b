"""A small real gloo job for the collective-record tests (PyTorch CPU): plain ``all_reduce``, DDP or FSDP2.

    torchrun --standalone --nproc-per-node 4 tests/support/train_collectives.py --mode plain --steps 60

Each step: a data loader batch, forward of a small MLP, backward, the gradient
all-reduce (``--mode plain``: one ``dist.all_reduce`` of the flattened
gradients; ``--mode ddp``: DDP's bucket all-reduces during backward;
``--mode fsdp``: FSDP2's ``fully_shard`` on each ``Linear`` and the root, its
parameter all-gathers before each layer's forward and backward and its
gradient reduce-scatters, several per step, issued back to back), an
optimizer step. Faults, on one rank, from one step on:

* ``--late-rank R --late-s S --late-from N``: rank R sleeps S seconds just
  before its gradient all-reduce (plain: before the call; DDP and FSDP: between
  forward and backward), i.e. it enters the collective late (a host-side delay),
  in a function of its own (``late_start``: a stack the other ranks never show);
  ``--late-every K``: only every K-th step from N on (an intermittent stall);
* ``--slow-rank R --slow-ms M``: rank R's forward does M ms of extra busy work
  (``slow_forward``) from ``--fault-from`` on; ``--loader-rank R --loader-ms M``:
  rank R waits M ms for each batch (``load_batch``); ``--layer-delay-rank R
  --layer-delay-ms M``: rank R sleeps M ms between its first and second
  layer's forward (``between_layers``; FSDP2: before the second layer's
  all-gather);
* ``--contend-rank R``: from ``--fault-from`` on, rank R shares one core with
  ``--contend-procs`` busy processes of the same priority (``contend``: it pins
  itself and them to its last allowed CPU, as a neighbour's processes on a
  shared host; one alone costs this mostly sleeping rank nothing, three
  about 25 ms of its 40 ms step);
* ``--hang-rank R --hang-from N``: rank R stops between forward and backward of
  step N, so it never enters that step's gradient collectives (plain, DDP: the
  all-reduce; FSDP2: the first all-gather of its backward) and sleeps until
  killed; ``--hang-file F`` gets the wall time (seconds) at which it stopped.

``--loader-workers N`` loads batches in N worker processes per rank
(``DataLoader(num_workers=N)``, the common setup; default 0: in the rank).

``--flight-recorder N`` sizes torch's Flight Recorder to N entries
(``TORCH_FR_BUFFER_SIZE``, set before the process group is created; torch
2.13 keeps 2,000 when unset, 0 turns it off); without it torch's default holds.

Rank 0 writes a hash of the parameters to ``--out`` (runs with and without the
collector compare bit for bit). Nothing here knows trainscope.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def late_start(seconds: float) -> None:
    """The late rank's delay (a host-side stall before the collective: a slow data or checkpoint step)."""
    time.sleep(seconds)


def slow_forward(ms: float) -> None:
    """The slow rank's extra work inside its forward (a slower GPU or a heavier shard): busy, not asleep."""
    end = time.perf_counter() + ms / 1e3
    a = torch.randn(64, 64)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def between_layers(ms: float) -> None:
    """The delayed rank's host work between two layers (a slow hook, a synchronising log call)."""
    time.sleep(ms / 1e3)


def load_batch(ms: float) -> None:
    """The slow rank's data loader (a slow worker or storage read) before its forward."""
    time.sleep(ms / 1e3)


def contend(n: int) -> list[subprocess.Popen]:
    """Host contention on this rank (``--contend-rank``): this process and ``n`` busy ones share one
    core, at the same priority; the busy ones end when this process does (they watch their parent)."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    spin = ("import os, sys\nparent = int(sys.argv[1])\nos.sched_setaffinity(0, {int(sys.argv[2])})\n"
            "while os.getppid() == parent:\n    sum(range(100_000))\n")
    # -I -S: no site hooks and no environment (nothing of the job it runs beside)
    return [subprocess.Popen([sys.executable, "-I", "-S", "-c", spin, str(os.getpid()), str(cpu)]) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("plain", "ddp", "fsdp"), default="plain")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--late-from", type=int, default=0)
    ap.add_argument("--late-every", type=int, default=1, help="late only every N-th step from --late-from")
    ap.add_argument("--slow-rank", type=int, default=-1, help="this rank's forward does --slow-ms of extra work")
    ap.add_argument("--slow-ms", type=float, default=0.0)
    ap.add_argument("--loader-rank", type=int, default=-1, help="this rank waits --loader-ms for each batch")
    ap.add_argument("--loader-ms", type=float, default=0.0)
    ap.add_argument("--layer-delay-rank", type=int, default=-1,
                    help="this rank sleeps --layer-delay-ms between its first and second layer's forward")
    ap.add_argument("--layer-delay-ms", type=float, default=0.0)
    ap.add_argument("--fault-from", type=int, default=10,
                    help="first step of --slow-rank / --loader-rank / --layer-delay-rank")
    ap.add_argument("--contend-rank", type=int, default=-1,
                    help="this rank shares its core with a busy process from --fault-from on")
    ap.add_argument("--contend-procs", type=int, default=3, help="busy processes on --contend-rank's core")
    ap.add_argument("--loader-workers", type=int, default=0, help="data-loader worker processes per rank")
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-from", type=int, default=0)
    ap.add_argument("--hang-file", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--flight-recorder", type=int, default=-1, help="entries of torch's Flight Recorder (0: off)")
    a = ap.parse_args()
    if a.flight_recorder >= 0:   # read when the first process group is created
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(a.flight_recorder)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    if a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    steps_done = [0]
    if rank == a.layer_delay_rank:
        # FSDP2: between the first layer's forward and the second's all-gather (its pre-forward hook)
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        linears[1].register_forward_pre_hook(
            lambda *_: between_layers(a.layer_delay_ms) if steps_done[0] >= a.fault_from else None, prepend=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    data = TensorDataset(torch.randn(a.steps * 32, 64, generator=g), torch.randn(a.steps * 32, 8, generator=g))
    loader = DataLoader(data, batch_size=32, num_workers=a.loader_workers)
    hogs: list[subprocess.Popen] = []
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        if rank == a.contend_rank and step == a.fault_from:
            hogs = contend(a.contend_procs)
        if rank == a.loader_rank and step >= a.fault_from:
            load_batch(a.loader_ms)
        out = model(x)
        if rank == a.slow_rank and step >= a.fault_from:
            slow_forward(a.slow_ms)
        loss = nn.functional.mse_loss(out, y)
        time.sleep(0.02)  # a steady step (~30 ms) on a shared 2-core host
        if rank == a.hang_rank and step >= a.hang_from:
            if a.hang_file:
                with open(a.hang_file, "w") as f:
                    f.write(str(time.time()))
            time.sleep(3600)
        if rank == a.late_rank and step >= a.late_from and (step - a.late_from) % a.late_every == 0:
            late_start(a.late_s)
        loss.backward()
        if a.mode == "plain":
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([t.reshape(-1) for t in grads])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for t in grads:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
        opt.step()
        steps_done[0] += 1
    if a.out:
        h = hashlib.sha256()
        for p in model.parameters():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t      # FSDP2: a DTensor shard (collective)
            h.update(t.contiguous().numpy().tobytes())
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"params": h.hexdigest(), "loss": loss.item()}, f)
    dist.barrier()
    dist.destroy_process_group()
    for hog in hogs:
        hog.kill()
    return 0


if __name__ == "__main__":
    from clean_exit import skip_teardown   # beside this script (torchrun puts its folder first)

    raise SystemExit(skip_teardown(main()))
