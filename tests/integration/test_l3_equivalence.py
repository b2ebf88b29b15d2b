"""L3's fast path gives the findings of the reference path on a real-noise job (issue #15).

Fast: KernelWindows read from their wire format (``kernel_columns``) and CDFs/W1 rebuilt only
for segments where a rank is flagged. Reference: the message-by-message flatten
(``flatten_messages``) and W1 for every segment (``score_kernels(w1_everywhere=True)``), the
pre-#15 path. The job is built from the real job16 kernel stream (tests/support/realjob.py: real
steps, measured per-rank noise, pipeline stages) and summarised by the processor's own
Summarizer, window by window; one rank's compute kernels are 1.3x slower, so findings exist.
In the integration tier for its ~15 s (building the job from the real trace), though it starts no process.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from support.realjob import SHARED, Fault, JobSpec, build_job
from trainscope.analyzer import l3_kernels as l3
from trainscope.analyzer.model import JobWindow
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.processor.model import ClosedWindow
from trainscope.processor.summarize import SummaryConfig, Summarizer
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (SHARED / "job16-rank0.json.gz").exists(), reason="real traces not found")]

SPEC = JobSpec(ranks=8, tp=1, pp=1, steps=5, ranks_per_host=4, seed=11,
               faults=(Fault("compute", ranks=(5,), factor=1.3, start=0),))
PER_WINDOW = 5


def job_windows(tmp_path) -> list[JobWindow]:
    """The job cut into windows of 5 steps, each rank's kernels summarised as the processor does."""
    job = tmp_path / "job"
    build_job(job, SPEC)
    out = [JobWindow("j", records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=i,
                                             first_iteration=i * PER_WINDOW, last_iteration=(i + 1) * PER_WINDOW - 1))
           for i in range(SPEC.steps // PER_WINDOW)]
    summarize = Summarizer(SummaryConfig(names_inline=True))   # names as the analyzer sees them (resolved)
    for r in range(SPEC.ranks):
        t = load_rank_trace(job / f"rank-{r}.json.gz")
        marks = sorted(t.iterations, key=lambda m: m.iteration)
        res = Resource(job_id="j", rank=r, world_size=SPEC.ranks, host=f"host{r // SPEC.ranks_per_host}",
                       device=f"cuda:{r % SPEC.ranks_per_host}", coords=coords_for_rank(r, SPEC.ranks, tp=SPEC.tp, pp=SPEC.pp))
        for jw in out:
            ms = marks[jw.window.first_iteration:jw.window.last_iteration + 1]
            sel = np.flatnonzero((t.kernels.start_ns >= ms[0].start_ns) & (t.kernels.start_ns < ms[-1].end_ns))
            kw = summarize.kernels(ClosedWindow(resource=res, window=jw.window, kernels=t.kernels.take(sel)),
                                   res.to_pb())
            jw.resources[r] = res
            jw.kernels[r] = kw
            jw.iterations[r] = records_pb2.IterationWindow(resource=res.to_pb(), window=jw.window, marks=ms)
    return out


def pb(finding) -> records_pb2.Diagnosis:
    """The finding as stored, less the wall-clock time it was made at."""
    d = finding.to_pb()
    d.created_unix_ns = 0
    return d


def test_fast_path_findings_equal_the_reference_on_a_real_noise_job(tmp_path, monkeypatch):
    windows = job_windows(tmp_path)
    fast = [[pb(f) for f in l3.analyze_kernels(jw)] for jw in windows]
    # the flat tables are identical, array for array
    for jw in windows:
        a, b = l3.flatten_kernels(jw.kernels), l3.flatten_messages(jw.kernels)
        assert a.keys == b.keys
        for name in ("ranks", "dist_rank", "dist_key", "cl_start", "cl_count", "cl_p50", "cl_p99",
                     "dist_mean_ns", "dist_sd_ns", "dist_max_ns"):
            assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True), name
    monkeypatch.setattr(l3, "flatten_kernels", l3.flatten_messages)
    monkeypatch.setattr(l3, "score_kernels", functools.partial(l3.score_kernels, w1_everywhere=True))
    reference = [[pb(f) for f in l3.analyze_kernels(jw)] for jw in windows]
    assert fast == reference
    # the job has findings to compare: rank 5's compute kernels, with their W1 evidence
    named = [f for fs in fast for f in fs if not f.informational and f.suspects]
    assert named and all(f.suspects[0].rank == 5 for f in named)
    assert any(f.suspects[0].evidence["w1_ns"] > 0 for f in named if f.kind == "degraded_kernel")
