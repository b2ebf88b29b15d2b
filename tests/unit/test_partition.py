"""Partitioned analysis (``analyzer/partition.py``): the per-group L3 of two members, merged at the
job's owner, gives one process's L3 findings; the merge step's re-test, idempotence, gate and
fill; the group stage's readiness, offsets and revocation. No broker, no processes."""
import numpy as np
import pytest

from trainscope.analyzer.impact import window_scale
from trainscope.analyzer.l3_kernels import L3Config, analyze_kernels, flatten_kernels, score_kernels
from trainscope.analyzer.levels import WindowContext
from trainscope.analyzer.model import Finding, JobWindow, Scope, SuspectRank
from trainscope.analyzer.partition import (
    GroupStage, PartialStore, analyse_groups, finding_from_dict, finding_to_dict, group_comparisons,
    PART_RANKS, merge_partials, partial_records,
)
from trainscope.analyzer.significance import z_threshold
from trainscope.analyzer.topology import group_of, rank_to_group
from trainscope.processor.kafka_sink import group_key
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

WORLD, TP, PP, BAD, BAD_KEY = 64, 2, 2, 13, 3
WINDOW = records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=3, first_iteration=30, last_iteration=39)


def job(factor=1.3, keys=12, seed=0, drop_key_on=()):
    """64 ranks (tp=2, pp=2: four dp groups of 16), ``keys`` kernels per rank (one memcpy, one
    collective); rank 13 runs key 3 ``factor`` times slower; ranks in ``drop_key_on`` lack key 5."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.uniform(np.log(5e3), np.log(5e6), keys))
    res, kern = {}, {}
    for r in range(WORLD):
        res[r] = Resource(job_id="j", rank=r, world_size=WORLD, coords=coords_for_rank(r, WORLD, tp=TP, pp=PP),
                          device="cuda:0", host=f"h{r // 8}")
        kw = records_pb2.KernelWindow(resource=res[r].to_pb(), window=WINDOW)
        for k in range(keys):
            if k == 5 and r in drop_key_on:
                continue
            p50 = base[k] * np.exp(rng.normal(0, 0.01)) * (factor if (r == BAD and k == BAD_KEY) else 1.0)
            name = "ncclAllReduce" if k == keys - 1 else "memcpy_htod" if k == keys - 2 else f"gemm_{k}"
            ks = kw.kernels.add(kernel=name, stream=7, count=100, total_ns=100 * p50)
            ks.clusters.add(count=100, p50_ns=p50, p99_ns=p50 * 1.5)
        kern[r] = kw
    return res, kern


def digest(findings):
    return sorted((f.kind, f.scope.kernel, f.scope.group_index, tuple(s.rank for s in f.suspects),
                   round(f.severity, 9), f.informational, tuple(round(s.impact_ns, 3) for s in f.suspects),
                   round(float(f.evidence.get("z_threshold", 0.0)), 9)) for f in findings)


def two_members(res, kern, cfg, split=((0, 1), (2, 3)), part_ranks=None):
    """The partials of two members holding the dp groups in ``split``, through their wire records."""
    groups = group_of(res, "dp")
    store = PartialStore(cfg)
    for held in split:
        ranks = [r for g in held for r in groups[g]]
        payload = analyse_groups("j", WINDOW, {r: kern[r] for r in ranks}, {r: res[r] for r in ranks}, cfg,
                                 part_ranks=part_ranks)
        for rec in partial_records("j", WINDOW, payload, f"m{held[0]}"):
            store.add(records_pb2.Diagnosis.FromString(rec.SerializeToString()))
    return store


def merged(store, res, kern, cfg):
    ctx = WindowContext(JobWindow("j", WINDOW, dict(res)), window_scale(JobWindow("j", WINDOW, res, kern)), {})
    found = store.take(ctx)
    return found, ctx.comparisons.get("L3")


def test_processor_group_key_follows_the_analyzers_groups():
    res, _ = job()
    for g, members in group_of(res, "dp").items():
        assert {group_key(res[r].to_pb()) for r in members} == {f"j/dp{g}"}
    assert group_key(Resource(job_id="j", rank=0, world_size=4).to_pb()) == "j"   # no coordinates: one group


@pytest.mark.parametrize("drop", [(), (1, 3, 5)])
def test_group_comparisons_add_up_to_the_windows_bonferroni_m(drop):
    res, kern = job(drop_key_on=drop)
    cfg = L3Config()
    t = flatten_kernels(kern)
    rg = rank_to_group(group_of(res, "dp"))
    rank_group = np.array([rg[r] for r in t.ranks.tolist()])
    per_group = group_comparisons(t, rank_group, cfg)
    assert len(per_group) == 4
    assert sum(per_group.values()) == score_kernels(t, rank_group, cfg).comparisons


@pytest.mark.parametrize("factor,part_ranks", [(1.3, None), (1.0, None), (1.3, 5)])
def test_two_members_merged_give_one_process_findings(factor, part_ranks):
    res, kern = job(factor=factor, drop_key_on=(1, 3, 5))
    cfg = L3Config()
    one = analyze_kernels(JobWindow("j", WINDOW, res, kern), cfg)
    store = two_members(res, kern, cfg, part_ranks=part_ranks)   # 5: each group of 16 in 4 records
    assert len(store._windows[("j", WINDOW.kind, WINDOW.index)]) == (4 if part_ranks is None else 16)
    found, compared = merged(store, res, kern, cfg)
    assert digest(found) == digest(one)
    assert compared == WORLD
    named = {s.rank for f in found if not f.informational and f.kind.startswith("degraded") for s in f.suspects}
    assert named == ({BAD} if factor > 1 else set())


def test_merge_retests_every_suspect_at_the_windows_threshold():
    cfg = L3Config()
    lo, hi = z_threshold(cfg.false_alarm, 100), z_threshold(cfg.false_alarm, 1000)
    mid = (lo + hi) / 2
    f = Finding(level="L3", kind="degraded_kernel", job_id="j", window=WINDOW,
                scope=Scope(kernel="gemm", stream=7, group="dp", group_index=0),
                suspects=(SuspectRank(3, hi + 1, {"z": hi + 1, "time_per_iteration_ns": 2e6, "group_median_ns": 1e6},
                                      impact_ns=1e6),
                          SuspectRank(4, mid, {"z": mid, "time_per_iteration_ns": 1.5e6, "group_median_ns": 1e6},
                                      impact_ns=5e5)),
                severity=hi + 1, evidence={"group_size": 16, "z_threshold": lo, "comparisons": 100})
    entries = {0: {"M": 100, "compared": 16, "findings": [finding_to_dict(f)]},
               1: {"M": 900, "compared": 16, "findings": []}}
    found, compared, m = merge_partials(entries, "j", WINDOW, cfg)
    assert m == 1000 and compared == 32
    assert [s.rank for s in found[0].suspects] == [3]          # z* of 1,000 comparisons, not of the member's 100
    assert found[0].evidence["z_threshold"] == pytest.approx(hi)
    alone, _, _ = merge_partials({0: entries[0]}, "j", WINDOW, cfg)
    assert [s.rank for s in alone[0].suspects] == [3, 4]        # with the member's own M both stay


def test_a_group_analysed_twice_counts_once():
    res, kern = job()
    cfg = L3Config()
    once = two_members(res, kern, cfg)
    twice = two_members(res, kern, cfg, split=((0, 1), (2, 3), (1, 2)))    # groups 1, 2 again after a rebalance
    assert twice.duplicates == 2 and once.duplicates == 0
    a, ca = merged(once, res, kern, cfg)
    b, cb = merged(twice, res, kern, cfg)
    assert digest(a) == digest(b) and ca == cb == WORLD


def test_a_full_partial_record_fits_kafkas_default_record_limit():
    from trainscope.analyzer.partition import _b64
    rng = np.random.default_rng(0)
    entry = {"g": 0, "part": 0, "parts": 1, "M": 10**6, "members": PART_RANKS, "compared": PART_RANKS,
             "ranks": _b64(np.arange(PART_RANKS, dtype="<i4") + 90_000),
             "sums": _b64(rng.uniform(1e8, 1e9, (PART_RANKS, 3))), "findings": []}
    (rec,) = partial_records("j", WINDOW, {"groups": [entry], "names": ["a" * 200] * 3}, "member")
    assert len(rec.SerializeToString()) < 1_000_000 * 0.5      # librdkafka's message.max.bytes: 1,000,000


def test_finding_survives_the_partial_record():
    f = Finding(level="L3", kind="degraded_kernels", job_id="j", window=WINDOW,
                scope=Scope(kernel="[compute]", stream=-1, group="dp", group_index=2),
                suspects=(SuspectRank(7, 5.5, {"z": 5.5, "direction": "slower", "count": 100}, impact_ns=123.5),),
                severity=5.5, evidence={"group_size": 16, "category": "compute"}, comparison="peers")
    (d,) = partial_records("j", WINDOW, {"groups": [{"g": 2, "findings": [finding_to_dict(f)]}]}, "m")
    from google.protobuf import json_format
    back = finding_from_dict(json_format.MessageToDict(records_pb2.Diagnosis.FromString(
        d.SerializeToString()).evidence)["groups"][0]["findings"][0], "j", WINDOW)
    assert back == f


def test_owner_rescales_impacts_when_it_counts_iterations_differently():
    cfg = L3Config()
    f = Finding(level="L3", kind="degraded_kernel", job_id="j", window=WINDOW,
                scope=Scope(kernel="gemm", stream=7, group="dp"),
                suspects=(SuspectRank(3, 50.0, {"z": 50.0, "time_per_iteration_ns": 2e6, "group_median_ns": 1e6},
                                      impact_ns=1e6),), severity=50.0, evidence={"group_size": 16})
    iters = records_pb2.IterationWindow(window=WINDOW)
    for i in range(5):
        iters.marks.add(iteration=30 + i, start_ns=i * 100, end_ns=i * 100 + 90)
    scale = window_scale(JobWindow("j", WINDOW, iterations={3: iters}))
    found, _, _ = merge_partials({0: {"M": 10, "compared": 16, "findings": [finding_to_dict(f)]}}, "j", WINDOW, cfg,
                                 scale, member_iterations={0: 10.0})
    s = found[0].suspects[0]
    assert s.impact_ns == pytest.approx(2e6)                     # the member divided by 10, the rank ran 5
    assert s.evidence["time_per_iteration_ns"] == pytest.approx(4e6)


def test_gate_waits_for_partials_covering_the_window_and_fill_gives_kernel_sums():
    res, kern = job()
    cfg = L3Config()
    now = [100.0]
    store = PartialStore(cfg, first_wait_s=10.0, clock=lambda: now[0])
    jw = JobWindow("j", WINDOW, dict(res))
    other = JobWindow("k", WINDOW, dict(res))
    assert not store.gate("k", other, first_seen=95.0)          # no partial yet: wait ...
    now[0] = 106.0
    assert store.gate("k", other, first_seen=95.0)              # ... first_wait_s, then: a job without kernels
    groups = group_of(res, "dp")
    half = [r for g in (0, 1) for r in groups[g]]
    for rec in partial_records("j", WINDOW, analyse_groups("j", WINDOW, {r: kern[r] for r in half},
                                                           {r: res[r] for r in half}, cfg), "m0"):
        store.add(rec)
    assert not store.gate("j", jw, first_seen=100.0)            # half of the ranks covered
    rest = [r for g in (2, 3) for r in groups[g]]
    for rec in partial_records("j", WINDOW, analyse_groups("j", WINDOW, {r: kern[r] for r in rest},
                                                           {r: res[r] for r in rest}, cfg), "m1"):
        store.add(rec)
    assert store.gate("j", jw, first_seen=100.0)
    store.fill(jw)
    assert sorted(jw.kernels) == list(range(WORLD))
    sums = {ks.kernel: ks.total_ns for ks in jw.kernels[BAD].kernels}
    assert set(sums) == {"gemm_0", "memcpy_htod", "ncclAllReduce"}   # one per category, named by a kernel of it
    want = sum(ks.total_ns for ks in kern[BAD].kernels if ks.kernel.startswith("gemm"))
    assert sums["gemm_0"] == pytest.approx(want)


def test_group_stage_analyses_a_window_when_its_groups_are_complete():
    res, kern = job()
    groups = group_of(res, "dp")
    now = [0.0]
    stage = GroupStage(L3Config(), grace_s=0.5, window_timeout_s=60, clock=lambda: now[0])
    g0, g2 = groups[0], groups[2]
    for i, r in enumerate(g0 + g2[:-1]):
        stage.add(kern[r], ("kernels", 0 if r in g0 else 1), 100 + i)
    now[0] = 5.0
    assert stage.ready() == []                                   # group 2 lacks a rank
    assert stage.held() == {("kernels", 0): 100, ("kernels", 1): 100 + len(g0)}
    stage.add(kern[g2[-1]], ("kernels", 1), 500)
    assert stage.ready() == []                                   # within grace_s of the last record
    now[0] = 6.0
    key = ("j", WINDOW.kind, WINDOW.index)
    assert stage.ready() == [key]
    recs, _ = stage.analyse(key, "m")
    assert [r.kind for r in recs] == ["group_partial"] * 2 and stage.held() == {}   # one per group held
    assert not stage.add(kern[g0[0]], ("kernels", 0), 900) and stage.late == 1   # its window was analysed


def test_group_stage_forgets_only_the_revoked_partitions_records():
    res, kern = job()
    groups = group_of(res, "dp")
    stage = GroupStage(L3Config())
    for r in groups[0]:
        stage.add(kern[r], ("kernels", 0), 10 + r)
    for r in groups[1]:
        stage.add(kern[r], ("kernels", 4), 10 + r)
    stage.drop({("kernels", 4)})
    (s,) = stage.open.values()
    assert sorted(s.kernels) == groups[0] and set(stage.held()) == {("kernels", 0)}
    stage.drop({("kernels", 0)})
    assert stage.open == {}


def test_late_partials_are_dropped_once_their_window_was_judged():
    from trainscope.analyzer.service import Analyzer, AnalyzerConfig

    class Nothing:
        def poll(self, timeout_s=0.0):
            return []

        def close(self):
            pass

    res, kern = job()
    an = Analyzer(AnalyzerConfig(), Nothing())
    iw = records_pb2.IterationWindow(resource=res[0].to_pb(), window=WINDOW)
    an.ingest("iterations", iw)
    assert not an.analysed("j", WINDOW.kind, WINDOW.index)       # open
    an.finish()
    assert an.analysed("j", WINDOW.kind, WINDOW.index) and not an.analysed("j", WINDOW.kind, WINDOW.index + 1)
    store = two_members(res, kern, L3Config())
    store.discard("j", WINDOW.kind, WINDOW.index)
    assert store.covered("j", WINDOW) == 0
