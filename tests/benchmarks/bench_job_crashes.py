"""Does trainscope crash the job it watches? Crash counts of a real 4-rank gloo job per mode (prints figures).

    python tests/benchmarks/bench_job_crashes.py [--runs 20] [--steps 20] [--modes plain,hooks,sampler]
    python tests/benchmarks/bench_job_crashes.py --stress-runs 5 --runs 0     # the mechanisms only (~2 min)

Part 1 (``--runs`` per mode, 0 skips it). The job is tests/support/train_small.py under torchrun (4 ranks, CPU, gloo,
127.0.0.1), as tests/integration/test_torch_job.py runs it. Modes:

  plain     torchrun alone, no trainscope (the reference crash rate of torch)
  hooks     ``trainscope run``: torch hooks, exporter to a live processor,
            py-spy sidecar; the CPU-operator sampler off (TRAINSCOPE_CPU_OPS=0)
  sampler   the same plus the sampler at the integration test's aggressive
            setting (period_s=0.5, window_s=0.05, first_after_s=0)
  sampler-only  the sampler without the torch hooks (TRAINSCOPE_HOOKS=0)

1. Start one ``trainscope processor`` (a child process, 127.0.0.1, a fresh
   home in a temporary directory) for every trainscope run.
2. Run the modes in rounds, one job at a time, the order rotating per round so
   load from other work on the host falls on every mode alike.
3. Classify each run: ok (rc 0), else by the first signature found in its
   output (heap corruption messages, ``terminate called ...``, the signal
   torchrun reports as ``exitcode: -N``, a timeout).
4. Print per mode: runs, ok, failures by signature, median wall time (s); the
   output of every failed run is kept under a fresh directory (printed).

Part 2 (``--stress-runs`` per mechanism): job-level crashes are rare (the
windows are 1/10 of the time at the aggressive setting), so each mechanism
also runs in a one-process stress loop: train_small.py's model and AdamW on
the main thread, every step inside a ``record_function`` scope (as user code
often has), windows of 10 ms every 30 ms for ``--stress-s`` seconds:

  kineto-side-thread   the sampler before the fix (a faithful copy): Kineto,
                       CPU activity, ``profile_all_threads``, started and
                       stopped from a daemon thread
  kineto-steps         thread-local Kineto opened and closed on the training
                       thread at step boundaries, windows back to back (an
                       operator, the step scope, opened in one window ends in
                       the next)
  source               the shipped CpuOpSource (push/pop profiler on the
                       training thread), also closing/opening mid-step inside
                       the open scope
Each child's exit is classified as in part 1 (negative return codes are signals).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
TRAIN = ROOT / "tests" / "support" / "train_small.py"

from support.ports import free_port  # noqa: E402

AGGRESSIVE = "period_s=0.5,window_s=0.05,first_after_s=0"
MODES = ("plain", "hooks", "sampler", "sampler-only")

#: First match wins: the most specific evidence of how a rank died.
SIGNATURES = (
    ("heap corruption", re.compile(r"malloc\(\)|free\(\)|double free|corrupted (size|double-linked|top|unsorted)"
                                   r"|unsorted double linked list")),
    ("terminate (std::terminate)", re.compile(r"terminate called")),
    ("SIGSEGV", re.compile(r"exitcode\s*:\s*-11\b|Segmentation fault|Fatal Python error: Segmentation")),
    ("SIGABRT", re.compile(r"exitcode\s*:\s*-6\b|Aborted")),
    ("other signal", re.compile(r"exitcode\s*:\s*-\d+")),
)


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}


def torchrun(steps: int, world: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            str(TRAIN), "--steps", str(steps), "--out", str(out)]


def command(mode: str, processor: str, work: Path, steps: int, world: int) -> list[str]:
    job = torchrun(steps, world, work / "result.json")
    if mode == "plain":
        return job
    extra = {"hooks": ["TRAINSCOPE_CPU_OPS=0"], "sampler": [f"TRAINSCOPE_CPU_OPS={AGGRESSIVE}"],
             "sampler-only": [f"TRAINSCOPE_CPU_OPS={AGGRESSIVE}", "TRAINSCOPE_HOOKS=0"]}[mode]
    sets = [a for e in extra for a in ("--set", e)]
    return [sys.executable, "-m", "trainscope.deploy.cli", "run", "--processor", processor, "--no-processor",
            "--stacks-window-s", "1", "--run-dir", str(work / "run"), "--job-id", f"crash-{mode}", *sets,
            "--", *job]


def classify(rc: int | None, out: str) -> str:
    if rc == 0:
        return "ok"
    if rc is None:
        return "timeout"
    for name, pattern in SIGNATURES:
        if pattern.search(out):
            return name
    return f"rc {rc}"


def start_processor(home: Path) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", addr,
                             "--home", str(home)], env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    from trainscope.collector.exporter_socket import reachable
    deadline = time.monotonic() + 30
    while not reachable(addr):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("bench_job_crashes: the processor did not start")
        time.sleep(0.1)
    return proc, addr


STRESS = ("kineto-side-thread", "kineto-steps", "source")


def stress_child(mechanism: str, seconds: float) -> int:
    """One mechanism under stress in this process; prints steps and windows; a crash kills the process."""
    import threading

    import torch
    from torch import autograd, nn
    from torch._C import _profiler as P

    sys.path.insert(0, str(TRAIN.parent))
    from train_small import TinyLM

    torch.set_num_threads(1)
    model = TinyLM(64, 32, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    windows, stop = [0], threading.Event()

    def kineto(all_threads: bool):
        cfg = autograd.ProfilerConfig(autograd.ProfilerState.KINETO, False, False, False, False, False,
                                      P._ExperimentalConfig(profile_all_threads=all_threads))
        return cfg, {autograd.ProfilerActivity.CPU}

    def kineto_window_from_side_thread():  # the removed CpuOpSource.window(), on its daemon thread
        while not stop.wait(0.02):
            cfg, acts = kineto(True)
            autograd._prepare_profiler(cfg, acts)
            autograd._enable_profiler(cfg, acts)
            stop.wait(0.01)
            ev = autograd._disable_profiler().events()
            [(e.name(), e.start_ns(), e.duration_ns(), e.start_thread_id()) for e in ev]
            windows[0] += 1

    src = None
    if mechanism == "kineto-side-thread":
        threading.Thread(target=kineto_window_from_side_thread, daemon=True).start()
    elif mechanism == "source":
        from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource
        src = CpuOpSource(CpuOpConfig(period_s=0.03, window_s=0.01, min_window_s=0.001, first_after_s=0))
        src.start(lambda cols: None)
    t_end, steps, kineto_open = time.monotonic() + seconds, 0, False
    while time.monotonic() < t_end:
        with autograd.profiler.record_function("train_step"):
            opt.zero_grad()
            loss_fn(model(x).reshape(-1, 64), y.reshape(-1)).backward()
            if src is not None:
                src.safe_point()  # a mid-step boundary too: windows close/open inside the open scope
            opt.step()  # the source's own hook runs here
            if mechanism == "kineto-steps":
                if kineto_open:
                    autograd._disable_profiler().events()
                    windows[0] += 1
                cfg, acts = kineto(False)
                autograd._prepare_profiler(cfg, acts)
                autograd._enable_profiler(cfg, acts)
                kineto_open = True
        steps += 1
    stop.set()
    if kineto_open:
        autograd._disable_profiler()
    if src is not None:
        src.stop()
        windows[0] = src.stats["windows"]
    print(f"stress {mechanism}: {steps} steps, {windows[0]} windows", flush=True)
    return 0


def run_stress(runs: int, seconds: float, keep: Path, mechanisms: list[str]) -> None:
    counts: dict[str, collections.Counter] = {m: collections.Counter() for m in mechanisms}
    for i in range(runs):
        for j in range(len(mechanisms)):
            mech = mechanisms[(i + j) % len(mechanisms)]
            try:
                p = subprocess.run([sys.executable, __file__, "--stress-child", mech, "--stress-s", str(seconds)],
                                   env=clean_env(), capture_output=True, text=True, timeout=seconds + 120)
                rc, out = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired:
                rc, out = None, ""
            kind = classify(rc, out)
            if kind.startswith("rc -"):
                kind = f"signal {-rc}"
            counts[mech][kind] += 1
            if kind != "ok":
                (keep / f"stress-{mech}-{i:03d}.txt").write_text(out)
            print(f"stress {i + 1:>3}/{runs}  {mech:<19} {kind}", flush=True)
    print(f"\nstress: windows of 10 ms every 30 ms, {seconds:.0f} s per run, {runs} runs per mechanism")
    print(f"{'mechanism':<19} {'runs':>5} {'ok':>5} {'crashed':>8}  by signature")
    for mech in mechanisms:
        c = counts[mech]
        bad = sum(n for k, n in c.items() if k != "ok")
        detail = ", ".join(f"{k}: {n}" for k, n in c.most_common() if k != "ok") or "-"
        print(f"{mech:<19} {sum(c.values()):>5} {c['ok']:>5} {bad:>8}  {detail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="runs per mode")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--world", type=int, default=4, help="ranks per job")
    ap.add_argument("--modes", default="plain,hooks,sampler", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="per run")
    ap.add_argument("--stress-runs", type=int, default=0, help="stress runs per mechanism (part 2)")
    ap.add_argument("--stress-s", type=float, default=8.0, help="seconds per stress run")
    ap.add_argument("--mechanisms", default=",".join(STRESS), help="comma-separated, of the stress mechanisms")
    ap.add_argument("--stress-child", choices=STRESS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stress_child:
        return stress_child(args.stress_child, args.stress_s)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    mechanisms = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES] + [m for m in mechanisms if m not in STRESS]
    if bad or not modes or args.runs < 0 or args.stress_runs < 0 or args.steps < 1 or args.world < 1:
        print(f"bench_job_crashes: bad --modes/--mechanisms/--runs/--steps/--world (modes: {', '.join(MODES)}; "
              f"mechanisms: {', '.join(STRESS)})", file=sys.stderr)
        return 2
    keep = Path(tempfile.mkdtemp(prefix="trainscope-crashes-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processor on the way out
    if args.stress_runs:
        run_stress(args.stress_runs, args.stress_s, keep, mechanisms)
    if args.runs:
        run_jobs(args, modes, keep)
    return 0


def run_jobs(args, modes: list[str], keep: Path) -> None:
    proc, addr = start_processor(keep / "processor-home")
    results: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    t_start = time.monotonic()
    try:
        for i in range(args.runs):
            for j in range(len(modes)):
                mode = modes[(i + j) % len(modes)]
                work = keep / f"{mode}-{i:03d}"
                work.mkdir()
                t0 = time.monotonic()
                try:
                    p = subprocess.run(command(mode, addr, work, args.steps, args.world), env=clean_env(),
                                       capture_output=True, text=True, timeout=args.timeout_s)
                    rc, out = p.returncode, p.stdout + p.stderr
                except subprocess.TimeoutExpired as e:
                    rc, out = None, f"{e.stdout or ''}{e.stderr or ''}"
                    out = out.decode(errors="replace") if isinstance(out, bytes) else out
                seconds = time.monotonic() - t0
                kind = classify(rc, out)
                results[mode].append((kind, seconds))
                if kind != "ok":
                    (work / "output.txt").write_text(out)
                print(f"round {i + 1:>3}/{args.runs}  {mode:<13} {kind:<28} {seconds:6.1f} s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\n{args.world} ranks x {args.steps} steps per run, {args.runs} runs per mode, "
          f"{time.monotonic() - t_start:.0f} s in all; failed runs' output under {keep}")
    print(f"{'mode':<13} {'runs':>5} {'ok':>5} {'failed':>7} {'rate':>7} {'median s':>9}  failures by signature")
    for mode in modes:
        rs = results[mode]
        fails = collections.Counter(k for k, _ in rs if k != "ok")
        n_fail = sum(fails.values())
        detail = ", ".join(f"{k}: {n}" for k, n in fails.most_common()) or "-"
        print(f"{mode:<13} {len(rs):>5} {len(rs) - n_fail:>5} {n_fail:>7} {100 * n_fail / max(len(rs), 1):>6.1f}% "
              f"{statistics.median(s for _, s in rs):>8.1f}s  {detail}")


if __name__ == "__main__":
    raise SystemExit(main())
