"""L4 deep dive: the Kineto reader, the critical path (EROICA §4.2) and the patterns, on every real
trace in ../shared/data/kineto (each read once per module)."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from trainscope.analyzer.deepdive import TraceError, read_trace
from trainscope.analyzer.deepdive.critical_path import COMPUTE, HOST, IDLE, critical_path
from trainscope.analyzer.deepdive.patterns import behaviour_patterns
from trainscope.analyzer.deepdive.trace import KERNEL, RUNTIME

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
FILES = sorted(SHARED.glob("*.json.gz"))

pytestmark = pytest.mark.skipif(not FILES, reason="needs ../shared/data/kineto")
_CACHE: dict[str, tuple] = {}


@pytest.fixture(params=[f.name for f in FILES], scope="module")
def traced(request):
    if request.param not in _CACHE:
        tr = read_trace(SHARED / request.param)
        cp = critical_path(tr)
        _CACHE[request.param] = (tr, cp, behaviour_patterns(cp))
    return _CACHE[request.param]


def _union(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals (independent of the module's sweep)."""
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, bool)
    new[1:] = s[1:] > reach[:-1]
    starts = s[new]
    ends = np.maximum.reduceat(e, np.flatnonzero(new)) if s.size else e
    return starts, ends


def _inside(t: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    k = np.searchsorted(starts, t, side="right") - 1
    return (k >= 0) & (t < ends[np.maximum(k, 0)])


def test_reader_columns(traced):
    tr, cp, _ = traced
    assert len(tr) > 1000 and tr.ts.size == tr.dur.size == tr.name.size == tr.cat.size == tr.tid.size
    assert np.all(np.diff(tr.ts) >= 0) and np.all(tr.dur >= 0)
    assert (tr.cat == KERNEL).sum() > 500
    k = tr.cat == KERNEL
    assert (tr.correlation[k] >= 0).mean() > 0.99            # kernels carry their correlation id
    assert tr.steps.shape[0] >= 2 and len(tr.step_ids) == tr.steps.shape[0]
    assert tr.rank >= 0 and tr.world_size >= 2


def test_critical_path_invariants(traced):
    tr, cp, _ = traced
    s, e, lv, own = cp.seg_start, cp.seg_end, cp.seg_level, cp.seg_owner
    # no overlap, in order, inside the window
    assert np.all(e > s) and np.all(s[1:] >= e[:-1]) and s[0] >= cp.t0 and e[-1] <= cp.t1
    # covers exactly the busy time: the union of every candidate event
    start = np.clip(tr.ts, cp.t0, cp.t1)
    end = np.clip(tr.ts + tr.dur, cp.t0, cp.t1)
    cand = (cp.level > IDLE) & (end > start)
    us, ue = _union(start[cand], end[cand])
    on = lv > IDLE
    assert np.isclose((e - s)[on].sum(), (ue - us).sum(), rtol=1e-9)
    # priority: nothing of a higher level runs during a segment; its owner runs and has its level
    mid = 0.5 * (s + e)
    for higher in range(HOST + 1, COMPUTE + 1):
        hs, he = _union(start[cp.level == higher], end[cp.level == higher])
        if hs.size:
            assert not np.any(_inside(mid[lv < higher], hs, he)), higher
    assert np.all(own[on] >= 0) and np.all(cp.level[own[on]] == lv[on])
    assert np.all((start[own[on]] <= mid[on]) & (mid[on] < end[own[on]]))
    # per-event critical time adds up to the path
    assert np.isclose(cp.critical.sum(), (e - s)[on].sum())
    # host owners are innermost: no later-started training-thread event runs at the midpoint
    hseg = np.flatnonzero(lv == HOST)[:2000]
    hev = np.flatnonzero(cp.level == HOST)
    for i in hseg[:: max(1, hseg.size // 200)]:
        o = own[i]
        inner = hev[(start[hev] > start[o]) & (start[hev] <= mid[i]) & (end[hev] > mid[i])]
        assert inner.size == 0, (tr.names[tr.name[o]], [tr.names[tr.name[j]] for j in inner[:3]])


def test_kernels_map_to_their_launching_cpu_op(traced):
    tr, cp, _ = traced
    k = np.flatnonzero(tr.cat == KERNEL)
    known = cp.launcher[k] >= 0
    assert known.mean() > 0.8
    # the launcher is a CPU-side function, never a runtime call or a kernel
    launch_names = {tr.names[i] for i in np.unique(cp.launcher[k][known])}
    kernel_names = {tr.names[i] for i in np.unique(tr.name[k])}
    runtime_names = {tr.names[i] for i in np.unique(tr.name[tr.cat == RUNTIME])}
    assert not launch_names & (kernel_names | runtime_names)


def test_patterns_on_a_real_trace(traced):
    tr, cp, p = traced
    shares = cp.time_by_level()
    busy = 1.0 - shares["idle"] / cp.window_us
    idle = np.array([k == "idle" for k in p.kinds])
    assert np.isclose(p.beta[~idle].sum(), busy, atol=1e-9)
    assert np.isclose(p.beta.sum(), 1.0, atol=1e-9)              # the idle pseudo-function holds the rest
    assert np.isclose(cp.idle_gaps().sum(), shares["idle"], rtol=1e-9)
    assert np.all((p.beta >= 0) & (p.beta <= 1)) and np.all(p.sigma >= 0) and np.all(p.count >= 1)
    assert np.allclose(p.mu * p.count, p.beta * p.window_s, rtol=1e-9)      # μ is per execution
    assert p.iterations == tr.steps.shape[0]
    kinds = set(p.kinds)
    assert "compute" in kinds and "communication" in kinds       # every trace here has NCCL kernels
    comm = [f for f, kd in zip(p.functions, p.kinds) if kd == "communication"]
    assert any("nccl" in f.lower() for f in comm)
    # compute kernels hold their share of the window: the compute level's time
    comp = sum(b for b, kd in zip(p.beta, p.kinds) if kd == "compute")
    assert np.isclose(comp, shares["compute"] / cp.window_us, atol=1e-9)
    mem = sum(b for b, kd in zip(p.beta, p.kinds) if kd == "memory")
    assert np.isclose(mem, shares["memory"] / cp.window_us, atol=1e-9)


def test_truncated_and_bad_files_give_a_clear_error(tmp_path):
    src = FILES[0].read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(src[: len(src) // 2])
    with pytest.raises(TraceError) as ei:
        read_trace(cut)
    msg = str(ei.value)
    assert str(cut) in msg and "truncated" in msg and "\n" not in msg
    plain = tmp_path / "cut.json"
    plain.write_bytes(gzip.decompress(src)[:100_000])
    with pytest.raises(TraceError, match="not valid JSON"):
        read_trace(plain)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="no 'traceEvents'"):
        read_trace(other)
    empty = tmp_path / "empty.json"
    empty.write_text('{"traceEvents": [{"ph": "M", "name": "process_name"}]}')
    with pytest.raises(TraceError, match="no complete events"):
        read_trace(empty)
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "missing.json")
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "x", "dur": 1}]}')
    with pytest.raises(TraceError, match="malformed event"):
        read_trace(bad)
