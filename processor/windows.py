"""Cut each rank's telemetry into windows and decide when a window is closed.

Three modes (``WindowConfig.mode``): ``auto`` (the default) cuts by
iterations whenever the rank sends iteration marks, and falls back to time
windows for a rank that has sent none within ``auto_wait_s`` of its own
clock (its kernels and phases wait, bounded, meanwhile). Time windows of a
job whose ranks step at different rates hold different iterations on
different ranks, so comparing them names whoever happened to fit one more
step in: iterations are the right unit whenever they exist. The two ways to
cut:

* ``time``: fixed-length windows aligned to multiples of ``length_ns`` on the
  rank's own clock (ARGUS §5.2 summarises "each time window"). Ranks are never
  compared by absolute timestamps; aligned boundaries only make windows of
  different ranks roughly cover the same period.
* ``iterations``: windows of ``iterations`` consecutive training iterations,
  taken from the rank's iteration marks. Clock-free, so the same window index
  means the same iterations on every rank: the natural choice for replayed
  traces, whose clocks are unrelated.

Closing rule (both modes): a window closes once the rank's *watermark* (the
latest end time seen in any signal of that rank) passes the window's end by
``lateness_ns`` — GPU activity is reported after the CPU has moved on — or
once the rank has been silent for ``idle_close_s`` of wall time, or on
``flush``. Records for a window that is already closed are dropped and
counted (``drops{where="late"}``).

Per-record work is numpy over whole batches; Python work is per batch, per
window and per string-table entry, never per kernel.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Callable, Iterator

import numpy as np

from trainscope.processor.model import ClosedWindow
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.contracts import WINDOW_MODES, WindowMode, one_of
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2

RankKey = tuple[str, int]  # (job_id, rank)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WindowConfig:
    mode: str = WindowMode.AUTO
    """``auto`` (iterations when the rank sends iteration marks, else time), ``time`` or ``iterations``."""
    length_s: float = 10.0
    """Window length in seconds, for ``time`` mode."""
    iterations: int = 10
    """Iterations per window, for ``iterations`` mode."""
    lateness_s: float = 2.0
    """How far (rank clock) the watermark must pass a window's end before it closes."""
    idle_close_s: float = 30.0
    """Close a rank's open windows after this much wall time without data from it."""
    max_open_windows_per_rank: int = 64
    """Bound on open windows per rank; the oldest is force-closed beyond it."""
    max_pending_events: int = 1_000_000
    """Iterations mode: bound on kernel events waiting for an iteration mark."""
    max_stacks_per_window: int = 1024
    """Bound on stack snapshots kept per rank and window (a hung rank keeps sending them)."""
    auto_wait_s: float = 20.0
    """Auto mode: how long (rank clock) a rank's data waits for a first iteration mark before
    the rank falls back to time windows."""
    max_names_per_rank: int = 50_000
    """Bound on a rank's interned kernel names: beyond it the table is rebuilt from the names
    its open windows still hold (ever-new names must not grow memory without end)."""
    rank_expire_s: float = 600.0
    """A rank with nothing open that has sent nothing for this long is forgotten (its state freed)."""

    def __post_init__(self) -> None:
        if self.mode not in WINDOW_MODES:
            raise ConfigError("window.mode", self.mode, f"must be {one_of(WINDOW_MODES)}")
        if not self.auto_wait_s > 0:
            raise ConfigError("window.auto_wait_s", self.auto_wait_s, "must be > 0")
        if not self.length_s > 0:
            raise ConfigError("window.length_s", self.length_s, "must be > 0")
        if self.iterations < 1:
            raise ConfigError("window.iterations", self.iterations, "must be >= 1")
        if self.lateness_s < 0:
            raise ConfigError("window.lateness_s", self.lateness_s, "must be >= 0")
        if not self.idle_close_s > 0:
            raise ConfigError("window.idle_close_s", self.idle_close_s, "must be > 0")
        if self.max_open_windows_per_rank < 1:
            raise ConfigError("window.max_open_windows_per_rank", self.max_open_windows_per_rank, "must be >= 1")
        if self.max_stacks_per_window < 1:
            raise ConfigError("window.max_stacks_per_window", self.max_stacks_per_window, "must be >= 1")
        if self.max_pending_events < 1:
            raise ConfigError("window.max_pending_events", self.max_pending_events, "must be >= 1")
        if self.max_names_per_rank < 1:
            raise ConfigError("window.max_names_per_rank", self.max_names_per_rank, "must be >= 1")
        if not self.rank_expire_s > 0:
            raise ConfigError("window.rank_expire_s", self.rank_expire_s, "must be > 0")

    @property
    def length_ns(self) -> int:
        return int(self.length_s * 1e9)

    @property
    def lateness_ns(self) -> int:
        return int(self.lateness_s * 1e9)


class _KernelChunks:
    """Kernel columns appended batch by batch; names already mapped to rank-global ids."""

    __slots__ = ("start", "dur", "gid", "stream", "kind", "n")

    def __init__(self) -> None:
        self.start: list[np.ndarray] = []
        self.dur: list[np.ndarray] = []
        self.gid: list[np.ndarray] = []
        self.stream: list[np.ndarray] = []
        self.kind: list[np.ndarray] = []
        self.n = 0

    def append(self, start, dur, gid, stream, kind) -> None:
        self.start.append(start)
        self.dur.append(dur)
        self.gid.append(gid)
        self.stream.append(stream)
        self.kind.append(kind)
        self.n += len(start)

    def columns(self, names: tuple[str, ...], device: int) -> KernelColumns:
        if not self.n:
            return KernelColumns.empty()
        cat = np.concatenate
        return KernelColumns(
            names=names, start_ns=cat(self.start), duration_ns=cat(self.dur),
            name_id=cat(self.gid), stream=cat(self.stream), kind=cat(self.kind), device=device,
        )


@dataclasses.dataclass(slots=True)
class _Open:
    index: int
    kernels: _KernelChunks = dataclasses.field(default_factory=_KernelChunks)
    phases: list = dataclasses.field(default_factory=list)
    iterations: list = dataclasses.field(default_factory=list)
    stacks: list = dataclasses.field(default_factory=list)
    kernel_iters: set = dataclasses.field(default_factory=set)   # iterations its kernel events fell in
    lo: int = 2**63  # earliest start seen (rank clock)
    hi: int = 0      # latest end seen


class _RankState:
    def __init__(self, resource: Resource, mode: str | None) -> None:
        self.resource = resource
        self.mode = mode                  # "time" | "iterations"; None: auto, not decided yet
        self.first_ns = 0                 # auto: earliest data seen (rank clock)
        self.waiting_phases: list = []    # auto, undecided: phases held until the mode is known
        self.waiting_stacks: list = []    # ... and stack snapshots
        self.name_ids: dict[str, int] = {}
        self.names: list[str] = []
        self.device = 0
        self.open: dict[int, _Open] = {}
        self.closed_upto = -1          # highest window index closed
        self.watermark = 0
        self.last_seen = time.monotonic()
        # iterations mode
        self.mark_iters: list[int] = []   # sorted iteration numbers
        self.mark_starts: list[int] = []  # their start_ns, same order
        self.mark_ends: list[int] = []
        self.pending = _KernelChunks()
        self.names_cap = 0  # set by the windower: max_names_per_rank, raised when open data needs more
        # the last batch's string table and its ids: a sender's batches mostly repeat it
        self.last_table: tuple[str, ...] | None = None
        self.last_lut: np.ndarray | None = None

    def chunks(self) -> Iterator[_KernelChunks]:
        yield self.pending
        for w in self.open.values():
            yield w.kernels

    def compact_names(self) -> int:
        """Rebuild the name table from the names the rank's open data still uses; returns
        how many names were dropped. Ids in every held chunk are rewritten to the new table."""
        used = [np.unique(g) for c in self.chunks() for g in c.gid]
        keep = np.unique(np.concatenate(used)) if used else np.empty(0, np.uint32)
        remap = np.zeros(len(self.names), dtype=np.uint32)
        remap[keep] = np.arange(len(keep), dtype=np.uint32)
        for c in self.chunks():
            c.gid = [remap[g] for g in c.gid]
        dropped = len(self.names) - len(keep)
        self.names = [self.names[i] for i in keep.tolist()]
        self.name_ids = {n: i for i, n in enumerate(self.names)}
        self.last_table = self.last_lut = None
        return dropped

    def lut(self, names) -> np.ndarray:
        """Map a batch's string table to this rank's global name ids (new names are appended).

        1. the same table as the last batch's: its ids again (one tuple comparison);
        2. else one ``dict.get`` per name, looped in C (``map``); 3. only names not seen
        before go through Python, in order, to be appended.
        """
        if names == self.last_table:
            return self.last_lut
        ids = list(map(self.name_ids.get, names))
        if None in ids:
            for i, n in enumerate(names):
                if ids[i] is None:
                    gid = self.name_ids.get(n)   # a name repeated within one table
                    if gid is None:
                        gid = self.name_ids[n] = len(self.names)
                        self.names.append(n)
                    ids[i] = gid
        out = np.array(ids, dtype=np.uint32)
        self.last_table, self.last_lut = tuple(names), out
        return out


class Windower:
    """Per-(job, rank) windows. Not thread-safe: one processing thread owns it."""

    def __init__(
        self,
        config: WindowConfig,
        emit: Callable[[ClosedWindow], None],
        metrics: SelfMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._emit = emit
        self.metrics = metrics or SelfMetrics()
        self._clock = clock
        self._ranks: dict[RankKey, _RankState] = {}

    # ---------------------------------------------------------------- input
    def _state(self, resource: Resource, progress: bool = True) -> _RankState:
        """The rank's state. Only progress signals (kernels, phases, iterations)
        count as activity for the idle rule: a hung rank still sends py-spy
        stacks, and its windows must close all the same."""
        key = (resource.job_id, resource.rank)
        st = self._ranks.get(key)
        if st is None:
            mode = None if self.config.mode == WindowMode.AUTO else self.config.mode
            st = self._ranks[key] = _RankState(resource, mode)
            self.metrics.set("ranks", len(self._ranks))
        elif progress and st.resource != resource:
            # a restarted process of the same rank (not the py-spy sidecar, which
            # sends the rank's stacks under its own pid)
            st.resource = resource
        if progress:
            st.last_seen = self._clock()
        return st

    def _window(self, st: _RankState, index: int) -> _Open | None:
        if index <= st.closed_upto:
            return None
        w = st.open.get(index)
        if w is None:
            w = st.open[index] = _Open(index)
            if len(st.open) > self.config.max_open_windows_per_rank:
                self._close(st, min(st.open), "bound")
        return w

    def add_kernels(self, resource: Resource, cols: KernelColumns) -> None:
        if not len(cols):
            return
        st = self._state(resource)
        st.device = cols.device
        if len(st.names) + len(cols.names) > max(st.names_cap, self.config.max_names_per_rank):
            dropped = st.compact_names()
            self.metrics.inc("names_evicted", dropped)
            # open windows may themselves hold more names than the cap: leave room above them
            st.names_cap = max(self.config.max_names_per_rank, 2 * len(st.names))
        gid = st.lut(cols.names)[cols.name_id]
        end_max = int((cols.start_ns + cols.duration_ns).max())
        start_min = int(cols.start_ns.min())
        self._note_first(st, start_min)
        if st.mode == WindowMode.TIME:
            length = self.config.length_ns
            if start_min // length == int(cols.start_ns.max()) // length:
                # the whole batch in one window (the common case): no per-record window index
                self._append_one(st, start_min // length, cols.start_ns, cols.duration_ns, gid,
                                 cols.stream, cols.kind, start_min, end_max)
            else:
                self._route(st, cols.start_ns // np.uint64(length),
                            cols.start_ns, cols.duration_ns, gid, cols.stream, cols.kind)
        else:
            st.pending.append(cols.start_ns, cols.duration_ns, gid, cols.stream, cols.kind)
            self._assign_pending(st, final=False)
        self._advance(st, end_max)

    def _append_one(self, st: _RankState, index: int, start, dur, gid, stream, kind, lo: int, hi: int) -> None:
        """``_route`` for records all in window ``index``, whose earliest start and latest end are known."""
        w = self._window(st, index)
        if w is None:
            self.metrics.inc("drops", len(start), where="late")
            return
        w.kernels.append(start, dur, gid, stream, kind)
        w.lo = min(w.lo, lo)
        w.hi = max(w.hi, hi)

    def _route(self, st: _RankState, widx: np.ndarray, start, dur, gid, stream, kind,
               iters: np.ndarray | None = None) -> None:
        """Append records to their windows; one slice per distinct window index. ``iters``
        (iterations mode): each record's iteration, kept per window as the iterations it covers."""
        if widx.shape[0] == 0:
            return
        first, last = int(widx[0]), int(widx[-1])
        if first == last and (widx == first).all():
            groups: Iterator = iter([(first, slice(None))])
        else:
            order = np.argsort(widx, kind="stable")
            sw = widx[order]
            uniq, at = np.unique(sw, return_index=True)
            bounds = list(at[1:]) + [len(sw)]
            groups = ((int(u), order[a:b]) for u, a, b in zip(uniq, at, bounds))
        for index, sel in groups:
            w = self._window(st, index)
            if w is None:
                n = len(start) if isinstance(sel, slice) else len(sel)
                self.metrics.inc("drops", n, where="late")
                continue
            s = start[sel]
            w.kernels.append(s, dur[sel], gid[sel], stream[sel], kind[sel])
            if iters is not None:
                w.kernel_iters.update(np.unique(iters[sel]).tolist())
            w.lo = min(w.lo, int(s.min()))
            w.hi = max(w.hi, int((s + dur[sel]).max()))

    def _assign_pending(self, st: _RankState, final: bool) -> None:
        """Iterations mode: give waiting kernel events to the iteration that holds them.

        An event at t belongs to the last iteration whose start <= t. It is
        only certain once t < that iteration's end, or once a later iteration
        is known; events past the last known end wait (bounded) unless final.
        """
        p = st.pending
        if not p.n or not st.mark_starts:
            if p.n > self.config.max_pending_events:
                self.metrics.inc("drops", p.n, where="pending")
                st.pending = _KernelChunks()
            return
        cols = p.columns(tuple(st.names), st.device)
        starts = np.asarray(st.mark_starts, dtype=np.uint64)
        pos = np.searchsorted(starts, cols.start_ns, side="right") - 1
        pos = np.maximum(pos, 0)  # events before the first mark: pre-roll of the first window
        if final:
            ready = np.ones(len(cols), dtype=bool)
        else:
            ready = (pos < len(starts) - 1) | (cols.start_ns < np.uint64(st.mark_ends[-1]))
        iters = np.asarray(st.mark_iters, dtype=np.int64)[pos[ready]]
        widx = iters // self.config.iterations
        r = cols.take(ready)
        self._route(st, widx, r.start_ns, r.duration_ns, r.name_id, r.stream, r.kind, iters)
        st.pending = _KernelChunks()
        if not ready.all():
            rest = cols.take(~ready)
            st.pending.append(rest.start_ns, rest.duration_ns, rest.name_id, rest.stream, rest.kind)
            if st.pending.n > self.config.max_pending_events:
                self.metrics.inc("drops", st.pending.n, where="pending")
                st.pending = _KernelChunks()

    def _note_first(self, st: _RankState, t: int) -> None:
        if st.mode is None and (not st.first_ns or t < st.first_ns):
            st.first_ns = t

    def _decide(self, st: _RankState, mode: str) -> None:
        """Auto mode: fix the rank's mode and hand it what waited (module docstring)."""
        st.mode = mode
        waiting, st.waiting_phases = st.waiting_phases, []
        if mode == WindowMode.TIME and st.pending.n:
            cols = st.pending.columns(tuple(st.names), st.device)
            st.pending = _KernelChunks()
            self._route(st, cols.start_ns // np.uint64(self.config.length_ns), cols.start_ns,
                        cols.duration_ns, cols.name_id, cols.stream, cols.kind)
        if waiting:
            self.add_phases(st.resource, waiting, st)
        stacks, st.waiting_stacks = st.waiting_stacks, []
        if stacks:
            self.add_stacks(st.resource, stacks)
        self.metrics.inc("window_mode_decided", 1, mode=mode)

    def _index_for_time(self, st: _RankState, t: int) -> int | None:
        if st.mode == WindowMode.TIME:
            return t // self.config.length_ns
        if not st.mark_starts:
            return None
        i = max(bisect.bisect_right(st.mark_starts, t) - 1, 0)
        return st.mark_iters[i] // self.config.iterations

    def add_phases(self, resource: Resource, phases, st: _RankState | None = None) -> None:
        st = st or self._state(resource)
        if st.mode is None:                 # auto, undecided: wait (bounded) for the mode
            for ph in phases:
                self._note_first(st, ph.start_ns)
            st.waiting_phases.extend(phases)
            if len(st.waiting_phases) > self.config.max_pending_events:
                self.metrics.inc("drops", len(st.waiting_phases), where="pending")
                st.waiting_phases = []
            self._advance(st, max((p.start_ns + p.duration_ns for p in phases), default=0))
            return
        hi = 0
        for ph in phases:
            if st.mode == WindowMode.ITERATIONS:
                index = ph.iteration // self.config.iterations
            else:
                index = ph.start_ns // self.config.length_ns
            w = self._window(st, index)
            end = ph.start_ns + ph.duration_ns
            if w is None:
                self.metrics.inc("drops", 1, where="late")
                continue
            w.phases.append(ph)
            w.lo, w.hi = min(w.lo, ph.start_ns), max(w.hi, end)
            hi = max(hi, end)
        self._advance(st, hi)

    def add_iterations(self, resource: Resource, marks) -> None:
        st = self._state(resource)
        if st.mode is None and len(marks):
            self._decide(st, WindowMode.ITERATIONS)
        hi = 0
        for m in marks:
            if st.mode == WindowMode.ITERATIONS:
                index = m.iteration // self.config.iterations
                j = bisect.bisect_left(st.mark_iters, m.iteration)
                if j < len(st.mark_iters) and st.mark_iters[j] == m.iteration:
                    self.metrics.inc("records_rejected", 1, reason="duplicate_iteration")
                    continue
                st.mark_iters.insert(j, m.iteration)
                st.mark_starts.insert(j, m.start_ns)
                st.mark_ends.insert(j, m.end_ns)
            else:
                index = m.start_ns // self.config.length_ns
            w = self._window(st, index)
            if w is None:
                self.metrics.inc("drops", 1, where="late")
                continue
            w.iterations.append(m)
            w.lo, w.hi = min(w.lo, m.start_ns), max(w.hi, m.end_ns)
            hi = max(hi, m.end_ns)
        if st.mode == WindowMode.ITERATIONS:
            self._assign_pending(st, final=False)
        self._advance(st, hi)

    def add_stacks(self, resource: Resource, snapshots) -> None:
        st = self._state(resource, progress=False)
        if st.mode is None:                 # auto, undecided: stacks wait with the phases
            st.waiting_stacks.extend(snapshots)
            if len(st.waiting_stacks) > self.config.max_stacks_per_window:
                self.metrics.inc("drops", len(st.waiting_stacks) - self.config.max_stacks_per_window,
                                 where="stacks")
                del st.waiting_stacks[: len(st.waiting_stacks) - self.config.max_stacks_per_window]
            return
        hi = 0
        for s in snapshots:
            index = self._index_for_time(st, s.window_start_ns)
            if index is None:
                index = st.closed_upto + 1 if not st.open else max(st.open)
            w = self._window(st, index)
            if w is None:
                self.metrics.inc("drops", 1, where="late")
                continue
            if len(w.stacks) >= self.config.max_stacks_per_window:
                self.metrics.inc("drops", 1, where="stacks")
                continue
            w.stacks.append(s)
            hi = max(hi, s.window_end_ns)
        if st.mode == WindowMode.TIME:
            self._advance(st, hi)

    # -------------------------------------------------------------- closing
    def _advance(self, st: _RankState, t: int) -> None:
        if t > st.watermark:
            st.watermark = t
        if st.mode is None:
            if st.first_ns and st.watermark - st.first_ns >= int(self.config.auto_wait_s * 1e9):
                self._decide(st, WindowMode.TIME)     # no iteration marks: time windows
            else:
                return
        horizon = st.watermark - self.config.lateness_ns
        if st.mode == WindowMode.TIME:
            for index in sorted(st.open):
                if (index + 1) * self.config.length_ns <= horizon:
                    self._close(st, index, "watermark")
                else:
                    break
        elif st.mark_iters:
            # window k is over once an iteration of a later window started before the horizon
            for index in sorted(st.open):
                nxt = bisect.bisect_left(st.mark_iters, (index + 1) * self.config.iterations)
                if nxt < len(st.mark_iters) and st.mark_starts[nxt] <= horizon:
                    self._close(st, index, "watermark")
                else:
                    break

    def _close(self, st: _RankState, index: int, trigger: str, final: bool = False) -> None:
        t0 = time.perf_counter()
        w = st.open.pop(index)
        st.closed_upto = max(st.closed_upto, index)
        if st.mark_iters:
            # forget the marks of closed windows but their latest: it still maps older (late)
            # events to a closed window, so nothing is routed differently (they grew for ever)
            k = bisect.bisect_left(st.mark_iters, (st.closed_upto + 1) * self.config.iterations) - 1
            if k > 0:
                del st.mark_iters[:k], st.mark_starts[:k], st.mark_ends[:k]
        window = records_pb2.Window(index=index, final=final)
        if st.mode == WindowMode.TIME:
            window.kind = records_pb2.WINDOW_KIND_TIME
            window.start_ns = index * self.config.length_ns
            window.end_ns = (index + 1) * self.config.length_ns
        else:
            window.kind = records_pb2.WINDOW_KIND_ITERATIONS
            window.start_ns = w.lo if w.lo < 2**63 else 0
            window.end_ns = w.hi
            window.first_iteration = index * self.config.iterations
            window.last_iteration = (index + 1) * self.config.iterations - 1
        cw = ClosedWindow(
            resource=st.resource, window=window,
            kernels=w.kernels.columns(tuple(st.names), st.device),
            phases=tuple(w.phases), iterations=tuple(w.iterations), stacks=tuple(w.stacks),
            kernel_iterations=len(w.kernel_iters),
        )
        self.metrics.inc("windows_closed", 1, trigger=trigger)
        self._emit(cw)
        self.metrics.inc("window_close_seconds_sum", time.perf_counter() - t0)
        self.metrics.set_max("window_close_seconds_max", time.perf_counter() - t0)

    def finish_rank(self, resource: Resource) -> None:
        """The rank's process shut down normally: close its windows now, the last
        one marked ``final`` (an empty final window when nothing was open)."""
        st = self._state(resource)
        self._settle_pending(st)
        if not st.open:
            self._window(st, st.closed_upto + 1)
        last = max(st.open) if st.open else None
        for index in sorted(st.open):
            self._close(st, index, "final", final=index == last)
        del self._ranks[(resource.job_id, resource.rank)]
        self.metrics.set("ranks", len(self._ranks))

    def close_idle(self) -> None:
        """Close every window of ranks silent for ``idle_close_s`` (call periodically)."""
        now = self._clock()
        expired = 0
        for key, st in list(self._ranks.items()):
            if (st.open or st.pending.n) and now - st.last_seen >= self.config.idle_close_s:
                self._flush_rank(st, "idle")
            elif (not st.open and not st.pending.n and not st.waiting_phases and not st.waiting_stacks
                  and now - st.last_seen >= self.config.rank_expire_s):
                del self._ranks[key]  # a rank gone for good (job over): free its names and marks
                expired += 1
        if expired:
            self.metrics.inc("ranks_expired", expired)
            self.metrics.set("ranks", len(self._ranks))
        self.metrics.set("open_windows", self.open_windows)

    def flush(self) -> None:
        """Close everything that is open (shutdown, end of a replay)."""
        for st in list(self._ranks.values()):
            self._flush_rank(st, "flush")
        self.metrics.set("open_windows", 0)

    def _settle_pending(self, st: _RankState) -> None:
        """Iterations mode, closing time: kernels still waiting for a mark go to
        the iteration that holds them, or, if the rank never reported an
        iteration, into one window of their own (nothing is dropped). An auto
        rank still undecided at closing time never sent a mark: time windows."""
        if st.mode is None:
            self._decide(st, WindowMode.TIME)
        if st.mode != WindowMode.ITERATIONS or not st.pending.n:
            return
        if st.mark_starts:
            self._assign_pending(st, final=True)
            return
        w = self._window(st, st.closed_upto + 1)
        if w is not None:
            p = st.pending
            for parts in zip(p.start, p.dur, p.gid, p.stream, p.kind):
                w.kernels.append(*parts)
                w.lo = min(w.lo, int(parts[0].min()))
                w.hi = max(w.hi, int((parts[0] + parts[1]).max()))
        st.pending = _KernelChunks()

    def _flush_rank(self, st: _RankState, trigger: str) -> None:
        self._settle_pending(st)
        for index in sorted(st.open):
            self._close(st, index, trigger)

    @property
    def open_windows(self) -> int:
        return sum(len(st.open) for st in self._ranks.values())
