"""L4 deep dive localisation (EROICA §4.3) on jobs built from a real Kineto trace.

One real rank (``../shared/data/kineto/job2-rank0-nccl.json.gz``, a 2-rank
CNN job on A100s) becomes an 8-rank job: every rank gets its own clock offset
and its own draw of the trace's variability (each device event's duration
replaced by one drawn from the same function's occurrences in the trace, the
timeline re-timed around it). That job must give no outlier; the same job
with one rank's fault must name that rank and that function.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from trainscope.analyzer.deepdive import localize_columns, localize_traces
from trainscope.analyzer.deepdive.trace import KERNEL, MEMCPY, MEMSET, PYTHON, TraceColumns, read_trace
from trainscope.analyzer.merge import merge

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto"
BASE = SHARED / "job2-rank0-nccl.json.gz"
RANKS = 8

pytestmark = pytest.mark.skipif(not BASE.exists(), reason="needs ../shared/data/kineto")


@pytest.fixture(scope="module")
def base() -> TraceColumns:
    return read_trace(BASE)


def retime(tr: TraceColumns, at: np.ndarray, added: np.ndarray) -> TraceColumns:
    """Move every time t to t + S(t), S(t) = the time added by changes that happened at or before t:
    what a longer execution does to everything after it. Host spans across t wait for it (they
    stretch); device events keep their own durations (a kernel on another stream does not slow down
    because this one did)."""
    o = np.argsort(at, kind="stable")
    pts, cum = at[o], np.cumsum(added[o])

    def shift(t):
        k = np.searchsorted(pts, t, side="right")
        return np.where(k > 0, cum[np.maximum(k - 1, 0)], 0.0)

    s, e = tr.ts, tr.ts + tr.dur
    ns, ne = s + shift(s), e + shift(e)
    dev = np.isin(tr.cat, (KERNEL, MEMCPY, MEMSET))
    ne[dev] = ns[dev] + tr.dur[dev]
    steps = tr.steps + np.stack([shift(tr.steps[:, 0]), shift(tr.steps[:, 1])], axis=1)
    return dataclasses.replace(tr, ts=ns, dur=np.maximum(ne - ns, 0.0), steps=steps)


def call_sites(tr: TraceColumns, dev: np.ndarray) -> np.ndarray:
    """A key per device event for "the same call in another iteration": its name and how many
    events of that name came before it in its iteration (events outside the steps: name only)."""
    it = np.searchsorted(tr.steps[:, 0], tr.ts[dev], side="right")      # 0 = before the first step
    names = tr.name[dev].astype(np.int64)
    o = np.lexsort((tr.ts[dev], names, it))
    key = names[o] * (it.max() + 1) + it[o]
    first = np.searchsorted(key, key, side="left")
    nth = np.empty(dev.size, np.int64)
    nth[o] = np.arange(dev.size) - first
    nth[it == 0] = 0
    return names * (dev.size + 1) + nth


def healthy_rank(tr: TraceColumns, seed: int) -> TraceColumns:
    """Own clock offset, and each device event's duration drawn from the same call's durations in the
    trace's iterations (the trace's own iteration-to-iteration variability)."""
    rng = np.random.default_rng(seed)
    dev = np.flatnonzero(np.isin(tr.cat, (KERNEL, MEMCPY, MEMSET)))
    names = call_sites(tr, dev)
    o = np.argsort(names, kind="stable")
    sorted_names = names[o]
    first = np.searchsorted(sorted_names, names, side="left")
    count = np.searchsorted(sorted_names, names, side="right") - first
    pick = first + (rng.random(dev.size) * count).astype(np.int64)
    new = tr.dur[dev][o][pick]
    at = tr.ts[dev] + tr.dur[dev]
    out = retime(tr, at, new - tr.dur[dev])
    dur = out.dur.copy()
    dur[dev] = new
    off = rng.uniform(-5e6, 5e6)          # µs: clocks are not synchronised
    return dataclasses.replace(out, dur=dur, ts=out.ts + off, steps=out.steps + off)


def slow_function(tr: TraceColumns, fid: int, factor: float) -> TraceColumns:
    sel = np.flatnonzero(tr.name == fid)
    extra = tr.dur[sel] * (factor - 1)
    out = retime(tr, tr.ts[sel] + tr.dur[sel], extra)
    dur = out.dur.copy()
    dur[sel] = tr.dur[sel] * factor
    return dataclasses.replace(out, dur=dur)


def insert_gap(tr: TraceColumns, name: str, share: float) -> TraceColumns:
    """A gc-like pause: at the start of every iteration the training thread runs ``name`` for
    ``share`` of the iteration while nothing else happens (everything after it moves later)."""
    starts = tr.steps[:, 0] + 1.0
    gap = (tr.steps[:, 1] - tr.steps[:, 0]) * share
    out = retime(tr, starts - 1e-3, gap)
    fid = len(out.names)
    tid = out.step_tid if out.step_tid >= 0 else int(out.tid[0])
    n = starts.size
    shifted = starts + np.concatenate([[0.0], np.cumsum(gap)[:-1]])
    cat = np.concatenate([out.cat, np.full(n, PYTHON, np.int8)])
    ts = np.concatenate([out.ts, shifted])
    o = np.argsort(ts, kind="stable")
    return dataclasses.replace(
        out, names=out.names + (name,), cat=cat[o], ts=ts[o],
        name=np.concatenate([out.name, np.full(n, fid, np.int32)])[o],
        dur=np.concatenate([out.dur, gap])[o], tid=np.concatenate([out.tid, np.full(n, tid)])[o],
        correlation=np.concatenate([out.correlation, np.full(n, -1)])[o])


@pytest.fixture(scope="module")
def healthy(base) -> dict[int, TraceColumns]:
    return {r: healthy_rank(base, 1000 + r) for r in range(RANKS)}


@pytest.fixture(scope="module")
def healthy_result(healthy):
    return localize_columns(healthy, job_id="healthy")


def _kernel_to_slow(res) -> str:
    """A compute kernel with a small but real share of rank 0's critical path (1-10 %)."""
    cands = [(f, b) for f, kind, b, _, _ in res.ranks[0].top if kind == "compute" and 0.01 < b < 0.1]
    if not cands:
        cands = [(f, b) for f, kind, b, _, _ in res.ranks[0].top if kind == "compute"]
    return cands[0][0]


def test_healthy_job_has_no_outlier(healthy_result):
    assert healthy_result.outliers == (), [o.evidence for o in healthy_result.outliers]
    assert healthy_result.healthy and healthy_result.to_findings() == []
    assert len(healthy_result.ranks) == RANKS
    # the ranks' own variability is there: their top function's β is not identical
    betas = {r.top[0][2] for r in healthy_result.ranks}
    assert len(betas) > 1


def test_slower_kernel_on_one_rank_is_named(healthy, healthy_result, base):
    name = _kernel_to_slow(healthy_result)
    fid = base.names.index(name)
    job = dict(healthy)
    job[5] = slow_function(healthy[5], fid, 2.0)
    res = localize_columns(job, job_id="slow-kernel")
    assert res.outliers, "a kernel twice as slow on one rank must be found"
    top = res.outliers[0]
    assert top.function == name and top.ranks[0] == 5, top.evidence
    assert {r for o in res.outliers for r in o.ranks} == {5}, [o.evidence for o in res.outliers]
    assert top.slower[0] and top.impact_s[0] is not None and top.impact_s[0] > 0
    assert top.mu[0] > 1.5 * top.expected[1]


def test_gc_pause_on_one_rank_is_named(healthy):
    job = dict(healthy)
    job[2] = insert_gap(healthy[2], "<gc>: collect", 0.05)
    res = localize_columns(job, job_id="gc")
    named = [(o.function, o.ranks) for o in res.outliers]
    assert res.outliers and res.outliers[0].function == "<gc>: collect", named
    assert {r for o in res.outliers for r in o.ranks} == {2}, named
    assert res.outliers[0].kind == "python"
    # it costs about the pause: 5 % of a step, per step
    step = res.ranks[2].step_s
    assert 0.02 * step < res.outliers[0].impact_s[0] < 0.08 * step


def test_findings_become_a_verdict_naming_the_rank(healthy, healthy_result, base):
    """The L4 findings go through the verdict merge like any level's: the slow rank is the culprit."""
    name = _kernel_to_slow(healthy_result)
    job = dict(healthy)
    job[6] = slow_function(healthy[6], base.names.index(name), 2.0)
    res = localize_columns(job, job_id="v")
    fs = res.to_findings()
    assert fs and all(f.level == "L4" for f in fs)
    assert fs[0].suspects[0].rank == 6 and fs[0].suspects[0].evidence["function"] == name
    pb = fs[0].to_pb()
    assert pb.level == "L4" and pb.suspects[0].rank == 6
    v = merge("v", fs[0].window, fs, step_ns=fs[0].step_ns)
    assert v.state == "degraded" and [s.rank for s in v.ranks if s.role == "culprit"][:1] == [6], v
    assert name[:40] in v.summary or any(name[:40] in k for k in v.kernels), v.summary
    # and the healthy job's (empty) findings give no suspect
    hv = merge("h", fs[0].window, healthy_result.to_findings(), step_ns=fs[0].step_ns)
    assert not hv.ranks and hv.state != "degraded"


def test_files_round_trip_and_bad_file(tmp_path, base):
    """The public entry point on files: two copies of the real trace are one healthy job;
    a truncated copy fails with a TraceError naming that file."""
    a, b = tmp_path / "r0.json.gz", tmp_path / "r1.json.gz"
    a.write_bytes(BASE.read_bytes())
    b.write_bytes(BASE.read_bytes())
    res = localize_traces({0: a, 1: str(b)}, job_id="j")
    assert res.outliers == () and [r.rank for r in res.ranks] == [0, 1]
    assert res.ranks[0].iterations == 3 and res.first_iteration >= 0
    bad = tmp_path / "r2.json.gz"
    bad.write_bytes(BASE.read_bytes()[: 200_000])
    from trainscope.analyzer.deepdive import TraceError
    with pytest.raises(TraceError) as ei:
        localize_traces({0: a, 2: bad})
    assert str(bad) in str(ei.value) and "truncated" in str(ei.value)


def test_expected_ranges_from_the_paper_flag_a_common_problem(healthy):
    """EROICA's production ranges (§4.3): on this CNN job the training thread's host time is far over 1 %
    of the window on every rank, so the host function at the top is a problem of the whole job
    (named as such, not as any one rank)."""
    from trainscope.analyzer.deepdive import PAPER_RANGES
    res = localize_columns({r: healthy[r] for r in range(4)}, expected=PAPER_RANGES)
    common = [o for o in res.outliers if o.common]
    assert common and all(len(o.ranks) > 2 for o in common)
    fs = res.to_findings()
    assert any(not f.suspects and f.comparison == "job" for f in fs)


def test_json_written_back_reads_the_same(tmp_path, base):
    """The reader on a plain (not gzipped) export."""
    doc = json.loads(gzip.decompress(BASE.read_bytes()))
    p = tmp_path / "plain.json"
    p.write_text(json.dumps(doc))
    t = read_trace(p)
    assert len(t) == len(base) and np.array_equal(t.dur, base.dur)


def test_ranks_are_compared_within_their_role(healthy, healthy_result, base):
    """Two roles (pipeline stages, say) whose code differs: stage "b" runs one kernel twice as long on
    every one of its 3 ranks (5 ranks in stage "a"). Compared within roles, nothing is abnormal; lumped
    into one role, the 3 ranks are far from the job's median and the kernel is reported on them."""
    name = _kernel_to_slow(healthy_result)
    fid = base.names.index(name)
    job = {r: (healthy[r] if r < 5 else slow_function(healthy[r], fid, 2.0)) for r in range(RANKS)}
    roles = {r: "a" if r < 5 else "b" for r in range(RANKS)}
    assert localize_columns(job, roles=roles).outliers == ()
    lumped = localize_columns(job)
    assert [(o.function, set(o.ranks)) for o in lumped.outliers][:1] == [(name, {5, 6, 7})]


def test_l4_collective_evidence_is_typed_like_other_levels():
    """attribution.evidence_of on L4 findings: more time in a collective is waiter evidence, less
    (the late arriver's collectives are its shortest) is culprit evidence, slower own work is culprit."""
    from trainscope.analyzer.attribution import evidence_of
    from trainscope.analyzer.deepdive import DeepDiveResult, Outlier

    def outlier(fn, kind, slower):
        return Outlier(function=fn, kind=kind, role="job", ranks=(3,), d=(0.0,), delta=(0.9,), beta=(0.2,),
                       mu=(0.01,), sigma=(0.001,), impact_s=(0.004,), slower=(slower,),
                       expected=(0.1, 0.005, 0.001), delta_threshold=0.3, common=False)
    res = DeepDiveResult(job_id="j", ranks=(), params={}, analysis_s=0.0, outliers=(
        outlier("ncclKernel_AllReduce_RING_LL_Sum_float", "communication", True),
        outlier("ncclKernel_SendRecv", "communication", False),
        outlier("sm80_xmma_gemm", "compute", True),
        outlier("aten::copy_", "cpu", False)))
    fs = res.to_findings()
    assert len(fs) == 3                        # less of its own non-collective work is no evidence
    roles = [evidence_of(f)[0].role for f in fs]
    assert roles == ["waiter", "culprit", "culprit"]
    assert [evidence_of(f)[0].level for f in fs] == ["L4"] * 3
    assert fs[2].suspects[0].impact_ns == pytest.approx(4e6)


def test_bad_settings_name_the_setting():
    from trainscope.analyzer.deepdive import LocalizeConfig
    from trainscope.proto.errors import ConfigError
    for kw, name in (({"delta": 0}, "deepdive.delta"), ({"n_sample": 0}, "deepdive.n_sample"),
                     ({"k": -1}, "deepdive.k"), ({"min_beta": 1.5}, "deepdive.min_beta"),
                     ({"rel_floor": -0.1}, "deepdive.rel_floor")):
        with pytest.raises(ConfigError, match=name):
            LocalizeConfig(**kw)
