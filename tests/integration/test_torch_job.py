"""A real 4-rank PyTorch job (CPU, gloo, 127.0.0.1) under ``trainscope run``, through a real processor.

Each fixture runs ``tests/support/train_small.py`` on torchrun's ranks (forked after one ``import torch``,
``tests/support/forkrun.py``) once per
module: without trainscope (the reference result), under ``trainscope run``
with a live processor and one rank's data loading slowed on purpose (a sleep
changes no numerics, so the result must still equal the reference), and with
the processor killed mid-run. Nothing in the training script knows trainscope.
Three 4-rank jobs (reference, slow data loader, healthy) and two 2-rank ones (processor killed, pair).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support import forkrun
from support.pipeline import bus_records, start_processor
from support.ports import free_port
from trainscope.processor.windows import WindowConfig

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

TRAIN = Path(__file__).resolve().parents[1] / "support" / "train_small.py"
#: Crash policy, measured with tests/benchmarks/bench_job_crashes.py (4 ranks x 20 steps of
#: train_small.py, one job at a time on the shared 2-core host, 2026-11-24):
#: * torch 2.13's gloo sometimes aborts a rank at exit ("terminate called without an active
#:   exception", std::terminate, SIGABRT, no Python frame) in plain torchrun too: 2 of 23 plain
#:   runs. It happens in interpreter teardown, after the training: train_small.py ends with
#:   os._exit after the at-exit hooks (tests/support/clean_exit.py), and no job is run twice.
#: * No SIGSEGV and no heap corruption in those 23 plain runs. The SIGSEGV and the SIGABRT
#:   "malloc(): unsorted double linked list corrupted" once seen here were the collector's: its
#:   CPU-operator sampler started and stopped Kineto (profile_all_threads) from a daemon thread
#:   while the training thread ran operators. In the bench's stress loop (windows of 10 ms every
#:   30 ms) that mechanism crashed 14 of 19 runs (12 SIGSEGV, 2 SIGABRT with exactly that malloc
#:   message); the fixed sampler (thread-local, opened and closed by the training thread at
#:   optimizer steps) crashed 0 of 19 (18 ran clean; one ended by SIGKILL with no output and no
#:   OOM record, cause unknown, not seen in the 14 runs after it). Whole jobs are too short to show
#:   it often: 0 of 10 with the old sampler, 0 of 12 with the fixed one, 0 of 22 hooks only.
#:   These are not retried any more: a crash other than torch's exit abort fails the test.

WORLD, STEPS = 4, 30
SLOW_RANK, SLOW_S = 2, 0.03
CPU_OPS = "TRAINSCOPE_CPU_OPS=period_s=0.5,window_s=0.05,first_after_s=0"


def torchrun(*args: str, world: int = WORLD) -> list[str]:
    """torchrun's ranks, forked after one ``import torch`` (tests/support/forkrun.py)."""
    return forkrun.command(TRAIN, *args, world=world)


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}


def trainscope_run(processor: str, run_dir: Path, *job_args: str, popen: bool = False, world: int = WORLD):
    cmd = [sys.executable, "-m", "trainscope.deploy.cli", "run", "--processor", processor, "--no-processor",
           "--stacks-window-s", "1", "--run-dir", str(run_dir), "--job-id", "torchjob", "--set", CPU_OPS,
           "--", *torchrun(*job_args, world=world)]
    if popen:
        return subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)


def rank_stats(run_dir: Path) -> dict[int, dict]:
    out = {}
    for f in run_dir.glob("stats-*.json"):
        s = json.loads(f.read_text())
        out[s["resource"]["rank"]] = s
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("baseline") / "result.json"
    p = subprocess.run(torchrun("--steps", str(STEPS), "--out", str(out)),
                       env=clean_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())


def collect(tmp: Path, *job_args: str, world: int = WORLD, steps: int = STEPS) -> dict:
    tmp.mkdir(exist_ok=True)
    proc = start_processor(window=WindowConfig(length_s=5, lateness_s=1))
    try:
        t0 = time.monotonic()
        p = trainscope_run(proc.address, tmp / "run", "--steps", str(steps), "--out", str(tmp / "r.json"),
                           *job_args, world=world)
        seconds = time.monotonic() - t0
        assert p.returncode == 0, p.stdout + p.stderr
        assert proc.drain(30)
        records = {s: bus_records(proc, s) for s in ("iterations", "phases", "stacks", "kernels")}
    finally:
        proc.stop()
    return {"records": records, "result": json.loads((tmp / "r.json").read_text()),
            "stats": rank_stats(tmp / "run"), "output": p.stdout + p.stderr, "seconds": seconds}


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("collected")
    got = collect(tmp, "--slow-rank", str(SLOW_RANK), "--slow-s", str(SLOW_S), "--loader-times", str(tmp / "waits"))
    got["waits"] = {r: json.loads((tmp / f"waits.{r}").read_text()) for r in range(WORLD)}
    return got


def test_every_rank_reports_every_signal_with_its_identity(collected):
    recs = collected["records"]
    for signal_name, windows in recs.items():
        assert {w.resource.rank for w in windows} == set(range(WORLD)), signal_name
        for w in windows:
            r = w.resource
            assert (r.job_id, r.world_size) == ("torchjob", WORLD)
            # pure data parallel: dp coordinate = rank, every other dimension of size 1
            assert (r.coords.dp, r.coords.dp_size, r.coords.tp_size, r.coords.pp_size) == (r.rank, WORLD, 1, 1)
    # iterations: EROICA detection found every optimizer step, numbered 0..STEPS-1 on each rank
    for rank in range(WORLD):
        marks = sorted(m.iteration for w in recs["iterations"] if w.resource.rank == rank for m in w.marks)
        assert marks == list(range(STEPS)), rank
    # phases from the automatic hooks, including the collective named by its group's role
    names = {(w.resource.rank, p.phase) for w in recs["phases"] for p in w.phases}
    for rank in range(WORLD):
        for phase in ("dataloader", "forward", "backward", "optimizer", "dp-allreduce"):
            assert (rank, phase) in names
    # CPU-fallback kernels: leaf ATen operators
    for rank in range(WORLD):
        kernels = {k.kernel for w in recs["kernels"] if w.resource.rank == rank for k in w.kernels}
        assert any(k.startswith("aten::") for k in kernels), kernels
    # stacks from the sidecar: the training script's frames, active and idle samples
    for rank in range(WORLD):
        stacks = [s for w in recs["stacks"] if w.resource.rank == rank for s in w.stacks]
        assert stacks and any("train_small.py" in s.stack for s in stacks)
    assert any(s.idle for w in recs["stacks"] for s in w.stacks)  # e.g. gloo / exporter threads


def test_training_result_is_identical_with_and_without_the_collector(baseline, collected):
    assert collected["result"]["hash"] == baseline["hash"]
    assert collected["result"]["loss"] == baseline["loss"]
    assert collected["result"]["steps"] == STEPS


def test_each_rank_reports_its_counters_without_drops(collected):
    stats = collected["stats"]
    assert set(stats) == set(range(WORLD)), collected["output"]
    for s in stats.values():
        assert s["collector"]["dropped_total"] == 0
        assert s["hooks"]["errors"] == 0 and s["hooks"]["pattern"] == "DO"
        assert s["kernel_source"]["name"] == "cpu-ops" and s["kernel_source"]["kept"] > 0
    assert "rank 3:" in collected["output"]


def test_the_slowed_ranks_dataloader_phase_is_the_longest(collected):
    slow = SLOW_RANK
    by_rank: dict[int, list[float]] = {}
    for w in collected["records"]["phases"]:
        for p in w.phases:
            if p.phase == "dataloader":
                by_rank.setdefault(w.resource.rank, []).append(p.total_ns / max(p.count, 1))
    mean = {r: sum(v) / len(v) for r, v in by_rank.items()}
    assert max(mean, key=mean.get) == slow, mean
    assert mean[slow] >= 0.9 * SLOW_S * 1e9
    assert all(mean[r] < 0.5 * mean[slow] for r in mean if r != slow)


#: The processor-kill job needs no peers to compare: two ranks (a collective between them) keep it short.
KILL_WORLD = 2


def test_killing_the_processor_does_not_break_or_slow_training(tmp_path):
    _kill_processor_mid_run(tmp_path / "a")


def _kill_processor_mid_run(tmp_path: Path) -> None:
    tmp_path.mkdir()
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", addr,
                             "--home", str(tmp_path / "home")], env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        from trainscope.collector.exporter_socket import reachable
        deadline = time.monotonic() + 30
        while not reachable(addr):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        times, progress = tmp_path / "times", tmp_path / "progress"
        job = trainscope_run(addr, tmp_path / "run", "--steps", str(2 * STEPS), "--out", str(tmp_path / "r.json"),
                             "--times", str(times), "--progress", str(progress), popen=True, world=KILL_WORLD)
        deadline = time.monotonic() + 120
        while _steps_done(progress) < STEPS:  # collected for a while: the processor has data to lose
            if job.poll() is not None or time.monotonic() > deadline:
                job.kill()
                out = job.communicate()[0]
                pytest.fail(f"the job ended early (rc {job.returncode}):\n{out[-4000:]}")
            time.sleep(0.02)
        killed_at = time.perf_counter()
        proc.send_signal(signal.SIGKILL)
        out, _ = job.communicate(timeout=180)
        assert job.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] == 2 * STEPS
    for rank in range(KILL_WORLD):
        t = json.loads(Path(f"{times}.{rank}").read_text())
        assert len(t) == 2 * STEPS
        before = [b - a for a, b in zip(t, t[1:]) if b < killed_at]
        after = [b - a for a, b in zip(t, t[1:]) if a > killed_at + 0.5]
        if len(before) >= 5 and len(after) >= 5:
            assert _median(after) < 3 * _median(before) + 0.01, (rank, _median(before), _median(after))
    stats = rank_stats(tmp_path / "run")
    assert set(stats) == set(range(KILL_WORLD)), out
    for s in stats.values():
        c = s["collector"]
        assert c["dropped_total"] > 0, c  # what the dead processor never received is counted
        assert c["confirmed"] + c["dropped_total"] >= c["submitted"], c
    assert "dropped" in out


def _steps_done(progress: Path) -> int:
    try:
        return len(progress.read_text().split())
    except OSError:
        return 0


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


# ---------------------------------------------------------------- verdicts on real jobs
class _Records:
    """The processor's records of a finished job as an analyzer source (read once)."""

    def __init__(self, records: dict) -> None:
        self._left = [(sig, r) for sig, rs in records.items() for r in rs]

    def poll(self, timeout_s: float = 0.0) -> list:
        out, self._left = self._left, []
        return out

    def close(self) -> None:
        pass


def analyse(records: dict):
    """Every window verdict and the job verdict the analyzer gives on the job's records."""
    from trainscope.analyzer.merge import merge_windows
    from trainscope.analyzer.service import Analyzer, AnalyzerConfig

    a = Analyzer(AnalyzerConfig(), _Records(records), [])
    a.finish()
    return list(a.verdicts), merge_windows(list(a.verdicts))


def test_the_verdict_names_the_rank_with_the_slow_data_loader(collected):
    windows, job = analyse(collected["records"])
    assert job.state == "degraded", job.summary
    top = job.ranks[0]
    assert top.rank == SLOW_RANK and top.role == "culprit", job.summary
    # the data loader, as the L2 phase ("dataloader") or as the L3 CPU operator the sampler caught
    # ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"): which one carries more
    # impact depends on where the sampler's windows fell
    assert any("dataloader" in w.lower() for w in top.evidence["where"]), job.summary
    assert all(s.role != "culprit" for s in job.ranks[1:]), job.summary   # the others only waited
    # the price is what the slow loader cost the job, on the job's own clock: its steps' wait for a
    # batch beyond its peers' (a 30 ms sleep costs more on a loaded host: the wake-up waits for a core)
    lost = own_clock_loader_excess(collected["waits"], SLOW_RANK)
    assert lost > SLOW_S * 0.9, collected["waits"]
    assert top.impact_s == pytest.approx(lost, rel=0.5) and top.impact_pct > 5, (lost, job.summary)


def own_clock_loader_excess(waits: dict[int, list[float]], rank: int, warmup: int = 3) -> float:
    """The median step's wait for its batch on ``rank`` beyond the median of its peers' same step
    (the training script's perf_counter, not trainscope's)."""
    w = np.asarray([waits[r][warmup:] for r in sorted(waits)])
    peers = np.delete(w, sorted(waits).index(rank), axis=0)
    return float(np.median(w[sorted(waits).index(rank)] - np.median(peers, axis=0)))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("healthy")
    got = collect(tmp, "--times", str(tmp / "times"))
    got["times"] = json.loads((tmp / "times.0").read_text())    # rank 0's step ends, its own clock
    return got


def own_clock_slowed(step_ends: list[float], shift: float = 0.05, k: int = 5, warmup: int = 3) -> bool:
    """Did the job itself get ``shift`` slower? A later run of ``k`` steps whose median step is that
    much over an earlier, disjoint run's, on the training script's own clock (not trainscope's)."""
    d = np.diff(np.asarray(step_ends))[warmup:]
    med = [float(np.median(d[i:i + k])) for i in range(len(d) - k + 1)]
    return any(med[j] >= (1 + shift) * min(med[:j - k + 1]) for j in range(k, len(med)))


def own_clock_spiked(step_ends: list[float], factor: float, warmup: int = 3) -> bool:
    """Did one of the job's steps take ``factor`` x its median step, on the training script's own clock?"""
    d = np.diff(np.asarray(step_ends))[warmup:]
    return bool(d.size) and float(d.max()) >= factor * float(np.median(d))


def test_a_healthy_real_job_names_nobody(healthy):
    """Real CPU noise (a 1-3 ms data loader on a ~100 ms step, sampled CPU operators that differ per
    rank) is informational at most: no window's verdict names a rank. The job is "healthy", unless
    it really got slower or stalled as a whole (the pace level or L1's job-level jitter, naming
    nobody, on a host loaded by other work: "degraded, not localized"): then the training script's
    own clock must show that slowdown or those stalls too."""
    windows, job = analyse(healthy["records"])
    assert windows and all(not v.ranks for v in windows), "\n".join(v.summary for v in windows)
    if job.state != "healthy":
        flagged = {(d.level, d.kind) for v in windows for d in v.findings if not d.informational}
        assert job.state == "degraded" and not job.ranks, job.summary
        assert flagged <= {("pace", "job_slowdown"), ("L1", "jitter")}, (flagged, job.summary)
        if ("pace", "job_slowdown") in flagged:
            assert own_clock_slowed(healthy["times"]), (job.summary, healthy["times"])
        for d in (d for v in windows for d in v.findings if (d.level, d.kind) == ("L1", "jitter")):
            # the spike L1 saw (a point over its exceed factor x the baseline) is on the job's own clock too
            factor = d.evidence["exceed_factor"]
            assert own_clock_spiked(healthy["times"], factor), (factor, job.summary, healthy["times"])
        print(f"\nthe job slowed or stalled on its own clock too (host load): {job.summary}")
    for v in windows:
        for d in v.findings:
            assert not d.suspects or d.kind == "missing_rank", (d.kind, d.scope)


def test_a_two_rank_job_names_the_rank_its_partner_waited_for(tmp_path):
    """Two ranks cannot be compared by majority; the dependency can: rank 1 sleeps in its data loader,
    rank 0 waits for it in the all-reduce."""
    got = collect(tmp_path, "--slow-rank", "1", "--slow-s", str(SLOW_S), world=2)
    windows, job = analyse(got["records"])
    assert job.state == "degraded" and job.ranks[0].rank == 1, job.summary
    assert job.comparison == "pair" and "pair" in job.summary
