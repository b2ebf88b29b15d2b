"""One rank's critical path over the profiling window (EROICA §4.2, Figure 9).

A function's execution (or part of it) is on the critical path iff no
higher-priority function executes at that time. Priorities, high to low:
GPU compute kernels > memory operations (memcpy, memset) > collective
communication kernels (NCCL) > host functions (CPU ops, Python functions,
CUDA runtime calls). Host functions count only on the training thread and
only when innermost (no executing child call) — EROICA's rule for Python.

Steps (vectorised: sorts, ``searchsorted`` and prefix sums; the one loop over
events is step 3's stack pass over host events):
1. Window: from the first ``ProfilerStep`` start to the last one's end (the
   iterations the deep dive covers on every rank); without marks, the span
   of the events. Events are clipped to it.
2. Levels: every event gets its priority (0 = not a candidate: other
   threads' host events, runtime calls off the training thread).
3. Host nesting, per CPU thread: parent = the nearest enclosing event still
   open at an event's start (one stack pass). Assumption: a thread's events
   nest (Kineto records them as a call tree); a child that outlives its
   parent by a few ns is still attributed by the time checks of step 5.
4. Elementary segments: the sorted, distinct start/end times of all
   candidates. At each segment's midpoint, the number of running events of
   each level (two ``searchsorted``); the segment's level is the highest with
   one running.
5. Owner of each segment within its level: device levels — of the events
   started by then, the one that ends last (prefix arg-max of the ends);
   host — the last started event, walked up its parents until one still
   runs (pointer jumping, as many rounds as the deepest nesting).
6. Per-event critical time = sum of the lengths of the segments it owns
   (``bincount``). Segments with nothing running are idle, off the path.
7. Launchers (kernel -> CPU op / Python function): the runtime call with the
   kernel's correlation id, and that call's parent on its thread. A CPU op or
   a built-in (``<built-in function collect>``) of the training thread (not a
   collective's) gets its caller instead: the
   nearest enclosing Python function that is neither a built-in nor an op —
   on a CPU job the user's function behind an ``aten::mul`` (an unfused
   sequence of small ops shows as ops called from one ``forward``).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from trainscope.analyzer.deepdive.trace import (
    ANNOTATION, CPU_OP, KERNEL, MEMCPY, MEMSET, PYTHON, RUNTIME, TraceColumns,
)

IDLE, HOST, COMM, MEMORY, COMPUTE = range(5)
LEVEL_NAMES = ("idle", "host", "communication", "memory", "compute")
_HOST_CATS = (CPU_OP, PYTHON, ANNOTATION, RUNTIME)
_COMM_KERNEL = re.compile(r"nccl|rccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|sendrecv", re.I)
#: Host functions that are collectives (gloo/NCCL front ends): their kind is "communication".
COMM_HOST = re.compile(r"^(nccl|gloo|c10d|mpi|ucc):|^c10d::|record_param_comms|distributed_c10d\.py|"
                       r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|\bbarrier\b|"
                       r"(^|[._ :])(send|recv|isend|irecv)\b", re.I)


@dataclasses.dataclass(frozen=True, slots=True)
class CriticalPath:
    """Steps 1-7 for one rank. Times in µs as in the trace."""

    trace: TraceColumns
    t0: float
    t1: float
    iterations: int                # ProfilerStep spans in the window (0 when unmarked)
    level: np.ndarray              # int8 per event (step 2)
    seg_start: np.ndarray          # float64 per segment
    seg_end: np.ndarray
    seg_level: np.ndarray          # int8 per segment
    seg_owner: np.ndarray          # int64 event index per segment, -1 when idle
    critical: np.ndarray           # float64 µs per event (step 6)
    launcher: np.ndarray           # int32 name id per event of the CPU op that launched it, -1 when unknown
    training_tid: int

    @property
    def window_us(self) -> float:
        return self.t1 - self.t0

    def idle_gaps(self) -> np.ndarray:
        """µs of each stretch of the window where nothing traced runs (off the path)."""
        busy = self.seg_level > IDLE
        s, e = self.seg_start[busy], self.seg_end[busy]
        if s.size == 0:
            return np.array([self.window_us]) if self.window_us > 0 else np.zeros(0)
        starts = np.concatenate([[self.t0], e])
        ends = np.concatenate([s, [self.t1]])
        g = ends - starts
        return g[g > 0]

    def time_by_level(self) -> dict[str, float]:
        """µs of the window at each level (idle included)."""
        t = np.bincount(self.seg_level.astype(np.int64), weights=self.seg_end - self.seg_start, minlength=5)
        out = {LEVEL_NAMES[i]: float(t[i]) for i in range(5)}
        out["idle"] += self.window_us - float(t.sum())       # gaps before/after the first/last boundary
        return out


def _training_tid(tr: TraceColumns) -> int:
    host = np.isin(tr.cat, (CPU_OP, PYTHON, ANNOTATION))
    if tr.step_tid >= 0 and (tr.tid[host] == tr.step_tid).any():
        return tr.step_tid
    if not host.any():
        return -1
    return int(tr.tid[host][np.argmax(tr.dur[host])])   # the thread of the outermost span (the loop)


def _nesting(start: np.ndarray, end: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Step 3: parent index (into the given arrays) of each host event, -1 at the top.

    One pass with a stack per thread over the events in (start, longest first)
    order. This is the one per-event Python loop of the analysis (about
    50 ns per event): the nearest enclosing open event is a stack question,
    and numpy has no scan that answers it exactly.
    """
    parent = np.full(start.size, -1, dtype=np.int64)
    for t in np.unique(tid):
        idx = np.flatnonzero(tid == t)
        o = idx[np.lexsort((-(end[idx] - start[idx]), start[idx]))]
        par = [-1] * o.size
        stack_i: list[int] = []
        stack_e: list[float] = []
        for i, (s, e) in enumerate(zip(start[o].tolist(), end[o].tolist())):
            while stack_e and stack_e[-1] <= s:
                stack_e.pop()
                stack_i.pop()
            if stack_i:
                par[i] = stack_i[-1]
            stack_i.append(i)
            stack_e.append(e)
        par_a = np.asarray(par, dtype=np.int64)
        has = par_a >= 0
        parent[o[has]] = o[par_a[has]]
    return parent


def critical_path(tr: TraceColumns) -> CriticalPath:
    """Steps 1-7 (see the module docstring)."""
    # 1. window
    if tr.steps.shape[0]:
        t0, t1 = float(tr.steps[0, 0]), float(tr.steps[-1, 1])
        iterations = int(tr.steps.shape[0])
    else:
        t0, t1 = float(tr.ts.min()), float((tr.ts + tr.dur).max())
        iterations = 0
    start = np.clip(tr.ts, t0, t1)
    end = np.clip(tr.ts + tr.dur, t0, t1)
    live = end > start
    # 2. levels
    comm_name = np.fromiter((bool(_COMM_KERNEL.search(n)) for n in tr.names), dtype=bool, count=len(tr.names))
    level = np.zeros(tr.ts.size, dtype=np.int8)
    is_kernel = tr.cat == KERNEL
    level[is_kernel] = np.where(comm_name[tr.name[is_kernel]], COMM, COMPUTE)
    level[(tr.cat == MEMCPY) | (tr.cat == MEMSET)] = MEMORY
    tid0 = _training_tid(tr)
    host_any = np.isin(tr.cat, _HOST_CATS)
    level[host_any & (tr.tid == tid0)] = HOST
    level[~live] = IDLE
    # 3. nesting of every CPU thread (for host owners and for launchers)
    hidx = np.flatnonzero(host_any)
    hparent_local = _nesting(tr.ts[hidx], tr.ts[hidx] + tr.dur[hidx], tr.tid[hidx])
    parent = np.full(tr.ts.size, -1, dtype=np.int64)
    has = hparent_local >= 0
    parent[hidx[has]] = hidx[hparent_local[has]]
    # 4. elementary segments and running counts per level
    cand = np.flatnonzero(level > IDLE)
    bounds = np.unique(np.concatenate([start[cand], end[cand]]))
    if bounds.size < 2:
        z = np.zeros(0)
        return CriticalPath(tr, t0, t1, iterations, level, z, z, z.astype(np.int8), z.astype(np.int64),
                            np.zeros(tr.ts.size), np.full(tr.ts.size, -1, np.int32), tid0)
    seg_s, seg_e = bounds[:-1], bounds[1:]
    mid = 0.5 * (seg_s + seg_e)
    seg_level = np.zeros(mid.size, dtype=np.int8)
    owner = np.full(mid.size, -1, dtype=np.int64)
    for lv in (COMPUTE, MEMORY, COMM, HOST):
        ev = cand[level[cand] == lv]
        if ev.size == 0:
            continue
        free = seg_level == IDLE
        if lv == HOST:
            o = ev[np.lexsort((-(end[ev] - start[ev]), start[ev]))]
        else:
            o = ev[np.argsort(start[ev], kind="stable")]
        s_sorted = start[o]
        k = np.searchsorted(s_sorted, mid, side="right") - 1
        running = (k + 1) - np.searchsorted(np.sort(end[o]), mid, side="right")
        here = free & (running > 0)
        if not here.any():
            continue
        seg_level[here] = lv
        kk = k[here]
        # 5. owner within the level
        e_o = end[o]
        pm = np.maximum.accumulate(e_o)
        longest = o[np.maximum.accumulate(np.where(e_o >= pm, np.arange(o.size), 0))[kk]]
        if lv != HOST:
            owner[here] = longest
        else:
            cur = o[kk]
            m = mid[here]
            dead = end[cur] <= m
            for _ in range(4096):                     # bounded by the deepest nesting
                if not dead.any():
                    break
                nxt = parent[cur[dead]]
                # a parent off the training thread or not a candidate stops the walk
                nxt = np.where((nxt >= 0) & (level[np.maximum(nxt, 0)] == HOST), nxt, -1)
                cur[dead] = nxt
                dead = (cur >= 0) & (end[np.maximum(cur, 0)] <= m)
            # a child outliving every running ancestor (not nested): the running one that ends last
            owner[here] = np.where(cur >= 0, cur, longest)
    # 6. per-event critical time
    on = owner >= 0
    critical = np.bincount(owner[on], weights=(seg_e - seg_s)[on], minlength=tr.ts.size)
    # 7. launchers
    launcher = np.full(tr.ts.size, -1, dtype=np.int32)
    rt = np.flatnonzero((tr.cat == RUNTIME) & (tr.correlation >= 0))
    dev = np.flatnonzero(np.isin(tr.cat, (KERNEL, MEMCPY, MEMSET)) & (tr.correlation >= 0))
    if rt.size and dev.size:
        o = np.argsort(tr.correlation[rt], kind="stable")
        rc = tr.correlation[rt][o]
        j = np.clip(np.searchsorted(rc, tr.correlation[dev]), 0, rc.size - 1)
        hit = rc[j] == tr.correlation[dev]
        caller = parent[rt[o[j[hit]]]]
        for _ in range(8):              # a runtime call inside a runtime call: up to the op around them
            inner = (caller >= 0) & (tr.cat[np.maximum(caller, 0)] == RUNTIME)
            if not inner.any():
                break
            caller[inner] = parent[caller[inner]]
        launcher[dev[hit]] = np.where(caller >= 0, tr.name[np.maximum(caller, 0)], -1)
    # 7b. callers of the training thread's CPU ops: the nearest enclosing Python function that is not a
    # built-in (``<built-in method tanh ...>``) nor another op, i.e. the user's code that ran the op
    builtin = np.fromiter((n.startswith("<built-in") for n in tr.names), dtype=bool, count=len(tr.names))
    ops = np.flatnonzero(((tr.cat == CPU_OP) | ((tr.cat == PYTHON) & builtin[tr.name])) & (level == HOST))
    if ops.size:
        comm_op = np.fromiter((bool(COMM_HOST.search(n)) for n in tr.names), dtype=bool, count=len(tr.names))
        ops = ops[~comm_op[tr.name[ops]]]       # a collective's front end keeps no caller (its scope stays the op)
        user = (tr.cat == PYTHON) & ~builtin[tr.name]
        cur = parent[ops]
        for _ in range(256):                     # bounded by the deepest nesting
            up = (cur >= 0) & ~user[np.maximum(cur, 0)]
            if not up.any():
                break
            cur[up] = parent[cur[up]]
        launcher[ops] = np.where(cur >= 0, tr.name[np.maximum(cur, 0)], -1)
    return CriticalPath(trace=tr, t0=t0, t1=t1, iterations=iterations, level=level, seg_start=seg_s,
                        seg_end=seg_e, seg_level=seg_level, seg_owner=owner, critical=critical,
                        launcher=launcher, training_tid=tid0)
