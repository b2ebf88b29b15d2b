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
   start in each ``ProfilerStep`` over that step's length), and its median
   over the iterations, ``beta_median``: a function that costs more in every
   iteration (a hot loop) moves it, a one-off stall of one iteration (the
   scheduler preempting a rank on a shared host) does not (``localize``'s
   steadiness rule). Without iteration marks, or for the idle pseudo-function,
   it is β.
5. Function identity: its name (a kernel's demangled name, an op's name, a
   Python function's ``file(line): name``). EROICA keys Python functions by
   their whole call stack; Kineto's name already carries file and line, and
   the stack is left out (a known simplification).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.analyzer.deepdive.critical_path import (
    COMM, COMM_HOST, COMPUTE, MEMORY, CriticalPath,
)
from trainscope.analyzer.deepdive.trace import PYTHON, RUNTIME

#: Kinds of function (what EROICA's expected ranges are given for, §4.3).
KINDS = ("compute", "memory", "communication", "python", "cpu", "runtime", "idle")
#: The pseudo-function of step 3.
IDLE = "(idle: nothing traced running)"


@dataclasses.dataclass(frozen=True, slots=True)
class Patterns:
    """Step 2 for every function of one rank that was on its critical path."""

    functions: tuple[str, ...]
    kinds: tuple[str, ...]
    beta: np.ndarray        # share of the window, [0, 1]
    mu: np.ndarray          # s per execution
    sigma: np.ndarray       # s
    count: np.ndarray       # executions on the path
    launched_by: tuple[str, ...]   # the CPU op / Python function most of its executions came from, "" if none
    window_s: float
    iterations: int
    beta_median: np.ndarray | None = None   # step 4: median over iterations of β per iteration; None: β

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
    # kind and launcher of each function: from its first execution on the path / its most common launcher
    first = np.full(nn, -1, dtype=np.int64)
    idx = np.flatnonzero(on)
    first[tr.name[idx[::-1]]] = idx[::-1]
    kinds = tuple(_kind(int(cp.level[first[f]]), int(tr.cat[first[f]]), tr.names[f]) for f in keep)
    launched = np.full(nn, -1, dtype=np.int64)
    lk = on & (cp.launcher >= 0)
    if lk.any():
        pair = tr.name[lk].astype(np.int64) * (nn + 1) + cp.launcher[lk]
        u, c = np.unique(pair, return_counts=True)
        o = np.lexsort((c, u // (nn + 1)))          # per function, the most common launcher last
        launched[u[o] // (nn + 1)] = u[o] % (nn + 1)
    launched_by = tuple(tr.names[launched[f]] if launched[f] >= 0 else "" for f in keep)
    funcs = tuple(tr.names[f] for f in keep)
    beta = total[keep] / window_s if window_s > 0 else np.zeros(keep.size)
    sigma, count = np.sqrt(var), n[keep]
    beta_median = _beta_median(cp, keep, beta)          # step 4
    gaps = cp.idle_gaps() * 1e-6
    if gaps.size and window_s > 0:                      # step 3
        funcs, kinds, launched_by = funcs + (IDLE,), kinds + ("idle",), launched_by + ("",)
        beta = np.append(beta, gaps.sum() / window_s)
        mu = np.append(mu, gaps.mean())
        sigma = np.append(sigma, gaps.std())
        count = np.append(count, gaps.size)
        beta_median = np.append(beta_median, beta[-1])
    return Patterns(functions=funcs, kinds=kinds, beta=beta, mu=mu, sigma=sigma, count=count,
                    launched_by=launched_by, window_s=window_s, iterations=cp.iterations, beta_median=beta_median)


def _beta_median(cp: CriticalPath, keep: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Step 4: per function (``keep``), the median over iterations of its share of each iteration."""
    tr = cp.trace
    steps = tr.steps
    if steps.shape[0] < 3:
        return beta.copy()
    on = np.flatnonzero(cp.critical > 0)
    it = np.searchsorted(steps[:, 0], tr.ts[on], side="right") - 1
    inside = (it >= 0) & (tr.ts[on] < steps[np.maximum(it, 0), 1])
    on, it = on[inside], it[inside]
    n_it, nn = steps.shape[0], len(tr.names)
    per = np.bincount(tr.name[on].astype(np.int64) * n_it + it, weights=cp.critical[on],
                      minlength=nn * n_it).reshape(nn, n_it)
    length = np.maximum(steps[:, 1] - steps[:, 0], 1e-9)
    return np.median(per[keep] / length[None, :], axis=1)


