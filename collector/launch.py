"""Enablement: ``trainscope run -- torchrun ... train.py``, one environment variable, or one import.

Three ways to turn collection on, from most to least managed:

* ``trainscope run [opts] -- CMD`` (:func:`run`): makes sure a processor
  listens (starts one on this host unless told not to), starts the py-spy
  stack sidecar, runs ``CMD`` with the environment below, forwards signals,
  then stops what it started and reports each rank's collector counters.
* An environment for launchers that cannot be wrapped: ``trainscope run
  --print-env`` prints it (``PYTHONPATH`` = the bootstrap directory first, plus
  ``TRAINSCOPE_*``); or ``trainscope run --install-pth`` once per
  environment, after which ``TRAINSCOPE_AUTOSTART=1`` alone turns it on.
* ``import trainscope.collector.launch as l; l.start_in_process()`` in code.

In each process the bootstrap hook decides whether it is a rank
(``bootstrap/_trainscope_boot.py``, ARGUS Appendix A); in a rank
:func:`start_in_process`:

1. builds the collector from the launcher's variables (``RANK``/``WORLD_SIZE``
   /``LOCAL_RANK``, or Open MPI / Slurm ones) and ``TRAINSCOPE_*``;
2. marks the environment (``TRAINSCOPE_RANK_PID``) so its children are
   skipped, and announces itself to the stack sidecar (``stacks.write_rank_file``);
3. waits for ``torch`` to be imported by the program (an import hook, so a
   process that never imports torch never pays for it), then installs the
   torch hooks (phases, collectives, iterations) and a kernel source: CUPTI
   when a CUDA driver and cupti-python are there, else the CPU operator source;
4. at exit flushes (bounded by ``TRAINSCOPE_SHUTDOWN_TIMEOUT_S``) and writes
   its counters to ``<run dir>/stats-<pid>.json``.
Nothing here raises into the program: a failure logs and leaves it untraced.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Sequence

from trainscope.collector.bootstrap import DIR as BOOTSTRAP_DIR
from trainscope.collector.bootstrap import AfterImport, install_autostart_pth  # noqa: F401 (API)
from trainscope.collector.exporter import reachable
from trainscope.proto import env
from trainscope.proto.env import (
    AUTOSTART, MATCH, RANK_PID, RUN_PID, identity,
    CPU_OPS, CUPTI, HOOKS, NCCL_TIMING, OFF as _OFF, RUN_DIR, SHIP_INTERVAL_S, SHUTDOWN_TIMEOUT_S, STACKS,
    STACKS_WINDOW_S)
from trainscope.proto.errors import ConfigError

log = logging.getLogger(__name__)


# ======================================================== in the rank process
@dataclasses.dataclass
class InProcess:
    """What :func:`start_in_process` started in this rank."""

    collector: Any
    run_dir: str
    pid: int = dataclasses.field(default_factory=os.getpid)
    hooks: Any = None
    source: Any = None
    sidecar: Any = None
    notes: list = dataclasses.field(default_factory=list)

    def stats(self) -> dict:
        out = {"resource": dataclasses.asdict(self.collector.resource), "collector": self.collector.stats(),
               "notes": list(self.notes)}
        if self.hooks is not None:
            h = self.hooks
            out["hooks"] = {"errors": h.errors, "phases_recorded": h.phases.recorded,
                            "phases_dropped": dict(h.phases.dropped), "iterations": h.detector.iterations,
                            "pattern": h.detector.pattern, "relearned": h.detector.relearned}
        if self.source is not None:
            out["kernel_source"] = {"name": self.source.name, **dict(getattr(self.source, "stats", {}))}
        return out

    def shutdown(self) -> None:
        """Stop sources, resolve pending phases, flush (bounded), leave counters for ``trainscope run``."""
        if os.getpid() != self.pid:
            return  # a forked child inherited the atexit hook: it is not the rank
        try:
            timeout = _float_env(SHUTDOWN_TIMEOUT_S, 3.0)
        except ConfigError:
            timeout = 3.0
        target = getattr(getattr(self.collector, "exporter", None), "config", None)
        if target is not None and not reachable(target.target):
            timeout = min(timeout, 0.2)  # nobody to flush to: count the rest as dropped, exit now
        for step in (lambda: self.source and self.source.stop(),
                     lambda: self.hooks and self.hooks.phases.stop(min(timeout, 2.0)),
                     lambda: self.collector.shutdown(timeout)):
            try:
                step()
            except Exception:
                log.debug("trainscope shutdown step failed", exc_info=True)
        try:
            path = os.path.join(self.run_dir, f"stats-{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.stats(), f, default=str)
            os.replace(path + ".tmp", path)
        except Exception:
            log.debug("could not write trainscope stats", exc_info=True)


_STATE: InProcess | None = None


def current() -> InProcess | None:
    """The collector started in this process by :func:`start_in_process`, if any."""
    return _STATE


def start_in_process(environ=None) -> InProcess | None:
    """Start collecting in this (rank) process; idempotent; never raises."""
    global _STATE
    if _STATE is not None:
        return _STATE
    environ = os.environ if environ is None else environ
    try:
        _STATE = _start(environ)
    except Exception as e:
        print(f"trainscope: collector not started: {e}", file=sys.stderr)
        log.debug("start_in_process failed", exc_info=True)
    return _STATE


def _start(environ) -> InProcess:
    from trainscope.collector.exporter import ExporterConfig
    from trainscope.collector.sdk import Collector, CollectorConfig
    from trainscope.collector.stacks import write_rank_file

    rank, world, local = identity(environ) or (0, 1, 0)
    exporter = ExporterConfig(target=environ.get(env.PROCESSOR) or ExporterConfig().target,
                              shutdown_timeout_s=_float_env(SHUTDOWN_TIMEOUT_S, 3.0, environ))
    cfg = CollectorConfig.from_env(environ, rank=rank, world_size=world, local_rank=local, exporter=exporter,
                                   ship_interval_s=_float_env(SHIP_INTERVAL_S, 1.0, environ))
    state = InProcess(Collector(cfg), run_dir=environ.get(RUN_DIR) or os.path.join(
        tempfile.gettempdir(), "trainscope", "ranks"))
    environ[RANK_PID] = str(os.getpid())  # children (workers, tools) are not ranks
    write_rank_file(state.run_dir, state.collector.resource)
    mode = environ.get(STACKS, "1").lower()
    if mode not in _OFF and mode != "external" and local == 0:
        state.sidecar = _spawn_sidecar(state.run_dir, environ)
    atexit.register(state.shutdown)
    if "torch" in sys.modules:
        _on_torch(state, environ)
    else:
        sys.meta_path.insert(0, AfterImport("torch", lambda _m: _on_torch(state, environ)))
    return state


def _on_torch(state: InProcess, environ) -> None:
    """Runs once torch is imported: hooks, then a kernel source."""
    from trainscope.collector.stacks import write_rank_file
    from trainscope.collector.torch_hooks import TorchHooks, TorchHooksConfig

    spec = environ.get(HOOKS, "all").lower()
    if spec not in _OFF:
        parts = {p.strip() for p in spec.split(",")}
        kinds = ("dataloader", "optimizer", "module", "collectives")
        cfg = TorchHooksConfig(**{k: ("all" in parts or k in parts) for k in kinds})
        state.hooks = TorchHooks(state.collector, cfg,
                                 on_resource=lambda res: write_rank_file(state.run_dir, res)).install()
    state.source = _kernel_source(state, environ)
    if state.source is not None:
        state.collector.add_kernel_source(state.source)


def _kernel_source(state: InProcess, environ):
    import torch

    if environ.get(CUPTI, "1").lower() not in _OFF and torch.version.cuda and _has_cuda_driver():
        from trainscope.collector.cupti_source import CuptiKernelSource
        src = CuptiKernelSource()
        src.start(state.collector.record_kernels)  # add_kernel_source's start is then a no-op
        if src.running:
            return src
        state.notes.append(f"CUPTI off: {src.reason}")
    spec = environ.get(CPU_OPS, "")
    if spec.lower() in _OFF:
        return None
    from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource
    gate = state.hooks.first_step if state.hooks is not None and state.hooks.config.optimizer else None
    src = CpuOpSource(CpuOpConfig.parse(spec, CPU_OPS), gate=gate)
    if not src.available:
        state.notes.append(f"CPU operator source off: {src.reason}")
        return None
    return src


def _has_cuda_driver() -> bool:
    import ctypes.util
    return os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None


def _spawn_sidecar(run_dir: str, environ, window_s: float | None = None) -> subprocess.Popen | None:
    """Start the host's stack sidecar unless one already holds the run directory's lock."""
    import fcntl

    os.makedirs(run_dir, exist_ok=True)
    lock = open(os.path.join(run_dir, "stacks.lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None  # another process of this host runs it
    cmd = [sys.executable, "-m", "trainscope.collector.stacks", "--run-dir", run_dir,
           "--window-s", str(window_s or _float_env(STACKS_WINDOW_S, env.DEFAULT_STACKS_WINDOW_S, environ))]
    child_env = {k: v for k, v in environ.items() if k != RANK_PID}
    child_env[AUTOSTART] = "0"
    try:
        return subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=(lock.fileno(),))  # the sidecar inherits the lock
    finally:
        lock.close()


def _float_env(name: str, default: float, environ=None) -> float:
    return env.number(name, default, environ)


# ============================================= parallel groups, by convention
#: Mesh dimension names (torchtitan / FSDP2 conventions) -> trainscope dimension.
MESH_DIMS = {"dp": "dp", "dp_shard": "dp", "dp_replicate": "dp", "fsdp": "dp", "ddp": "dp",
             "dp_shard_cp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep"}
MEGATRON = {"dp": "get_data_parallel_group", "tp": "get_tensor_model_parallel_group",
            "pp": "get_pipeline_model_parallel_group", "cp": "get_context_parallel_group",
            "ep": "get_expert_model_parallel_group"}


def declare_groups(hooks=None, **groups):
    """Name this rank's process groups by role (``dp=, tp=, pp=, ep=, cp=``): collectives on
    them become ``<role>-<op>`` phases and the rank's coordinates follow (rank and size in
    each). DeepSpeed and custom frameworks call this with their groups. No-op when off."""
    hooks = hooks or (_STATE.hooks if _STATE is not None else None)
    return hooks.declare_groups(**groups) if hooks is not None else None


def declare_device_mesh(mesh, hooks=None):
    """Declare the groups of a ``DeviceMesh`` by its dimension names (FSDP2, torchtitan)."""
    groups = {}
    for i, dim in enumerate(mesh.mesh_dim_names or ()):
        role = MESH_DIMS.get(dim)
        if role and role not in groups:
            groups[role] = mesh.get_group(i)
    return declare_groups(hooks, **groups)


def declare_megatron(hooks=None):
    """Declare Megatron-LM's groups from ``megatron.core.parallel_state`` (once it is initialised)."""
    from megatron.core import parallel_state as ps  # type: ignore

    groups = {}
    for role, getter in MEGATRON.items():
        try:
            groups[role] = getattr(ps, getter)()
        except Exception:  # a dimension this Megatron version or run does not have
            continue
    return declare_groups(hooks, **groups)


# ================================================================ the wrapper
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


@dataclasses.dataclass
class RunResult:
    returncode: int
    job_id: str
    processor: str
    processor_started: bool
    run_dir: str
    ranks: list = dataclasses.field(default_factory=list)
    """Per-rank counters written at exit (``InProcess.stats``), by rank."""


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
    job_id = config.job_id or os.environ.get(env.JOB_ID) or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    target = config.processor or os.environ.get(env.PROCESSOR) or env.DEFAULT_PROCESSOR_TARGET
    run_dir = config.run_dir or tempfile.mkdtemp(prefix="trainscope-run-")
    os.makedirs(run_dir, exist_ok=True)
    proc = sidecar = None
    if not reachable(target):
        if config.start_processor:
            proc = start_processor(target, config.home or os.path.join(os.getcwd(), ".trainscope"))
        else:
            print(f"trainscope: no processor at {target}; the job runs, its telemetry is counted as dropped",
                  file=sys.stderr)
    e = child_env(config, job_id=job_id, processor=target, run_dir=run_dir)
    try:
        if config.stacks:
            sidecar = _spawn_sidecar(run_dir, e, config.stacks_window_s)
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
    return RunResult(rc, job_id, target, proc is not None, run_dir, read_stats(run_dir))


def read_stats(run_dir: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("stats-") and name.endswith(".json"):
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
            f"{c.get('dropped_total', 0)} dropped {c.get('dropped', {}) or ''}; "
            f"{h.get('iterations', 0)} iterations (sequence {h.get('pattern')}); "
            f"kernels: {k.get('name', 'none')}" + "".join(f"; {n}" for n in s.get("notes", [])))
    if not result.ranks:
        lines.append("  no rank reported counters (were ranks selected? TRAINSCOPE_DEBUG_BOOT=1 shows why)")
    return lines


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


__all__ = ["InProcess", "RunConfig", "RunResult", "child_env", "current", "declare_device_mesh", "declare_groups",
           "declare_megatron", "default_match", "install_autostart_pth", "print_env", "reachable", "read_stats", "run",
           "start_in_process", "start_processor", "summary_lines"]
