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
  all-reduce (a host-side delay).

Nothing here knows trainscope.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from train_collectives import late_start, slow_forward   # beside this script: torchrun puts its folder first


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
    for step, (x, y) in enumerate(DataLoader(data, batch_size=32)):   # the iterations: batch .. optimizer step
        opt.zero_grad()
        h = torch.relu(first(x))
        if rank == a.slow_rank and step >= a.fault_from:
            slow_forward(a.slow_ms)
        out = TPAllReduce.apply(second(h), tp)
        loss = nn.functional.mse_loss(out, y)
        time.sleep(0.02)  # a steady step on a shared 2-core host
        loss.backward()
        if rank == a.late_rank and step >= a.fault_from:
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
    return 0


if __name__ == "__main__":
    from clean_exit import skip_teardown   # beside this script (torchrun puts its folder first)

    raise SystemExit(skip_teardown(main()))
