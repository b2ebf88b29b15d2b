"""A real job under ``trainscope run`` with a live analyzer beside it (tests and benchmarks).

A processor on 127.0.0.1:0 in this process, an analyzer reading its embedded
bus on a thread while the job runs, and the job itself started as
``trainscope run ... -- torchrun ...`` in a session of its own (killed with
its ranks by ``close``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support import forkrun
from support.pipeline import start_processor
from trainscope.analyzer.service import Analyzer, AnalyzerConfig
from trainscope.analyzer.sources import BusSource
from trainscope.processor.windows import WindowConfig

TRAIN = Path(__file__).resolve().parent / "train_collectives.py"


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}


def torchrun(*args: str, world: int = 4, script: Path = TRAIN, fork: bool = True) -> list[str]:
    """The job's launch: ``torchrun --standalone``'s ranks, forked after one ``import torch`` (forkrun.py:
    the tests), or torchrun itself (``fork=False``: the benchmarks, which measure what a user runs)."""
    if fork:
        return forkrun.command(script, *args, world=world)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            str(script), *args]


class LiveJob:
    """A processor, a live analyzer on its bus, and one job under ``trainscope run``."""

    def __init__(self, tmp: Path, job_id: str, *args: str, analyzer: AnalyzerConfig | None = None, world: int = 4,
                 command: list[str] | None = None, analyzer_nice: int = 0, fork: bool = True,
                 **processor) -> None:
        """``analyzer_nice``: the analyzer thread's niceness. A deployed analyzer runs off the training
        hosts (a central service, deploy/); here it shares the job's cores, and a benchmark that judges
        a healthy job against its own pace runs it at a lower priority so that its own work does not
        slow the job it judges (the processor, which does run on the job's host, keeps its priority)."""
        self.analyzer_nice = analyzer_nice
        self.proc = start_processor(window=WindowConfig(iterations=10, lateness_s=1), **processor)
        self.analyzer = Analyzer(analyzer or AnalyzerConfig(), BusSource(self.proc.bus), [])
        self.verdicts: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        cmd = [sys.executable, "-m", "trainscope.deploy.cli", "run", "--processor", self.proc.address,
               "--no-processor", "--no-stacks", "--run-dir", str(tmp / "run"), "--job-id", job_id,
               "--", *(command or torchrun(*args, world=world, fork=fork))]
        self.tmp, self.job_id = tmp, job_id
        self.started = time.time()
        self.job = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)

    def _run(self) -> None:
        if self.analyzer_nice:
            try:        # this thread only (Linux: a thread's id is a PRIO_PROCESS target)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.analyzer_nice)
            except OSError:
                pass
        while not self._stop.is_set():
            out = self.analyzer.step(0.2)
            with self._lock:
                self.verdicts += out
                self.verdicts += [v for v in self.analyzer.verdicts if v not in self.verdicts]

    def seen(self) -> list:
        with self._lock:
            return list(self.verdicts)

    def wait_for(self, pred, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = [v for v in self.seen() if pred(v)]
            if hit:
                return hit[0], time.time()
            time.sleep(0.2)
        return None, time.time()

    def finish(self, timeout_s: float = 150) -> str:
        out, _ = self.job.communicate(timeout=timeout_s)
        self.proc.drain(10)
        time.sleep(1.0)
        return out

    def close(self) -> None:
        if self.job.poll() is None:
            # torchrun puts each rank in a session of its own: kill the ranks this job announced
            # (their rank files), then trainscope run and torchrun (the group this test started)
            for f in (self.tmp / "run").glob("rank-*.json"):
                r = json.loads(f.read_text())
                if r.get("job_id") == self.job_id:
                    try:
                        os.kill(int(r["pid"]), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            os.killpg(self.job.pid, signal.SIGKILL)
            self.job.communicate(timeout=30)
        # windows left open close on the processor's stop; the analyzer judges them all
        self.proc.stop()
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            self.verdicts += [v for v in self.analyzer.finish() if v not in self.verdicts]
