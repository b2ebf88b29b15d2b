"""Runtime behaviour pattern of every function on one rank (EROICA §4.2, eq. 1-5).

EROICA's pattern is P_{f,w} = (β, μ, σ): β the share of the profiling window
that f spends on w's critical path (eq. 2), μ and σ the mean and spread of a
hardware utilisation over f's *critical execution durations* (eq. 4-5,
Algorithm 1). A Kineto trace has no utilisation samples (EROICA takes them
from nsys at 10 kHz), so here μ and σ are the mean and standard deviation of
the critical durations themselves (seconds per execution): what Algorithm 1
would give with a constant utilisation over each execution, and what a slower
GPU, a throttled link or a slower Python function changes.

Steps:
1. Critical duration of each execution e of f: the time e owns on the
   critical path (``critical_path`` step 6); executions that never reach the
   path (fully overlapped) have none and are left out of μ and σ, as
   Algorithm 1 leaves out the parts of an execution without activity.
2. β_f = Σ_e L(e) / |T|, μ_f = mean L(e), σ_f = std L(e) over the executions
   with L(e) > 0; n_f = their count. One ``bincount`` per statistic.
3. The time nothing traced runs (GPU idle while the training thread is in
   no traced function; all of the GPU-idle time in a trace with kernels
   only) is one more function, ``IDLE`` (kind "idle"), one execution per
   gap: EROICA has no such entry because its traces always hold the host
   functions; without them an idle GPU would be invisible to localisation.
4. Steadiness: β per iteration (the critical time of the executions that
   start in each ``ProfilerStep`` over that step's length), and its lower
   quartile over the iterations, ``beta_steady``: a function that costs more
   in every iteration (a hot loop) moves it, stalls of a few iterations (the
   scheduler preempting a rank on a shared host, a GIL hand-off) do not
   (``localize``'s steadiness rule). The median was not enough: on a loaded
   2-core host a healthy rank's ``aten::addmm`` cost [5.1, 0.6, 0.5, 6.5] ms
   in a 4-iteration dive (peers 0.5 ms), preempted in two iterations of four,
   and a healthy rank was named for ``aten::cat`` or ``aten::copy_``. Without
   iteration marks, or for the idle pseudo-function, it is β.
5. Other threads (:func:`thread_patterns`, an addition): the training
   thread's path cannot show *what* slows it when another thread of the
   process takes the CPU or the GIL (it only shows its own functions
   taking longer). For the Python functions of every other thread: its
   self time (clipped to the window, minus its callees'; the caller from
   ``Python parent id``, cut at a thread's ``threading.py: _bootstrap``
   root), β = Σ self time / window, kind ``thread``; ``localize`` compares
   them across ranks apart from the path. trainscope's own threads (a
   thread is the frames under one root; ours when one of them is a
   collector frame) are left out: their parked frames differ by rank.
6. Typical execution (an addition): μ̃, the median critical duration per
   execution. The scheduler preempting a rank inflates the few executions it
   interrupts (a healthy rank's ``aten::addmm`` averaged 2.0 ms per execution
   against its peers' 0.7-1.0 ms beside a busy process); a slower device
   moves every execution, and μ̃ with it. ``localize`` measures the distance
   from the expected range on μ̃ and on step 4's steady β.
7. Waiting for peers (an addition, for ``localize`` step 8): per iteration,
   the critical time in collectives and c10d's ``Work.wait``
   (``peer_waits``): how long the rank waited for the last of its peers to
   arrive. Not a ``time.sleep`` or a data loader's queue: a rank whose own
   thread held the GIL woke up late from its sleep (12 ms per iteration in a
   6-rank dive beside a busy process), which is its own slowness.
8. Function identity: its name (a kernel's demangled name, an op's name, a
   Python function's ``file(line): name``). EROICA keys Python functions by
   their whole call stack; Kineto's name already carries file and line, and
   the stack is left out (a known simplification).
"""
from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from trainscope.analyzer.deepdive.critical_path import (
    COMM, COMM_HOST, COMPUTE, MEMORY, CriticalPath,
)
from trainscope.analyzer.deepdive.trace import PYTHON, RUNTIME

#: Kinds of function (what EROICA's expected ranges are given for, §4.3).
KINDS = ("compute", "memory", "communication", "python", "cpu", "runtime", "idle", "thread")
#: The pseudo-function of step 3.
IDLE = "(idle: nothing traced running)"
#: Kind of the functions of other threads (step 6): not on the critical path, compared apart.
THREAD = "thread"
#: A thread's outermost frame: Kineto chains the stacks of threads already running when profiling
#: began one after the other on one pseudo-thread, each root given the previous stack's leaf as caller.
#: trainscope's own frames (editable checkout or installed package): its threads are not the job's.
_OWN = re.compile(r"(^|/)trainscope/collector/|^" + re.escape(os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "collector", "")))
_THREAD_ROOT = re.compile(r"(^|/)threading\.py(\(\d+\))?: _bootstrap$")


@dataclasses.dataclass(frozen=True, slots=True)
class Patterns:
    """Step 2 for every function of one rank that was on its critical path."""

    functions: tuple[str, ...]
    kinds: tuple[str, ...]
    beta: np.ndarray        # share of the window, [0, 1]
    mu: np.ndarray          # s per execution
    sigma: np.ndarray       # s
    count: np.ndarray       # executions on the path
    launched_by: tuple[str, ...]   # the CPU op / Python function behind most of its critical time, "" if none
    window_s: float
    iterations: int
    beta_steady: np.ndarray | None = None   # step 4: lower quartile over iterations of β per iteration; None: β
    mu_median: np.ndarray | None = None     # step 6: median s per execution; None: μ
    peer_waits: np.ndarray | None = None    # step 7: s per iteration waiting for peers; None: no iteration marks

    def as_dict(self) -> dict[str, tuple[float, float, float]]:
        return {f: (float(b), float(m), float(s)) for f, b, m, s in zip(self.functions, self.beta, self.mu, self.sigma)}


def _kind(level: int, cat: int, name: str) -> str:
    if level == COMPUTE:
        return "compute"
    if level == MEMORY:
        return "memory"
    if level == COMM or COMM_HOST.search(name):
        return "communication"
    if cat == PYTHON:
        return "python"
    if cat == RUNTIME:
        return "runtime"
    return "cpu"


def behaviour_patterns(cp: CriticalPath) -> Patterns:
    """Steps 1-3."""
    tr = cp.trace
    nn = len(tr.names)
    on = cp.critical > 0
    crit_s = cp.critical * 1e-6
    total = np.bincount(tr.name[on], weights=crit_s[on], minlength=nn)
    n = np.bincount(tr.name[on], minlength=nn)
    sq = np.bincount(tr.name[on], weights=crit_s[on] ** 2, minlength=nn)
    keep = np.flatnonzero(n > 0)
    window_s = cp.window_us * 1e-6
    mu = total[keep] / n[keep]
    var = np.maximum(sq[keep] / n[keep] - mu ** 2, 0.0)
    # kind and launcher of each function: from its first execution on the path / the launcher (a kernel's
    # CPU op, a CPU op's calling Python function) of most of its critical time
    first = np.full(nn, -1, dtype=np.int64)
    idx = np.flatnonzero(on)
    first[tr.name[idx[::-1]]] = idx[::-1]
    kinds = tuple(_kind(int(cp.level[first[f]]), int(tr.cat[first[f]]), tr.names[f]) for f in keep)
    launched = np.full(nn, -1, dtype=np.int64)
    lk = on & (cp.launcher >= 0)
    if lk.any():
        pair = tr.name[lk].astype(np.int64) * (nn + 1) + cp.launcher[lk]
        u, inv = np.unique(pair, return_inverse=True)
        c = np.bincount(inv.reshape(-1), weights=cp.critical[lk])
        o = np.lexsort((c, u // (nn + 1)))          # per function, the launcher of most critical time last
        launched[u[o] // (nn + 1)] = u[o] % (nn + 1)
    launched_by = tuple(tr.names[launched[f]] if launched[f] >= 0 else "" for f in keep)
    funcs = tuple(tr.names[f] for f in keep)
    beta = total[keep] / window_s if window_s > 0 else np.zeros(keep.size)
    sigma, count = np.sqrt(var), n[keep]
    per = _per_iteration(cp)
    beta_steady = _beta_steady(per, keep, beta)          # step 4
    peer_waits = _peer_waits(per, keep, funcs, kinds)   # step 7
    mu_median = _group_median(tr.name[on], crit_s[on], keep)    # step 6
    gaps = cp.idle_gaps() * 1e-6
    if gaps.size and window_s > 0:                      # step 3
        funcs, kinds, launched_by = funcs + (IDLE,), kinds + ("idle",), launched_by + ("",)
        beta = np.append(beta, gaps.sum() / window_s)
        mu = np.append(mu, gaps.mean())
        sigma = np.append(sigma, gaps.std())
        count = np.append(count, gaps.size)
        beta_steady = np.append(beta_steady, beta[-1])
        mu_median = np.append(mu_median, np.median(gaps))
    return Patterns(functions=funcs, kinds=kinds, beta=beta, mu=mu, sigma=sigma, count=count,
                    launched_by=launched_by, window_s=window_s, iterations=cp.iterations, beta_steady=beta_steady,
                    mu_median=mu_median, peer_waits=peer_waits)


def _group_median(keys: np.ndarray, values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Step 6: the median of ``values`` per key, for the keys in ``keep`` (sorted, each present)."""
    if keep.size == 0:
        return np.zeros(0)
    o = np.lexsort((values, keys))
    k, v = keys[o], values[o]
    lo = np.searchsorted(k, keep, side="left")
    n = np.searchsorted(k, keep, side="right") - lo
    return 0.5 * (v[lo + (n - 1) // 2] + v[lo + n // 2])


#: Step 4: the quantile over iterations of a function's share of each iteration that must be out of line:
#: the lower quartile, so it is in at least about three iterations of four (at 4 iterations, 0.25 lies
#: three quarters of the way from the lowest to the second lowest).
STEADY_QUANTILE = 0.25


def _per_iteration(cp: CriticalPath) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps 4 and 7: the critical time (µs) of every name in every ``ProfilerStep`` (names, iterations), by
    the executions that start in it, and the steps' lengths (µs); None with fewer than two iteration marks."""
    tr = cp.trace
    steps = tr.steps
    if steps.shape[0] < 2:
        return None
    on = np.flatnonzero(cp.critical > 0)
    it = np.searchsorted(steps[:, 0], tr.ts[on], side="right") - 1
    inside = (it >= 0) & (tr.ts[on] < steps[np.maximum(it, 0), 1])
    on, it = on[inside], it[inside]
    n_it, nn = steps.shape[0], len(tr.names)
    per = np.bincount(tr.name[on].astype(np.int64) * n_it + it, weights=cp.critical[on],
                      minlength=nn * n_it).reshape(nn, n_it)
    return per, np.maximum(steps[:, 1] - steps[:, 0], 1e-9)


def _beta_steady(per: tuple[np.ndarray, np.ndarray] | None, keep: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Step 4: per function (``keep``), the lower quartile over iterations of its share of each iteration."""
    if per is None or per[1].size < 3:
        return beta.copy()
    return np.quantile(per[0][keep] / per[1][None, :], STEADY_QUANTILE, axis=1)


#: Step 7: c10d's ``Work.wait`` (``<built-in method wait of ...>``), under every gloo/NCCL collective a
#: Python training loop runs: with the communication kind, where a rank waits for its peers.
PEER_WAIT = re.compile(r"built-in method wait\b")


def waits_for_peers(function: str, kind: str) -> bool:
    """Step 7: time in ``function`` is time waiting for other ranks (a collective or its ``Work.wait``); a
    ``time.sleep`` or a data loader's queue is not (a rank longer in it is slower itself, or woke late)."""
    return kind == "communication" or bool(PEER_WAIT.search(function))


def _peer_waits(per: tuple[np.ndarray, np.ndarray] | None, keep: np.ndarray, funcs: tuple[str, ...],
                kinds: tuple[str, ...]) -> np.ndarray | None:
    """Step 7: s per iteration on the path waiting for peers; None with fewer than two iteration marks."""
    if per is None:
        return None
    wait = np.fromiter((waits_for_peers(f, k) for f, k in zip(funcs, kinds)), dtype=bool, count=len(funcs))
    return per[0][keep[wait]].sum(axis=0) * 1e-6


def thread_patterns(cp: CriticalPath) -> Patterns:
    """Step 5: self time of the Python functions of threads other than the training thread.

    A CPU-bound Python loop on a helper thread is its own innermost frame for
    the whole window; a blocked thread's innermost frame (``wait``, ``get``)
    is too, on every rank alike: ``localize`` tells them apart by comparing
    ranks. Empty when the trace has no ``Python id`` columns.
    """
    tr = cp.trace
    window_s = cp.window_us * 1e-6
    empty = Patterns(functions=(), kinds=(), beta=np.zeros(0), mu=np.zeros(0), sigma=np.zeros(0),
                     count=np.zeros(0, dtype=np.int64), launched_by=(), window_s=window_s,
                     iterations=cp.iterations, beta_steady=np.zeros(0))
    if (tr.py_id is None or tr.py_parent is None or window_s <= 0
            or tr.py_id.size != tr.ts.size or tr.py_parent.size != tr.ts.size):   # columns rebuilt without them
        return empty
    py = np.flatnonzero((tr.cat == PYTHON) & (tr.tid != cp.training_tid) & (tr.py_id >= 0))
    if py.size == 0:
        return empty
    nn = len(tr.names)
    t = np.clip(tr.ts[py], cp.t0, cp.t1)
    own = np.clip(tr.ts[py] + tr.dur[py], cp.t0, cp.t1) - t
    root = np.fromiter((bool(_THREAD_ROOT.search(n)) for n in tr.names), dtype=bool, count=nn)
    parent_id = np.where(root[tr.name[py]], -1, tr.py_parent[py])
    o = np.argsort(tr.py_id[py], kind="stable")
    ids = tr.py_id[py][o]
    k = np.clip(np.searchsorted(ids, parent_id), 0, ids.size - 1)
    pidx = np.where((parent_id >= 0) & (ids[k] == parent_id), o[k], -1)
    has = pidx >= 0
    # trainscope's own threads (the collector's exporter, its gRPC request iterator) are left out: a
    # thread is the events under one root (pointer jumping up the callers), ours when one is our frame
    top = np.arange(py.size)
    for _ in range(1024):                    # bounded by the deepest stack
        up = pidx[top]
        move = up >= 0
        if not move.any():
            break
        top[move] = up[move]
    # ... and a thread is its real thread id too, except on a pseudo-thread holding several roots
    tids, tix = np.unique(tr.tid[py], return_inverse=True)
    roots = np.bincount(tix, weights=root[tr.name[py]], minlength=tids.size)
    group = np.where(roots[tix] > 1, top, py.size + tix)
    ours = np.fromiter((bool(_OWN.search(n)) for n in tr.names), dtype=bool, count=nn)
    mine = np.bincount(group, weights=ours[tr.name[py]], minlength=py.size + tids.size) > 0
    own = np.where(mine[group], 0.0, own)
    callees = np.bincount(pidx[has], weights=own[has], minlength=py.size)
    self_s = np.maximum(own - callees, 0.0) * 1e-6
    on = self_s > 0
    names = tr.name[py][on]
    total = np.bincount(names, weights=self_s[on], minlength=nn)
    n = np.bincount(names, minlength=nn)
    sq = np.bincount(names, weights=self_s[on] ** 2, minlength=nn)
    keep = np.flatnonzero(n > 0)
    mu = total[keep] / n[keep]
    beta = total[keep] / window_s
    mu_median = _group_median(names, self_s[on], keep)
    # steadiness (step 4): each execution's self time spread over the iterations it overlaps, in
    # proportion; a thread that works in every iteration moves the lower quartile, a 20 ms wait
    # for a lock in one iteration or two does not
    steps = tr.steps
    if steps.shape[0] >= 3:
        n_it = steps.shape[0]
        ev = np.flatnonzero(on)
        a, b = t[ev], t[ev] + own[ev]
        i0 = np.clip(np.searchsorted(steps[:, 0], a, side="right") - 1, 0, n_it - 1)
        i1 = np.clip(np.searchsorted(steps[:, 0], b, side="left") - 1, 0, n_it - 1)
        per = np.zeros((nn, n_it))
        one = i0 >= i1                          # within one iteration (most): all of its self time there
        np.add.at(per, (tr.name[py][ev[one]], i0[one]), self_s[ev[one]] * 1e6)
        span = np.flatnonzero(~one)             # the few spanning several: shared by overlap (bounded matrix)
        for c in range(0, span.size, 4096):
            k = span[c:c + 4096]
            ov = np.maximum(0.0, np.minimum(b[k, None], steps[None, :, 1]) - np.maximum(a[k, None], steps[None, :, 0]))
            share = ov / np.maximum(ov.sum(axis=1, keepdims=True), 1e-12)
            np.add.at(per, tr.name[py][ev[k]], share * (self_s[ev[k]] * 1e6)[:, None])
        beta_steady = np.quantile(per[keep] / np.maximum(steps[:, 1] - steps[:, 0], 1e-9)[None, :],
                                  STEADY_QUANTILE, axis=1)
    else:
        beta_steady = beta.copy()
    return Patterns(functions=tuple(tr.names[f] for f in keep), kinds=(THREAD,) * keep.size, beta=beta, mu=mu,
                    sigma=np.sqrt(np.maximum(sq[keep] / n[keep] - mu ** 2, 0.0)), count=n[keep],
                    launched_by=("",) * keep.size, window_s=window_s, iterations=cp.iterations,
                    beta_steady=beta_steady, mu_median=mu_median)
