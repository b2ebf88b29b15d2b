"""A small real gloo job with two kinds of process groups (PyTorch CPU): tensor-parallel pairs and data-parallel pairs.

    torchrun --standalone --nproc-per-node 4 tests/support/train_groups.py --steps 80

Ranks (0, 1) and (2, 3) are tensor-parallel pairs: inside the forward each
rank all-reduces its half of the hidden activations with its partner (as a
row-parallel layer does). Ranks (0, 2) and (1, 3) are data-parallel pairs:
after backward each all-reduces its gradients with its DP peer. Faults, on one
rank from ``--fault-from`` on:

* ``--slow-rank R --slow-ms M``: M ms of extra busy work in R's forward, before
  its TP all-reduce (its partner waits there; its DP peer waits for the pair);
* ``--late-rank R --late-ms M``: R sleeps M ms after backward, before its DP
  all-reduce (a host-side delay); with ``--late-every K`` only every K-th step
  (an intermittent stall);
* ``--loader-rank R --loader-ms M``: R waits M ms for each batch (a slow data
  loader) before its forward;
* ``--contend-rank R``: R shares one core with ``--contend-procs`` busy
  processes (host contention);
* ``--hang-rank R``: R stops before backward from step ``--fault-from`` on
  (its TP partner and DP peer wait in their collectives); ``--hang-file F``
  gets the wall time (seconds) at which it stopped.

``--loader-workers N`` loads batches in N worker processes per rank (a healthy
job whose workers share the host).

Nothing here knows trainscope.
"""
from __future__ import annotations

import argparse
import subprocess
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from train_collectives import contend, late_start, load_batch, slow_forward   # beside this script: torchrun puts its folder first


class TPAllReduce(torch.autograd.Function):
    """Sum of the pair's partial activations (row-parallel layer), identity gradient."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-ms", type=float, default=0.0)
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-ms", type=float, default=0.0)
    ap.add_argument("--late-every", type=int, default=1, help="late only every N-th step from --fault-from")
    ap.add_argument("--loader-rank", type=int, default=-1)
    ap.add_argument("--loader-ms", type=float, default=0.0)
    ap.add_argument("--contend-rank", type=int, default=-1)
    ap.add_argument("--contend-procs", type=int, default=3)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-file", default="")
    ap.add_argument("--loader-workers", type=int, default=0)
    ap.add_argument("--fault-from", type=int, default=10)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "four ranks: two TP pairs x two DP pairs"
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tp_groups[rank // 2], dp_groups[rank % 2]
    torch.manual_seed(rank % 2)          # TP shards differ, DP replicas match
    first = nn.Linear(64, 128)
    second = nn.Linear(128, 8)
    params = list(first.parameters()) + list(second.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(100 + rank // 2)
    data = TensorDataset(torch.randn(a.steps * 32, 64, generator=g), torch.randn(a.steps * 32, 8, generator=g))
    hogs: list[subprocess.Popen] = []
    loader = DataLoader(data, batch_size=32, num_workers=a.loader_workers)
    for step, (x, y) in enumerate(loader):   # the iterations: batch .. optimizer step
        faulty = step >= a.fault_from
        opt.zero_grad()
        if rank == a.contend_rank and step == a.fault_from:
            hogs = contend(a.contend_procs)
        if rank == a.loader_rank and faulty:
            load_batch(a.loader_ms)
        h = torch.relu(first(x))
        if rank == a.slow_rank and faulty:
            slow_forward(a.slow_ms)
        out = TPAllReduce.apply(second(h), tp)
        loss = nn.functional.mse_loss(out, y)
        time.sleep(0.02)  # a steady step on a shared 2-core host
        if rank == a.hang_rank and faulty:
            if a.hang_file:
                with open(a.hang_file, "w") as f:
                    f.write(str(time.time()))
            time.sleep(3600)
        loss.backward()
        if rank == a.late_rank and faulty and (step - a.fault_from) % a.late_every == 0:
            late_start(a.late_ms / 1e3)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=dp)
        flat /= 2
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
    for hog in hogs:
        hog.kill()
    return 0


if __name__ == "__main__":
    from clean_exit import skip_teardown   # beside this script (torchrun puts its folder first)

    raise SystemExit(skip_teardown(main()))
