"""The job against its own pace (analyzer/job_pace.py, levels.JobPace, merge): a job slower than
itself with no rank to blame is "degraded, not localized"; healthy jobs stay healthy.

Iteration marks come from jobs built from the real job16 kernel stream (tests/support/realjob.py:
real steps drawn per step, the measured per-rank noise), cut into windows of 5 steps as replay does.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from support.realjob import SHARED, Fault, JobSpec, build_job
from trainscope.analyzer import job_pace
from trainscope.analyzer.impact import ImpactConfig, apply_floor, window_scale
from trainscope.analyzer.levels import JobPace, WindowContext
from trainscope.analyzer.merge import merge, merge_windows
from trainscope.analyzer.model import JobWindow
from trainscope.analyzer.significance import Persistence
from trainscope.collector.sources.replay import load_rank_trace
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

pytestmark = pytest.mark.skipif(not (SHARED / "job16-rank0.json.gz").exists(), reason="real traces not found")

PER_WINDOW = 5


def marks_of(tmp_path, spec: JobSpec) -> dict[int, list]:
    job = tmp_path / f"job{spec.seed}"
    build_job(job, spec)
    return {r: sorted(load_rank_trace(job / f"rank-{r}.json.gz").iterations, key=lambda m: m.iteration)
            for r in range(spec.ranks)}


def windows(marks: dict[int, list], spec: JobSpec, *, drop=()) -> list[JobWindow]:
    out = []
    for idx in range(spec.steps // PER_WINDOW):
        w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=idx,
                               first_iteration=idx * PER_WINDOW, last_iteration=(idx + 1) * PER_WINDOW - 1)
        jw = JobWindow("j", w)
        for r, ms in marks.items():
            if (idx, r) in drop:
                continue
            res = Resource(job_id="j", rank=r, world_size=spec.ranks, host=f"host{r // spec.ranks_per_host}",
                           coords=coords_for_rank(r, spec.ranks, tp=spec.tp, pp=spec.pp),
                           device=f"cuda:{r % spec.ranks_per_host}")      # GPU streams: device-timed steps
            jw.resources[r] = res
            rec = records_pb2.IterationWindow(resource=res.to_pb(), window=w)
            for m in ms[idx * PER_WINDOW:(idx + 1) * PER_WINDOW]:
                rec.marks.add(iteration=m.iteration, start_ns=m.start_ns, end_ns=m.end_ns)
            jw.iterations[r] = rec
        out.append(jw)
    return out


def verdicts(jws: list[JobWindow], spec: JobSpec, cfg=job_pace.PaceConfig()) -> list[records_pb2.Verdict]:
    """The pace level and merge, window by window, as the service runs them (k=2 of n=3)."""
    state = types.SimpleNamespace(world_size=spec.ranks, ended=set(), first_iteration={r: 0 for r in range(spec.ranks)},
                                  pace_baseline=None)
    det, pers, out = JobPace(cfg, warmup_iterations=5), Persistence(2, 3), []
    for jw in jws:
        scale = window_scale(jw)
        ctx = WindowContext(jw, scale, {}, job_state=state)
        found = apply_floor(det.analyze(ctx), scale, ImpactConfig())
        out.append(merge("j", jw.window, found, jw.resources, jw=jw, step_ns=scale.step_ns,
                         iterations=scale.iterations, persistence=pers, comparisons=ctx.comparisons))
    return out


@pytest.mark.parametrize("seed", [31, 32, 33, 34])
def test_healthy_real_stream_jobs_stay_healthy_against_their_own_pace(tmp_path, seed):
    spec = JobSpec(ranks=4, tp=2, pp=1, steps=40, seed=seed, noisy=(3,), ranks_per_host=4)
    vs = verdicts(windows(marks_of(tmp_path, spec), spec), spec)
    # the first windows build the baseline (warm-up, 5 steps): nothing could be compared yet
    assert all(v.state == "healthy" for v in vs[2:]), [v.summary for v in vs]
    assert all(v.state in ("healthy", "unknown") and not v.ranks for v in vs)
    assert not any(d.level == "pace" and not d.informational for v in vs for d in v.findings)
    assert any(v.comparison and "own_pace" in v.comparison for v in vs)   # the comparison was made


def test_every_rank_slower_together_is_degraded_not_localized_with_impact_and_onset(tmp_path):
    """Compute 1.3x on all 4 ranks from step 20 (window 4): no rank differs from its peers; the
    job's own pace says degraded from window 4, naming nobody, with seconds per iteration."""
    spec = JobSpec(ranks=4, tp=2, pp=1, steps=40, seed=35, ranks_per_host=4,
                   faults=(Fault("compute", ranks=tuple(range(4)), factor=1.3, start=20),))
    healthy = JobSpec(**{**spec.__dict__, "faults": ()})
    mk = marks_of(tmp_path, spec)
    vs = verdicts(windows(mk, spec), spec)
    assert all(v.state in ("healthy", "unknown") for v in vs[:4]), [v.summary for v in vs[:4]]
    slow = vs[5:]
    assert all(v.state == "degraded" and not v.ranks for v in slow), [v.summary for v in slow]
    v = slow[-1]
    assert v.since_window == 4, v.summary
    (d,) = [d for d in v.findings if d.level == "pace" and not d.informational]
    steps = np.median([[m.end_ns - m.start_ns for m in mk[r]] for r in mk], axis=0)   # per iteration
    base, now = np.median(steps[5:20]), np.median(steps[35:40])   # windows 1-3 (after warm-up); 7
    assert d.impact_s == pytest.approx((now - base) / 1e9, rel=0.05)
    assert d.evidence["slowdown_pct"] > 5 and not d.suspects
    assert "not localized: every rank slower together" in v.summary and "ms/iteration" in v.summary
    job = merge_windows(vs)
    assert job.state == "degraded" and not job.ranks and job.since_window == 4
    assert "not localized" in job.summary, job.summary
    # the same draws without the fault: healthy throughout
    assert all(v.state in ("healthy", "unknown")
               for v in verdicts(windows(marks_of(tmp_path / "h", healthy), healthy), healthy))


def test_one_slow_window_is_watched_not_a_state(tmp_path):
    """A checkpoint-like window (every rank 1.5x for 5 steps, window 4) is flagged but only watched
    (informational) until it holds in 2 of 3 windows; the fast window after it is no baseline shift."""
    spec = JobSpec(ranks=4, tp=2, pp=1, steps=40, seed=36, ranks_per_host=4,
                   faults=(Fault("compute", ranks=tuple(range(4)), factor=1.5, start=20, every=5),))
    vs = verdicts(windows(marks_of(tmp_path, spec), spec), spec)
    # on in windows 4 and 6, off in 5 and 7: flagged in 2 of 3 windows (4, 6) confirms at window 6 only
    assert all(v.state in ("healthy", "unknown") for v in vs[:6]), [v.summary for v in vs]
    assert [d.informational for d in vs[4].findings if d.level == "pace"] == [True]


def test_partial_windows_are_neither_judged_nor_baseline(tmp_path):
    spec = JobSpec(ranks=4, tp=2, pp=1, steps=30, seed=37, ranks_per_host=4,
                   faults=(Fault("compute", ranks=tuple(range(4)), factor=1.4, start=15),))
    mk = marks_of(tmp_path, spec)
    drop = {(i, r) for i in (3, 4, 5) for r in (3,)}       # every slow window misses a rank
    vs = verdicts(windows(mk, spec, drop=drop), spec)
    assert all(v.state in ("healthy", "unknown") for v in vs)
    assert not any(d.level == "pace" for v in vs for d in v.findings)


def test_job_steps_are_the_median_over_ranks_per_iteration_after_warm_up():
    w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=0, first_iteration=0, last_iteration=9)
    jw = JobWindow("j", w)
    for r, scale in enumerate((1.0, 1.0, 5.0)):         # rank 2 an outlier: the median ignores it
        rec = records_pb2.IterationWindow(window=w)
        for i in range(10):
            rec.marks.add(iteration=i, start_ns=0, end_ns=int((100 + i) * scale))
        jw.iterations[r] = rec
    steps = job_pace.job_steps(jw, {0: 0, 1: 0, 2: 0}, warmup=5)
    assert steps.tolist() == [105.0, 106.0, 107.0, 108.0, 109.0]


def test_pace_config_is_validated():
    with pytest.raises(ConfigError, match="pace.min_shift"):
        job_pace.PaceConfig(min_shift=0)
    with pytest.raises(ConfigError, match="pace.min_iterations"):
        job_pace.PaceConfig(min_iterations=1)
    with pytest.raises(ConfigError, match="pace.batch_min_windows"):
        job_pace.PaceConfig(batch_min_windows=1)


def _synthetic(steps_ms: np.ndarray, per_window: int = 10, ranks: int = 4,
               device: str = "cpu") -> tuple[list[JobWindow], JobSpec]:
    """Iteration marks of ``ranks`` ranks sharing the step ``steps_ms`` (a synchronous job), cut into
    windows; ``device`` "cpu": host-timed steps (gloo CPU ranks), "cuda": device-timed."""
    spec = JobSpec(ranks=ranks, tp=1, pp=1, steps=len(steps_ms), seed=0, ranks_per_host=ranks)
    ends = np.cumsum(steps_ms * 1e6).astype(np.int64)
    starts = np.r_[0, ends[:-1]]
    out = []
    for idx in range(len(steps_ms) // per_window):
        w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=idx,
                               first_iteration=idx * per_window, last_iteration=(idx + 1) * per_window - 1)
        jw = JobWindow("j", w)
        for r in range(ranks):
            res = Resource(job_id="j", rank=r, world_size=ranks, host="h0",
                           coords=coords_for_rank(r, ranks, tp=1, pp=1),
                           device="cpu" if device == "cpu" else f"cuda:{r}")
            jw.resources[r] = res
            rec = records_pb2.IterationWindow(resource=res.to_pb(), window=w)
            for i in range(idx * per_window, (idx + 1) * per_window):
                rec.marks.add(iteration=i, start_ns=int(starts[i]), end_ns=int(ends[i]))
            jw.iterations[r] = rec
        out.append(jw)
    return out, spec


def test_a_host_noise_burst_of_consecutive_steps_is_judged_against_how_far_healthy_windows_moved():
    """Steps of one window are not independent (a busy neighbour slows a run of them): a healthy job
    whose window medians wander by ±8 % and then has two windows +18 % is not "degraded", as the
    window medians' own spread (batch means) bounds what one window's median says; a +40 % slowdown
    still is. The price: on such a host a job-wide slowdown must exceed z* times that spread
    (about +25 % here) to be named; on a steady host the steps' own spread sets the bar, as before."""
    rng = np.random.default_rng(7)
    level = np.repeat(36.0 * (1 + rng.uniform(-0.08, 0.08, 8)), 10)        # each window's host state
    healthy = level * (1 + rng.normal(0, 0.04, level.size))               # and each step's own noise
    burst = np.r_[healthy, np.repeat([36.0 * 1.18] * 2, 10) * (1 + rng.normal(0, 0.04, 20))]
    jws, spec = _synthetic(burst)
    vs = verdicts(jws, spec)
    assert all(v.state in ("healthy", "unknown") for v in vs), [v.summary for v in vs]
    # without the windows' spread (the same steps timed on a device, batch means off), the steps'
    # spread alone calls the burst a slowdown
    iid = verdicts(_synthetic(burst, device="cuda")[0], spec, job_pace.PaceConfig(batch_min_windows=10_000))
    assert iid[-1].state == "degraded", [v.summary for v in iid]
    big = np.r_[healthy, np.repeat([36.0 * 1.4] * 2, 10) * (1 + rng.normal(0, 0.04, 20))]
    jws, spec = _synthetic(big)
    v = verdicts(jws, spec)[-1]
    assert v.state == "degraded" and not v.ranks and "not localized" in v.summary, v.summary


def test_a_host_timed_job_is_not_judged_against_its_pace_before_its_windows_spread_is_known():
    """A CPU job's first window is no better a baseline than its second: an idle 4-rank DDP gloo job
    (two ranks per core) ran window 1 on +11 % slower than window 0 and read "degraded, not
    localized" for the rest of the job, as a window held out of the baseline kept it there. Host-timed
    steps are judged once 4 windows give the windows' spread; the same steps timed on a device are
    judged from the second window, and a CPU job +40 % slower after its baseline still is named."""
    rng = np.random.default_rng(3)
    step = np.r_[np.full(10, 36.0), np.full(70, 36.0 * 1.11)] * (1 + rng.normal(0, 0.02, 80))
    host = verdicts(*_synthetic(step))
    assert all(v.state != "degraded" for v in host), [v.summary for v in host]
    jws, spec = _synthetic(step, device="cuda")
    assert verdicts(jws, spec)[-1].state == "degraded"
    slow = np.r_[np.full(50, 36.0), np.full(30, 36.0 * 1.4)] * (1 + rng.normal(0, 0.02, 80))
    v = verdicts(*_synthetic(slow))[-1]
    assert v.state == "degraded" and not v.ranks and "not localized" in v.summary, v.summary


def test_what_the_job_lost_caps_its_culprits_price_flagged_or_not():
    """Step 5 and merge step 5b: a rank 0.4 s/iteration slower in its NVLink kernels, in a window the
    pace level judged 0.04 s/iteration slower than the job's healthy pace (under its 5 % threshold:
    not flagged), costs the job 0.04 s, not 0.4 s; without a judged window its own excess stands. A
    window whose verdict named a rank leaves the baseline (it is not the job's healthy pace)."""
    from trainscope.analyzer.model import Finding, Scope, SuspectRank
    res = {r: Resource(job_id="j", rank=r, world_size=8, host="h0", device=f"cuda:{r}",
                       coords=coords_for_rank(r, 8, tp=1, pp=1)) for r in range(8)}
    w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=3, first_iteration=30, last_iteration=39)
    slow = Finding(level="L3", kind="degraded_kernel", job_id="j", window=w, scope=Scope(kernel="nvlink_copy"),
                   suspects=(SuspectRank(5, 9.0, {"direction": "slower", "ratio": 1.5}, impact_ns=400e6),))
    steady = tuple((i, np.full(10, 3e9)) for i in range(3))
    lost = job_pace.JobLoss(np.full(10, 3.04e9), steady, job_pace.PaceConfig())
    priced = merge("j", w, [slow], res, step_ns=3e9, job_loss=lost)
    assert [(s.rank, round(s.impact_s, 3)) for s in priced.ranks] == [(5, 0.04)], priced.summary
    alone = merge("j", w, [slow], res, step_ns=3e9)
    assert [(s.rank, round(s.impact_s, 3)) for s in alone.ranks] == [(5, 0.4)]
    base = job_pace.Baseline(8)
    for i in range(3):
        base.add(i, np.full(10, 3e9))
    base.discard(1)
    base.discard(7)         # never in it: nothing happens
    assert list(base.indices) == [0, 2] and base.steps().size == 20


def test_what_the_job_lost_is_its_mean_step_against_the_windows_before_its_culprit_was_flagged():
    """Step 5: a 1 s pause in one step of ten costs the job 0.1 s/iteration, which the mean counts
    and a median steps over; measured against the baseline windows before a window (``before``), a
    slowdown already inside the later baseline windows is not hidden by them."""
    rng = np.random.default_rng(5)
    steady = [3e9 * (1 + rng.normal(0, 0.01, 10)) for _ in range(3)]
    paused = 3e9 * (1 + rng.normal(0, 0.01, 10))
    paused[4] += 1e9
    loss = job_pace.JobLoss(paused, tuple(enumerate(steady)), job_pace.PaceConfig())
    lost, z = loss.bound()
    assert 0.08e9 < lost < 0.12e9 and z > 3, (lost, z)
    assert abs(float(np.median(paused) - np.median(np.concatenate(steady)))) < 0.03e9   # what a median reads
    # the same pause already in baseline window 2: against all three windows the loss reads a third
    # less; against the windows before 2 it is the whole pause again
    inside = (steady[0], steady[1], steady[2] + np.r_[1e9, np.zeros(9)])
    later = job_pace.JobLoss(paused, tuple(enumerate(inside)), job_pace.PaceConfig())
    assert later.bound()[0] < 0.08e9 < later.bound(before=2)[0]
    assert later.bound(before=0) is None              # no baseline window before the first


def test_a_real_job_loss_beyond_its_named_excess_is_the_culprits_price():
    """Merge step 5b, up: a rank flagged for 20 ms/iteration of lateness in a window whose mean step
    is 100 ms over the job's steady pace (many standard errors) is priced at the job's 100 ms; the
    same excess in a window whose loss is within the job's noise keeps its own 20 ms."""
    from trainscope.analyzer.model import Finding, Scope, SuspectRank
    res = {r: Resource(job_id="j", rank=r, world_size=8, host="h0", device=f"cuda:{r}",
                       coords=coords_for_rank(r, 8, tp=1, pp=1)) for r in range(8)}
    w = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=3, first_iteration=30, last_iteration=39)
    late = Finding(level="L2", kind="individual_slowdown", job_id="j", window=w, scope=Scope(phase="forward"),
                   suspects=(SuspectRank(5, 9.0, {"direction": "slower", "ratio": 1.2}, impact_ns=20e6),))
    rng = np.random.default_rng(11)
    steady = tuple((i, 3e9 * (1 + rng.normal(0, 0.005, 10))) for i in range(3))
    real = job_pace.JobLoss(3.1e9 * (1 + rng.normal(0, 0.005, 10)), steady, job_pace.PaceConfig())
    priced = merge("j", w, [late], res, step_ns=3e9, job_loss=real)
    assert [s.rank for s in priced.ranks] == [5] and 0.09 < priced.ranks[0].impact_s < 0.11, priced.summary
    noisy = tuple((i, 3e9 * (1 + rng.normal(0, 0.08, 10))) for i in range(3))
    unsure = job_pace.JobLoss(3.05e9 * (1 + rng.normal(0, 0.08, 10)), noisy, job_pace.PaceConfig())
    assert unsure.bound()[1] < 3
    kept = merge("j", w, [late], res, step_ns=3e9, job_loss=unsure)
    assert [(s.rank, round(s.impact_s, 3)) for s in kept.ranks] == [(5, 0.02)], kept.summary
