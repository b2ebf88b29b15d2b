"""Short captures and what a verdict says when it cannot name anyone yet (issue #22 item 3):
the replay's window for a short capture (``deploy/replay.capture_window``), the state
"suspected" for ranks flagged but not yet persistent, "unknown" when most ranks are absent, a
one-window capture not naming an iteration-time spike, and a group finding naming only its
members above the impact floor (analyzer/merge.py, analyzer/impact.py)."""
import numpy as np

from trainscope.analyzer.impact import ImpactConfig, WindowScale, apply_floor
from trainscope.analyzer.job_pace import JobLoss, PaceConfig
from trainscope.analyzer.merge import merge, merge_windows
from trainscope.analyzer.model import Finding, Scope, SuspectRank
from trainscope.analyzer.significance import Persistence
from trainscope.deploy.replay import capture_window
from trainscope.proto.model import Resource, coords_for_rank
from trainscope.proto.v1 import records_pb2

MS = 1e6


def win(index):
    return records_pb2.Window(kind=records_pb2.WINDOW_KIND_ITERATIONS, index=index,
                              first_iteration=10 * index, last_iteration=10 * index + 9)


def resources(world=16, tp=4, per_host=4, ranks=None):
    return {r: Resource(job_id="j", rank=r, world_size=world, host=f"h{r // per_host}",
                        coords=coords_for_rank(r, world, tp=tp)) for r in (ranks if ranks is not None else range(world))}


def finding(level, kind, where, suspects, index=0, informational=False):
    return Finding(level=level, kind=kind, job_id="j", window=win(index), scope=Scope(phase=where),
                   informational=informational,
                   suspects=tuple(SuspectRank(r, 1.0, {"direction": "slower"}, impact_ns=i) for r, i in suspects))


def test_a_short_capture_is_one_window_and_a_long_one_keeps_five_iteration_windows():
    assert capture_window(range(6)) == 6                    # 5 + 1 would leave a stub window
    assert capture_window(range(12)) == 12
    w = capture_window(range(30, 38))                       # steps 30-37: one window holds them all
    assert w >= 8 and 30 // w == 37 // w and w < 16
    assert capture_window(range(15)) == 5 and capture_window(range(40)) == 5
    assert capture_window([]) == 5 and capture_window(range(9), default=3) == 3


def test_a_rank_flagged_but_not_yet_persistent_is_suspected_never_healthy():
    p = Persistence(2, 3)
    f = finding("L2", "straggler", "forward", [(3, 9 * MS)])
    v = merge("j", win(0), [f], resources(), step_ns=100 * MS, persistence=p)
    assert v.state == "suspected" and list(v.pending) == [3] and not v.ranks
    assert "suspected rank(s) 3" in v.summary and "healthy" not in v.summary
    clean = merge("j", win(0), [], resources(), step_ns=100 * MS, persistence=Persistence(2, 3))
    assert clean.state == "healthy" and not clean.pending


def test_the_job_is_suspected_only_while_the_suspicion_is_open_at_its_end():
    res = resources()
    p = Persistence(2, 3)
    noise = merge("j", win(0), [finding("L2", "straggler", "forward", [(3, 9 * MS)])], res,
                  step_ns=100 * MS, persistence=p)
    quiet = [merge("j", win(i), [], res, step_ns=100 * MS, persistence=p) for i in (1, 2)]
    assert noise.state == "suspected" and merge_windows([noise, *quiet]).state == "healthy"
    late = merge("j", win(3), [finding("L2", "straggler", "forward", [(5, 9 * MS)], 3)], res,
                 step_ns=100 * MS, persistence=p)
    # a job of 4 windows that ends on one window's suspicion: noise, as any of its windows could have been
    assert merge_windows([noise, *quiet, late]).state == "healthy"
    # a capture too short to confirm anything (2 windows) that ends on it is suspected, with the rank
    q = Persistence(2, 3)
    short = [merge("j", win(0), [], res, step_ns=100 * MS, persistence=q),
             merge("j", win(1), [finding("L2", "straggler", "forward", [(5, 9 * MS)], 1)], res,
                   step_ns=100 * MS, persistence=q)]
    job = merge_windows(short)
    assert job.state == "suspected" and list(job.pending) == [5] and not job.ranks


def test_two_of_many_ranks_present_is_unknown_not_healthy():
    present = resources(128, tp=8, per_host=8, ranks=[0, 1])
    missing = Finding(level="L2", kind="missing_rank", job_id="j", window=win(0), scope=Scope(group="job"),
                      suspects=tuple(SuspectRank(r, 1.0, {}, role="missing") for r in range(2, 128)))
    v = merge("j", win(0), [missing], present, step_ns=100 * MS, persistence=Persistence(2, 3), partial=True,
              comparisons={"L2": 0, "L3": 0})
    assert v.state == "unknown" and not v.ranks and "126 of 128 ranks missing" in v.summary
    assert merge_windows([v]).state == "unknown"
    few = merge("j", win(0), [dataclasses_replace_suspects(missing, range(14, 16))], resources(),
                step_ns=100 * MS, persistence=Persistence(2, 3), partial=True)
    assert few.state == "healthy"                            # 2 of 16 missing: the rest was judged


def dataclasses_replace_suspects(f, ranks):
    import dataclasses
    return dataclasses.replace(f, suspects=tuple(SuspectRank(r, 1.0, {}, role="missing") for r in ranks))


def test_a_one_window_capture_names_what_it_flagged_but_not_an_iteration_spike():
    res = resources()
    slow = Finding(level="L3", kind="degraded_kernels", job_id="j", window=win(0), scope=Scope(kernel="[compute]"),
                   suspects=(SuspectRank(5, 1.0, {"direction": "slower"}, impact_ns=12 * MS),))
    jitter = Finding(level="L1", kind="jitter", job_id="j", window=win(0), scope=Scope(),
                     suspects=(SuspectRank(9, 1.0, {}, impact_ns=6 * MS),))
    v = merge("j", win(0), [slow, jitter], res, step_ns=100 * MS, persistence=Persistence(2, 3), final=True)
    assert [s.rank for s in v.ranks] == [5], v.summary
    # the spike's rank also waited in its collectives (a TP partner of a slow GPU): still not a culprit
    waited = Finding(level="L2", kind="slow_group", job_id="j", window=win(0), scope=Scope(kernel="[communication]"),
                     suspects=(SuspectRank(9, 1.0, {"direction": "slower"}, impact_ns=8 * MS),),
                     evidence={"communication": True})
    v = merge("j", win(0), [slow, jitter, waited], res, step_ns=100 * MS, persistence=Persistence(2, 3), final=True)
    assert [s.rank for s in v.ranks if s.role == "culprit"] == [5], v.summary


def test_a_group_finding_names_only_its_members_above_the_floor():
    scale = WindowScale(100 * MS, {r: 10.0 for r in range(16)}, 10.0, 10.0, 10.0)
    group = finding("L2", "slow_group", "[memory]", [(5, 8 * MS), (4, 0.5 * MS)])
    (out,) = apply_floor([group], scale, ImpactConfig(floor_pct=1.0))
    assert not out.informational and [s.rank for s in out.suspects] == [5]
    assert out.evidence["below_floor"][0]["rank"] == 4
    (small,) = apply_floor([finding("L2", "slow_group", "x", [(5, 0.5 * MS), (4, 0.4 * MS)])], scale,
                           ImpactConfig(floor_pct=1.0))
    assert small.informational and len(small.suspects) == 2   # all below: informational, evidence kept


def test_culprits_impacts_never_exceed_what_the_job_lost_against_its_own_pace():
    """Issue #22 item 5: a rank the others wait for is priced by their wait; where the pace level
    measured the job's loss (here 20 ms/iteration: a 120 ms step against its 100 ms pace), the
    culprits together are scaled to it."""
    res = resources()
    slow = Finding(level="L3", kind="degraded_kernels", job_id="j", window=win(3), scope=Scope(kernel="[compute]"),
                   suspects=(SuspectRank(5, 1.0, {"direction": "slower"}, impact_ns=60 * MS),
                             SuspectRank(9, 1.0, {"direction": "slower"}, impact_ns=20 * MS)))
    lost = JobLoss(np.full(10, 120 * MS), tuple((i, np.full(10, 100 * MS)) for i in range(3)), PaceConfig())
    v = merge("j", win(3), [slow], res, step_ns=120 * MS, job_loss=lost)
    culprits = {s.rank: s.impact_s for s in v.ranks if s.role == "culprit"}
    assert set(culprits) == {5, 9} and sum(culprits.values()) <= 0.020 + 1e-12
    assert culprits[5] == 3 * culprits[9]                          # the ranking is kept
    assert "15 ms/iteration" in v.ranks[0].why                      # the why says the scaled cost
    alone = merge("j", win(3), [slow], res, step_ns=120 * MS)       # no measured loss: as measured
    assert {s.rank: round(s.impact_s, 6) for s in alone.ranks} == {5: 0.06, 9: 0.02}


def test_a_rank_already_slow_inside_the_pace_baseline_keeps_its_own_price():
    """A data loader that cost rank 5 60 ms/iteration from window 0 was inside the job's pace
    baseline (windows 0 and 1); a busy host then slowed the job 7 ms more (window 2). That 7 ms is
    a later change, not rank 5's price: with no baseline window before its first flag, its impact
    stays 60 ms. A rank first flagged after the baseline is still scaled to the loss."""
    res, p = resources(), Persistence(1, 1)

    def slow(index):
        return Finding(level="L2", kind="straggler", job_id="j", window=win(index), scope=Scope(phase="dataloader"),
                       suspects=(SuspectRank(5, 1.0, {"direction": "slower"}, impact_ns=60 * MS),))
    lost = JobLoss(np.full(10, 167 * MS), tuple((i, np.full(10, 160 * MS)) for i in range(2)), PaceConfig())
    for i in range(2):
        merge("j", win(i), [slow(i)], res, step_ns=160 * MS, persistence=p)
    v = merge("j", win(2), [slow(2)], res, step_ns=167 * MS, persistence=p, job_loss=lost)
    assert [(s.rank, round(s.impact_s, 6)) for s in v.ranks] == [(5, 0.06)]
    fresh = Persistence(1, 1)                                # first flagged after the baseline: scaled
    w = merge("j", win(2), [slow(2)], res, step_ns=167 * MS, persistence=fresh, job_loss=lost)
    assert [(s.rank, round(s.impact_s, 6)) for s in w.ranks] == [(5, 0.007)]


def test_the_data_loader_seen_by_two_levels_in_turn_is_one_place():
    """A 4-rank CPU job's slow data loader was flagged as the L2 phase ``dataloader`` in one window
    and as the sampled CPU operator ``enumerate(DataLoader)#..__next__`` in the next: one cause,
    so 2 of 3 windows name it. Two unrelated places in turn (a forward, then an optimizer) do not."""
    res = resources(world=4, tp=1)

    def phase(index, where, rank=2):
        return Finding(level="L2", kind="straggler", job_id="j", window=win(index), scope=Scope(phase=where),
                       suspects=(SuspectRank(rank, 1.0, {"direction": "slower"}, impact_ns=30 * MS),))

    def op(index, where, rank=2):
        return Finding(level="L3", kind="degraded_kernel", job_id="j", window=win(index),
                       scope=Scope(kernel=where),
                       suspects=(SuspectRank(rank, 1.0, {"direction": "slower"}, impact_ns=30 * MS),))
    p = Persistence(2, 3)
    first = merge("j", win(0), [phase(0, "dataloader")], res, step_ns=60 * MS, persistence=p)
    assert first.state == "suspected"
    second = merge("j", win(1), [op(1, "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__")], res,
                   step_ns=60 * MS, persistence=p)
    assert [s.rank for s in second.ranks] == [2] and second.ranks[0].why.startswith("host: data loader")
    q = Persistence(2, 3)
    merge("j", win(0), [phase(0, "forward")], res, step_ns=60 * MS, persistence=q)
    other = merge("j", win(1), [phase(1, "optimizer")], res, step_ns=60 * MS, persistence=q)
    assert not other.ranks and other.state == "suspected"


def test_lateness_is_followed_across_groups_to_the_rank_that_made_others_wait():
    """Issue #22 item 2: rank 5's slow GPU makes its TP partner 4 late; 4 is late to its DP all-reduce
    with 0, 2, 6, which wait for 4. Those three are waiters (of 4, itself a waiter of 5), not slow
    links, and 5 is the only culprit."""
    res = {r: Resource(job_id="j", rank=r, world_size=16, host=f"h{r // 8}",
                       coords=coords_for_rank(r, 16, tp=2, pp=2)) for r in range(16)}
    gpu = Finding(level="L3", kind="degraded_kernels", job_id="j", window=win(0), scope=Scope(kernel="[compute]"),
                  suspects=(SuspectRank(5, 1.0, {"direction": "slower"}, impact_ns=40 * MS),))

    def waits(for_rank, ranks, ms):
        return Finding(level="collectives", kind="collective_wait", job_id="j", window=win(0),
                       scope=Scope(group="collective"), evidence={"communication": True},
                       suspects=tuple(SuspectRank(r, 1.0, {"ratio": 2.0}, impact_ns=ms * MS, role="waiter",
                                                  waited_for=for_rank) for r in ranks))
    v = merge("j", win(0), [gpu, waits(5, [4], 40), waits(4, [0, 2, 6], 25)], res, step_ns=300 * MS)
    roles = {s.rank: (s.role, s.waited_for) for s in v.ranks}
    assert roles[5][0] == "culprit" and [r for r, (role, _) in roles.items() if role in ("culprit", "link")] == [5]
    assert roles[4] == ("waiter", 5) and all(roles[r] == ("waiter", 4) for r in (0, 2, 6)), roles


def test_a_late_start_persists_though_its_collective_sequence_number_changes_every_window():
    """An FSDP2 rank late every step is found by the collectives level alone, each window at a new seq
    ("late start to allgather (group 0, seq 94)", then seq 184): the place is the group and op."""
    res = {r: Resource(job_id="j", rank=r, world_size=4, host="h0", coords=coords_for_rank(r, 4)) for r in range(4)}
    p = Persistence(2, 3)
    verdicts = []
    for i in range(2):
        late = Finding(level="collectives", kind="late_start", job_id="j", window=win(i), scope=Scope(group="collective"),
                       evidence={"communication": False},
                       suspects=(SuspectRank(2, 4.9, {"function": f"late start to allgather (group 0, seq {94 + 90 * i})"},
                                             impact_ns=32 * MS, role="culprit"),))
        verdicts.append(merge("j", win(i), [late], res, step_ns=140 * MS, persistence=p))
    assert verdicts[0].state == "suspected" and [s.rank for s in verdicts[1].ranks] == [2]
    assert "seq 184" in verdicts[1].ranks[0].why                   # the why keeps the collective to look up


def late(rank, group, ms):
    """The collectives level's late start of ``rank`` to an all-reduce of ``group`` (window 0)."""
    return Finding(level="collectives", kind="late_start", job_id="j", window=win(0), scope=Scope(group="collective"),
                   evidence={"communication": False},
                   suspects=(SuspectRank(rank, 5.0, {"function": f"late start to allreduce (group {group}, seq 9)"},
                                         impact_ns=ms * MS, role="culprit"),))


def wait(rank, for_rank, ms):
    """The collectives level measured ``rank`` waiting ``ms`` for ``for_rank`` (window 0)."""
    return Finding(level="collectives", kind="collective_wait", job_id="j", window=win(0),
                   scope=Scope(group="collective"), evidence={"communication": True},
                   suspects=(SuspectRank(rank, 1.0, {}, impact_ns=ms * MS, role="waiter", waited_for=for_rank),))


def test_a_rank_late_only_because_it_waited_in_another_group_is_a_waiter():
    """Two kinds of groups (TP pairs 0-1 and 2-3, DP pairs 0-2 and 1-3): rank 1 sleeps before its DP
    all-reduce, so its DP peer 3 waits for it and then starts its TP all-reduce late, making 2 wait.
    3's lateness is 1's wait passed on: 1 is the only culprit, 3 a waiter of 1, 2 a waiter of 3."""
    res = {r: Resource(job_id="j", rank=r, world_size=4, host="h0", coords=coords_for_rank(r, 4, tp=2))
           for r in range(4)}

    found = [late(1, "dp1", 28), wait(3, 1, 28), late(3, "tp1", 26), wait(2, 3, 26), late(1, "tp0", 18), wait(0, 1, 18)]
    v = merge("j", win(0), found, res, step_ns=60 * MS)
    roles = {s.rank: (s.role, s.waited_for) for s in v.ranks}
    assert roles[1][0] == "culprit" and roles[3] == ("waiter", 1), roles
    assert roles[2] == ("waiter", 3) and roles[0] == ("waiter", 1)
    assert [r for r, (role, _) in roles.items() if role in ("culprit", "link")] == [1]


def test_a_rank_whose_forward_holds_its_wait_for_its_tp_partner_is_that_partners_waiter():
    """Attribution step 3 (``_wait_in_iteration``) for a phase: in a real 4-rank two-group job (TP pairs 0-1
    and 2-3, DP pairs 0-2 and 1-3) rank 1's forward was slower; rank 0 waited 12.6 ms for it in the TP
    all-reduce inside its own forward, so its forward read 0.6 ms an iteration slower than its own history
    (L2), and it arrived 9 ms late to its DP pair. That forward was taken for work of its own: rank 0 owned
    its lateness and was named a culprit beside 1. Its forward holds its measured wait: 1 is the only
    culprit, 0 and 3 its waiters, 2 a waiter of 0; and a rank slower in its forward than the waits it was
    measured in stays a culprit."""
    res = {r: Resource(job_id="j", rank=r, world_size=4, host="h0", coords=coords_for_rank(r, 4, tp=2))
           for r in range(4)}

    def forward(rank, ms):
        return Finding(level="L2", kind="individual_slowdown", job_id="j", window=win(0), scope=Scope(phase="forward"),
                       suspects=(SuspectRank(rank, 9.3, {"direction": "slower"}, impact_ns=ms * MS),))
    found = [forward(1, 14), late(1, "tp0", 13), wait(0, 1, 12.6), late(1, "dp1", 13.7), wait(3, 1, 13.7),
             late(0, "dp0", 9), wait(2, 0, 9)]
    v = merge("j", win(0), [*found, forward(0, 0.6)], res, step_ns=45 * MS)
    roles = {s.rank: (s.role, s.waited_for) for s in v.ranks}
    assert [r for r, (role, _) in roles.items() if role in ("culprit", "link")] == [1], roles
    assert roles[0] == ("waiter", 1) and roles[3] == ("waiter", 1) and roles[2] == ("waiter", 0), roles
    # slower in its own forward than every wait it was measured in: work of its own, a culprit
    both = merge("j", win(0), [*found, forward(0, 20)], res, step_ns=45 * MS)
    assert {s.rank for s in both.ranks if s.role == "culprit"} == {0, 1}, both.summary
