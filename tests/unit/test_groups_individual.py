"""Sibling groups (a whole group slower than its siblings) and small jobs (own history, pairs):
analyzer/l2_groups.py and analyzer/individual.py, alone and through the service's verdict."""
import numpy as np
import pytest

from trainscope.analyzer.impact import window_scale
from trainscope.analyzer.individual import History, IndividualConfig, analyze_individual
from trainscope.analyzer.l2_groups import GroupsConfig, analyze_groups
from trainscope.analyzer.merge import merge
from trainscope.analyzer.model import JobWindow
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

MS = 1_000_000
ITERS = 10


def window(index=0):
    return records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=index,
                              first_iteration=index * ITERS, last_iteration=(index + 1) * ITERS - 1)


def job(world=32, tp=4, *, seed=0, slow=None, index=0, noise=0.01, coords=True) -> JobWindow:
    """Phases per rank: mlp 40 ms, tp-allreduce 8 ms, dataloader 1 ms per iteration, with per-rank noise.
    ``slow(rank, phase) -> factor``."""
    rng = np.random.default_rng(seed * 1000 + index)
    w = window(index)
    jw = JobWindow(job_id="j", window=w)
    for r in range(world):
        c = coords_for_rank(r, world, tp=tp) if coords else coords_for_rank(r, world)
        res = Resource(job_id="j", rank=r, world_size=world, host=f"h{r // tp}", coords=c)
        if not coords:
            res = Resource(job_id="j", rank=r, world_size=world, host=f"h{r}")
        jw.resources[r] = res
        pw = records_pb2.PhaseWindow(resource=res.to_pb(), window=w)
        for name, base in (("mlp", 40), ("tp-allreduce", 8), ("dataloader", 1)):
            f = (slow(r, name) if slow else 1.0) * np.exp(rng.normal(0, noise))
            m = base * MS * f
            pw.phases.add(phase=name, count=ITERS, mean_ns=m, p50_ns=m, p99_ns=m * 1.02, total_ns=m * ITERS)
        jw.phases[r] = pw
        iw = records_pb2.IterationWindow(resource=res.to_pb(), window=w, mean_ns=50 * MS)
        for i in range(w.first_iteration, w.last_iteration + 1):
            iw.marks.add(iteration=i, start_ns=i * 50 * MS, end_ns=(i + 1) * 50 * MS)
        jw.iterations[r] = iw
    return jw


# ------------------------------------------------------------------ sibling groups
def test_a_whole_tp_group_slower_in_its_collective_is_a_group_finding_and_a_slow_link():
    # TP group of ranks 12-15 (host h3): every member's tp-allreduce 40 % longer, nobody late
    jw = job(slow=lambda r, p: 1.4 if 12 <= r <= 15 and p == "tp-allreduce" else 1.0)
    found, n = analyze_groups(jw, window_scale(jw))
    assert n > 0
    [f] = [f for f in found if f.scope.phase == "tp-allreduce"]
    assert f.kind == "slow_group" and f.scope.group == "tp" and f.evidence["shared_host"] == "h3"
    assert sorted(s.rank for s in f.suspects) == [12, 13, 14, 15]
    assert f.suspects[0].impact_ns == pytest.approx(0.4 * 8 * MS, rel=0.1)
    v = merge("j", jw.window, found, jw.resources, jw=jw, step_ns=50 * MS)
    assert v.host == "h3" and {s.role for s in v.ranks} == {"link"}


def test_healthy_siblings_and_a_single_slow_member_give_no_group_finding():
    for seed in range(5):
        found, _ = analyze_groups(job(seed=seed, noise=0.03), window_scale(job(seed=seed, noise=0.03)))
        assert found == []
    one = job(slow=lambda r, p: 1.5 if r == 13 and p == "mlp" else 1.0)
    found, _ = analyze_groups(one, window_scale(one))
    assert found == []          # one slow member is L2's business, not a group's


def test_a_class_split_by_a_slow_host_names_the_slower_side_and_healthy_splits_do_not():
    """Step 3b: 16 ranks in TP groups of 2 on two hosts of 8; every rank of host 1 does its mlp 20 %
    slower and nobody waits (no dependency to follow): half of the TP groups are slow, so the
    siblings' median sits between the sides and no robust z stands out. The split names host 1's
    ranks; a healthy job with 3 % noise, and one slowed 3 % (under min_excess), name nobody."""
    def two_hosts(slow_factor, seed):
        jw = job(world=16, tp=2, seed=seed, noise=0.03,
                 slow=lambda r, p: slow_factor if r >= 8 and p == "mlp" else 1.0)
        for r, res in jw.resources.items():      # hosts of 8 ranks: 4 TP groups each
            jw.resources[r] = Resource(job_id="j", rank=r, world_size=16, host=f"h{r // 8}", coords=res.coords)
        return jw
    jw = two_hosts(1.2, 0)
    found, _ = analyze_groups(jw, window_scale(jw))
    slow = [f for f in found if f.scope.phase == "mlp"]
    assert slow and {s.rank for f in slow for s in f.suspects} == set(range(8, 16))
    assert all(f.evidence["shared_host"] == "h1" for f in slow)
    v = merge("j", jw.window, found, jw.resources, jw=jw, step_ns=50 * MS)
    assert v.host == "h1" and v.ranks[0].role == "culprit"
    for seed in range(8):
        for factor in (1.0, 1.03):
            jw = two_hosts(factor, seed)
            assert analyze_groups(jw, window_scale(jw))[0] == [], (seed, factor)


def test_groups_config_is_validated():
    for field, bad in (("dims", ("xx",)), ("min_groups", 2), ("uniform", 0.0), ("false_alarm", 2.0)):
        with pytest.raises(ConfigError) as e:
            GroupsConfig(**{field: bad})
        assert e.value.setting.startswith("groups.")


# ------------------------------------------------------------------ small jobs
def test_own_history_finds_a_rank_slower_than_itself_when_peers_cannot_be_compared():
    hist = History(16)
    cfg = IndividualConfig()
    slowdown = lambda r, p: 1.3 if r == 1 and p == "mlp" else 1.0   # noqa: E731
    for i in range(4):                                                # 2 ranks: no peer comparison
        jw = job(world=2, tp=1, index=i, seed=3)
        found, made = analyze_individual(jw, window_scale(jw), hist, cfg)
        assert found == [] and (made["own_history"] > 0) == (i >= cfg.min_history) and made["dependency"] == 1
    jw = job(world=2, tp=1, index=4, seed=3, slow=slowdown)
    found, _ = analyze_individual(jw, window_scale(jw), hist, cfg)
    [f] = [f for f in found if f.kind == "individual_slowdown"]
    assert f.comparison == "own_history" and f.suspects[0].rank == 1 and f.scope.phase == "mlp"
    assert f.suspects[0].impact_ns == pytest.approx(0.3 * 40 * MS, rel=0.1)


def test_own_history_confirmed_by_peers_finds_a_rank_a_noisy_small_group_hides():
    """16 ranks in TP groups of 4: DP groups of 4 peers. Rank 5's mlp becomes 20 % slower while a
    peer (rank 13) draws +9 % noise: the 4-peer MAD hides rank 5 from L2, its own history does
    not, and its peers agree (z >= peer_z). A job-wide 20 % slowdown names nobody here (the peers
    do not agree: L1's business); neither do healthy windows."""
    cfg = IndividualConfig()
    hist = History(16)
    for i in range(4):
        jw = job(world=16, tp=4, index=i, seed=5, noise=0.02)
        found, _ = analyze_individual(jw, window_scale(jw), hist, cfg)
        assert [f for f in found if f.kind == "individual_slowdown"] == []
    slow = lambda r, p: {5: 1.2, 13: 1.09}.get(r, 1.0) if p == "mlp" else 1.0   # noqa: E731
    jw = job(world=16, tp=4, index=4, seed=5, noise=0.02, slow=slow)
    found, _ = analyze_individual(jw, window_scale(jw), hist, cfg)
    named = {s.rank for f in found if f.kind == "individual_slowdown" for s in f.suspects}
    assert named == {5}
    f = next(f for f in found if f.kind == "individual_slowdown")
    assert f.comparison == "own_history" and f.scope.phase == "mlp" and f.suspects[0].evidence["peers_z"] >= 2
    hist2 = History(16)
    for i in range(5):
        everyone = (lambda r, p: 1.2 if p == "mlp" else 1.0) if i == 4 else None
        jw = job(world=16, tp=4, index=i, seed=6, noise=0.02, slow=everyone)
        found, _ = analyze_individual(jw, window_scale(jw), hist2, cfg)
        assert [f for f in found if f.kind == "individual_slowdown"] == [], i


def test_pair_dependency_names_the_rank_its_partner_waited_for():
    """Two ranks: rank 1's data loader takes 16 ms a step; rank 0 waits that long in the all-reduce."""
    def slow(r, p):
        if r == 1 and p == "dataloader":
            return 16.0
        if r == 0 and p == "tp-allreduce":
            return 1 + 15 / 8
        return 1.0
    jw = job(world=2, tp=1, slow=slow)
    found, _ = analyze_individual(jw, window_scale(jw), History(16))
    [f] = [f for f in found if f.kind == "pair_straggler"]
    assert f.comparison == "pair" and f.suspects[0].rank == 1 and f.scope.phase == "dataloader"
    assert f.suspects[0].impact_ns == pytest.approx(15 * MS, rel=0.1)
    v = merge("j", jw.window, found, jw.resources, step_ns=50 * MS)
    assert v.ranks[0].rank == 1 and v.comparison == "pair"
    # the same pair, healthy: nothing
    ok = job(world=2, tp=1)
    assert analyze_individual(ok, window_scale(ok), History(16))[0] == []


def test_small_jobs_say_which_comparison_was_made_and_unknown_when_none(tmp_path):
    from trainscope.analyzer.service import Analyzer, AnalyzerConfig
    from trainscope.analyzer.sources import BusSource
    from trainscope.processor.bus import EmbeddedBus
    from trainscope.proto.contracts import topic_for

    bus = EmbeddedBus()
    t = [100.0]
    a = Analyzer(AnalyzerConfig(), BusSource(bus), [], clock=lambda: t[0])
    # two ranks: no peer group, no history yet, but the pair can be compared: says so
    jw = job(world=2, tp=1)
    for r in (0, 1):
        bus.publish(topic_for("phases"), b"j", jw.phases[r].SerializeToString())
        bus.publish(topic_for("iterations"), b"j", jw.iterations[r].SerializeToString())
    a.step(0)
    t[0] += 1
    (v,) = a.step(0)
    assert v.state == "healthy" and "dependency" in v.comparison and "compared with" in v.summary
    # one rank with its iteration marks: only its own iteration time can be judged, and the verdict says so
    solo = job(world=1, tp=1)
    solo.phases[0].resource.job_id = solo.iterations[0].resource.job_id = "solo"
    bus.publish(topic_for("phases"), b"solo", solo.phases[0].SerializeToString())
    bus.publish(topic_for("iterations"), b"solo", solo.iterations[0].SerializeToString())
    a.step(0)
    t[0] += 1
    (s1,) = a.step(0)
    assert s1.state == "healthy" and s1.comparison == "iteration_history"
    # one rank, phases only: nothing to compare it with at all: unknown, never "healthy"
    bare = job(world=1, tp=1)
    bare.phases[0].resource.job_id = "bare"
    bus.publish(topic_for("phases"), b"bare", bare.phases[0].SerializeToString())
    a.step(0)
    t[0] += 1
    (u,) = a.step(0)
    assert u.state == "unknown" and u.comparison == "none" and "no comparison possible" in u.summary
