"""Deep-dive window overhead on a real training step (issue #14; prints figures, asserts nothing).

    python tests/benchmarks/bench_deep_dive.py [--rounds 6] [--window 5] [--dim 96]

The step is tests/support/train_small.py's model (a small transformer LM, a
DataLoader, loss, backward, AdamW) in this process, one intra-op thread, no
process group. A real ``collector.deep_dive.DeepDiveWindow`` with the real
``torch.profiler`` (CPU activity, ``with_stack`` on, then off) is driven at the
data loader boundary exactly as the torch hooks drive it. Per round:

1. ``--window`` steps outside any window (the baseline of this round), then a
   command armed for the next iteration and ``--window`` steps inside the
   window, then the step during which it closes (profiler stop on the training
   thread, the trace written by the writer thread beside training), then
   ``--window`` steps after it.
2. Reported, medians over rounds: step time outside, inside (ratio to outside),
   the closing step's extra time (ms), the profiler stop on the training thread
   (ms), the trace's bytes per window and per iteration, and the columnar summary's
   bytes and parse time (made by the processor, timed here after the rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--dim", type=int, default=96)
    a = ap.parse_args()

    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from train_small import TinyLM, Tokens
    from trainscope.collector.deep_dive import DeepDiveWindow
    from trainscope.processor.control import summarize_trace
    from trainscope.proto.model import Resource
    from trainscope.proto.v1 import control_pb2

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(vocab=256, dim=a.dim, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_round = 3 * a.window + 1
    data = Tokens(n=16 * (steps_per_round * a.rounds + 10) * 2, seq=32, vocab=256, seed=1)
    batches = iter(DataLoader(data, batch_size=16))

    def step(window, it):
        t = time.perf_counter()
        window.before_batch(it)
        x, y = next(batches)
        opt.zero_grad()
        out = model(x)
        loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        return time.perf_counter() - t

    root = tempfile.mkdtemp(prefix="bench-deep-dive-")
    for with_stack in (True, False):
        reports = []
        w = DeepDiveWindow(root, Resource(job_id="bench", rank=0, world_size=1).to_pb(), reports.append)
        it = 0
        for _ in range(3):  # warm-up: allocator, first profiler start
            step(w, it)
            it += 1
        outside, inside, closing, after = [], [], [], []
        for r in range(a.rounds):
            o = [step(w, it + k) for k in range(a.window)]
            it += a.window
            w.arm(control_pb2.DeepDiveCommand(dive_id=f"s{int(with_stack)}r{r}", job_id="bench", start_iteration=it,
                                              iterations=a.window, with_stack=with_stack, max_bytes=1 << 30))
            i = [step(w, it + k) for k in range(a.window)]
            it += a.window
            c = step(w, it)          # the window closes before this step's batch
            it += 1
            af = [step(w, it + k) for k in range(a.window)]
            it += a.window
            w.wait_written(30)
            outside.append(statistics.median(o))
            inside.append(statistics.median(i))
            closing.append(c - statistics.median(o))
            after.append(statistics.median(af))
        done = [x for x in reports if x.trace_path]
        med = statistics.median
        out_s, in_s = med(outside), med(inside)
        tb = med([x.trace_bytes for x in done]) if done else 0
        t = time.perf_counter()
        sums = [json.dumps(summarize_trace(x.trace_path)) for x in done]   # what the processor does, timed here
        sum_s = (time.perf_counter() - t) / max(len(done), 1)
        sb = med([len(x) for x in sums]) if sums else 0
        stop_ms = med([x.profiler_stop_s for x in done]) * 1e3 if done else float("nan")
        print(f"with_stack={with_stack}: {len(done)}/{a.rounds} windows of {a.window} iterations written")
        print(f"  step outside a window   {out_s * 1e3:8.1f} ms (median of round medians)")
        print(f"  step inside a window    {in_s * 1e3:8.1f} ms  = {in_s / out_s:5.2f}x outside")
        print(f"  step after a window     {med(after) * 1e3:8.1f} ms  = {med(after) / out_s:5.2f}x outside")
        print(f"  closing step, extra     {med(closing) * 1e3:8.1f} ms (profiler stop {stop_ms:.1f} ms on the "
              f"training thread; the write runs beside training)")
        print(f"  trace                   {tb / 1e6:8.2f} MB per window, {tb / a.window / 1e3:.0f} kB per iteration; "
              f"summary {sb / 1e3:.0f} kB\n"
              f"  summary (by the processor, out of the training process) {sum_s * 1e3:.0f} ms per trace")
    print(f"traces left in {root} (delete it when done)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
