"""A 2-rank gloo job for the FSDP and Flight Recorder tests (PyTorch CPU), one rank per process.

    TORCH_FR_BUFFER_SIZE=2000 python tests/support/train_fsdp_fr.py RANK WORLD OUT_DIR

Both ranks run the collector's torch hooks (``TorchHooks``) with an exporter
that keeps the collective batches in memory (the same records ``trainscope run``
ships), then:

1. FSDP2 (``fully_shard`` on each ``Linear`` and the root) of a tiny MLP, 3
   training steps; the collective records go to ``OUT/records-RANK.json``.
2. A hang of seconds: rank 0 enters an all-reduce (async) that rank 1 has not
   entered; rank 0 dumps its Flight Recorder (pickle ``fr-RANK.pkl`` and JSON
   ``fr-RANK.json``, torch's own in-process dump functions) while it is in
   flight and takes ``flight_recorder.snapshot()``, writes ``entered-0``;
   rank 1 waits for that file, dumps its recorder (it never entered the
   collective yet), then enters it and both finish.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainscope.collector import flight_recorder
from trainscope.collector.collective_log import CollectiveLogConfig
from trainscope.collector.torch_hooks import TorchHooks, TorchHooksConfig


class Exporter:
    def __init__(self) -> None:
        self.batches = []

    def submit(self, payload, nbytes, resource=None) -> bool:
        self.batches.append(payload() if callable(payload) else payload)
        return True


class Collector:
    def __init__(self) -> None:
        self.exporter, self.resource = Exporter(), None

    def record_phase(self, *a, **k) -> None: ...

    def iteration(self, *a, **k) -> None: ...


def records(exp: Exporter) -> list:
    return [[b.groups[r.group].id, list(b.groups[r.group].members), r.seq, r.op, r.bytes, r.dtype, r.end_ns > 0]
            for b in exp.batches for r in b.records]


def wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.02)


def main() -> int:
    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    c = Collector()
    hooks = TorchHooks(c, TorchHooksConfig(collective_log=CollectiveLogConfig(interval_s=60))).install()
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    hooks.collective_log.ship()
    (out / f"records-{rank}.json").write_text(json.dumps(records(c.exporter)))

    from torch._C import _distributed_c10d as c10d_C
    t = torch.ones(256)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        time.sleep(0.2)
        (out / f"fr-{rank}.pkl").write_bytes(c10d_C._dump_fr_trace())
        (out / f"fr-{rank}.json").write_bytes(c10d_C._dump_fr_trace_json())
        snap = flight_recorder.snapshot()
        if snap is not None:
            batch, counts = flight_recorder.to_batch(*snap)
            (out / "snapshot-0.json").write_text(json.dumps({
                "counts": counts, "records": [[batch.groups[r.group].id, list(batch.groups[r.group].members),
                                               r.seq, r.op, r.end_ns] for r in batch.records]}))
        (out / "entered-0").write_text("1")
        work.wait()
    else:
        wait_for(out / "entered-0")
        (out / f"fr-{rank}.pkl").write_bytes(c10d_C._dump_fr_trace())
        (out / f"fr-{rank}.json").write_bytes(c10d_C._dump_fr_trace_json())
        dist.all_reduce(t)
    assert t[0].item() == world
    dist.barrier()
    dist.destroy_process_group()
    hooks.uninstall()
    return 0


if __name__ == "__main__":
    from clean_exit import skip_teardown   # beside this script (torchrun puts its folder first)

    sys.exit(skip_teardown(main()))
