"""L2 phase stragglers within parallel groups (ARGUS §6.1, App. B eq. 5, §9.5)."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.l2_phases import L2Config, analyze_phases, group_stats, phase_matrix
from trainscope.analyzer.model import JobWindow
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2, telemetry_pb2

MS = 1e6
PHASES = {"forward": 40 * MS, "backward": 80 * MS, "self_attention": 12 * MS, "mlp": 9 * MS,
          "dp-allreduce": 6 * MS, "optimizer": 3 * MS}


def job(world, *, tp=1, pp=1, ep=1, phases=PHASES, scale=None, noise=0.005, seed=0, coords=True):
    """Each rank reports every phase; ``scale(rank, coords, phase)`` multiplies its mean."""
    rng = np.random.default_rng(seed)
    win = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, first_iteration=10,
                             last_iteration=19)
    jw = JobWindow(job_id="j", window=win)
    for r in range(world):
        c = coords_for_rank(r, world, tp=tp, pp=pp, ep=ep) if coords else None
        res = Resource(job_id="j", rank=r, world_size=world, **({"coords": c} if c else {}))
        jw.resources[r] = res
        pw = records_pb2.PhaseWindow(resource=res.to_pb(), window=win)
        for name, base in phases.items():
            mean = base * np.exp(rng.normal(0, noise)) * (scale(r, c, name) if scale else 1.0)
            pw.phases.add(phase=name, count=10, mean_ns=mean, p50_ns=mean, p99_ns=mean * 1.1,
                          max_ns=mean * 1.2, total_ns=mean * 10)
        jw.phases[r] = pw
    return jw


def summary(findings):
    return sorted((f.kind, f.scope.phase, f.scope.group, f.scope.group_index,
                   tuple(s.rank for s in f.suspects)) for f in findings)


def test_healthy_job_yields_nothing():
    assert analyze_phases(job(64, tp=2, pp=2)) == []


def test_slow_rank_found_in_its_phase_and_group_only():
    # tp=2: group index = tp coordinate; rank 11 has tp=1
    jw = job(16, tp=2, scale=lambda r, c, p: 1.6 if (r, p) == (11, "self_attention") else 1.0)
    found = analyze_phases(jw)
    assert summary(found) == [("straggler", "self_attention", "dp", 1, (11,))]
    s = found[0].suspects[0]
    assert s.evidence["ratio"] == pytest.approx(1.6, rel=0.03)
    assert s.evidence["z"] > 2 and found[0].evidence["cv_level"] == "severe"
    assert found[0].level == "L2" and found[0].to_pb().scope.phase == "self_attention"


def test_small_group_uses_the_robust_criterion_where_z_is_bounded():
    # 4 ranks: max z = (n-1)/sqrt(n) = 1.5 < 2, yet one rank is 50 % slower
    found = analyze_phases(job(4, scale=lambda r, c, p: 1.5 if (r, p) == (2, "mlp") else 1.0))
    assert summary(found) == [("straggler", "mlp", "dp", 0, (2,))]
    assert found[0].suspects[0].evidence["z"] == pytest.approx(1.5, abs=0.01)


def test_different_pipeline_stages_are_not_compared():
    # stage 1 runs a 1.5x longer forward than stage 0: a different role, not a straggler
    jw = job(16, pp=2, scale=lambda r, c, p: 1.5 if c.pp == 1 and p == "forward" else 1.0)
    assert analyze_phases(jw) == []
    # compared job-wide (no coordinates), half the ranks would look different; still no single straggler,
    # but a real straggler inside stage 1 is found by its stage peers only
    jw = job(16, pp=2, scale=lambda r, c, p: (1.5 if c.pp == 1 and p == "forward" else 1.0)
             * (1.3 if (r, p) == (12, "forward") else 1.0))
    assert summary(analyze_phases(jw)) == [("straggler", "forward", "dp", 1, (12,))]


def test_moe_load_imbalance_in_the_ep_group():
    # ep=8, dp=2: moe_experts compared within EP groups (same dp replica), ARGUS Table 3 and Table 6
    phases = {"moe_experts": 20 * MS, "self_attention": 12 * MS}
    jw = job(16, ep=8, phases=phases,
             scale=lambda r, c, p: 1.5 if (r, p) == (13, "moe_experts") else 1.0)
    found = analyze_phases(jw)
    assert summary(found) == [("imbalance", "moe_experts", "ep", 1, (13,))]


def test_late_arriver_is_the_culprit_and_victims_are_not_suspects():
    # rank 3's compute is slow; in the dp all-reduce its peers wait for it, so they show long
    # collectives and rank 3 the shortest (ARGUS §9.5)
    def scale(r, c, p):
        if p == "mlp":
            return 5.0 if r == 3 else 1.0
        if p == "dp-allreduce":
            return 1.0 if r == 3 else 7.0           # peers: 6 ms transfer + 36 ms waiting
        return 1.0
    found = analyze_phases(job(8, scale=scale))
    assert summary(found) == [("straggler", "dp-allreduce", "dp", 0, (3,)),
                              ("straggler", "mlp", "dp", 0, (3,))]
    comm = next(f for f in found if f.scope.phase == "dp-allreduce")
    s = comm.suspects[0]
    assert s.evidence["role"] == "late_arriver" and s.evidence["cause"] == "own_compute"
    assert s.evidence["compute_slower"] == {"mlp": pytest.approx(5.0, rel=0.03)}
    assert comm.evidence["victims"] == [0, 1, 2, 4, 5, 6, 7] and comm.evidence["victims_count"] == 7
    assert s.evidence["peers_waited_ns"] == pytest.approx(36 * MS, rel=0.05)
    comm.to_pb()


def test_late_arriver_delayed_by_a_dependency_has_normal_compute():
    # replica 2 is late in both stages because of a pipeline dependency (ARGUS §9.5): compute is fine
    jw = job(8, pp=2, scale=lambda r, c, p: (1.0 if c.dp == 2 else 6.0) if p == "dp-allreduce" else 1.0)
    found = analyze_phases(jw)
    assert summary(found) == [("straggler", "dp-allreduce", "dp", 0, (2,)),
                              ("straggler", "dp-allreduce", "dp", 1, (6,))]
    assert {f.suspects[0].evidence["cause"] for f in found} == {"delayed_by_dependency"}


def test_slow_communication_without_a_late_arriver():
    phases = {"pp-send": 4 * MS, "forward": 40 * MS}
    jw = job(16, pp=2, phases=phases, scale=lambda r, c, p: 2.0 if (r, p) == (5, "pp-send") else 1.0)
    assert summary(analyze_phases(jw)) == [("slow_communication", "pp-send", "dp", 0, (5,))]


def test_missing_coordinates_compare_the_whole_job():
    jw = job(6, coords=False, scale=lambda r, c, p: 1.4 if (r, p) == (4, "optimizer") else 1.0)
    assert summary(analyze_phases(jw)) == [("straggler", "optimizer", "dp", 0, (4,))]


def test_group_stats_match_numpy_per_group():
    rng = np.random.default_rng(0)
    x, label = rng.random(50), rng.integers(0, 4, 50)
    st = group_stats(x, label)
    for g in range(4):
        sel = label == g
        v = x[sel]
        np.testing.assert_allclose(st["mean"][sel], v.mean())
        np.testing.assert_allclose(st["std"][sel], v.std(ddof=1))
        np.testing.assert_allclose(st["median"][sel], np.median(v))
        np.testing.assert_allclose(st["mad"][sel], np.median(np.abs(v - np.median(v))))
        assert (st["n"][sel] == sel.sum()).all()


def test_repeated_phase_names_merge_and_config_is_validated():
    jw = job(3)
    jw.phases[0].phases.add(phase="forward", count=10, mean_ns=80 * MS, total_ns=800 * MS)
    ranks, names, m = phase_matrix(jw)
    assert m[0, names.index("forward")] == pytest.approx(60 * MS, rel=0.01)
    for field, bad in [("cv_mild", 0), ("cv_severe", 0.01), ("min_group_size", 2), ("imbalance", "("),
                       ("comm_min_deficit", 1.0), ("false_alarm", True), ("rel_floor", -1.0), ("pure_compute", "[")]:
        with pytest.raises(ConfigError) as e:
            L2Config(**{field: bad})
        assert e.value.setting == f"l2.{field}"


# ------------------------------------------------------------ step 3b: a host phase's own fault
CPU_PHASES = {"dataloader": 1.5 * MS, "forward": 4 * MS, "backward": 5 * MS, "optimizer": 4 * MS}


def cpu_job(scale, noise=0.5, seed=3):
    """A 4-rank CPU job: every phase on the host's clock, each rank's window mean as spread as a
    real gloo job's (its data loader 0.3-3.6 ms, optimizer 1.9-11 ms: ~50 % log-normal)."""
    jw = job(4, phases=CPU_PHASES, scale=scale, noise=noise, seed=seed)
    for pw in jw.phases.values():
        for p in pw.phases:
            p.clock = telemetry_pb2.PHASE_CLOCK_CPU
    return jw


def run_windows(scale, seeds, spread=True):
    from trainscope.analyzer.l2_phases import PhaseSpread
    memory = PhaseSpread(8) if spread else None
    return [analyze_phases(cpu_job(scale, seed=s), L2Config(), None, memory) for s in seeds]


def test_a_host_phase_whose_typical_instance_is_out_of_line_is_named_whatever_the_preemptions(monkeypatch):
    """Step 3c. Beside busy processes the peers' data loader means carry preempted steps (one step of ten
    at 20-60 ms: means 2-6x their p50) while rank 2 waits 30 ms in every step: its mean is lost in the
    peers' spread in some windows, its typical instance (p50) never is. The preempted peers alone, and a
    forward (it can hold a wait) whose p50 is 3x, name nobody by step 3c."""
    rng = np.random.default_rng(7)

    def window(slow: bool, seed: int, phase: str = "dataloader"):
        jw = cpu_job(lambda r, c, p: 1.0, noise=0.05, seed=seed)
        for r, pw in jw.phases.items():
            for p in pw.phases:
                if p.phase != phase:
                    continue
                if slow and r == 2:
                    p.p50_ns = 20 * p.p50_ns if phase == "dataloader" else 3 * p.p50_ns
                    p.total_ns = p.p50_ns * p.count + rng.uniform(0, 40) * MS
                else:                       # one preempted step of ten
                    p.total_ns = p.p50_ns * p.count + rng.uniform(20, 60) * MS
                p.mean_ns = p.total_ns / p.count
        return jw

    from trainscope.analyzer import l2_phases

    def by_mean_only(jw):
        with monkeypatch.context() as m:
            m.setattr(l2_phases, "_typical_phases", lambda *a, **k: {})
            return analyze_phases(jw)

    named, by_mean = 0, 0
    for s in range(30):
        slow = window(True, s)          # one window judged both ways
        got = analyze_phases(slow)
        assert all(x.rank == 2 for f in got for x in f.suspects), summary(got)
        named += any(f.scope.phase == "dataloader" for f in got)
        by_mean += any(f.scope.phase == "dataloader" for f in by_mean_only(slow))
        # the preempted peers alone, and a forward 3x typical: step 3c adds nothing to what the means say
        for jw in (window(False, s), window(True, s, "forward")):
            assert summary(analyze_phases(jw)) == summary(by_mean_only(jw)), s
    assert named == 30 and by_mean < named, (named, by_mean)


def test_a_host_phase_far_out_of_line_is_judged_against_its_spread_over_windows():
    """Step 3b. After 4 healthy windows, a data loader 30x its peers on rank 2 (its other phases as
    theirs) is named in every window; judged in each window alone (the Student t of 3 degrees of
    freedom) it is missed in some. (A real 4-rank job's slow loader was 13-71x.) A rank whose whole host is 2.5x slower, a healthy job, and a
    forward (it can hold a wait) are never named by step 3b."""
    def loader(r, c, p):
        return 30.0 if (r, p) == (2, "dataloader") else 1.0
    seeds = range(40)
    healthy = run_windows(lambda r, c, p: 1.0, seeds)
    assert not any(healthy), [summary(f) for f in healthy if f]
    from trainscope.analyzer.l2_phases import PhaseSpread
    memory, named, alone = PhaseSpread(8), 0, 0
    for s in seeds:
        scale = (lambda r, c, p: 1.0) if s < 4 else loader
        got = analyze_phases(cpu_job(scale, seed=s), L2Config(), None, memory)
        single = analyze_phases(cpu_job(scale, seed=s))
        if s >= 4:
            assert [(f.scope.phase, [x.rank for x in f.suspects]) for f in got] == [("dataloader", [2])], s
            named += 1
            alone += bool(single)
    assert named == 36 and alone < named
    busy = run_windows(lambda r, c, p: 2.5 if r == 2 else 1.0, seeds)
    alone = run_windows(lambda r, c, p: 2.5 if r == 2 else 1.0, seeds, spread=False)
    assert [summary(f) for f in busy] == [summary(f) for f in alone]
    fwd = run_windows(lambda r, c, p: 3.0 if (r, p) == (2, "forward") else 1.0, seeds)
    same = run_windows(lambda r, c, p: 3.0 if (r, p) == (2, "forward") else 1.0, seeds, spread=False)
    assert [summary(f) for f in fwd] == [summary(f) for f in same]
    with pytest.raises(ConfigError, match="specific_factor"):
        L2Config(specific_factor=1.0)
    with pytest.raises(ConfigError, match="spread_windows"):
        L2Config(spread_windows=0)
    with pytest.raises(ConfigError, match="holds_collectives"):
        L2Config(holds_collectives="(forward")
