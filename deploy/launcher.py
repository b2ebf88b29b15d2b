"""``trainscope run [opts] -- CMD``: the launcher around a training job (runs outside it).

1. Make sure a processor listens at the target (``TRAINSCOPE_PROCESSOR`` or
   the host's default socket); start ``trainscope processor`` as its own
   process unless told not to, so it outlives the job and drains on SIGTERM.
2. Build the job's environment (:func:`child_env`): the bootstrap directory
   first on ``PYTHONPATH``, the job id, the run directory, a ``MATCH`` regex
   for the training script, ``TRAINSCOPE_STACKS=external``.
3. Start the py-spy stack sidecar (``collector/stacks.py``), run ``CMD``,
   forward SIGINT/SIGTERM to it.
4. Stop what it started and read each rank's collector counters from the
   run directory (:func:`read_stats`, :func:`summary_lines`).

What runs inside each rank is ``collector/launch.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Sequence

from trainscope.collector.bootstrap import DIR as BOOTSTRAP_DIR
from trainscope.collector.exporter_socket import reachable
from trainscope.collector.launch import spawn_sidecar
from trainscope.proto import env
from trainscope.proto.securefs import owned_by_me, private_dir
from trainscope.proto.env import AUTOSTART, MATCH, NCCL_TIMING, RANK_PID, RUN_DIR, RUN_PID, STACKS
from trainscope.proto.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    command: tuple[str, ...]
    """The launcher or program to run (``torchrun ... train.py``)."""
    processor: str = ""
    """Processor address; empty: ``TRAINSCOPE_PROCESSOR`` or the host's default socket."""
    start_processor: bool = True
    """Start a processor on this host when none answers at ``processor``."""
    stacks: bool = True
    """Run the py-spy stack sidecar for the ranks of this host."""
    stacks_window_s: float = env.DEFAULT_STACKS_WINDOW_S
    """Stack sampling window per rank."""
    job_id: str = ""
    """Job id; empty: ``TRAINSCOPE_JOB_ID``, else generated."""
    match: str | None = None
    """Regex rank command lines must match; None: derived from the command's script/module."""
    run_dir: str = ""
    """Rank registry and counters; empty: a fresh temporary directory."""
    home: str = ""
    """State directory of a processor started here; empty: ``./.trainscope``."""
    extra_env: tuple[tuple[str, str], ...] = ()
    """More variables for the job (e.g. ``TRAINSCOPE_CPU_OPS``)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("run.command", self.command, "give the command after --")
        if not self.stacks_window_s >= 1:
            raise ConfigError("run.stacks_window_s", self.stacks_window_s, "must be >= 1 (py-spy takes whole seconds)")
        if self.processor:
            env.check_target("--processor", self.processor)


@dataclasses.dataclass
class RunResult:
    returncode: int
    job_id: str
    processor: str
    processor_started: bool
    run_dir: str
    ranks: list = dataclasses.field(default_factory=list)
    """Per-rank counters written at exit (``InProcess.stats``), by rank."""
    home: str = ""
    """State directory of the processor started here ("" when one was already running)."""


def default_match(command: Sequence[str]) -> str | None:
    """The training script (``*.py``) or ``-m module`` of a command, as a regex."""
    args = list(command)
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args) and not args[i + 1].startswith("torch.distributed"):
            return _re_escape(args[i + 1])
        if a.endswith(".py") and os.path.basename(a) not in ("torchrun", "run.py"):
            return _re_escape(os.path.basename(a))
    return None


def _re_escape(s: str) -> str:
    import re
    return re.escape(s)


def child_env(config: RunConfig, *, job_id: str, processor: str, run_dir: str, base=None) -> dict:
    """The environment the job runs with (also what ``--print-env`` prints)."""
    e = dict(os.environ if base is None else base)
    e["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e[AUTOSTART] = "1"
    e[env.JOB_ID] = job_id
    e[env.PROCESSOR] = processor
    e[RUN_DIR] = run_dir
    e[RUN_PID] = str(os.getpid())
    e[STACKS] = "external" if config.stacks else "0"
    e.setdefault(NCCL_TIMING, "1")
    e.pop(RANK_PID, None)
    match = config.match if config.match is not None else default_match(config.command)
    if match:
        e[MATCH] = match
    e.update(dict(config.extra_env))
    return e


def start_processor(target: str, home: str, timeout_s: float = 30.0) -> subprocess.Popen:
    """Start ``trainscope processor --listen target`` and wait until it answers."""
    cmd = [sys.executable, "-m", "trainscope.deploy.cli", "processor", "--listen", target, "--home", home]
    e = {k: v for k, v in os.environ.items() if k not in (AUTOSTART, RANK_PID)}
    proc = subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError("run.processor", target, f"the processor exited with status {proc.returncode}")
        if reachable(target):
            return proc
        time.sleep(0.1)
    proc.terminate()
    raise ConfigError("run.processor", target, f"no processor answered within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen | None, timeout_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(config: RunConfig) -> RunResult:
    """``trainscope run``: processor, sidecar, the job under the bootstrap hook, counters."""
    job_id = config.job_id or env.text(env.JOB_ID) or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    target = config.processor or env.text(env.PROCESSOR) or env.DEFAULT_PROCESSOR_TARGET
    run_dir = config.run_dir or tempfile.mkdtemp(prefix="trainscope-run-")
    try:
        return _run_in(config, job_id, target, run_dir)
    finally:
        if not config.run_dir:  # made here for this run: leave no temporary directory behind, even on an error
            import shutil
            shutil.rmtree(run_dir, ignore_errors=True)


def _run_in(config: RunConfig, job_id: str, target: str, run_dir: str) -> RunResult:
    try:
        private_dir(run_dir, "--run-dir")  # 0700 and ours: ranks announce themselves in it
    except OSError as e:
        raise ConfigError("--run-dir", run_dir, f"cannot use it as the run directory: {e.strerror}") from None
    proc = sidecar = None
    home = ""
    if not reachable(target):
        if config.start_processor:
            home = os.path.abspath(config.home or os.path.join(os.getcwd(), ".trainscope"))
            proc = start_processor(target, home)
        else:
            print(f"trainscope: no processor at {target}; the job runs, its telemetry is counted as dropped",
                  file=sys.stderr)
    e = child_env(config, job_id=job_id, processor=target, run_dir=run_dir)
    try:
        if config.stacks:
            py_spy = find_py_spy()
            if py_spy is None:
                print("trainscope: py-spy is neither on PATH nor beside this python "
                      f"({os.path.dirname(sys.executable)}); stack sampling (L5) is off: pip install py-spy",
                      file=sys.stderr)
            else:  # the sidecar finds it on its PATH; the job's own PATH is left as it is
                side_env = dict(e, PATH=os.pathsep.join([os.path.dirname(py_spy), e.get("PATH", "")]))
                sidecar = spawn_sidecar(run_dir, side_env, config.stacks_window_s)
        child = subprocess.Popen(list(config.command), env=e)
        forward = lambda sig, _frame: child.send_signal(sig)  # noqa: E731
        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = child.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    finally:
        _stop(sidecar, 10.0)
        _stop(proc, 60.0)  # the processor drains and closes its windows on SIGTERM
    stats = read_stats(run_dir)
    return RunResult(rc, job_id, target, proc is not None, run_dir, stats, home if proc is not None else "")


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside the interpreter (a virtualenv used without being activated)."""
    import shutil

    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def read_stats(run_dir: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("stats-") and name.endswith(".json") and owned_by_me(os.path.join(run_dir, name)):
            try:
                with open(os.path.join(run_dir, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(out, key=lambda s: s["resource"]["rank"])


def summary_lines(result: RunResult) -> list[str]:
    """Human-readable per-rank counters of a finished run."""
    lines = [f"trainscope: job {result.job_id!r} exited with status {result.returncode}; processor "
             f"{result.processor}{' (started here, now stopped)' if result.processor_started else ''}"]
    for s in result.ranks:
        c, h, k = s.get("collector", {}), s.get("hooks") or {}, s.get("kernel_source") or {}
        lines.append(
            f"  rank {s['resource']['rank']}: {c.get('confirmed', 0)}/{c.get('submitted', 0)} batches confirmed, "
            f"{c.get('dropped_total', 0)} dropped{_by_cause(c.get('dropped') or {})}; "
            f"{h.get('iterations', 0)} iterations"
            + (f" (sequence {h['pattern']})" if h.get("pattern") else "") + "; "
            f"kernels: {k.get('name', 'none')}" + "".join(f"; {n}" for n in s.get("notes", [])))
    if not result.ranks:
        lines.append("  no rank reported counters (were ranks selected? TRAINSCOPE_DEBUG_BOOT=1 shows why)")
    if result.processor_started and result.home:
        # the processor stored the windows; no analyzer ran beside it: say how to get the diagnosis
        lines.append(f"next: trainscope analyzer --home {result.home}   (diagnoses the stored windows; "
                     "Ctrl-C when it has printed them)")
        lines.append(f"then: trainscope query verdict --job {result.job_id} --home {result.home}")
    else:
        lines.append(f"next: the analyzer beside processor {result.processor} diagnoses the job; "
                     f"trainscope query verdict --job {result.job_id} --home <that processor's home>")
    return lines


def _by_cause(dropped: dict) -> str:
    """`` (queue_full 3, unauthenticated 1)`` for a rank's drops by cause; "" when none."""
    causes = [f"{k} {v:,}" for k, v in sorted(dropped.items()) if v]
    return f" ({', '.join(causes)})" if causes else ""


def print_env(config: RunConfig, out=None) -> None:
    """Shell ``export`` lines that enable collection for a launcher that cannot be wrapped."""
    out = sys.stdout if out is None else out
    e = child_env(config, job_id=config.job_id,
                  processor=config.processor or env.DEFAULT_PROCESSOR_TARGET,
                  run_dir=config.run_dir or os.path.join(tempfile.gettempdir(), "trainscope", "ranks"), base={})
    e.pop(RUN_PID, None)
    if not config.job_id:
        e.pop(env.JOB_ID)  # the collector falls back to the launcher's TORCHELASTIC_RUN_ID
    e[STACKS] = "1" if config.stacks else "0"
    for k in sorted(e):
        print(f"export {k}={shlex.quote(e[k])}" + (":$PYTHONPATH" if k == "PYTHONPATH" else ""), file=out)
