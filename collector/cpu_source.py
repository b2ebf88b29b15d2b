"""CPU fallback kernel source: PyTorch operators in short, periodic windows.

On a CPU-only job there are no GPU kernels; the closest equivalent is the
ATen operators that do the work. This source records them in bounded windows
and feeds them to the same kernel pipeline as CUPTI (``KernelColumns``: name =
operator, stream = thread):

1. Windows open and close only on the training thread, at optimizer-step
   boundaries (a global ``torch.optim`` step post hook; frameworks without
   ``torch.optim`` call :meth:`CpuOpSource.safe_point` once per step). The
   first step starts the clock (start-up and rendezvous are not sampled);
   ``first_after_s`` later, then every ``period_s``, a window opens at a step
   boundary and closes at the first boundary ``window_s`` after it (so it
   spans whole steps: forward, backward, collectives, optimizer).
2. The recorder is torch's thread-local RecordFunction profiler in its
   push/pop form (``_enable_profiler_legacy``, CPU state; no shapes, stacks
   or memory): every operator entered on the training thread while the
   window is open is a (push, pop) pair matched by handle. Why not Kineto:
   started and stopped from a side thread with ``profile_all_threads`` (the
   first design) it corrupts the job's heap: 14 of 19 stress runs of
   ``tests/benchmarks/bench_job_crashes.py`` died (12 SIGSEGV, 2 SIGABRT
   "malloc(): unsorted double linked list corrupted"; this source: 0 of 19), as its global
   callbacks use the profiler state that the other thread's stop frees.
   Thread-local Kineto on the training thread did not crash (5 runs), but by
   its code an operator that opens in one window and ends in the next writes
   its end into the first window's freed event buffer; a push/pop event
   holds no pointer, and an unmatched pop is simply ignored. Windows are
   skipped while another profiler is on, and a ``torch.profiler`` the job
   starts on the training thread closes an open window first (one profiler
   per thread), and so does a fork (a DataLoader worker would inherit it).
3. Closing a window hands its events to a worker thread, which pairs them
   and keeps each operator's *exclusive* time, its duration minus that of the
   operators it called directly (a stack walk per thread): like GPU kernels,
   these records say where the time went, and no time is counted twice
   (``mode="top"``: only outermost operators, inclusive). The records become
   one ``KernelColumns`` batch (wall-clock ns, the clock of phases and
   iterations) handed to ``emit``.
4. Bounds: an open window costs each operator a push and a pop, and reading
   it ~2 us per operator on the reader thread (``bench_overhead.py``: 18.7 ms
   of training time per window of ~4,500 operators on a loaded 2-core host,
   0.06% at one window per 30 s); a window that yielded
   more than ``max_events`` operators is truncated, counted, and the next
   window is halved (down to ``min_window_s``, never below one step); quiet
   windows grow back to ``window_s``.

Fidelity: operator names and exclusive host durations of every operator the
training thread runs inside the windows (a ``window_s / period_s`` duty cycle,
1/600 by default; at least one step per window); nothing between windows; no
operators of other threads (on CPU, autograd runs backward on the calling
thread); no GPU time.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
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
    """Shortest length of a window; it closes at the first optimizer step after it (whole steps)."""
    first_after_s: float = 5.0
    """Delay before the first window, after the first optimizer step (warm-up steps are not typical)."""
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


def pair_events(lists, limit: int) -> tuple[list, list, list, list, int]:
    """Push/pop profiler events (one list per thread) -> parallel lists of operators, and how many there were.

    A push opens an operator (name, start, thread) under its RecordFunction
    handle; the pop with that handle closes it. A pop whose push came before
    the window opened, and a push still open when it closed, are left out.
    Only the first ``limit`` closed operators are kept (in closing order).
    """
    names: list[str] = []
    start: list[int] = []
    dur: list[int] = []
    tid: list[int] = []
    total = 0
    for events in lists:
        opened: dict[int, tuple] = {}
        for e in events:
            kind = e.kind()
            if kind == "push":
                opened[e.handle()] = (e.name(), e.start_us(), e.thread_id())
            elif kind == "pop":
                got = opened.pop(e.handle(), None)
                if got is None:
                    continue
                total += 1
                if total <= limit:
                    names.append(got[0])
                    start.append(round(got[1] * 1000))  # the profiler's clock is the wall clock, in us
                    dur.append(round((e.start_us() - got[1]) * 1000))
                    tid.append(got[2])
    return names, start, dur, tid, total


class CpuOpSource:
    """A :class:`~trainscope.collector.sources.KernelSource` of operators recorded in windows at step boundaries."""

    name = "cpu-ops"

    def __init__(self, config: CpuOpConfig = CpuOpConfig(), *, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._window_s = config.window_s
        self._lock = threading.Lock()
        self._next_at: float | None = None
        self._owner: int | None = None
        """Ident of the thread whose window is open (the profiler is thread-local: only it may close it)."""
        self._opened: tuple[float, int] = (0.0, 0)
        self._stopping = False
        self._hook = None
        self._patched = None
        self._pending: queue.Queue = queue.Queue(maxsize=2)
        self._worker: threading.Thread | None = None
        self._emit: Emit | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        """windows, skipped_busy, yielded, closed_for_fork, events, kept, truncated, windows_dropped, errors."""
        self.last_window: tuple[int, int] | None = None
        """(start_ns, end_ns) of the last window closed."""
        self.available, self.reason = _probe()

    # ------------------------------------------------------------ lifecycle
    def start(self, emit: Emit) -> None:
        """Hooks the optimizer step and starts the reader thread; returns at once (the source is endless)."""
        if not self.available:
            log.info("trainscope: CPU operator source off: %s", self.reason)
            return
        if self._worker is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._emit = emit
        self._worker = threading.Thread(target=self._drain, name="trainscope-cpu-ops", daemon=True)
        self._worker.start()
        self._hook = register_optimizer_step_post_hook(lambda _opt, _args, _kwargs: self.safe_point())
        self._patch_profiler_start()
        if hasattr(os, "register_at_fork"):  # a DataLoader worker forked mid-window would record forever
            os.register_at_fork(before=self._before_fork)

    def stop(self) -> None:
        """Unhooks, closes a window open on this thread, hands the last events to ``emit`` (bounded)."""
        self._stopping = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._unpatch_profiler_start()
        if self._owner == threading.get_ident():
            self.safe_point()  # stopping: closes it
        # a window open on another thread closes at that thread's next step (nobody else may close it)
        w = self._worker
        if w is not None and w is not threading.current_thread():
            try:
                self._pending.put(None, timeout=1.0)
            except queue.Full:
                pass
            w.join(timeout=5.0)

    # ------------------------------------------------------ training thread
    def safe_point(self) -> None:
        """A step boundary of the calling (training) thread: opens or closes a window when due; never raises.

        Costs a clock read and a comparison when nothing is due.
        """
        if not self._lock.acquire(blocking=False):
            return  # another thread's step is in here: this boundary is skipped
        try:
            now = self._clock()
            if self._owner is not None:
                if self._owner == threading.get_ident() and (
                        self._stopping or now - self._opened[0] >= self._window_s):
                    self._close()
                return
            if self._stopping:
                return
            if self._next_at is None:  # the first step: start-up and rendezvous are behind us
                self._next_at = now + self.config.first_after_s
            if now < self._next_at:
                return
            self._next_at += self.config.period_s
            if self._next_at <= now:  # slow steps: skip ahead, never catch up in a burst
                self._next_at = now + self.config.period_s
            self._open(now)
        except Exception:
            self.stats["errors"] += 1
            log.debug("CPU operator window failed", exc_info=True)
        finally:
            self._lock.release()

    def _open(self, now: float) -> None:
        from torch import autograd

        if autograd._profiler_enabled():  # the job's own profiler (one per thread)
            self.stats["skipped_busy"] += 1
            return
        autograd._enable_profiler_legacy(_profiler_config())
        self._owner, self._opened = threading.get_ident(), (now, time.time_ns())

    def _close(self) -> None:
        from torch import autograd

        self._owner = None
        lists = autograd._disable_profiler_legacy()
        self.last_window = (self._opened[1], time.time_ns())
        self.stats["windows"] += 1
        try:
            self._pending.put_nowait(lists)
        except queue.Full:  # the reader is behind: this window is not read (bounded memory)
            self.stats["windows_dropped"] += 1

    def _before_fork(self) -> None:
        """Close a window open on the forking thread: the child would inherit it with nobody to close it."""
        if self._owner == threading.get_ident() and self._lock.acquire(blocking=False):
            try:
                if self._owner == threading.get_ident():
                    self.stats["closed_for_fork"] += 1
                    self._close()
            except Exception:
                self.stats["errors"] += 1
            finally:
                self._lock.release()

    def _patch_profiler_start(self) -> None:
        """A ``torch.profiler`` started on the thread of an open window closes the window first.

        Every torch profiler context (``torch.profiler.profile``, ``autograd.profiler.profile``,
        ``emit_nvtx``, ``emit_itt``) calls ``torch.autograd.profiler._run_on_profiler_start`` just
        before enabling; without this the job's profiler would fail with "already enabled".
        """
        from torch.autograd import profiler as tap

        orig = getattr(tap, "_run_on_profiler_start", None)
        if orig is None:
            return

        def before_profiler_start(*a, **kw):
            if self._owner == threading.get_ident():
                with self._lock:
                    if self._owner == threading.get_ident():
                        self.stats["yielded"] += 1
                        self._close()
            return orig(*a, **kw)

        tap._run_on_profiler_start = before_profiler_start
        self._patched = (tap, orig, before_profiler_start)

    def _unpatch_profiler_start(self) -> None:
        if self._patched is not None:
            tap, orig, mine = self._patched
            if getattr(tap, "_run_on_profiler_start", None) is mine:  # nobody wrapped it after us
                tap._run_on_profiler_start = orig
            self._patched = None

    # --------------------------------------------------------- reader thread
    def _drain(self) -> None:
        while True:
            lists = self._pending.get()
            if lists is None:
                return
            try:
                cols = self.read(lists)
                if len(cols) and self._emit is not None:
                    self._emit(cols)
            except Exception:
                self.stats["errors"] += 1
                log.debug("reading a CPU operator window failed", exc_info=True)

    def read(self, lists) -> KernelColumns:
        """One closed window's events -> ``KernelColumns``; adapts the next window's length."""
        limit = self.config.max_events
        names, start, dur, tid, total = pair_events(lists, limit)
        self.stats["events"] += total
        if total > limit:
            self.stats["truncated"] += total - limit
            self._window_s = max(self.config.min_window_s, self._window_s / 2)
        elif total < limit // 4:
            self._window_s = min(self.config.window_s, self._window_s * 2)
        cols = events_to_columns(names, start, dur, tid, mode=self.config.mode)
        self.stats["kept"] += len(cols)
        return cols


def _profiler_config():
    """torch's push/pop RecordFunction profiler, CPU only; no shapes, memory, stacks, flops or modules."""
    from torch import autograd
    from torch._C import _profiler as P

    return autograd.ProfilerConfig(autograd.ProfilerState.CPU, False, False, False, False, False,
                                   P._ExperimentalConfig())


def _probe() -> tuple[bool, str]:
    try:
        from torch import autograd
        from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: F401
        autograd._enable_profiler_legacy  # noqa: B018
        autograd._disable_profiler_legacy  # noqa: B018
        _profiler_config()
        return True, ""
    except ImportError:
        return False, "torch is not installed"
    except Exception as e:  # a torch without the push/pop profiler or global optimizer hooks
        return False, f"this torch has no thread-local operator profiler: {e}"


__all__ = ["CpuOpConfig", "CpuOpSource", "events_to_columns", "pair_events"]
