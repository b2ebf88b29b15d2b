"""A small real training job for the collector's tests and benchmark (PyTorch CPU, gloo).

    torchrun --standalone --nproc-per-node 4 tests/support/train_small.py --steps 30 --out result.json

A tiny transformer language model on synthetic tokens, a ``DataLoader``, a
loss function module, ``loss.backward()``, one ``dist.all_reduce`` of the
flattened gradients and ``optimizer.step()`` per step: the call sites the
collector hooks, in the order real training code has them. Nothing in it
knows about trainscope. Deterministic for a given seed: rank 0 writes the
final loss and a hash of the parameters, so runs with and without the
collector can be compared bit for bit.

``--slow-rank R --slow-s S`` sleeps S seconds in rank R's data loading (a
fail-slow host, e.g. a slow disk); ``--times FILE`` writes every rank's step
end times (perf_counter) for step-time comparisons; ``--loader-times FILE`` writes
the seconds each of its steps waited for its batch (the job's own measure of a
slow data loader); ``--progress FILE`` gets a
line per step from rank 0 (so a test can act mid-run).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Tokens(Dataset):
    """Deterministic random token sequences; the target is the next token."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i):
        row = self.data[i]
        return row[:-1], row[1:]


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


class SlowCollate:
    """Default collation plus a sleep: a rank whose input pipeline is slow."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        return torch.utils.data.default_collate(batch)


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-s", type=float, default=0.0)
    ap.add_argument("--out", help="rank 0 writes {loss, hash, steps} here")
    ap.add_argument("--times", help="each rank writes its step end times to FILE.<rank>")
    ap.add_argument("--loader-times", help="each rank writes the seconds each step waited for its batch to FILE.<rank>")
    ap.add_argument("--progress", help="rank 0 appends a line per finished step here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    data = Tokens(args.steps * args.batch, args.seq, args.vocab, seed=args.seed + rank)
    collate = SlowCollate(args.slow_s) if rank == args.slow_rank and args.slow_s > 0 else None
    loader = DataLoader(data, batch_size=args.batch, shuffle=False, collate_fn=collate)
    params = [p for p in model.parameters()]

    times, waits, loss = [], [], torch.zeros(())
    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x).reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        opt.step()
        times.append(time.perf_counter())
        if args.progress and rank == 0:
            with open(args.progress, "a") as f:
                f.write(f"{len(times)}\n")

    final = loss.detach().clone()
    dist.all_reduce(final)
    if args.times:
        with open(f"{args.times}.{rank}", "w") as f:
            json.dump(times, f)
    if args.loader_times:
        with open(f"{args.loader_times}.{rank}", "w") as f:
            json.dump(waits, f)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"loss": float(final) / world, "hash": params_hash(model), "steps": len(times),
                       "world": world, "pid": os.getpid()}, f)
    dist.barrier()  # every rank is done with gloo before any tears it down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from clean_exit import skip_teardown   # beside this script (torchrun puts its folder first)

    raise SystemExit(skip_teardown(main()))
