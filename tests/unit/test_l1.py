"""L1 iteration-time detection: jitter, regression, both, stall (ARGUS §6.1, App. B; EROICA §4.1)."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.l1_iteration import (
    L1Config, classify, detect_jitter, detect_regression, l1_findings,
    thresholds,
)
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2

MS = 1e6


def noisy(n, seed=0, sigma=0.03, level=1000 * MS):
    return level * np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))


def test_narrow_spike_gets_its_true_effective_width_not_w():
    x = noisy(200)
    x[120:122] *= 3.0                           # two slow iterations; W = 8 smears them to ≥ 8
    cfg = L1Config(window=8)
    [j] = detect_jitter(x, cfg)
    assert j.end - j.start >= 8                 # phase 1 smears...
    assert (j.effective_start, j.effective_end, j.effective_width) == (120, 122, 2)   # ...phase 2 recovers
    assert j.peak_ratio == pytest.approx(3.0, rel=0.15)
    r = classify(x, cfg)
    assert r.state == "jitter" and r.regression is None


def test_wide_burst_and_a_dip_and_separate_spikes():
    x = noisy(300, seed=1)
    x[50:56] *= 2.0                              # a burst of 6
    x[150] *= 0.4                                # a fast iteration is not jitter
    x[250] *= 4.0
    found = detect_jitter(x)
    assert [(j.effective_start, j.effective_width) for j in found] == [(50, 6), (250, 1)]


def test_thresholds_adapt_to_the_noise_level():
    # frequent small spikes (GC pauses: +15 % on 40 % of iterations) on a quiet job are jitter...
    rng = np.random.default_rng(5)
    quiet = noisy(120, seed=5, sigma=0.003)
    quiet[rng.random(120) < 0.4] *= 1.15
    theta, exceed, sigma = thresholds(quiet)
    assert sigma < 0.02 and (theta, exceed) == (1.15, 1.1)     # spikes barely move σ̂: the floors hold
    assert classify(quiet).state == "jitter"
    # ...while on a 5 % noisy job the same +15 % is within the noise: e rises to ~e^(5σ)
    loud = noisy(400, seed=6, sigma=0.05)
    theta, exceed, sigma = thresholds(loud)
    assert sigma == pytest.approx(0.05, rel=0.15) and exceed == pytest.approx(np.exp(5 * sigma))
    assert theta == exceed > 1.2


@pytest.mark.parametrize("seed", range(20))
def test_stable_noisy_series_yields_nothing(seed):
    assert classify(noisy(400, seed=seed, sigma=0.04)).state == "stable"


def test_step_regression_found_at_the_split_with_its_ratio():
    x = noisy(240, seed=2, sigma=0.02)
    x[170:] *= 1.5
    reg = detect_regression(x)
    assert reg.split == 170
    assert reg.ratio == pytest.approx(1.5, rel=0.02)
    assert reg.mean_before == pytest.approx(1000 * MS, rel=0.02)
    r = classify(x)
    assert r.state == "regression" and r.jitter == ()       # the step is not mistaken for jitter


def test_small_or_unstable_changes_are_not_regressions():
    x = noisy(240, seed=3, sigma=0.02)
    x[170:] *= 1.05                                          # below min_regression_ratio
    assert detect_regression(x) is None
    y = noisy(240, seed=3, sigma=0.3)                        # segments too noisy to call a level
    y[170:] *= 1.5
    assert detect_regression(y) is None
    assert detect_regression(noisy(15)) is None              # too short for two segments


def test_jitter_on_top_of_a_regression_is_both():
    x = noisy(300, seed=4, sigma=0.02)
    x[200:] *= 1.4
    x[80] *= 3.0
    x[260:262] *= 2.5
    r = classify(x)
    assert r.state == "both"
    assert r.regression.split == 200 and r.regression.ratio == pytest.approx(1.4, rel=0.03)
    assert [(j.effective_start, j.effective_width) for j in r.jitter] == [(80, 1), (260, 2)]


def test_stall_rule_is_five_times_the_typical_interval_on_either_clock():
    from trainscope.analyzer.stall import arrival_stall, stalled, telemetry_stall
    assert not stalled(4.0, 1.0, 5.0) and stalled(5.0, 1.0, 5.0) and not stalled(5.0, 1.0, 6.0)
    assert not stalled(50.0, 0.0, 5.0) and not stalled(5.0, 1.0, 5.0, floor=10.0)
    win = records_pb2.Window()
    f = arrival_stall("j", win, quiet_s=20.0, mean_gap_s=2.0, factor=5.0, floor_s=10.0)
    assert f.kind == "stall" and f.severity == 10.0
    assert arrival_stall("j", win, quiet_s=9.0, mean_gap_s=1.0, factor=5.0, floor_s=10.0) is None
    # rank clocks: ranks 0, 1, 3 ran 10 iterations past their last one; rank 2 stopped 3 earlier
    hist = {r: [(i, 1_000) for i in range(20)] for r in range(4)}
    end = {r: 20_000 for r in range(4)}
    wm = {0: 30_000, 1: 30_000, 2: 27_000, 3: 30_000}
    h = telemetry_stall("j", win, last_iter_end=end, watermark=wm, history=hist, ended=set(), factor=5.0)
    assert h.kind == "stall" and [s.rank for s in h.suspects] == [2] and h.suspects[0].impact_ns == 1_000
    assert telemetry_stall("j", win, last_iter_end=end, watermark={r: 22_000 for r in range(4)}, history=hist,
                           ended=set(), factor=5.0) is None


def ranks_series(n_ranks, n_iter, seed=0):
    """Synchronised ranks: every rank's iteration time is the job's (gradient sync) plus a little noise."""
    rng = np.random.default_rng(seed)
    job = noisy(n_iter, seed=seed, sigma=0.02)
    its = np.arange(100, 100 + n_iter)
    return its, {r: job * np.exp(rng.normal(0, 0.003, n_iter)) for r in range(n_ranks)}


def test_job_level_findings_have_no_suspects_when_all_ranks_carry_it():
    its, d = ranks_series(8, 120)
    for r in d:
        d[r][90:] *= 1.3                          # synchronised slowdown: every rank sees it
        d[r][40] *= 2.5
    win = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, first_iteration=100,
                             last_iteration=219)
    found = {f.kind: f for f in l1_findings("j", {r: (its, v) for r, v in d.items()}, win)}
    assert set(found) == {"jitter", "regression"}
    reg, jit = found["regression"], found["jitter"]
    assert reg.suspects == () and jit.suspects == ()
    assert reg.evidence["split_iteration"] == 190 and reg.evidence["ratio"] == pytest.approx(1.3, rel=0.03)
    [iv] = jit.evidence["intervals"]
    assert iv["effective_first_iteration"] == iv["effective_last_iteration"] == 140
    assert jit.evidence["state"] == "both"
    reg.to_pb(), jit.to_pb()                      # evidence converts to a protobuf Struct


def test_a_rank_that_carries_the_anomaly_alone_is_the_suspect():
    its, d = ranks_series(8, 120, seed=1)
    d[5][60:63] *= 3.0                  # only rank 5 reports slow iterations (job = max over ranks)
    [f] = l1_findings("j", {r: (its, v) for r, v in d.items()}, records_pb2.Window())
    assert f.kind == "jitter" and [s.rank for s in f.suspects] == [5]
    assert f.suspects[0].evidence["own_ratio"] == pytest.approx(3.0, rel=0.1)


def test_only_new_anomalies_are_reported_for_an_iterations_window():
    its, d = ranks_series(4, 120)
    for r in d:
        d[r][30:] *= 1.3                          # change point at iteration 130: detectable from 139
        d[r][35] *= 3.0                           # spike at iteration 135
    s = {r: (its, v) for r, v in d.items()}
    it_win = records_pb2.WINDOW_KIND_ITERATIONS
    old = records_pb2.Window(kind=it_win, first_iteration=200, last_iteration=219)
    assert l1_findings("j", s, old) == []         # both belong to earlier windows
    new = records_pb2.Window(kind=it_win, first_iteration=130, last_iteration=149)
    assert {f.kind for f in l1_findings("j", s, new)} == {"jitter", "regression"}
    assert {f.kind for f in l1_findings("j", s, old, since_iteration=0)} == {"jitter", "regression"}


def test_job_series_is_the_max_over_ranks_without_a_dense_matrix():
    from trainscope.analyzer.l1_iteration import _clean, _job_series
    for step in (1, 10**6):                        # a dense iteration range (bitmap) and a sparse one
        a = (np.array([3, 1, 2]) * step, np.array([30.0, 10.0, 20.0]))    # unsorted
        b = (np.array([2, 3, 4, 4]) * step, np.array([25.0, 5.0, 7.0, 9.0]))  # a repeated mark
        c = (np.array([1, 5]) * step, np.array([np.nan, -1.0]))              # bad points dropped
        iters, job = _job_series(_clean({0: a, 1: b, 2: c})[1])
        assert iters.tolist() == [step, 2 * step, 3 * step, 4 * step]
        assert job.tolist() == [10.0, 25.0, 30.0, 9.0]


def test_config_and_input_are_validated():
    for field, bad in [("window", 1), ("window", 4.0), ("ratio_threshold", 1.0), ("min_segment", 1),
                       ("noise_sigmas", -1.0),
                       ("max_rel_std", 0.0), ("min_segment", float("nan")), ("max_suspect_fraction", 2)]:
        with pytest.raises(ConfigError) as e:
            L1Config(**{field: bad})
        assert e.value.setting == f"l1.{field}"
    with pytest.raises(ValueError):
        detect_jitter([1.0, 0.0, 2.0])
    assert detect_jitter([5.0]) == [] and classify([]).state == "stable"


def test_phases_read_ahead_of_iterations_are_not_a_stall():
    """The telemetry clock's watermark moves with a rank's iteration records, not with the phases of a
    window whose iterations are still on their way: a healthy 4-rank DDP job beside a busy process had
    three ranks' phases of the next window read before their iterations and read "stalled", naming the
    fourth (the slowest read) as the rank that stopped 11 iterations before its peers."""
    from trainscope.analyzer.service import Analyzer, AnalyzerConfig
    from trainscope.proto.model import Resource

    class Nothing:
        def poll(self, timeout_s=0.0):
            return []

        def close(self):
            pass

    an = Analyzer(AnalyzerConfig(), Nothing())
    step = int(50 * MS)

    def window(i):
        return records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=i, first_iteration=10 * i,
                                  last_iteration=10 * i + 9, start_ns=10 * i * step, end_ns=10 * (i + 1) * step,
                                  signals=["iterations", "phases"])

    def records(rank, i):
        res = Resource(job_id="j", rank=rank, world_size=4).to_pb()
        it = records_pb2.IterationWindow(resource=res, window=window(i))
        for k in range(10 * i, 10 * i + 10):
            it.marks.add(iteration=k, start_ns=k * step, end_ns=(k + 1) * step)
        ph = records_pb2.PhaseWindow(resource=res, window=window(i))
        ph.phases.add(phase="forward", count=10, mean_ns=20 * MS, p50_ns=20 * MS, p99_ns=20 * MS, max_ns=20 * MS,
                      total_ns=200 * MS)
        return it, ph
    for i in range(3):
        for r in range(4):
            it, ph = records(r, i)
            an.ingest("iterations", it)
            an.ingest("phases", ph)
    for r in (0, 1, 3):                       # window 3's phases, read before its iterations
        an.ingest("phases", records(r, 3)[1])
    verdicts = an.step(0.0) + an.finish()
    assert verdicts and all(v.state != "stalled" for v in verdicts), [v.summary for v in verdicts]
    assert all(f.kind != "stall" for v in verdicts for f in v.findings)
