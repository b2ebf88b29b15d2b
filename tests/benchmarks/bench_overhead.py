"""Collector overhead on a real training step: trainscope on vs off vs torch.profiler (prints figures).

    python tests/benchmarks/bench_overhead.py [--rounds 20] [--steps 15] [--dim 96] [--long-s 120]

The job is tests/support/train_small.py's (a small transformer LM, DataLoader,
loss module, backward, gloo all-reduce of the gradients, AdamW) as one rank
(a world of 1) on one intra-op thread. A processor runs in its own process.

1. Direct comparison, same process, same run: rounds of three blocks whose
   order rotates (drift cancels):
     off          no instrumentation (hooks uninstalled)
     trainscope   the automatic torch hooks (data loader, forward, backward,
                  all-reduce, optimizer, iteration detection) and the collector
                  exporting to the processor
     profiler     torch.profiler with CPU activities on for the whole block
                  (always on; its exit processing is timed apart)
   Per round, the ratio to ``off`` of the median step time, of the 10th
   percentile (interference only adds time: the steadier estimate on a shared
   host) and of the median process CPU time; reported: median over rounds
   and a bootstrap 95% interval.
2. Per-step cost of the instrumentation in microseconds, on the same loop
   with a 4x4 model (steps of ~0.5 ms, so microseconds are measurable),
   and what it is as a share of the real job's step.
3. The CPU operator source works in windows (0.05 s every 30 s by default),
   too rare to land in short blocks: its cost is measured per window (extra
   training time while a window runs and is read) and amortised.
4. Collector RSS over a long run with everything on (hooks, exporter, CPU
   windows every 5 s, the py-spy sidecar) in a fresh process: it must stay flat.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from train_small import TinyLM, Tokens  # noqa: E402

from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource  # noqa: E402
from trainscope.collector.exporter_config import ExporterConfig  # noqa: E402
from trainscope.collector.exporter_socket import reachable  # noqa: E402
from trainscope.collector.sdk import Collector, CollectorConfig  # noqa: E402
from trainscope.collector.torch_hooks import TorchHooks  # noqa: E402


class Job:
    """train_small.py's loop, one block of steps at a time; each step's wall and CPU seconds."""

    def __init__(self, dim: int, layers: int, seq: int, batch: int, vocab: int, steps: int) -> None:
        torch.manual_seed(0)
        self.vocab = vocab
        self.model = TinyLM(vocab, dim, layers) if dim > 4 else torch.nn.Sequential(
            torch.nn.Embedding(vocab, 4), torch.nn.Linear(4, vocab))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.params = list(self.model.parameters())
        self.loader = torch.utils.data.DataLoader(Tokens(steps * batch, seq, vocab, seed=0), batch_size=batch)

    def block(self) -> tuple[list[float], list[float]]:
        wall, cpu = [], []
        t, c = time.perf_counter(), time.process_time()
        for x, y in self.loader:
            self.opt.zero_grad(set_to_none=False)
            loss = self.loss_fn(self.model(x).reshape(-1, self.vocab), y.reshape(-1))
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat)
            off = 0
            for p in self.params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            self.opt.step()
            t1, c1 = time.perf_counter(), time.process_time()
            wall.append(t1 - t)
            cpu.append(c1 - c)
            t, c = t1, c1
        return wall[2:], cpu[2:]  # a block's first steps pay for the iterator and the hooks' learning


def run_mode(job: Job, mode: str, col, prof_exit: list) -> tuple[list[float], list[float]]:
    if mode == "trainscope":
        hooks = TorchHooks(col).install()
        try:
            return job.block()
        finally:
            hooks.uninstall()
    if mode == "profiler":
        p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        p.__enter__()
        out = job.block()
        t0 = time.perf_counter()
        p.__exit__(None, None, None)
        prof_exit.append(time.perf_counter() - t0)
        return out
    return job.block()


def compare(job: Job, col, rounds: int, modes: list[str]) -> tuple[dict, dict, list]:
    """Per mode: all step times, and per-round ratios to ``off`` of the median wall time, of the
    10th-percentile wall time (interference from other processes only adds time, so a low
    percentile is the steadier estimate on a shared host) and of the median CPU time."""
    steps = {m: [] for m in modes}
    ratios = {m: {"median": [], "p10": [], "cpu": []} for m in modes}
    prof_exit: list[float] = []
    for r in range(rounds):
        stat = {}
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            w, c = run_mode(job, m, col, prof_exit)
            steps[m] += w
            stat[m] = (statistics.median(w), sorted(w)[len(w) // 10], statistics.median(c))
        for m in modes:
            for i, key in enumerate(("median", "p10", "cpu")):
                ratios[m][key].append(stat[m][i] / stat["off"][i])
    return steps, ratios, prof_exit


def ci(xs: list[float], n: int = 2000) -> tuple[float, float, float]:
    """Median and bootstrap 95% interval of the median."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n)]


def window_cost(job: Job, col, n_windows: int) -> tuple[float, int]:
    """Extra training seconds per CPU-operator window (recording + reading it), events per window.

    The source runs as in a job: windows open and close at optimizer steps on
    the training thread and a reader thread turns them into records; a window
    counts from its opening until its records are handed on.
    """
    src = CpuOpSource(CpuOpConfig(period_s=1.0, first_after_s=1.0))
    offset = time.time() - time.perf_counter()
    spans = []

    def emit(cols):
        col.record_kernels(cols)
        spans.append((src.last_window[0] / 1e9 - offset, time.time() - offset))

    src.start(emit)
    ends = []
    deadline = time.monotonic() + 60 + 3 * n_windows
    while len(spans) < n_windows and time.monotonic() < deadline:
        t = time.perf_counter()
        for d in job.block()[0]:
            ends.append((t, t + d))
            t += d
    src.stop()
    base = statistics.median(b - a for a, b in ends)
    extra = 0.0
    for w0, w1 in spans:
        hit = [b - a for a, b in ends if b > w0 and a < w1]
        extra += sum(hit) - base * len(hit)
    return extra / max(1, len(spans)), src.stats["events"] // max(1, src.stats["windows"])


def start_processor(home: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    p = subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", addr,
                          "--home", home], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not reachable(addr):
        if time.monotonic() > deadline or p.poll() is not None:
            raise SystemExit("the processor did not start")
        time.sleep(0.1)
    return p, addr


def rss_child(args) -> int:
    """``--rss-child``: everything on for ``--long-s``; prints one JSON line per block."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    job = Job(args.dim, args.layers, args.seq, args.batch, args.vocab, args.steps)
    col = Collector(CollectorConfig(job_id="bench-rss", exporter=ExporterConfig(target=args.processor),
                                    ship_interval_s=1.0))
    from trainscope.collector.stacks import write_rank_file
    write_rank_file(args.run_dir, col.resource)
    hooks = TorchHooks(col).install()
    src = CpuOpSource(CpuOpConfig(period_s=5, first_after_s=1))  # windows at optimizer steps
    col.add_kernel_source(src)
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < args.long_s:
        n += len(job.block()[0]) + 2
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        print(json.dumps({"t": time.monotonic() - t0, "rss_mb": rss, "steps": n}), flush=True)
    src.stop()
    hooks.uninstall()
    st = col.stats()
    col.shutdown(5)
    print(json.dumps({"done": True, "submitted": st["submitted"], "dropped": st["dropped_total"],
                      "cpu_source": dict(src.stats)}), flush=True)
    dist.destroy_process_group()
    return 0


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process and of the children it has reaped (/proc/PID/stat fields 14-17)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def slope_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return 60 * sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--windows", type=int, default=5, help="CPU-operator windows to time")
    ap.add_argument("--long-s", type=float, default=120.0, help="length of the RSS run (0: skip)")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--processor", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(args)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    home = tempfile.mkdtemp(prefix="bench-overhead-")
    proc, addr = start_processor(home)
    # as launch configures it in a rank: phases and marks handed to the exporter at most once a second
    col = Collector(CollectorConfig(job_id="bench", exporter=ExporterConfig(target=addr), ship_interval_s=1.0))
    try:
        job = Job(args.dim, args.layers, args.seq, args.batch, args.vocab, args.steps)
        job.block()
        print(f"job: TinyLM dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}; "
              f"torch {torch.__version__}, 1 intra-op thread, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        print(f"\n1. same process, {args.rounds} rounds x {args.steps} steps per mode (order rotates)")
        modes = ["off", "trainscope", "profiler"]
        steps, ratios, prof_exit = compare(job, col, args.rounds, modes)
        print(f"   {'mode':<11} {'median ms':>9} {'p10-p90 ms':>13}   ratios to off, median over rounds [95% CI]:")
        print(f"   {'':<11} {'':>9} {'':>13}   {'median step':<24} {'p10 step':<24} {'CPU time':<24}")
        for m in modes:
            s = sorted(steps[m])
            cells = " ".join(f"{c[0]:.4f} [{c[1]:.4f}, {c[2]:.4f}]" for c in (ci(ratios[m][k]) for k in ("median", "p10", "cpu")))
            print(f"   {m:<11} {1e3 * statistics.median(s):>9.2f} {1e3 * s[len(s) // 10]:>6.2f}-{1e3 * s[9 * len(s) // 10]:<6.2f}   {cells}")
        print(f"   profiler exit (processing its events) after a {args.steps}-step block: "
              f"{1e3 * statistics.median(prof_exit):.0f} ms")
        step_s = statistics.median(steps["off"])

        print("\n2. per-step cost of the instrumentation (same loop, 4x4 model: steps of well under 1 ms)")
        tiny = Job(4, 1, 8, 1, 16, 200)
        tiny.block()
        t_steps, _, _ = compare(tiny, col, max(6, args.rounds // 2), ["off", "trainscope"])
        cost = statistics.median(t_steps["trainscope"]) - statistics.median(t_steps["off"])
        print(f"   off {1e6 * statistics.median(t_steps['off']):.1f} us/step, trainscope "
              f"{1e6 * statistics.median(t_steps['trainscope']):.1f} us/step: {1e6 * cost:.1f} us per step "
              f"= {100 * cost / step_s:.3f}% of the real job's {1e3 * step_s:.1f} ms step")

        hooks = TorchHooks(col).install()
        per_window, events = window_cost(job, col, args.windows)
        hooks.uninstall()
        d = CpuOpConfig()
        amort = per_window / d.period_s
        print(f"\n3. CPU operator source: {1e3 * per_window:.1f} ms of training time per {d.window_s:.2f} s window "
              f"(~{events} operator events); one window every {d.period_s:.0f} s: {100 * amort:.3f}%")
        print(f"\nheadline: trainscope overhead {100 * (cost / step_s + amort):.2f}% of step time "
              f"(per-step cost + amortised windows; target <= 1%); direct ratios (median / p10 step): "
              f"trainscope {ci(ratios['trainscope']['median'])[0]:.4f} / {ci(ratios['trainscope']['p10'])[0]:.4f}, "
              f"torch.profiler always on {ci(ratios['profiler']['median'])[0]:.4f} / "
              f"{ci(ratios['profiler']['p10'])[0]:.4f}")

        if args.long_s > 0:
            run_dir = os.path.join(home, "run")
            child = subprocess.Popen([sys.executable, __file__, "--rss-child", "--processor", addr, "--run-dir", run_dir,
                                      "--long-s", str(args.long_s), "--steps", str(args.steps), "--dim", str(args.dim),
                                      "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch),
                                      "--vocab", str(args.vocab)], stdout=subprocess.PIPE, text=True)
            time.sleep(1.0)
            car = subprocess.Popen([sys.executable, "-m", "trainscope.collector.stacks", "--run-dir", run_dir,
                                    "--processor", addr, "--window-s", "5"], stdout=subprocess.DEVNULL)
            rows = [json.loads(line) for line in child.stdout]
            child.wait()
            car_cpu = proc_cpu_s(car.pid)
            car.terminate()
            car.wait(15)
            pts = [(r["t"], r["rss_mb"]) for r in rows if "rss_mb" in r]
            done = rows[-1] if rows and rows[-1].get("done") else {}
            late = [p for p in pts if p[0] > args.long_s / 4]
            print(f"\n4. RSS over {args.long_s:.0f} s, everything on, {pts[-1][0]:.0f} s / {rows[-2]['steps']} steps:"
                  f" {pts[0][1]:.1f} MB after the first block, {max(p[1] for p in pts):.1f} MB max, "
                  f"{pts[-1][1]:.1f} MB at the end; slope after the first quarter "
                  f"{slope_per_min(late):+.3f} MB/min")
            print(f"   collector: {done.get('submitted')} batches submitted, {done.get('dropped')} dropped; "
                  f"CPU windows: {done.get('cpu_source')}; stack sidecar + its py-spy runs: "
                  f"{car_cpu:.1f} CPU s in {args.long_s:.0f} s ({100 * car_cpu / args.long_s:.1f}% of a core)")
    finally:
        col.shutdown(5)
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(home, ignore_errors=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
