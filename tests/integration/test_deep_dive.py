"""Deep dive on a real 4-rank gloo job under ``trainscope run`` (issue #14, EROICA §4.1).

A real processor on 127.0.0.1:0 (in this process) and a real torch job
(``tests/support/train_collectives.py``, CPU, gloo) under ``trainscope run``;
nothing in the training script knows trainscope. Once the processor has seen the
job's iterations, the real ``trainscope profile`` CLI asks for a 4-iteration
deep dive. Every rank's collector, through the control stream it opened to the
processor, profiles the SAME iterations (the command's start iteration, not a
wall time): the four reports name equal iteration ranges, each trace holds
exactly those ``ProfilerStep#`` marks, and the traces, summaries and the
manifest are 0600 in 0700 directories. A second request during the cool-down is
refused. One job, ~20 s on 2 cores.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.pipeline import start_processor
from support.torch_jobs import TORCH_EXIT_ABORT
from trainscope.processor.control import ControlConfig
from trainscope.processor.windows import WindowConfig
from trainscope.proto import env

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

TRAIN = Path(__file__).resolve().parents[1] / "support" / "train_collectives.py"
WORLD = 4
ITERATIONS = 4


def clean_env(deep_dir: Path) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}
    e[env.DEEP_DIVE_DIR] = str(deep_dir)
    return e


def cli(*args: str, environ: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscope.deploy.cli", *args], env=environ,
                          capture_output=True, text=True, timeout=timeout)


def run_once(tmp: Path):
    deep = tmp / "deep"
    proc = start_processor(window=WindowConfig(iterations=10, lateness_s=1),
                           control=ControlConfig(directory=str(deep), lead_s=1.0, cooldown_s=600))
    environ = clean_env(deep)
    job = subprocess.Popen(
        [sys.executable, "-m", "trainscope.deploy.cli", "run", "--processor", proc.address, "--no-processor",
         "--no-stacks", "--run-dir", str(tmp / "run"), "--job-id", "dd", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
         str(TRAIN), "--steps", "140"],
        env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (proc.control.latest("dd")[0] < 12
                                               or len(proc.control.subscribers("dd")) < WORLD):
            assert job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.2)
        assert proc.control.subscribers("dd") == list(range(WORLD))
        p = cli("profile", "--job", "dd", "--processor", proc.address, "--iterations", str(ITERATIONS),
                "--wait", "40", "--json", environ=environ)
        again = cli("profile", "--job", "dd", "--processor", proc.address, environ=environ)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.communicate(timeout=30)
        proc.stop()
    return job.returncode, out, p, again, deep


def test_manual_profile_makes_every_rank_trace_the_same_iterations(tmp_path):
    rc, out, p, again, deep = run_once(tmp_path / "a1")
    if rc != 0 and TORCH_EXIT_ABORT in out:  # torch 2.13's gloo exit abort (tests/support/torch_jobs.py)
        rc, out, p, again, deep = run_once(tmp_path / "a2")
    assert p.returncode == 0, (p.stdout, p.stderr, out[-2000:])
    doc = json.loads(p.stdout)
    assert doc["complete"] is True
    (man,) = doc["processors"]
    ranks = man["ranks"]
    assert sorted(ranks, key=int) == [str(r) for r in range(WORLD)]
    start = man["start_iteration"]
    want = (start, start + ITERATIONS - 1)
    for r, rep in ranks.items():
        assert rep["outcome"] == "done", rep
        assert (rep["first_iteration"], rep["last_iteration"]) == want, (r, rep)   # the SAME iterations
        trace = Path(rep["trace"])
        assert trace.parent == deep / "dd" / man["dive_id"]
        for f in (trace, Path(rep["summary"]), trace.parent / "manifest.json"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        for d in (deep, deep / "dd", trace.parent):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        events = json.loads(trace.read_text())["traceEvents"]
        steps = sorted(int(e["name"][13:]) for e in events if e.get("name", "").startswith("ProfilerStep#"))
        assert steps == list(range(want[0], want[1] + 1)), (r, steps)
        assert any(e.get("cat") == "cpu_op" for e in events)            # CPU activity
        assert any(e.get("cat") == "python_function" for e in events)   # with_stack
        assert rep["trace_bytes"] == trace.stat().st_size
    print(f"\ndeep dive {man['dive_id']}: iterations {want[0]}-{want[1]} on {len(ranks)} ranks, "
          f"{sum(v['trace_bytes'] for v in ranks.values()) / 1e6:.1f} MB in all, profiler stop "
          f"{max(v['profiler_stop_s'] for v in ranks.values()) * 1e3:.0f} ms at most")
    # one window at a time, then a cool-down: the second request is refused with the reason
    assert again.returncode == 1 and "cool-down" in again.stderr, (again.stdout, again.stderr)
    assert rc == 0, out[-3000:]
