"""Enablement inside the training process: the bootstrap hook, one environment variable, or one import.

Three ways to turn collection on, from most to least managed:

* ``trainscope run [opts] -- CMD`` (``deploy/launcher.py``): makes sure a processor
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
import threading
import dataclasses
import json
import logging
import os
import subprocess
import sys
from typing import Any

from trainscope.collector.bootstrap import AfterImport
from trainscope.collector.exporter_socket import reachable
from trainscope.proto import env
from trainscope.proto.env import (
    AUTOSTART, CPU_OPS, CUPTI, DEEP_DIVE, HOOKS, RANK_PID, RUN_DIR, SHIP_INTERVAL_S, SHUTDOWN_TIMEOUT_S, STACKS,
    STACKS_WINDOW_S, identity, runtime_dir)
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
    deep_dive: Any = None
    """``collector.deep_dive.DeepDiveWindow`` (issue #14), fed by ``control``."""
    control: Any = None
    """``collector.control.ControlClient``: the stream this rank opens to its processor for commands."""
    notes: list = dataclasses.field(default_factory=list)

    def stats(self) -> dict:
        out = {"resource": dataclasses.asdict(self.collector.resource), "collector": self.collector.stats(),
               "notes": list(self.notes)}
        if self.hooks is not None:
            h = self.hooks
            out["hooks"] = {"errors": h.errors, "phases_recorded": h.phases.recorded,
                            "phases_dropped": dict(h.phases.dropped), "iterations": h.detector.iterations,
                            "pattern": h.detector.pattern, "relearned": h.detector.relearned,
                            "collectives": h.collective_log.stats() if h.collective_log else {}}
        if self.source is not None:
            out["kernel_source"] = {"name": self.source.name, **dict(getattr(self.source, "stats", {}))}
        if self.deep_dive is not None:
            out["deep_dive"] = {**dict(self.deep_dive.stats),
                                **{f"control_{k}": v for k, v in (self.control.stats if self.control else {}).items()}}
        return out

    def shutdown(self) -> None:
        """Stop sources, resolve pending phases, flush (bounded), leave counters for ``trainscope run``."""
        if os.getpid() != self.pid:
            return  # a forked child inherited the atexit hook: it is not the rank
        try:
            timeout = env.number(SHUTDOWN_TIMEOUT_S, 3.0)
        except ConfigError:
            timeout = 3.0
        target = getattr(getattr(self.collector, "exporter", None), "config", None)
        if target is not None and not reachable(target.target):
            timeout = min(timeout, 0.2)  # nobody to flush to: count the rest as dropped, exit now
        for step in (lambda: self.deep_dive and self.deep_dive.close_at_exit(),
                     lambda: self.control and self.control.stop(min(timeout, 2.0)),
                     lambda: self.source and self.source.stop(),
                     lambda: self.hooks and self.hooks.phases.stop(min(timeout, 2.0)),
                     lambda: self.hooks and self.hooks.stop_collectives(),
                     lambda: self.collector.shutdown(timeout)):
            try:
                step()
            except Exception:
                log.debug("trainscope shutdown step failed", exc_info=True)
        try:
            from trainscope.proto.securefs import write_private  # 0600, no predictable .tmp
            path = os.path.join(self.run_dir, f"stats-{os.getpid()}.json")
            write_private(path, json.dumps(self.stats(), default=str))
        except Exception:
            log.debug("could not write trainscope stats", exc_info=True)


_STATE: InProcess | None = None


def _at_exit(fn) -> None:
    """Run ``fn`` at interpreter exit while threads may still be started.

    Python 3.12 refuses new threads in ``atexit`` handlers ("can't create new
    thread at interpreter shutdown"), and the final flush needs them (gRPC
    starts a thread per stream). ``threading._register_atexit`` hooks run
    earlier, in ``threading._shutdown``, before that ban (concurrent.futures
    uses it for the same reason); ``atexit`` is the fallback where it is
    missing.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # already shutting down
        return
    atexit.register(fn)


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
    from trainscope.collector.exporter_config import ExporterConfig
    from trainscope.collector.sdk import Collector, CollectorConfig
    from trainscope.collector.stacks import write_rank_file

    rank, world, local = identity(environ) or (0, 1, 0)
    exporter = ExporterConfig(target=environ.get(env.PROCESSOR) or ExporterConfig().target,
                              shutdown_timeout_s=env.number(SHUTDOWN_TIMEOUT_S, 3.0, environ))
    cfg = CollectorConfig.from_env(environ, rank=rank, world_size=world, local_rank=local, exporter=exporter,
                                   ship_interval_s=env.number(SHIP_INTERVAL_S, 1.0, environ))
    state = InProcess(Collector(cfg), run_dir=environ.get(RUN_DIR) or os.path.join(
        runtime_dir(environ), "ranks"))  # per user: another user's rank files are never read
    environ[RANK_PID] = str(os.getpid())  # children (workers, tools) are not ranks
    write_rank_file(state.run_dir, state.collector.resource)
    stacks_here = env.text(STACKS, environ=environ).lower() != "external"  # else someone else runs the sidecar
    if env.switch(STACKS, environ=environ) and stacks_here and local == 0:
        state.sidecar = spawn_sidecar(state.run_dir, environ)
    _at_exit(state.shutdown)
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
    if env.switch(HOOKS, environ=environ):
        parts = {p.strip() for p in spec.split(",")}
        kinds = ("dataloader", "optimizer", "module", "collectives")
        cfg = TorchHooksConfig(**{k: ("all" in parts or k in parts) for k in kinds})
        state.hooks = TorchHooks(state.collector, cfg,
                                 on_resource=lambda res: write_rank_file(state.run_dir, res)).install()
    state.source = _kernel_source(state, environ)
    if state.source is not None:
        state.collector.add_kernel_source(state.source)
    if state.hooks is not None and env.switch(DEEP_DIVE, environ=environ):
        _start_deep_dive(state, environ)


def _start_deep_dive(state: InProcess, environ) -> None:
    """The deep-dive window on the hooks' iteration boundaries and the control stream to the processor."""
    from trainscope.collector.control import ControlClient
    from trainscope.collector.deep_dive import DeepDiveWindow
    from trainscope.collector.stacks import StackDumper

    target = getattr(getattr(state.collector, "exporter", None), "config", None)
    if target is None:
        return
    col = state.collector
    window = DeepDiveWindow(env.deep_dive_dir(environ), col.resource.to_pb(), lambda rep: client.report(rep))
    # stack-grid dumps (Mycroft §5) return on the ingest stream, through the exporter's bounded queue
    client = ControlClient(target.target, lambda: col.resource, window, dumper=StackDumper(col.exporter.submit))
    state.deep_dive, state.control = window, client
    state.hooks.deep_dive = window
    client.start()


def _kernel_source(state: InProcess, environ):
    import torch

    if env.switch(CUPTI, environ=environ) and torch.version.cuda and _has_cuda_driver():
        from trainscope.collector.cupti_source import CuptiKernelSource
        src = CuptiKernelSource()
        src.start(state.collector.record_kernels)  # add_kernel_source's start is then a no-op
        if src.running:
            return src
        state.notes.append(f"CUPTI off: {src.reason}")
    spec = environ.get(CPU_OPS, "")
    if not env.switch(CPU_OPS, environ=environ):
        return None
    from trainscope.collector.cpu_source import CpuOpConfig, CpuOpSource
    src = CpuOpSource(CpuOpConfig.parse(spec, CPU_OPS))  # windows at optimizer steps, on the training thread
    if not src.available:
        state.notes.append(f"CPU operator source off: {src.reason}")
        return None
    return src


def _has_cuda_driver() -> bool:
    import ctypes.util
    return os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None


def spawn_sidecar(run_dir: str, environ, window_s: float | None = None) -> subprocess.Popen | None:
    """Start the host's stack sidecar unless one already holds the run directory's lock."""
    import fcntl

    from trainscope.proto.securefs import open_private, private_dir
    private_dir(run_dir, "run_dir")
    lock = os.fdopen(open_private(os.path.join(run_dir, "stacks.lock")), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None  # another process of this host runs it
    cmd = [sys.executable, "-m", "trainscope.collector.stacks", "--run-dir", run_dir,
           "--window-s", str(window_s or env.number(STACKS_WINDOW_S, env.DEFAULT_STACKS_WINDOW_S, environ))]
    child_env = {k: v for k, v in environ.items() if k != RANK_PID}
    child_env[AUTOSTART] = "0"
    try:
        return subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=(lock.fileno(),))  # the sidecar inherits the lock
    finally:
        lock.close()


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


__all__ = ["InProcess", "current", "declare_device_mesh", "declare_groups", "declare_megatron",
           "spawn_sidecar", "start_in_process"]
