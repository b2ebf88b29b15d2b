"""CPU fallback kernel source: PyTorch operators in short, periodic windows.

On a CPU-only job there are no GPU kernels; the closest equivalent is the
ATen operators that do the work. This source samples them with the PyTorch
profiler's CPU activity, in bounded windows, and feeds them to the same kernel
pipeline as CUPTI (``KernelColumns``: name = operator, stream = thread):

1. A daemon thread waits for ``gate`` (``launch`` passes the torch hooks'
   first optimizer step, so start-up and rendezvous are not sampled; bounded
   by ``gate_timeout_s``) and ``first_after_s``, then every ``period_s`` opens a
   window of ``window_s`` seconds: the Kineto profiler with CPU activity only,
   on all threads (``profile_all_threads``), no shapes, stacks or memory.
   Windows are skipped while someone else's profiler is on (one profiler per
   process) and never opened from the training thread.
2. Closing the window hands back every operator event, nested (``aten::linear``
   calls ``aten::addmm``, which calls ``aten::resolve_conj``...). Each keeps
   its *exclusive* time, its duration minus that of the operators it called
   directly (a stack walk per thread over events sorted by start): like GPU
   kernels, these records say where the time went, and no time is counted
   twice (``mode="top"``: only outermost operators, inclusive).
3. The records become one ``KernelColumns`` batch (wall-clock ns, the same
   clock as phases and iterations; stream = thread) handed to ``emit``.
4. Bounds: closing a window costs the process a few microseconds of GIL time
   per event (torch builds its result, we read it; measured 10-40 us per event
   of lost training time on a busy 2-core host), so a window that yielded
   more than ``max_events`` events is truncated, counted, and the next window
   is halved (down to ``min_window_s``); quiet windows grow back to
   ``window_s``.

Fidelity: operator names and exclusive host durations of every operator inside the
windows (a ``window_s / period_s`` duty cycle, 1/600 by default), from all
threads of the process; nothing between windows; no GPU time.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Sequence

import numpy as np

from trainscope.collector.sources import Emit
from trainscope.proto.columnar import KIND_KERNEL, KernelColumns
from trainscope.proto.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("self", "top", "all")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CpuOpConfig:
    period_s: float = 30.0
    """Time between the starts of two windows."""
    window_s: float = 0.05
    """Length of a window (the duty cycle is window_s / period_s)."""
    first_after_s: float = 5.0
    """Delay before the first window, after the gate opened (warm-up steps are not typical)."""
    max_events: int = 20_000
    """Events kept from one window; beyond it the window is truncated and the next one halved."""
    min_window_s: float = 0.02
    """Shortest window the adaptation may shrink to."""
    mode: str = "self"
    """``self``: exclusive time of every operator; ``top``: outermost operators; ``all``: every one, inclusive."""

    def __post_init__(self) -> None:
        for name in ("period_s", "window_s", "min_window_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cpu_ops.{name}", getattr(self, name), "must be > 0")
        if self.first_after_s < 0:
            raise ConfigError("cpu_ops.first_after_s", self.first_after_s, "must be >= 0")
        if self.window_s >= self.period_s:
            raise ConfigError("cpu_ops.window_s", self.window_s, f"must be < period_s ({self.period_s})")
        if self.min_window_s > self.window_s:
            raise ConfigError("cpu_ops.min_window_s", self.min_window_s, "must be <= window_s")
        if self.mode not in MODES:
            raise ConfigError("cpu_ops.mode", self.mode, f"must be one of {MODES}")
        if type(self.max_events) is not int or self.max_events < 1:
            raise ConfigError("cpu_ops.max_events", self.max_events, "must be an integer >= 1")

    @classmethod
    def parse(cls, text: str, setting: str = "cpu_ops") -> "CpuOpConfig":
        """``"period_s=10,window_s=0.2"`` -> config; raises ConfigError naming ``setting``."""
        kw: dict = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in fields:
                raise ConfigError(setting, text, f"bad entry {part!r}; keys: {', '.join(fields)}")
            try:
                kw[key] = value if key == "mode" else int(value) if key == "max_events" else float(value)
            except ValueError:
                raise ConfigError(setting, text, f"{key} must be a number") from None
        return cls(**kw)


def events_to_columns(names: Sequence[str], start_ns, duration_ns, thread, *, mode: str = "self") -> KernelColumns:
    """Operator events (parallel sequences) -> ``KernelColumns``.

    ``mode``: ``self`` (every operator with its exclusive time: its duration
    minus that of the operators it called, kept where > 0), ``top`` (only
    operators called from outside any other, inclusive time) or ``all``
    (every operator, inclusive: nested time counts more than once). ``thread``
    becomes the stream column (small integers in order of thread id).
    """
    if mode not in MODES:
        raise ConfigError("cpu_ops.mode", mode, f"must be one of {MODES}")
    start = np.asarray(start_ns, dtype=np.int64)
    dur = np.maximum(np.asarray(duration_ns, dtype=np.int64), 0)
    tid = np.asarray(thread, dtype=np.int64)
    if start.shape[0] == 0:
        return KernelColumns.empty()
    table, name_id = np.unique(np.asarray(names, dtype=object), return_inverse=True)
    order = np.lexsort((-dur, start, tid))  # by thread, then start, outermost first
    start, dur, tid, name_id = start[order], dur[order], tid[order], name_id[order]
    if mode == "all":
        keep = dur > 0
    else:
        excl, top = _nesting(start.tolist(), dur.tolist(), tid.tolist())
        if mode == "self":
            dur = np.asarray(excl, dtype=np.int64)
        keep = (dur > 0) & (np.asarray(top, dtype=bool) if mode == "top" else True)
    _, stream = np.unique(tid, return_inverse=True)
    sel = np.flatnonzero(keep)
    sel = sel[np.argsort(start[sel], kind="stable")]
    return KernelColumns.build(
        [str(x) for x in table], start[sel], dur[sel], name_id[sel], stream[sel],
        np.full(sel.shape[0], KIND_KERNEL, np.uint8))


def _nesting(start: list, dur: list, tid: list) -> tuple[list, list]:
    """Exclusive durations and top-level flags of events sorted by (thread, start, longest first).

    A stack of open events per thread: an event's direct parent is the
    innermost open event that has not ended when it starts.
    """
    excl, top = list(dur), [False] * len(dur)
    stack: list[int] = []
    for i in range(len(start)):
        s, t = start[i], tid[i]
        while stack and (tid[stack[-1]] != t or start[stack[-1]] + dur[stack[-1]] <= s):
            stack.pop()
        if stack:
            p = stack[-1]
            excl[p] = max(excl[p] - dur[i], 0)
        else:
            top[i] = True
        stack.append(i)
    return excl, top


class CpuOpSource:
    """A :class:`~trainscope.collector.sources.KernelSource` of operators sampled in windows."""

    name = "cpu-ops"

    def __init__(self, config: CpuOpConfig = CpuOpConfig(), *, gate: threading.Event | None = None,
                 gate_timeout_s: float = 300.0) -> None:
        self.config = config
        self._gate, self._gate_timeout_s = gate, gate_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._window_s = config.window_s
        self.stats: collections.Counter[str] = collections.Counter()
        """windows, skipped_busy, events, kept, truncated, errors."""
        self.last_window: tuple[int, int] | None = None
        """(start_ns, end_ns) of the last window closed."""
        self.available, self.reason = _probe()

    def start(self, emit: Emit) -> None:
        """Starts the window thread and returns at once (the source is endless)."""
        if not self.available:
            log.info("trainscope: CPU operator source off: %s", self.reason)
            return
        if self._thread is None:
            self._warm_up()
            self._thread = threading.Thread(target=self._run, args=(emit,), name="trainscope-cpu-ops",
                                            daemon=True)
            self._thread.start()

    def _warm_up(self) -> None:
        """One empty enable/disable on the calling (training) thread: Kineto wants its first
        initialisation on the thread that imported torch, or it logs an error (~7 ms, once)."""
        try:
            from torch import autograd
            if not autograd._profiler_enabled():
                cfg, acts = _profiler_config()
                autograd._prepare_profiler(cfg, acts)
                autograd._enable_profiler(cfg, acts)
                autograd._disable_profiler()
        except Exception:
            log.debug("profiler warm-up failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    def _run(self, emit: Emit) -> None:
        cfg = self.config
        if self._gate is not None:  # e.g. the first optimizer step: start-up is not sampled
            deadline = time.monotonic() + self._gate_timeout_s
            while not self._gate.wait(0.1):
                if self._stop.is_set() or time.monotonic() > deadline:
                    break
        next_at = time.monotonic() + cfg.first_after_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += cfg.period_s
            try:
                cols = self.window()
                if cols is not None and len(cols):
                    emit(cols)
            except Exception:
                self.stats["errors"] += 1
                log.debug("CPU operator window failed", exc_info=True)
            now = time.monotonic()
            if next_at < now:  # a slow window: skip ahead, never catch up in a burst
                next_at = now + cfg.period_s

    def window(self) -> KernelColumns | None:
        """Profile one window now (on the calling thread's schedule) and return its leaves."""
        from torch import autograd

        if autograd._profiler_enabled():
            self.stats["skipped_busy"] += 1
            return None
        cfg, acts = _profiler_config()
        autograd._prepare_profiler(cfg, acts)
        t0 = time.time_ns()
        autograd._enable_profiler(cfg, acts)
        try:
            self._stop.wait(self._window_s)
        finally:
            result = autograd._disable_profiler()
        t1 = time.time_ns()
        self.last_window = (t0, t1)
        events = result.events()
        self.stats["windows"] += 1
        self.stats["events"] += len(events)
        limit = self.config.max_events
        if len(events) > limit:
            self.stats["truncated"] += len(events) - limit
            events = events[:limit]
            self._window_s = max(self.config.min_window_s, self._window_s / 2)
        elif len(events) < limit // 4:
            self._window_s = min(self.config.window_s, self._window_s * 2)
        names, start, dur, tid = [], [], [], []
        for e in events:
            names.append(e.name())
            start.append(e.start_ns())
            dur.append(e.duration_ns())
            tid.append(e.start_thread_id())
        cols = events_to_columns(names, start, dur, tid, mode=self.config.mode)
        self.stats["kept"] += len(cols)
        return cols


def _profiler_config():
    """Kineto, CPU activity only, all threads; no shapes, memory, stacks, flops or modules."""
    from torch import autograd
    from torch._C import _profiler as P

    cfg = autograd.ProfilerConfig(autograd.ProfilerState.KINETO, False, False, False, False, False,
                                  P._ExperimentalConfig(profile_all_threads=True))
    return cfg, {autograd.ProfilerActivity.CPU}


def _probe() -> tuple[bool, str]:
    try:
        from torch import autograd
        from torch._C import _profiler as P
        P._ExperimentalConfig(profile_all_threads=True)
        autograd._enable_profiler  # noqa: B018
        return True, ""
    except ImportError:
        return False, "torch is not installed"
    except Exception as e:  # an older torch without all-thread CPU profiling
        return False, f"this torch cannot profile all threads: {e}"


__all__ = ["CpuOpConfig", "CpuOpSource", "events_to_columns"]
