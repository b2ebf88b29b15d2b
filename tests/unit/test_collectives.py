"""Collective records end to end without processes: processor windows, then the analyzer's
late-start and hang rules (analyzer/collectives.py) on records built like the collector's."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer.collectives import CollectiveState, CollectivesConfig
from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows, size_class, validate
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.errors import ConfigError
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
W = records_pb2.Window(index=0)


def job_batches(ranks=4, steps=20, late_rank=None, late_ms=0.0, late_from=0, hang_rank=None, hang_at=None,
                seed=0, transfer_ms=1.0, step_ms=50.0, late_every=1, noise_ms=0.5, late_steps=None):
    """Per rank: one CollectiveBatch of an all-reduce per step. Each rank enters after its own compute
    (50 ms +- noise); the collective ends transfer_ms after the last member entered, on every member.
    ``hang_rank`` never enters step ``hang_at``: the others stay in flight (state records).
    ``late_steps``: the steps ``late_rank`` is late to (instead of ``late_from``/``late_every``)."""
    rng = np.random.default_rng(seed)
    recs = {r: [] for r in range(ranks)}
    t = T0
    now = {}
    for step in range(steps):
        enter = {r: t + int((step_ms + rng.normal(0, noise_ms)) * MS) for r in range(ranks)}
        if late_rank is not None and (step in late_steps if late_steps is not None
                                      else step >= late_from and (step - late_from) % late_every == 0):
            enter[late_rank] += int(late_ms * MS)
        if hang_at is not None and step == hang_at:
            for r in range(ranks):
                if r != hang_rank:
                    recs[r].append(telemetry_pb2.CollectiveRecord(
                        group=0, seq=step + 1, op="allreduce", bytes=4096, dtype="float32",
                        enqueue_ns=enter[r], start_ns=enter[r], end_ns=0, iteration=step))
                now[r] = enter[r] + 20_000 * MS   # 20 s later, still in flight
            now[hang_rank] = max(enter.values())
            break
        end = max(enter.values()) + int(transfer_ms * MS)
        for r in range(ranks):
            recs[r].append(telemetry_pb2.CollectiveRecord(
                group=0, seq=step + 1, op="allreduce", bytes=4096, dtype="float32",
                enqueue_ns=enter[r], start_ns=enter[r], end_ns=end + int(rng.uniform(0, 0.05) * MS),
                iteration=step))
        t = end
    return {r: telemetry_pb2.CollectiveBatch(
        groups=[telemetry_pb2.CollectiveGroup(id="0", members=list(range(ranks)))], records=recs[r],
        now_ns=now.get(r, t)) for r in range(ranks)}


def windows_of(batches, world=4):
    """The batches through the processor's validation and windows: CollectiveWindow per rank."""
    out = []
    m = SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(), out.append, m)
    for r, b in batches.items():
        payload, n, end = validate(b, world, 2**62, m)
        assert end == 0 and n == len(b.records)
        cw.add(Resource(job_id="j", rank=r, world_size=world), payload)
    cw.flush()
    assert cw.open_windows == 0
    return {o.collectives.resource.rank: o.collectives for o in out}


def state_of(batches, **cfg) -> CollectiveState:
    st = CollectiveState(CollectivesConfig(**cfg))
    for r, w in windows_of(batches).items():
        st.absorb(r, w)
    return st


def test_processor_window_keeps_raw_records_and_summarises_per_group_op_size():
    ws = windows_of(job_batches(steps=10))
    w = ws[1]
    assert len(w.records) == 10 and [g.id for g in w.groups] == ["0"]
    (s,) = w.stats
    assert (s.group, s.op, s.size_class, s.count) == ("0", "allreduce", size_class(4096), 10)
    assert s.p50_ns > 0 and s.max_ns >= s.p99_ns >= s.p50_ns
    assert w.window.end_ns >= w.window.start_ns > 0


def test_processor_window_is_bounded_and_counts_what_it_summarised_only():
    out = []
    m = SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(max_records_per_window=4), out.append, m)
    payload, _, _ = validate(job_batches(steps=10)[0], 4, 2**62, m)
    cw.add(Resource(job_id="j", rank=0, world_size=4), payload)
    cw.flush()
    (o,) = out
    assert len(o.collectives.records) == 4 and o.collectives.records_dropped == 6
    assert o.collectives.stats[0].count == 10          # summaries still cover every record
    assert o.raw.window.end_ns == 0                    # never moves durability's closed_until


def test_validation_drops_bad_records_and_refuses_an_empty_batch():
    m = SelfMetrics()
    b = job_batches(steps=3)[0]
    b.records[0].group = 7                       # no such group
    b.records[1].end_ns = b.records[1].enqueue_ns - 1   # ends before it began
    payload, n, _ = validate(b, 4, 2**62, m)
    assert n == 1
    bad = telemetry_pb2.CollectiveBatch(groups=[telemetry_pb2.CollectiveGroup(id="0", members=[0, 9])],
                                        records=[b.records[2]])
    with pytest.raises(ValueError):
        validate(bad, 4, 2**62, m)                # member 9 outside a world of 4


def test_late_start_names_the_late_rank_with_the_first_collective_it_was_late_to():
    st = state_of(job_batches(late_rank=2, late_ms=30, late_from=5))
    found = st.late_starts("j", W, {r: 20.0 for r in range(4)})
    culprit = [f for f in found if f.kind == "late_start"]
    assert len(culprit) == 1
    (s,) = culprit[0].suspects
    assert s.rank == 2 and s.role == "culprit"
    assert s.evidence["seq"] == 6 and s.evidence["group"] == "0"   # step 5 is the 6th all-reduce
    assert s.evidence["median_late_ms"] == pytest.approx(30, rel=0.2)
    waiters = [f for f in found if f.kind == "collective_wait"][0]
    assert sorted(w.rank for w in waiters.suspects) == [0, 1, 3]
    assert all(w.waited_for == 2 for w in waiters.suspects)


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_group_names_nobody(seed):
    st = state_of(job_batches(seed=seed))
    assert [f for f in st.late_starts("j", W) if not f.informational] == []
    assert st.hangs("j", W) == []
    st = state_of(job_batches(seed=seed))       # with the step known (step 3c): nobody either
    assert [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}, 51 * MS) if not f.informational] == []


def test_an_intermittent_late_start_is_named_by_what_it_costs():
    """Step 3c (issue #22): rank 1 stalls 300 ms before the all-reduce one step in five (4 of 20
    collectives, under min_share): the stalls cost ~60 ms per 50 ms step, so it is the culprit, the
    others its waiters; one stall alone is not named."""
    st = state_of(job_batches(late_rank=1, late_ms=300, late_from=2, late_every=5))
    assert [f for f in st.late_starts("j", W, {r: 20.0 for r in range(4)}) if f.kind == "late_start"] == []
    st = state_of(job_batches(late_rank=1, late_ms=300, late_from=2, late_every=5))
    found = st.late_starts("j", W, {r: 20.0 for r in range(4)}, 51 * MS)
    (culprit,) = [f for f in found if f.kind == "late_start"]
    (s,) = culprit.suspects
    assert s.rank == 1 and s.evidence["intermittent"] and s.evidence["late_iterations"] == 4
    assert s.evidence["seq"] == 3 and s.impact_ns == pytest.approx(4 * 300 * MS / 20, rel=0.1)
    (waiters,) = [f for f in found if f.kind == "collective_wait"]
    assert sorted(w.rank for w in waiters.suspects) == [0, 2, 3]
    once = state_of(job_batches(late_rank=1, late_ms=300, late_from=12, late_every=100))
    assert [f for f in once.late_starts("j", W, {r: 20.0 for r in range(4)}, 51 * MS)
            if f.kind == "late_start"] == []


def test_a_rank_last_to_every_collective_on_a_busy_host_is_named():
    """Step 3d (issue #22): beside a busy core the all-reduce itself takes ~10 ms and the scheduler adds
    ~3 ms to every entry; rank 2, 15 ms late every step, is under 2 transfer times in most collectives
    (step 1 names nobody), yet it is last to nearly all of them, which chance (1 in 4 each) does not do."""
    busy = dict(transfer_ms=10.0, noise_ms=3.0, steps=10)
    st = state_of(job_batches(late_rank=2, late_ms=15, **busy))
    found = st.late_starts("j", W, {r: 10.0 for r in range(4)}, 65 * MS)
    (culprit,) = [f for f in found if f.kind == "late_start"]
    (s,) = culprit.suspects
    assert s.rank == 2 and s.role == "culprit" and s.evidence["consistently_last"]
    assert s.evidence["last_iterations"] >= 8 and s.evidence["p_value"] < 0.01 / 4
    assert s.evidence["median_late_ms"] == pytest.approx(15, abs=5)
    (waiters,) = [f for f in found if f.kind == "collective_wait"]
    assert sorted(w.rank for w in waiters.suspects) == [0, 1, 3] and all(w.waited_for == 2 for w in waiters.suspects)
    # the same busy host without a late rank names nobody
    for seed in range(20):
        st = state_of(job_batches(seed=seed, **busy))
        assert [f for f in st.late_starts("j", W, {r: 10.0 for r in range(4)}, 65 * MS) if not f.informational] == []


def iteration_windows(n: int, per: int = 10) -> list[records_pb2.Window]:
    return [records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=i, first_iteration=i * per,
                               last_iteration=(i + 1) * per - 1) for i in range(n)]


def test_a_rank_last_more_often_than_chance_over_windows_is_named_once_its_evidence_adds_up():
    """Step 3f (issue #22, host contention on one rank's core): rank 2 is 12 ms late to 6 of every 10
    all-reduces on a busy host (entries +-3 ms, the all-reduce 10 ms), last to about 7 of each window's
    10: under step 3d's bar in one window, far over it in three. It is named from the window its
    evidence crosses the bar, with its waiters; healthy busy jobs over the same windows name nobody,
    and with the pool off (``last_pool_iterations`` 0) the windows judge alone, as before."""
    busy = dict(transfer_ms=10.0, noise_ms=3.0, steps=40)
    late = {s for s in range(40) if s % 10 in (0, 1, 3, 5, 6, 8)}
    windows = iteration_windows(4)

    def named(st):
        return [[s.rank for f in st.late_starts("j", w, {r: 10.0 for r in range(4)}, 65 * MS)
                 if f.kind == "late_start" and not f.informational for s in f.suspects] for w in windows]
    hits = named(state_of(job_batches(late_rank=2, late_ms=12, late_steps=late, **busy)))
    assert hits == [[], [2], [2], [2]], hits
    alone = named(state_of(job_batches(late_rank=2, late_ms=12, late_steps=late, **busy), last_pool_iterations=0))
    assert alone == [[]] * 4, alone
    st = state_of(job_batches(late_rank=2, late_ms=12, late_steps=late, **busy))
    found = [st.late_starts("j", w, {r: 10.0 for r in range(4)}, 65 * MS) for w in windows][-1]
    (culprit,) = [f for f in found if f.kind == "late_start"]
    (s,) = culprit.suspects
    assert s.evidence["accumulated"] and s.evidence["iterations"] == 40 and s.evidence["last_iterations"] >= 20, s.evidence
    (waiters,) = [f for f in found if f.kind == "collective_wait"]
    assert sorted(w.rank for w in waiters.suspects) == [0, 1, 3] and all(w.waited_for == 2 for w in waiters.suspects)
    for seed in range(20):
        assert named(state_of(job_batches(seed=seed, **busy))) == [[]] * 4, seed


def test_a_rank_late_once_a_step_to_a_different_collective_is_the_latest_of_its_iterations():
    """Step 3f over positions: rank 2 is 12 ms late to one of each step's 3 collectives, a different one
    in turn, so at each position it is last in about half the iterations (under 3d's bar there, window by
    window), but it is the latest member of nearly every iteration: named once the pool reaches beyond a
    window. Healthy busy jobs of the same shape raise it in at most ``last_alpha`` (1 %) of their windows, the
    rate the test is built for (the verdict's k of n windows then asks it again)."""
    # a busy host: entries +-3 ms, the collective 8 ms; the late collective rotates (late_pos None); one
    # processor window (2 s) holds the job
    rotating = dict(steps=40, per_step=3, late_pos=None, compute_ms=2.0, noise_ms=3.0, transfer_ms=8.0)
    windows = iteration_windows(4)

    def named(st):
        return [[s.rank for f in st.late_starts("j", w, {r: 10.0 for r in range(4)}, 100 * MS)
                 if f.kind == "late_start" and not f.informational for s in f.suspects] for w in windows]
    hits = named(state_of(fsdp_batches(**rotating, late_rank=2, late_ms=12)))
    assert hits == [[], [2], [2], [2]], hits
    off = named(state_of(fsdp_batches(**rotating, late_rank=2, late_ms=12), last_pool_iterations=0))
    assert off == [[]] * 4, off
    st = state_of(fsdp_batches(**rotating, late_rank=2, late_ms=12))
    found = [st.late_starts("j", w, {r: 10.0 for r in range(4)}, 100 * MS) for w in windows][-1]
    (s,) = [s for f in found if f.kind == "late_start" for s in f.suspects]
    assert s.evidence["accumulated"] and s.evidence["last_iterations"] >= 25, s.evidence
    alarms = [w for seed in range(100) for w in named(state_of(fsdp_batches(**rotating, seed=seed))) if w]
    assert len(alarms) <= 0.01 * 400, alarms


def test_the_late_member_of_a_pair_on_a_busy_host_is_named_by_its_signed_ranks():
    """Step 3e: in a pair either member is last by chance (step 3d needs three), but a member 15 ms late
    every step on a busy host (the all-reduce ~10 ms, entries +-3 ms) is late by more, and more often,
    than a coin and the scheduler give: Wilcoxon's signed ranks name it, with its partner as the waiter.
    Healthy busy pairs (30 seeds) name nobody, nor does a member 1 ms late (under min_late_ms), nor one
    kept 3 ms behind every step (consistently last, but a third of the 10 ms collective: a scheduler's
    preference on a busy host, not a cost the pair's transfer does not dwarf)."""
    busy = dict(transfer_ms=10.0, noise_ms=3.0, steps=10)
    for seed in range(5):
        st = state_of(job_batches(ranks=2, late_rank=1, late_ms=15, seed=seed, **busy))
        found = [f for f in st.late_starts("j", W, {r: 10.0 for r in range(2)}, 65 * MS) if not f.informational]
        (culprit,) = [f for f in found if f.kind == "late_start"]
        (s,) = culprit.suspects
        assert s.rank == 1 and s.evidence.get("paired") and s.evidence["p_value"] <= 0.01 / 2, s.evidence
        assert culprit.comparison == "pair"
        (waiters,) = [f for f in found if f.kind == "collective_wait"]
        assert [(w.rank, w.waited_for) for w in waiters.suspects] == [(0, 1)]
    for seed in range(30):
        for late, ms in ((None, 0.0), (1, 1.0), (1, 3.0)):
            st = state_of(job_batches(ranks=2, seed=seed, late_rank=late, late_ms=ms, **busy))
            assert [f for f in st.late_starts("j", W, {r: 10.0 for r in range(2)}, 65 * MS)
                    if not f.informational] == [], (seed, late, ms)


def test_a_noisy_healthy_pair_is_not_named_for_being_clearly_late_by_chance():
    """Step 3 in a pair: a healthy two-group job of 12 processes beside a busy one on 2 cores had a TP
    member clearly late (8.6 ms, over two transfer times) to 6 of 10 all-reduces, and named it: in a pair
    either member is last by chance, P(X >= 6; 10, 1/2) = 0.38. With entries +-6 ms around a 3 ms
    transfer, step 3 named a member of 36 of 300 healthy pairs; now it needs the binomial bar too, and
    what is left is step 3e's own rate (<= 1 %). A member late every step is still named by step 3."""
    alarms = []
    for seed in range(300):
        st = state_of(job_batches(ranks=2, seed=seed, transfer_ms=3.0, noise_ms=6.0, steps=10))
        alarms += [(seed, s.evidence.get("paired", False)) for f in st.late_starts("j", W, {0: 10.0, 1: 10.0}, 60 * MS)
                   if not f.informational and f.kind == "late_start" for s in f.suspects]
    assert all(paired for _, paired in alarms) and len(alarms) <= 0.01 * 300, alarms
    st = state_of(job_batches(ranks=2, seed=0, transfer_ms=3.0, noise_ms=6.0, steps=10, late_rank=1, late_ms=40))
    (s,) = [s for f in st.late_starts("j", W, {0: 10.0, 1: 10.0}, 100 * MS)
            if not f.informational and f.kind == "late_start" for s in f.suspects]
    assert s.rank == 1 and not s.evidence.get("paired"), s.evidence


def test_a_late_member_of_a_pair_is_compared_with_its_partner():
    """Step 1 in a group of two: the late member and the partner that waited for it are the pair
    comparison (the same two ranks as ``individual.py``'s), never "peers": there is no majority. A
    2-rank job's verdict read "compared with pair and peers" for one comparison."""
    st = state_of(job_batches(ranks=2, late_rank=1, late_ms=300))
    found = [f for f in st.late_starts("j", W, {r: 20.0 for r in range(2)}, 351 * MS) if not f.informational]
    (culprit,) = [f for f in found if f.kind == "late_start"]
    (waiters,) = [f for f in found if f.kind == "collective_wait"]
    assert [s.rank for s in culprit.suspects] == [1] and [s.rank for s in waiters.suspects] == [0]
    assert culprit.comparison == waiters.comparison == "pair"
    four = state_of(job_batches(late_rank=1, late_ms=300))
    assert {f.comparison for f in four.late_starts("j", W, {r: 20.0 for r in range(4)}, 351 * MS)
            if not f.informational} == {"peers"}


def fsdp_batches(ranks=4, steps=12, per_step=9, late_rank=None, late_pos=3, late_ms=150.0, seed=0,
                 noise_late=0.0, compute_ms=5.0, noise_ms=0.3, transfer_ms=2.0):
    """FSDP-like: ``per_step`` collectives a step on one group, each entered after a short compute
    (``compute_ms`` +- ``noise_ms``) and ending ``transfer_ms`` after the last entry; ``late_rank``
    enters the one at ``late_pos`` ``late_ms`` late every step (its host-side delay before backward;
    ``late_pos`` None: a different one each step, in turn); ``noise_late``: the chance that some
    random member enters a random collective 10 ms late (scheduler noise on a busy host)."""
    rng = np.random.default_rng(seed)
    recs = {r: [] for r in range(ranks)}
    t, seq = T0, 0
    for step in range(steps):
        for k in range(per_step):
            seq += 1
            enter = {r: t + int((compute_ms + rng.normal(0, noise_ms)) * MS) for r in range(ranks)}
            if late_rank is not None and k == (step % per_step if late_pos is None else late_pos):
                enter[late_rank] += int(late_ms * MS)
            if rng.random() < noise_late:
                enter[int(rng.integers(ranks))] += 10 * MS
            end = max(enter.values()) + int(transfer_ms * MS)
            for r in range(ranks):
                recs[r].append(telemetry_pb2.CollectiveRecord(
                    group=0, seq=seq, op="allgather" if k % 3 else "reducescatter", bytes=1 << 16,
                    dtype="float32", enqueue_ns=enter[r], start_ns=enter[r],
                    end_ns=end + int(rng.uniform(0, 0.05) * MS), iteration=step))
            t = end
    return {r: telemetry_pb2.CollectiveBatch(
        groups=[telemetry_pb2.CollectiveGroup(id="0", members=list(range(ranks)))], records=recs[r],
        now_ns=t) for r in range(ranks)}


def test_a_rank_late_to_one_collective_of_every_step_is_named():
    """Step 3b: late on 1 of 9 collectives a step (under min_share per collective), every step."""
    st = state_of(fsdp_batches(late_rank=1))
    found = [f for f in st.late_starts("j", W, {r: 12.0 for r in range(4)}) if f.kind == "late_start"]
    assert len(found) == 1, found
    s = found[0].suspects[0]
    assert s.rank == 1 and s.role == "culprit"
    assert s.evidence["per_iteration"] and s.evidence["position"] == 3 and s.evidence["late_iterations"] == 12
    assert s.evidence["median_late_ms"] == pytest.approx(150, rel=0.1)
    assert s.impact_ns == pytest.approx(150 * MS, rel=0.1)        # its lateness per iteration
    # without step 3b's pattern (per collective) it was 12 of 108: not a culprit
    assert s.evidence["late_collectives"] == 12 and s.evidence["judged"] == 108


def test_a_rank_in_another_group_is_not_named_by_position():
    """Step 3b only where nothing else can have made the rank late: a member of a second group (a TP
    partner waiting for its slow peer), or of a pipeline, inherits the same pattern."""
    from trainscope.analyzer.collectives import _Group
    st = state_of(fsdp_batches(late_rank=1))
    st.groups["tp:0"] = _Group((0, 1))          # rank 1 also synchronises with rank 0 elsewhere
    assert [f for f in st.late_starts("j", W) if f.kind == "late_start"] == []
    st = state_of(fsdp_batches(late_rank=1))
    st.stages[1] = 1                            # or sits in a pipeline stage
    assert [f for f in st.late_starts("j", W) if f.kind == "late_start"] == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_late_entries_at_random_positions_name_nobody(seed):
    st = state_of(fsdp_batches(seed=seed, noise_late=0.3))
    assert [f for f in st.late_starts("j", W) if f.kind == "late_start"] == []


def test_hang_names_the_rank_that_never_entered_and_the_sequence_number():
    st = state_of(job_batches(steps=30, hang_rank=2, hang_at=12))
    st.late_starts("j", W)
    (f,) = st.hangs("j", W)
    assert f.kind == "stall" and f.suspects[0].rank == 2
    assert f.evidence["seq"] == 13 and f.evidence["first_stuck_rank"] == 2
    assert f.evidence["waiting_ranks"] == [0, 1, 3]
    assert st.hangs("j", W) == []                 # reported once


def test_no_hang_before_the_timeout():
    st = state_of(job_batches(steps=30, hang_rank=2, hang_at=12), hang_timeout_s=60)
    assert st.hangs("j", W) == []


def test_state_is_bounded():
    st = state_of(job_batches(steps=40, hang_rank=2, hang_at=35), max_seqs_per_group=8)
    assert all(len(g.seqs) <= 8 for g in st.groups.values())


def test_config_validation():
    with pytest.raises(ConfigError):
        CollectivesConfig(min_share=0)
    for bad in (0, 1, -0.5, float("nan")):
        with pytest.raises(ConfigError, match="last_alpha"):
            CollectivesConfig(last_alpha=bad)
    for bad in (-1, 2.5, 10_001, "50"):
        with pytest.raises(ConfigError, match="last_pool_iterations"):
            CollectivesConfig(last_pool_iterations=bad)
    assert CollectivesConfig(last_pool_iterations=0).last_pool_iterations == 0     # step 3f off
    with pytest.raises(ConfigError):
        CollectiveWindowConfig(length_s=0)


class _Source:
    def __init__(self, items) -> None:
        self.items = list(items)

    def poll(self, timeout_s: float = 0.0):
        out, self.items = self.items, []
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("hang", [True, False])
def test_the_service_publishes_a_stalled_verdict_naming_the_first_stuck_rank(hang):
    """Through the Analyzer service: records of the collectives topic, a step, the verdict."""
    from trainscope.analyzer.service import Analyzer, AnalyzerConfig
    from trainscope.proto.contracts import Signal

    batches = job_batches(steps=30, hang_rank=2, hang_at=12) if hang else job_batches(steps=30)
    ws = windows_of(batches)
    for w in ws.values():
        w.resource.job_id = "j"
    a = Analyzer(AnalyzerConfig(), _Source((Signal.COLLECTIVES, w) for w in ws.values()), [])
    a.step(0)
    stalled = [v for v in a.verdicts if v.state == "stalled"]
    if not hang:
        assert stalled == [] and a._jobs["j"].collectives.records == 4 * 30
        return
    (v,) = stalled
    assert [(s.rank, s.role) for s in v.ranks] == [(2, "culprit")]
    (f,) = v.findings
    assert f.level == "collectives" and f.evidence["seq"] == 13
    assert a._jobs["j"].stalled


def test_a_barrier_can_close_the_collective_windows_only():
    """The simulator's barrier (deploy/embedded.py): collective windows close there, not after
    2 s of the processor's clock; the ranks' iteration windows stay open; a plain drain, as the
    live daemon's, leaves the collective windows to the clock."""
    from trainscope.processor.ingest import Decoded
    from trainscope.processor.pipeline import Pipeline
    from trainscope.processor.windows import WindowConfig
    from trainscope.proto.contracts import Signal

    class Capture:
        name = "capture"

        def __init__(self) -> None:
            self.out = []

        def export(self, out) -> None:
            self.out.append(out)

        def flush(self, timeout_s: float = 10.0) -> bool:
            return True

        def close(self) -> None:
            pass

    sink, m = Capture(), SelfMetrics()
    p = Pipeline(WindowConfig(mode="iterations", iterations=10, idle_close_s=3600), lambda cw: None, [sink], m,
                 idle_check_s=60.0).start()
    try:
        for r, b in job_batches(steps=5).items():
            payload, n, _ = validate(b, 4, 2**62, m)
            assert p.accept(Decoded(resource=Resource(job_id="j", rank=r, world_size=4), signal=Signal.COLLECTIVES,
                                    payload=payload, records=n, nbytes=0, sent_unix_ns=0, dropped_total=0))
        assert p.drain(10.0, close_windows=False)
        assert sink.out == [] and p.collectives.open_windows == 4
        assert p.drain(10.0, close_windows=False, close_collectives=True)
        assert sorted(o.collectives.resource.rank for o in sink.out) == [0, 1, 2, 3]
        assert all(len(o.collectives.records) == 5 for o in sink.out) and p.collectives.open_windows == 0
    finally:
        p.stop(5.0)
